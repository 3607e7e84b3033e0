"""What a training script sets for the whole process must not change what the library does.

``torch.set_default_device("cuda")`` (common in model-building code) sends every tensor factory call that
names no device to that device, from any thread; ``torch.use_deterministic_algorithms(True)`` (Lightning's
``deterministic=True``) makes torch fill new memory. The library's host buffers, headers and restore
targets must land in host memory and be made for any stored dtype regardless. On this machine the default
device is set to ``meta`` (no GPU here; any device but the CPU shows the same hazard: a host buffer made
there cannot be read or written). Each path a checkpoint takes: the memory and local tiers (in place,
into a missing key, from a new process's view), the remote tier over ``file://``, promote, export, and
``dcp.save`` / ``dcp.load`` through the tiers.
"""

from __future__ import annotations

import pytest
import torch

import ckpt

MODES = ["default-device", "deterministic"]


def _enter(mode: str) -> None:
    if mode == "default-device":
        torch.set_default_device("meta")  # the conftest fixture puts the default back
    else:
        torch.use_deterministic_algorithms(True)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
            "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
            "fp4": torch.arange(32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        },
        "step": 7,
        "extras": {"lr": 0.1},
    }


def _same(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert b["model"][k].device.type == "cpu", k
        assert b["model"][k].dtype == v.dtype and torch.equal(
            b["model"][k].view(torch.uint8), v.view(torch.uint8)
        ), k
    assert b["step"] == a["step"] and b["extras"] == a["extras"]


def _blank() -> dict:
    return {
        "model": {
            "w": torch.zeros(64, 32, device="cpu"),
            "b": torch.zeros(32, dtype=torch.bfloat16, device="cpu"),
            "fp8": None,
            "fp4": None,
        },
        "step": 0,
        "extras": {"lr": 0.0},
    }


@pytest.mark.parametrize("mode", MODES)
def test_save_and_restore_through_every_tier(tmp_path, mode):
    ref = _state()
    url = f"file://{tmp_path}/remote"
    _enter(mode)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "local", url=url)) as ck:
        ck.save(1, ref).wait()
        got = _blank()
        assert ck.restore(got) == 1  # this process's memory tier
        _same(ref, got)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tmp_path / "local")
    ) as ck:  # a new Checkpointer: segments or disk
        got = _blank()
        assert ck.restore(got) == 1
        _same(ref, got)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tmp_path / "fresh", url=url)
    ) as ck:  # only the remote tier has it
        got = _blank()
        assert ck.restore(got) == 1 and ck.last_restore.tier == "remote"
        _same(ref, got)
        ck.promote(1, "local")  # (the restore may have put it there already: then it is verified)
        assert "local" in ck.list()[0].tiers
    info = ckpt.export(tmp_path / "local", tmp_path / "out.pt", format="torch")
    assert info.tensors == 4


@pytest.mark.parametrize("mode", MODES)
def test_dcp_save_and_load_through_the_tiers(tmp_path, mode):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter

    ref = {"w": torch.randn(8, 4), "b": torch.randn(4).to(torch.bfloat16)}
    tiers = {"local_dir": tmp_path / "local", "url": f"file://{tmp_path}/remote"}
    _enter(mode)
    dcp.save(ref, storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-1")
    got = {"w": torch.zeros(8, 4, device="cpu"), "b": torch.zeros(4, dtype=torch.bfloat16, device="cpu")}
    dcp.load(got, storage_reader=TierStorageReader(**tiers), checkpoint_id="step-1")
    assert torch.equal(got["w"], ref["w"]) and torch.equal(got["b"], ref["b"])


def _module_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("where", ["memory", "local", "remote"])
def test_a_restore_called_inside_inference_mode(tmp_path, where):
    """Evaluation scripts restore inside ``torch.inference_mode()``: the restore's copies (on its own
    threads) must still land in the state's normal tensors, and training must go on from them after."""
    m, opt = _module_state()
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "local", url=url)) as ck:
        ck.save(1, {"model": m, "optim": opt}).wait()
        m2 = torch.nn.Linear(8, 4)
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
        if where == "memory":
            with torch.inference_mode():
                assert ck.restore({"model": m2, "optim": opt2}) == 1
            assert ck.last_restore.tier == "memory"
    if where != "memory":
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=tmp_path / ("local" if where == "local" else "fresh"), url=url)
        ) as ck:
            with torch.inference_mode():
                assert ck.restore({"model": m2, "optim": opt2}) == 1
            assert ck.last_restore.tier == where
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert not m2.weight.is_inference()  # restored in place: still the model's own parameters
    m2(torch.ones(2, 8)).sum().backward()  # and they train on (the optimizer's own load_state_dict made its
    torch.optim.SGD(m2.parameters(), lr=0.1).step()  # state inside inference mode: torch's rules apply there)


def test_inference_tensors_are_restored_in_place_from_outside_inference_mode(tmp_path):
    """A serving process that made its weights under ``torch.inference_mode()`` restores into them."""
    ref = {"w": torch.randn(32, 16), "b": torch.randn(16).to(torch.bfloat16)}
    with torch.inference_mode():
        got = {
            "w": torch.zeros(32, 16),
            "b": torch.zeros(16, dtype=torch.bfloat16),
            "t": None,
        }  # and a non-contiguous inference tensor, bytes through a stand-in
        stand_in = torch.zeros(16, 32).t()
        got["t"] = stand_in
    ref["t"] = torch.randn(16, 32).t().contiguous()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "local2")) as ck:
        ck.save(1, ref).wait()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tmp_path / "local2")
    ) as ck:  # read on the restore's own threads
        assert ck.restore(got) == 1
    assert got["t"] is stand_in and all(torch.equal(got[k], ref[k]) for k in ref)


def test_dcp_load_inside_inference_mode(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter

    ref = {"w": torch.randn(8, 4)}
    tiers = {"local_dir": tmp_path / "local"}
    dcp.save(ref, storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-1")
    got = {"w": torch.zeros(8, 4)}
    with torch.inference_mode():
        dcp.load(got, storage_reader=TierStorageReader(**tiers), checkpoint_id="step-1")
    assert torch.equal(got["w"], ref["w"])

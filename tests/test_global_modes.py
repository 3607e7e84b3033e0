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
        torch.set_default_device("meta")   # the conftest fixture puts the default back
    else:
        torch.use_deterministic_algorithms(True)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16),
                      "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
                      "fp4": torch.arange(32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)},
            "step": 7, "extras": {"lr": 0.1}}


def _same(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert b["model"][k].device.type == "cpu", k
        assert b["model"][k].dtype == v.dtype and torch.equal(b["model"][k].view(torch.uint8), v.view(torch.uint8)), k
    assert b["step"] == a["step"] and b["extras"] == a["extras"]


def _blank() -> dict:
    return {"model": {"w": torch.zeros(64, 32, device="cpu"), "b": torch.zeros(32, dtype=torch.bfloat16, device="cpu"),
                      "fp8": None, "fp4": None}, "step": 0, "extras": {"lr": 0.0}}


@pytest.mark.parametrize("mode", MODES)
def test_save_and_restore_through_every_tier(tmp_path, mode):
    ref = _state()
    url = f"file://{tmp_path}/remote"
    _enter(mode)
    with ckpt.Checkpointer(local_dir=tmp_path / "local", url=url) as ck:
        ck.save(1, ref).wait()
        got = _blank()
        assert ck.restore(got) == 1   # this process's memory tier
        _same(ref, got)
    with ckpt.Checkpointer(local_dir=tmp_path / "local") as ck:   # a new Checkpointer: segments or disk
        got = _blank()
        assert ck.restore(got) == 1
        _same(ref, got)
    with ckpt.Checkpointer(local_dir=tmp_path / "fresh", url=url) as ck:   # only the remote tier has it
        got = _blank()
        assert ck.restore(got) == 1 and ck.last_restore.tier == "remote"
        _same(ref, got)
        ck.promote(1, "local")   # (the restore may have put it there already: then it is verified)
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

"""A model saved wrapped and restored unwrapped, or the other way round: ``torch.compile`` (whole model or
per block, as large-model training compiles each transformer block) and ``DataParallel`` /
``DistributedDataParallel`` add components to the state-dict keys (``_orig_mod``, ``module``). A module's
state is stored under the unwrapped module's keys, so every pairing restores, optimizer state included,
and checkpoints written before (keys with ``_orig_mod``) still restore into either."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt import plan


def _net(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def _wrap(net: torch.nn.Sequential, how: str) -> torch.nn.Module:
    if how == "compiled":
        return torch.compile(net)
    if how == "per-block":
        net[0] = torch.compile(net[0])
        net[3] = torch.compile(net[3])
        return net
    if how == "data-parallel":
        return torch.nn.DataParallel(net)
    return net


def _plain(m: torch.nn.Module) -> dict:
    """The state under the unwrapped keys, to compare."""
    sd, _ = plan._module_sd(m, m.state_dict())
    return sd


WAYS = ["plain", "compiled", "per-block", "data-parallel"]


@pytest.mark.parametrize("saved", WAYS)
@pytest.mark.parametrize("restored", WAYS)
def test_every_pairing_of_wrappers_restores(local_dir, saved, restored):
    src = _wrap(_net(0), saved)
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    src.train()
    for _ in range(2):  # optimizer state and BatchNorm's running statistics move
        opt.zero_grad()
        src(torch.randn(6, 8)).sum().backward()
        opt.step()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": src, "optim": opt}).wait()
    dst = _wrap(_net(1), restored)
    opt2 = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir)
    ) as ck:  # a new process's view: read from the disk
        assert ck.restore({"model": dst, "optim": opt2}) == 1
    want, got = _plain(src), _plain(dst)
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_the_stored_keys_are_the_unwrapped_ones(tmp_path, local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": _wrap(_net(), "per-block")}).wait()
    info = ckpt.export(local_dir, tmp_path / "out", format="safetensors")
    from safetensors.torch import load_file

    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert names == {f"model/{k}" for k in _net().state_dict()}, names
    assert info.tensors == len(names)


@pytest.mark.parametrize("restored", ["plain", "compiled"])
def test_a_checkpoint_written_with_wrapper_components_in_its_keys_still_restores(
    local_dir, monkeypatch, restored
):
    src = _wrap(_net(0), "compiled")
    with monkeypatch.context() as m:  # how checkpoints were written before: the module's own keys
        m.setattr(plan, "_module_sd", lambda module, sd, wrappers=None: (sd, {}))
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
            ck.save(1, {"model": src}).wait()
    dst = _wrap(_net(1), restored)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"model": dst}) == 1
    want, got = _plain(src), _plain(dst)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("saved", ["compiled", "per-block"])
def test_a_checkpoint_written_with_wrapper_components_exports_under_the_plain_names(
    tmp_path, local_dir, monkeypatch, saved
):
    """Such a checkpoint exports as the plain model names its tensors (safetensors and the torch format), so
    ``load_state_dict`` of an uncompiled model and Hugging Face's loaders take it."""
    src = _wrap(_net(0), saved)
    with monkeypatch.context() as m:  # how checkpoints were written before: the module's own keys
        m.setattr(plan, "_module_sd", lambda module, sd, wrappers=None: (sd, {}))
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
            ck.save(1, {"model": src, "note": "x"}).wait()
    from safetensors.torch import load_file

    ckpt.export(local_dir, tmp_path / "st", format="safetensors")
    names = set(load_file(tmp_path / "st" / "model.safetensors"))
    assert names == {f"model/{k}" for k in _net().state_dict()}, names
    ckpt.export(local_dir, tmp_path / "pt", format="torch", key="model")
    out = torch.load(tmp_path / "pt")  # the torch format: one file
    plain = _net(1)
    plain.load_state_dict(out)  # strict: every key the plain model's
    want = _plain(src)
    assert all(torch.equal(plain.state_dict()[k], want[k]) for k in want)


def test_export_leaves_names_that_would_become_one_as_they_are():
    from ckpt.export import _bare, _bare_keys

    assert _bare("_orig_mod.0.weight") == "0.weight" and _bare("layers.3._orig_mod.bias") == "layers.3.bias"
    assert _bare("_orig_mod") == "_orig_mod" and _bare("a_orig_mod.b") == "a_orig_mod.b"
    both = {"_orig_mod.w": 1, "w": 2}  # two keys that would become one: kept
    assert _bare_keys({"m": both, "n": [{"_orig_mod.x": 3}]}) == {"m": both, "n": [{"x": 3}]}


def test_strict_false_with_a_compiled_target_takes_the_common_keys(local_dir):
    src = _net(0)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": src}).wait()
    bigger = torch.nn.Sequential(*_net(1), torch.nn.Linear(4, 2))
    dst = torch.compile(bigger)
    extra = bigger[4].weight.detach().clone()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"model": dst}, strict=False) == 1
    assert torch.equal(bigger[0].weight, src[0].weight) and torch.equal(bigger[4].weight, extra)


def test_a_user_submodule_named_module_is_not_taken_for_a_wrapper(local_dir):
    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(3, 3)  # an ordinary attribute that happens to be called "module"

    src = Outer()
    assert plan._wrapper_paths(src) == frozenset()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"m": src}).wait()
    dst = Outer()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"m": dst}) == 1
    assert torch.equal(dst.module.weight, src.module.weight)

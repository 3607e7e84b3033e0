"""Phase 1: the snapshot is consistent while training goes on, and torn snapshots are refused.

A slow stager is injected by wrapping the copy destination helper so that the
staging thread sleeps before it copies; ``save()`` then returns long before
the copy lands, which is the window these tests are about.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import ckpt


def test_save_returns_before_the_copy_lands(local_dir, slow_staging):
    w = torch.randn(1000)
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        t0 = time.perf_counter()
        h = ck.save(1, {"a": w, "b": w + 1, "c": w + 2})
        returned = time.perf_counter() - t0
        assert not h.done("memory")
        h.wait("memory")
        assert returned < 0.1 < time.perf_counter() - t0


def test_the_next_optimizer_step_waits_for_the_copy(local_dir, slow_staging):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 64)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        h = ck.save(1, {"model": model, "optim": opt})
        opt.step()   # mutates the parameters: must not tear the snapshot
        h.wait()
    assert not torch.equal(model.weight, before["weight"])
    fresh = nn.Linear(64, 64)
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        ck.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=1.0)})
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)


def test_module_buffers_are_copied_before_the_next_forward_can_change_them(local_dir, slow_staging):
    model = nn.BatchNorm1d(8)
    model(torch.randn(16, 8))
    before = model.running_mean.clone()
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        h = ck.save(1, {"model": model})
        model(torch.randn(16, 8) + 5)   # updates running stats in place
        h.wait()
    fresh = nn.BatchNorm1d(8)
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        ck.restore({"model": fresh})
    assert torch.equal(fresh.running_mean, before)


def test_an_in_place_write_during_the_copy_fails_the_save_loudly_naming_the_tensor(local_dir, slow_staging):
    ema = torch.zeros(1000)
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        ck.save(1, {"w": torch.ones(10), "ema": ema}).wait()
        h = ck.save(2, {"w": torch.ones(10), "ema": ema})
        ema.add_(1)   # an EMA update without wait_staged()
        with pytest.raises(ckpt.TornSnapshotError, match=r"'ema'.*wait_staged"):
            h.wait()
        with pytest.raises(ckpt.TornSnapshotError):
            ck.wait()
        assert [i.step for i in ck.list()] == [1]


def test_wait_staged_makes_in_place_writes_safe(local_dir, slow_staging):
    ema = torch.zeros(1000)
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        h = ck.save(1, {"ema": ema})
        ck.wait_staged()
        ema.add_(1)
        h.wait()
        out = {"ema": torch.empty(1000)}
        ck.restore(out)
    assert torch.equal(out["ema"], torch.zeros(1000))


def test_the_host_buffer_is_allocated_once_and_reused(local_dir):
    w = torch.randn(100_000)
    with ckpt.Checkpointer(local_dir=local_dir, max_in_flight=1) as ck:
        for s in range(5):
            ck.save(s, {"w": w})
        ck.wait()
        assert ck.pool.allocations == 1
        assert ck.pool.nbytes <= 1.05 * w.numel() * 4 + (2 << 20)


def test_with_a_closure_the_wait_moves_after_backward(local_dir, slow_staging):
    """optimizer.step(closure) (Lightning, LBFGS): forward/backward in the closure overlap the copy."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = {}
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        h = ck.save(1, {"model": model, "optim": opt})

        def closure():
            seen["staged_before_backward"] = h.done("memory")
            opt.zero_grad()
            loss = model(torch.randn(4, 64)).sum()
            loss.backward()
            return loss

        opt.step(closure)
        h.wait()
    assert seen["staged_before_backward"] is False, "the closure ran only after the copy: no overlap"
    fresh = nn.Linear(64, 64)
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        ck.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=1.0)})
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)

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
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
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
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"model": model, "optim": opt})
        opt.step()  # mutates the parameters: must not tear the snapshot
        h.wait()
    assert not torch.equal(model.weight, before["weight"])
    fresh = nn.Linear(64, 64)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=1.0)})
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)


def test_module_buffers_are_copied_before_the_next_forward_can_change_them(local_dir, slow_staging):
    model = nn.BatchNorm1d(8)
    model(torch.randn(16, 8))
    before = model.running_mean.clone()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"model": model})
        model(torch.randn(16, 8) + 5)  # updates running stats in place
        h.wait()
    fresh = nn.BatchNorm1d(8)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.restore({"model": fresh})
    assert torch.equal(fresh.running_mean, before)


def test_an_in_place_write_during_the_copy_fails_the_save_loudly_naming_the_tensor(local_dir, slow_staging):
    ema = torch.zeros(1000)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": torch.ones(10), "ema": ema}).wait()
        h = ck.save(2, {"w": torch.ones(10), "ema": ema})
        ema.add_(1)  # an EMA update without wait_staged()
        with pytest.raises(ckpt.TornSnapshotError, match=r"'ema'.*wait_staged"):
            h.wait()
        with pytest.raises(ckpt.TornSnapshotError):
            ck.wait()
        assert [i.step for i in ck.list()] == [1]


def test_wait_staged_makes_in_place_writes_safe(local_dir, slow_staging):
    ema = torch.zeros(1000)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"ema": ema})
        ck.wait_staged()
        ema.add_(1)
        h.wait()
        out = {"ema": torch.empty(1000)}
        ck.restore(out)
    assert torch.equal(out["ema"], torch.zeros(1000))


def test_the_host_buffer_is_allocated_once_and_reused(local_dir):
    w = torch.randn(100_000)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir, max_in_flight=1)) as ck:
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
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
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
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=1.0)})
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)


def _state_across_pieces() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(64, 300, generator=g)
    return {
        "contiguous": torch.randn(10_000, generator=g),  # several pieces, split as bytes
        "transposed": wide.t(),  # rows halved down to the boundary
        "strided": torch.randn(9_000, generator=g)[::2],  # one dimension: its elements
        "complex": torch.randn(3_000, dtype=torch.complex64, generator=g),
        "conj": torch.randn(2_500, dtype=torch.complex64, generator=g).conj(),
        "small": torch.arange(7, dtype=torch.int8),
        "scalar": torch.tensor(3.5),
        "bool_rows": torch.rand(40, 500, generator=g) > 0.5,
    }


@pytest.mark.parametrize("chunk", [16 << 10, 1 << 20])
def test_no_copy_into_a_segment_spans_two_registration_pieces(tmp_path, monkeypatch, chunk):
    # the CUDA driver refuses a copy spanning two registrations (cudaErrorInvalidValue): with 8 KiB pieces,
    # every (destination, source) pair the snapshot copy makes stays inside one, and together they copy all
    from ckpt import shm
    from ckpt.format import ItemRecord
    from ckpt.pool import HostBuffer
    from ckpt.stage import _chunks, _copies, _dst

    monkeypatch.setattr(shm, "REGISTER_PIECE", 8192)
    state = _state_across_pieces()
    recs, off = [], 4096
    for k, t in state.items():
        n = t.numel() * t.element_size()
        recs.append(ItemRecord(k, str(t.dtype), list(t.shape), "cpu", off, n))
        off += -(-n // 4096) * 4096
    seg = shm.Segment.create(tmp_path / "seg.buf", off)
    buf = HostBuffer(0, False, segment=seg)
    items = list(zip(state.values(), recs))
    spans = 0
    for pairs, _ in _chunks(buf, items, chunk):
        for dst, src in pairs:
            assert dst.is_contiguous()
            start = dst.data_ptr() - buf.tensor.data_ptr()
            end = start + dst.numel() * dst.element_size()
            assert start // 8192 == (end - 1) // 8192, (start, end)
            spans += 1
            dst.copy_(src)
    assert spans > len(state) + 10  # the boundaries were really crossed
    for t, rec in items:
        got = _dst(buf, rec, t)
        assert torch.equal(got, t.resolve_conj()), rec.key
    buf.tensor.zero_()
    for t, rec in items:  # the same for the module buffers' copies, made whole-item
        for dst, src in _copies(buf, rec, t):
            dst.copy_(src)
        assert torch.equal(_dst(buf, rec, t), t.resolve_conj()), rec.key
    seg.release()


def test_a_memory_tier_snapshot_round_trips_across_registration_pieces(local_dir, monkeypatch):
    from ckpt import shm

    monkeypatch.setattr(shm, "REGISTER_PIECE", 8192)
    state = _state_across_pieces()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
    ) as ck:
        ck.save(1, state).wait("memory")
        out = {k: torch.zeros_like(v.resolve_conj()) for k, v in state.items()}
        assert ck.restore(out) == 1 and ck.last_restore.tier == "memory"
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj()), k


def test_segments_are_not_taken_over_ahead_before_this_rank_s_gpu_is_known(tmp_path, monkeypatch):
    """Registering a segment happens in the context of the device the pool noted; before CUDA is
    initialised in the process that device is not known, and a background thread's is GPU 0: the
    takeover ahead waits (for a later call, or the first save) rather than open a context on GPU 0."""
    from ckpt.pool import HostPool, SharedSpace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    pool = HostPool(2, None, pin=True)
    pool.share(SharedSpace(tmp_path, "ckpt-test", str(tmp_path)))
    pool.adopt_ahead()
    assert pool._adopting is None and pool._device is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    pool.adopt_ahead()  # now the training thread's device is known: noted, and the takeover starts
    pool.wait_adopted()
    assert pool._adopting is not None and pool._device == 3 and pool.buffers == []
    pool.close()

"""A save of ``maybe_save`` that finds no host buffer free waits a bounded time (``CKPT_BUSY_WAIT_MS``), then
is skipped: while the background allocation of a fresh process is still running (it is never done beside it,
in the training thread), or while every buffer is held by a tier. Forced saves wait as long as it takes.

The allocation is made slow the way a fresh node's is (seconds to pin or register GBs): each call of
``HostPool._allocate`` sleeps first, until the test has seen what happens meanwhile.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import knobs, pool as pool_mod
from ckpt.pool import HostPool
from ckpt.tiers import LocalTier
from helpers import assert_ok, run_ranks

HERE = Path(__file__).parent
SLOW_S = 4.0  # one buffer's allocation
BOUND_MS = 500  # the busy wait in these tests: the slack around it is generous, the allocation far longer


class _Allocations(list):
    """The names of the threads that allocated a host buffer; ``finish()`` ends the allocations' sleep (this
    one's and those to come) once the test has checked what it needed while they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()

    def finish(self) -> None:
        self.done.set()


@pytest.fixture
def slow_allocation(monkeypatch):
    """Every host buffer takes SLOW_S seconds to allocate, or until ``finish()``; returns the _Allocations."""
    threads = _Allocations()
    real = HostPool._allocate

    def slow(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        threads.done.wait(SLOW_S)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HostPool, "_allocate", slow)
    return threads


def _state() -> dict:
    return {"w": torch.ones(1000)}


def _skip_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ckpt.api" and r.levelno == logging.WARNING]


def test_a_save_during_the_background_allocation_is_skipped_after_the_bound(
    local_dir, slow_allocation, caplog
):
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=BOUND_MS),
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1)) as ck,
    ):
        t0 = time.monotonic()
        handle = ck.maybe_save(1, _state())  # starts the allocation, then finds no buffer yet
        took = time.monotonic() - t0
        assert handle.status == "skipped" and ck.skipped == 1
        assert took < SLOW_S - 1, (
            took
        )  # not a whole allocation, in the loop or waiting for the background one
        assert [r.levelno for r in _skip_records(caplog)] == [logging.WARNING]
        slow_allocation.finish()
        ck.pool._prepared.join(60)
        # the training thread allocated nothing, not even beside the background allocation
        assert slow_allocation == ["ckpt-prepare"] * 3 and ck.pool.allocations == 3


def test_a_save_after_the_background_allocation_finished_is_taken(local_dir, slow_allocation):
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=BOUND_MS),
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1)) as ck,
    ):
        assert ck.maybe_save(1, _state()).status == "skipped"
        slow_allocation.finish()
        ck.pool._prepared.join(60)
        handle = ck.maybe_save(2, _state())
        assert handle.wait().status == "done" and ck.skipped == 1
        assert ck.local.committed_steps() == [2] and ck.pool.allocations == 3


def test_a_save_waits_for_the_background_allocation_within_the_bound(local_dir, slow_allocation):
    # the bound covers the allocation: the save waits for its first buffer instead of being skipped, and
    # does not allocate the second one itself meanwhile
    threading.Timer(1.0, slow_allocation.finish).start()  # an allocation of 1 s, well within the bound
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=int(SLOW_S * 1000) + 30_000),
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1)) as ck,
    ):
        assert ck.maybe_save(1, _state()).wait().status == "done"
        ck.pool._prepared.join(60)
        assert ck.skipped == 0 and slow_allocation == ["ckpt-prepare"] * 3


def test_an_explicit_save_during_the_background_allocation_waits_and_is_taken(local_dir, slow_allocation):
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=BOUND_MS),
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=50)
        ) as ck,
    ):
        assert ck.maybe_save(1, _state()) is None  # not due: starts the allocation only
        handle = ck.save(2, _state())
        assert handle.wait().status == "done" and ck.skipped == 0
        assert handle.stats.wait_s > SLOW_S / 2


def test_a_requested_save_during_the_background_allocation_waits_and_is_taken(local_dir, slow_allocation):
    signals = ckpt.Signals(save=(signal.SIGUSR1,))
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=BOUND_MS),
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=50), signals=signals
        ) as ck,
    ):
        assert ck.maybe_save(1, _state()) is None  # not due: starts the allocation only
        os.kill(os.getpid(), signal.SIGUSR1)
        threading.Timer(
            2 * BOUND_MS / 1000, slow_allocation.finish
        ).start()  # the allocation outlasts the bound
        handle = ck.maybe_save(2, _state())  # a forced save: waits for a buffer, durable on the local tier
        assert handle.status == "done" and ck.skipped == 0 and ck.local.committed_steps() == [2]


def test_if_busy_wait_never_skips_during_the_background_allocation(local_dir, slow_allocation):
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=BOUND_MS),
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1, if_busy="wait")
        ) as ck,
    ):
        threading.Timer(
            2 * BOUND_MS / 1000, slow_allocation.finish
        ).start()  # the allocation outlasts the bound
        handle = ck.maybe_save(1, _state())
        assert handle.wait().status == "done" and ck.skipped == 0


class _GatedTier(LocalTier):
    """A local tier whose writes wait for ``go``: the buffer it reads stays held meanwhile."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.go, self.started = threading.Event(), threading.Event()

    def write(self, step, manifest, data):
        self.started.set()
        assert self.go.wait(60)
        return super().write(step, manifest, data)


def test_a_save_finding_every_buffer_held_is_skipped_after_the_bound(local_dir, caplog):
    tier = _GatedTier(local_dir)
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=BOUND_MS),
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=tier, max_in_flight=1), policy=ckpt.Policy(every_steps=1)
        ) as ck,
    ):
        first = ck.maybe_save(1, _state())
        assert tier.started.wait(
            60
        )  # the write holds the one buffer (before it starts, step 2 would supersede it)
        t0 = time.monotonic()
        second = ck.maybe_save(2, _state())
        took = time.monotonic() - t0
        assert second.status == "skipped" and ck.skipped == 1
        assert BOUND_MS / 1000 * 0.9 <= took < BOUND_MS / 1000 + 5, (
            took
        )  # it did wait for a buffer, that long
        assert [r.levelno for r in _skip_records(caplog)] == [logging.WARNING]
        tier.go.set()
        first.wait()
        assert ck.maybe_save(3, _state()).wait().status == "done"


def test_a_save_takes_a_buffer_a_tier_lets_go_of_within_the_bound(local_dir):
    tier = _GatedTier(local_dir)
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=30_000),
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=tier, max_in_flight=1), policy=ckpt.Policy(every_steps=1)
        ) as ck,
    ):
        first = ck.maybe_save(1, _state())
        assert tier.started.wait(60)
        threading.Timer(0.3, tier.go.set).start()
        second = ck.maybe_save(2, _state())  # waits until the write of step 1 lets go of the buffer
        assert second.wait().status == "done" and first.status == "done" and ck.skipped == 0
        assert second.stats.wait_s >= 0.1


def test_repeated_skips_for_one_cause_warn_once_then_log_at_info(local_dir, caplog):
    tier = _GatedTier(local_dir)
    caplog.set_level(logging.INFO, logger="ckpt.api")
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=50),
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=tier, max_in_flight=1), policy=ckpt.Policy(every_steps=1)
        ) as ck,
    ):
        first = ck.maybe_save(1, _state())
        assert tier.started.wait(60)
        caplog.clear()
        assert [ck.maybe_save(s, _state()).status for s in (2, 3, 4)] == ["skipped"] * 3
        levels = [r.levelno for r in caplog.records if r.name == "ckpt.api"]
        assert levels == [logging.WARNING, logging.INFO, logging.INFO]
        tier.go.set()
        first.wait()


def test_two_ranks_skip_together_while_one_still_allocates_then_save_together(tmp_path):
    # rank 1's allocation is slow, rank 0's is not: both skip step 1 (the agreement), both save step 2
    results = run_ranks(HERE / "ranks_worker.py", str(tmp_path), "allocating")
    assert_ok(results)
    lines = [[l for l in r.stdout.splitlines() if l.startswith(("step", "allocated"))] for r in results]
    assert lines[0][:2] == lines[1][:2] == ["step 1 skipped 1", "step 2 done 1"], lines
    assert lines[1][2] == "allocated by ckpt-prepare ckpt-prepare ckpt-prepare", (
        lines
    )  # never in rank 1's training thread


def test_the_pool_counts_an_allocation_under_way_as_a_buffer_to_come(slow_allocation):
    pool = HostPool(1, None, pin=False)
    try:
        pool.prepare(1000)
        # acquire without block waits for that allocation: has_free says so (the ranks agree on it)
        assert pool.has_free()
        # a save that may be skipped does not wait that long
        assert not pool.wait_free(1000, 1, timeout=BOUND_MS / 1000)
        slow_allocation.finish()
        buf = pool.acquire(1000, block=False, step=1)
        assert buf is not None and slow_allocation == ["ckpt-prepare"]
    finally:
        pool.close()


def test_interval_auto_takes_its_first_snapshot_once_the_buffers_are_there_and_not_their_cost(
    local_dir, slow_allocation, monkeypatch
):
    # "as soon as it can" under interval="auto": no skip (nor wait) per step while the buffers, which cannot be
    # there within the bound (a slow rate for their size), are allocated in the background, and the
    # allocation (a one-time cost) never becomes the snapshot's measured cost
    monkeypatch.setattr(pool_mod, "_ALLOC_GBPS", 1e-9)
    clock = [0.0]
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(interval="auto", mtbf=3600),
        clock=lambda: clock[0],
    ) as ck:
        t0 = time.monotonic()
        first = ck.maybe_save(1, _state())  # starts the allocation: its first moments may still take a skip
        assert first is None or first.status == "skipped"
        assert ck.maybe_save(2, _state()) is None  # the allocation runs: not due yet, and no wait
        assert time.monotonic() - t0 < SLOW_S / 2 and ck.skipped <= 1
        skipped = ck.skipped
        deadline = time.monotonic() + 10 * SLOW_S
        step, handle = 2, None
        while handle is None and time.monotonic() < deadline:
            step += 1
            clock[0] += 1.0
            time.sleep(0.2)
            handle = ck.maybe_save(step, _state())
        assert handle is not None and handle.status != "skipped" and ck.skipped == skipped
        handle.wait()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir / "b"), policy=ckpt.Policy(interval="auto", mtbf=3600)
    ) as ck:
        ck.save(1, _state()).wait()  # an explicit first save allocates its buffer itself (SLOW_S)
        assert ck.history[-1].stall_s >= SLOW_S
        assert ck.interval_report()["cost_s"] < SLOW_S / 4  # the allocation is not the snapshot's cost


def test_a_save_skips_at_once_when_the_first_buffer_cannot_be_there_within_the_bound(
    local_dir, slow_allocation, monkeypatch
):
    # the first buffer's allocation needs far longer than the bound (a slow rate for its size): no wait at all
    monkeypatch.setattr(pool_mod, "_ALLOC_GBPS", 1e-9)
    with (
        knobs.override(CKPT_BUSY_WAIT_MS=3000),
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1)) as ck,
    ):
        t0 = time.monotonic()
        handle = ck.maybe_save(1, _state())
        assert handle.status == "skipped" and time.monotonic() - t0 < 1.5
        assert handle.skip_reason == "allocating"
        slow_allocation.finish()


def test_with_pinned_buffers_the_first_is_taken_while_the_others_are_allocated_between_copies(
    tmp_path, slow_allocation
):
    # the first buffer is there, the second still being allocated (pages reserved, mapped and registered with
    # the CUDA driver in paced pieces): a save takes the free buffer at once, and the allocation registers its
    # pieces only while no snapshot is being copied (a snapshot beside a registration stalls the loop)
    pool = HostPool(2, None, pin=True)
    pool.share(pool_mod.SharedSpace(tmp_path, "ckpt-0123456789abcdef-r00000", str(tmp_path)))
    pool.prepare(4096)
    deadline = time.monotonic() + 3 * SLOW_S
    while not pool.buffers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pool.buffers) == 1 and pool._allocating == 1
    t0 = time.monotonic()
    assert pool.wait_free(4096, 1, 5.0) and time.monotonic() - t0 < 0.5
    assert not pool.allocation_outlasts(5.0)
    pool._prepared.join(3 * SLOW_S)
    assert pool.wait_free(4096, 1, 0.3) and not pool.allocation_outlasts(0.3)
    pool.close()


def test_a_paced_allocation_waits_between_its_pieces_while_a_snapshot_is_copied(monkeypatch):
    """The background allocation's pieces are registered between snapshot copies (ckpt.shm.quiet), never beside
    one: while a copy is in flight, the next piece waits for it (at most pool_mod._QUIET_WAIT_S)."""
    from ckpt import shm

    monkeypatch.setattr(pool_mod, "_QUIET_WAIT_S", 30.0)
    stop = threading.Event()
    pool_mod._copy_began()
    done = threading.Event()
    try:
        threading.Thread(target=lambda: (shm._pause(stop, 0.001), done.set()), daemon=True).start()
        assert not done.wait(0.5), "a piece went ahead beside a snapshot copy"
    finally:
        pool_mod._copy_ended()
    assert done.wait(10)


def _registered_pieces(tmp_path, monkeypatch, burst_ms: int, copy_from: int | None = None) -> list[float]:
    """Register a paced 8-piece segment as the background allocation does, the driver's registration faked
    (this machine has no CUDA): when each piece was registered. ``copy_from``: a snapshot copy begins as
    that piece is registered and lands 0.3 s later."""
    from ckpt import shm

    monkeypatch.setattr(shm, "REGISTER_PIECE", 64 << 10)
    monkeypatch.setattr(shm, "REGISTER_GAP_S", 0.02)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    at: list[float] = []

    def register(ptr, nbytes):
        at.append(time.monotonic())
        if copy_from is not None and len(at) == copy_from:
            pool_mod._copy_began()
            threading.Timer(0.3, pool_mod._copy_ended).start()
        return 0

    monkeypatch.setattr(shm, "host_register", register)
    monkeypatch.setattr(shm, "host_unregister", lambda ptr: 0)
    tmp_path.mkdir()
    seg = shm.Segment.create(tmp_path / "seg", 8 * (64 << 10))
    with knobs.override(CKPT_REGISTER_BURST_MS=burst_ms):
        assert seg.register(paced=True, stop=threading.Event())
    seg.registered = False  # nothing was registered with a driver: release() must not unregister
    seg.release()
    return at


def test_a_registration_burst_registers_pieces_back_to_back_until_a_copy_begins(tmp_path, monkeypatch):
    """CKPT_REGISTER_BURST_MS: once no snapshot copy is in flight, the background allocation registers its
    pieces back to back (no pause between them) for that long; a copy that begins ends the burst, and the
    next piece waits for it to land. 0: a pause before every piece."""
    one_by_one = _registered_pieces(tmp_path / "a", monkeypatch, 0)
    gaps = [b - a for a, b in zip(one_by_one, one_by_one[1:])]
    assert len(one_by_one) == 8 and min(gaps) >= 0.02, gaps
    burst = _registered_pieces(tmp_path / "b", monkeypatch, 10_000)
    gaps = [b - a for a, b in zip(burst, burst[1:])]
    assert len(burst) == 8 and max(gaps) < 0.015, gaps  # one quiet moment: all eight at once
    cut = _registered_pieces(tmp_path / "c", monkeypatch, 10_000, copy_from=3)
    gaps = [b - a for a, b in zip(cut, cut[1:])]
    # pieces 1-3 back to back; the copy began with the third: the fourth waits until it landed (0.3 s)
    assert max(gaps[:2]) < 0.015 and gaps[2] >= 0.25, gaps
    assert max(gaps[3:]) < 0.015, gaps  # then the next burst

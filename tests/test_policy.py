"""When saves happen, what is kept, and what a save does while the previous one still persists."""

from __future__ import annotations

import threading
import time

import torch

import ckpt
from ckpt.tiers import LocalTier


def test_every_steps(local_dir):
    with ckpt.Checkpointer(local_dir=local_dir, every_steps=3, keep=ckpt.Retention(local=None)) as ck:
        saved = [s for s in range(1, 11) if ck.maybe_save(s, {"s": s}) is not None]
    assert saved == [3, 6, 9]


def test_every_seconds_with_an_injected_clock(local_dir):
    now = [0.0]
    with ckpt.Checkpointer(local_dir=local_dir, every_seconds=10, clock=lambda: now[0],
                           keep=ckpt.Retention(local=None)) as ck:
        saved = []
        for s in range(1, 30):
            now[0] += 3.0
            if ck.maybe_save(s, {"s": s}) is not None:
                saved.append(s)
    assert saved == [4, 8, 12, 16, 20, 24, 28]


def test_retention_keeps_the_newest_n(local_dir):
    with ckpt.Checkpointer(local_dir=local_dir, keep=ckpt.Retention(local=2)) as ck:
        for s in range(1, 6):
            ck.save(s, {"s": s}).wait()
        assert [i.step for i in ck.list()] == [5, 4]


def test_retention_removes_uncommitted_leftovers_of_crashed_writes(local_dir):
    (local_dir / "step-000000001").mkdir()
    (local_dir / "step-000000001" / "rank-00000.bin").write_bytes(b"torn")
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        ck.save(2, {"s": 2}).wait()
    assert sorted(p.name for p in local_dir.glob("step-*")) == ["step-000000002"]


class GatedTier(LocalTier):
    """A local tier whose writes wait for a gate: a slow disk under the test's control."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.started = threading.Event()   # a write is under way: its buffer is being read

    def write(self, step, manifest, data):
        self.started.set()
        self.gate.wait(10)
        return super().write(step, manifest, data)


def test_if_busy_skip_reports_the_skipped_save(local_dir, caplog):
    """One buffer, being read by the local tier: the next snapshot has nowhere to go and is skipped."""
    tier = GatedTier(local_dir)
    with ckpt.Checkpointer(local_dir=tier, if_busy="skip", max_in_flight=1) as ck:
        first = ck.save(1, {"s": torch.ones(10)})
        first.wait("memory")
        # once the write started (before, step 2 would supersede step 1 in the queue: newest wins)
        assert tier.started.wait(10)
        second = ck.save(2, {"s": torch.ones(10)})
        assert second.status == "skipped" and ck.skipped == 1
        assert "skipped the save of step 2" in caplog.text
        tier.gate.set()
        first.wait()
        assert ck.save(3, {"s": torch.ones(10)}).wait().status == "done"


def test_if_busy_wait_blocks_and_reports_the_wait(local_dir):
    tier = GatedTier(local_dir)
    with ckpt.Checkpointer(local_dir=tier, if_busy="wait", max_in_flight=1) as ck:
        ck.save(1, {"s": torch.ones(10)}).wait("memory")
        threading.Timer(0.3, tier.gate.set).start()
        h = ck.save(2, {"s": torch.ones(10)})
        assert h.stats.wait_s >= 0.2 and h.stats.stall_s >= h.stats.wait_s
        h.wait()


def test_two_buffers_and_a_busy_tier_newest_wins(local_dir):
    """Two buffers: one read by the (stuck) local tier, the other holds the newest snapshot waiting for
    it; each newer snapshot takes the waiting one's buffer and its place (superseded, reported), and no
    save waits for the tier."""
    tier = GatedTier(local_dir)
    with ckpt.Checkpointer(local_dir=tier, max_in_flight=2, keep=ckpt.Retention(local=None)) as ck:
        a = ck.save(1, {"s": torch.ones(10)})
        a.wait("memory")
        b = ck.save(2, {"s": torch.ones(10)})
        b.wait("memory")
        c = ck.save(3, {"s": torch.ones(10)})
        c.wait("memory")
        assert c.status == "pending" and b.tier_status("local") == "skipped"
        assert b.skipped_tiers["local"] == "superseded by step 3"
        tier.gate.set()
        ck.wait()
        assert ck.pool.allocations == 2
        assert ck.tier_counts["local"].persisted == 2 and ck.tier_counts["local"].superseded == 1
        assert tier.committed_steps() == [3, 1]


def test_an_older_snapshot_never_supersedes_a_newer_one(local_dir, monkeypatch):
    """Snapshots reach the tiers in the order they were taken, whatever order their copies land in: the
    memory commit of step 1 is slow, step 2's lands first, and the disk, busy with step 0, then writes
    step 2 (the newest), never step 1 in its place."""
    from ckpt.tiers.memory import MemoryTier

    tier = GatedTier(local_dir)
    commit = MemoryTier.commit

    def slow_for_step_1(self, step, manifest, buffer, *args, **kwargs):
        if step == 1:
            time.sleep(1.0)
        return commit(self, step, manifest, buffer, *args, **kwargs)

    monkeypatch.setattr(MemoryTier, "commit", slow_for_step_1)
    with ckpt.Checkpointer(local_dir=tier, max_in_flight=3) as ck:
        h0 = ck.save(0, {"s": torch.zeros(10)})
        assert tier.started.wait(10)   # the disk is busy with step 0
        h1 = ck.save(1, {"s": torch.ones(10)})
        h2 = ck.save(2, {"s": torch.full((10,), 2.0)})
        h2.wait("memory")
        h1.wait("memory")
        tier.gate.set()
        ck.wait()
        assert h1.skipped_tiers == {"local": "superseded by step 2"} and h2.skipped_tiers == {}
        assert h0.tier_status("local") == h2.tier_status("local") == "done"
    assert LocalTier(local_dir).committed_steps() == [2, 0]

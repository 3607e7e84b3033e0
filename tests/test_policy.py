"""When saves happen, what is kept, and what a save does while the previous one still persists."""

from __future__ import annotations

import copy
import pickle
import signal
import threading
import time

import pytest
import torch

import ckpt
from ckpt.tiers import LocalTier


def test_every_steps(local_dir):
    with ckpt.Checkpointer(local_dir=local_dir, every_steps=3, keep=ckpt.Retention(local=None)) as ck:
        saved = [s for s in range(1, 11) if ck.maybe_save(s, {"s": s}) is not None]
    assert saved == [3, 6, 9]


def test_every_seconds_with_an_injected_clock(local_dir):
    now = [0.0]
    with ckpt.Checkpointer(
        local_dir=local_dir, every_seconds=10, clock=lambda: now[0], keep=ckpt.Retention(local=None)
    ) as ck:
        saved = []
        for s in range(1, 30):
            now[0] += 3.0
            h = ck.maybe_save(s, {"s": s})
            if h is not None:
                saved.append(s)
                h.wait("memory")  # the copy lands before the next step, as in a training loop
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
        self.started = threading.Event()  # a write is under way: its buffer is being read

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


def test_two_buffers_and_a_busy_tier_keep_the_newest_and_skip_the_next(local_dir):
    """Two buffers: one read by the (stuck) local tier, the other holds the newest snapshot, waiting for it.
    A newer snapshot is skipped rather than copied over the newest (which a failed copy would then lose),
    and no save waits for the tier; the tier writes the newest once it is free."""
    tier = GatedTier(local_dir)
    with ckpt.Checkpointer(local_dir=tier, max_in_flight=2, keep=ckpt.Retention(local=None)) as ck:
        a = ck.save(1, {"s": torch.ones(10)})
        a.wait("memory")
        b = ck.save(2, {"s": torch.ones(10)})
        b.wait("memory")
        c = ck.save(3, {"s": torch.ones(10)})
        assert c.status == "skipped" and b.tier_status("local") == "pending"
        assert ck.tier_figures()["memory"].snapshots_skipped == 1
        tier.gate.set()
        ck.wait()
        assert ck.pool.allocations == 2
        assert ck.tier_counts["local"].persisted == 2 and ck.tier_counts["local"].superseded == 0
        assert tier.committed_steps() == [2, 1]


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
        assert tier.started.wait(10)  # the disk is busy with step 0
        h1 = ck.save(1, {"s": torch.ones(10)})
        h2 = ck.save(2, {"s": torch.full((10,), 2.0)})
        h2.wait("memory")
        h1.wait("memory")
        tier.gate.set()
        ck.wait()
        # (step 1's record in RAM may be superseded by step 2's, the newest: it then says so)
        assert {t: why for t, why in h1.skipped_tiers.items() if t != "memory"} == {
            "local": "superseded by step 2"
        }
        assert h1.tier_status("memory") in ("done", "skipped") and h2.skipped_tiers == {}
        assert h0.tier_status("local") == h2.tier_status("local") == "done"
    assert LocalTier(local_dir).committed_steps() == [2, 0]


# -- no silent policies -----------------------------------------------------------------------------------
def test_maybe_save_without_a_policy_refuses_at_the_first_call(local_dir):
    """A Checkpointer with no every_steps / every_seconds / interval (and no signals) would never save from
    maybe_save: the first call says so, naming the arguments, and nothing is written."""
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        with pytest.raises(ValueError) as e:
            ck.maybe_save(0, {"s": 0})
        assert "every_steps" in str(e.value)
        ck.save(1, {"s": 1}).wait()  # save() needs no policy
    with ckpt.Checkpointer(local_dir=local_dir, signals=(signal.SIGUSR1,)) as ck:
        assert ck.maybe_save(2, {"s": 2}) is None  # a loop that saves on signals only
    with ckpt.Checkpointer(local_dir=local_dir, every_steps=5) as ck:
        assert ck.maybe_save(2, {"s": 2}) is None and ck.maybe_save(5, {"s": 5}) is not None


def test_the_final_step_of_a_plain_loop_is_kept(local_dir, tmp_path):
    """every_steps=10 and 100 steps: maybe_save(final=...) at the last step makes step 99 the newest
    checkpoint on every tier (its cadences say otherwise), and a re-run restores it and trains nothing."""
    url = f"file://{tmp_path}/remote"
    total = 100
    for run in range(2):
        trained = []
        with ckpt.Checkpointer(
            url, local_dir=local_dir, every_steps=10, persist_every={"local": 30, "remote": 50}
        ) as ck:
            last = ck.restore(state := {"s": None})
            for step in range(0 if last is None else last + 1, total):
                state["s"] = step
                trained.append(step)
                ck.maybe_save(step, state, final=step == total - 1)
        assert (last, len(trained)) == ((None, total) if run == 0 else (total - 1, 0))
        with ckpt.Checkpointer(url, local_dir=local_dir) as reader:
            listed = reader.list()
        assert listed[0].step == total - 1 and {"local", "remote"} <= set(listed[0].tiers)


def test_the_final_step_is_saved_even_when_every_buffer_is_busy(local_dir):
    """if_busy="skip" skips a due save that finds no free host buffer; the final one waits for one."""
    tier = GatedTier(local_dir)
    with ckpt.Checkpointer(local_dir=tier, if_busy="skip", max_in_flight=1, every_steps=1) as ck:
        ck.save(1, {"s": torch.ones(10)}).wait("memory")
        assert tier.started.wait(10)  # the only buffer is being read by the local tier
        assert ck.maybe_save(2, {"s": torch.ones(10)}).status == "skipped"
        threading.Timer(0.5, tier.gate.set).start()
        handle = ck.maybe_save(3, {"s": torch.full((10,), 3.0)}, final=True)
        assert handle.status != "skipped"
        handle.wait()
    assert tier.committed_steps()[0] == 3


# -- keep= and the other fields of a Policy ---------------------------------------------------------------
def test_keep_as_an_int_keeps_that_many_on_every_tier(local_dir, tmp_path, caplog):
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(url, local_dir=local_dir, keep=2, if_busy="wait") as ck:
        assert ck.policy.keep == ckpt.Retention.every_tier(2) and ck.keep == ck.policy.keep
        for s in range(1, 6):
            ck.save(s, {"s": s}).wait()
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelname == "ERROR"]
    assert LocalTier(local_dir).committed_steps() == [5, 4]
    with ckpt.Checkpointer(url, local_dir=tmp_path / "other") as reader:
        assert [c.step for c in reader.list()] == [5, 4]
    assert ckpt.Policy(keep=3).keep == ckpt.Retention.every_tier(3) != ckpt.Retention(local=3, remote=3)
    assert (ckpt.Policy(keep=3).keep.local, ckpt.Policy(keep=3).keep.remote) == (3, 3)


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("keep", 0, ValueError),
        ("keep", -1, ValueError),
        ("keep", True, TypeError),
        ("keep", 2.0, TypeError),
        ("keep", "2", TypeError),
        ("keep", {"local": 0}, ValueError),
        ("keep", {"disk2": 1.5}, ValueError),
        ("keep", {2: 2}, TypeError),
        ("keep", [2], TypeError),
        ("every_steps", 0, ValueError),
        ("every_steps", True, TypeError),
        ("every_steps", 2.5, TypeError),
        ("every_steps", "10", TypeError),
        ("every_seconds", 0, ValueError),
        ("every_seconds", -1.0, ValueError),
        ("every_seconds", float("nan"), ValueError),
        ("every_seconds", float("inf"), ValueError),
        ("every_seconds", "60", TypeError),
        ("interval", "daly", ValueError),
        ("mtbf", -5, ValueError),
        ("mtbf", "1h", TypeError),
        ("mtbf", {"memory": 0}, ValueError),
        ("restart_cost", -1, ValueError),
        ("restart_cost", None, TypeError),
        ("persist_every", {"local": 0}, ValueError),
        ("persist_every", {"local": 2.0}, TypeError),
        ("persist_every", 50, TypeError),
        ("if_busy", "block", ValueError),
        ("on_unsupported", "pickle", ValueError),
    ],
)
def test_every_policy_field_is_checked_when_the_checkpointer_is_made(local_dir, field, value, error):
    with pytest.raises(error) as e:
        ckpt.Policy(**{field: value})
    assert field in str(e.value)
    with pytest.raises(error):  # the keyword argument is the same option
        ckpt.Checkpointer(local_dir=local_dir, **{field: value})
    assert not any(local_dir.iterdir())


def test_a_retention_with_wrong_counts_is_refused():
    for bad in (0, -2, 1.5, "3", True):
        with pytest.raises(ValueError):
            ckpt.Retention(local=bad)
        with pytest.raises(ValueError):
            ckpt.Retention(remote=bad)
        with pytest.raises(ValueError):  # a tier by its name is checked alike
            ckpt.Retention(disk2=bad)


def test_keep_as_a_dict_is_a_retention_by_tier_name():
    r = ckpt.Retention(local=3, disk2=5)
    assert ckpt.Policy(keep={"local": 3, "disk2": 5}).keep == r
    assert r.local == 3 and r.remote == 10 and dict(r.tiers) == {"disk2": 5}  # remote keeps its default
    assert hash(r) == hash(ckpt.Retention(local=3, disk2=5)) and r != ckpt.Retention(local=3)
    assert copy.deepcopy(r) == r and pickle.loads(pickle.dumps(r)) == r
    assert ckpt.Policy(keep={"local": 1}).keep == ckpt.Retention(local=1)


@pytest.mark.parametrize("keep", [ckpt.Retention(disk9=2), {"memory": 2}, {"peer": 1}, {"disk9": None}])
def test_a_retention_naming_a_tier_this_checkpointer_lacks_is_refused(local_dir, keep):
    """Only durable tiers the Checkpointer has may be named: an unknown name, or a RAM tier (whose retention
    is its number of buffers), is a ValueError at construction, before anything is written."""
    with pytest.raises(ValueError):
        ckpt.Checkpointer(local_dir=local_dir, keep=keep)
    assert not any(local_dir.iterdir())

"""The memory tier outlives the process (shared memory), tiers at their own cadence, newest wins."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import shm
from ckpt.tiers import LocalTier
from helpers import kill_after

HERE = Path(__file__).parent
needs_shm = pytest.mark.skipif(shm.shm_root() is None, reason="no RAM file system (/dev/shm) here")
# restore into CPU tensors, and into CUDA tensors (read into pinned chunks, checked, sent on a side stream)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)"
            ),
        ],
    ),
]


def _model(device: str) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).to(device)


def _start(local_dir: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, str(HERE / "memory_worker.py"), str(local_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _run(local_dir: Path, *args: str) -> list[str]:
    p = _start(local_dir, *args)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return out.splitlines()


@needs_shm
def test_a_killed_training_process_resumes_from_ram_bit_identically(tmp_path):
    """Snapshots every step, the local tier every 1000: SIGKILLed at step 7, a new process restores step 7
    from the memory tier (the disk holds only step 1) and ends bit-identical to an uninterrupted run."""
    ref = _run(tmp_path / "ref", "12", "train")
    assert ref[-1].startswith("final ")
    run = tmp_path / "run"
    proc = _start(run, "12", "train", "0.05")
    kill_after(proc, "step 7")
    on_disk = LocalTier(run).committed_steps()
    newest = max(r.step for g in shm.segments(prefix=shm.prefix_for(run, 0, create=True)) for r in g.records)
    # the disk holds the first snapshot only (step 1, or 2 where step 1 came while the first buffer was still
    # being allocated, as on a GPU node, where that allocation starts CUDA): step 7 is in RAM alone
    assert len(on_disk) == 1 and on_disk[0] <= 2 and newest >= 7
    out = _run(run, "12", "train")
    assert out[0] == f"restored {newest} memory"
    assert out[-1] == ref[-1]
    # a clean finish freed the RAM
    assert shm.segments(prefix=shm.prefix_for(run, 0, create=True)) == []


@needs_shm
@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_torn_by_a_kill_mid_copy_is_never_served(tmp_path, device):
    run = tmp_path / "run"
    proc = _start(run, "0", "tear")
    kill_after(proc, "copying")
    recs = {
        r.slot: r.step for g in shm.segments(prefix=shm.prefix_for(run, 0, create=True)) for r in g.records
    }
    assert recs == {1: 2}, recs  # step 1's buffer was being overwritten: its record went first
    state = {"model": _model(device), "step": 0}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=run)) as ck:
        assert ck.restore(state, strict=False) == 2
        assert ck.last_restore.tier == "memory" and ck.last_restore.skipped == []
    assert all(torch.equal(p, torch.full_like(p, 2)) for p in state["model"].parameters())


@needs_shm
@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupt_memory_snapshot_is_refused_and_the_next_tier_used(tmp_path, caplog, device):
    run = tmp_path / "run"
    proc = _start(run, "0", "tear")
    kill_after(proc, "copying")
    [rec] = [r for g in shm.segments(prefix=shm.prefix_for(run, 0, create=True)) for r in g.records]
    buf = Path(rec.path).with_name(rec.buffer)
    with open(buf, "r+b") as f:  # one bit of step 2's snapshot flips in RAM
        f.seek(rec.manifest.items[0].offset + 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    state = {"model": _model(device), "step": 0}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=run)) as ck:
        with pytest.warns(RuntimeWarning, match=str(buf)):
            assert ck.restore(state, strict=False) == 1
        assert ck.last_restore.tier == "local" and ck.last_restore.skipped[0].startswith("memory:2")
    assert all(torch.equal(p, torch.full_like(p, 1)) for p in state["model"].parameters())


class GatedTier(LocalTier):
    """A local tier that cannot write until the gate opens: a disk slower than any loop."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.entered: list[int] = []  # the steps whose write began, in order

    def write(self, step, manifest, data):
        self.entered.append(step)
        assert self.gate.wait(120), "the gate never opened"
        return super().write(step, manifest, data)


def test_a_slow_tier_makes_no_save_wait_and_writes_the_newest_snapshot_at_the_end(local_dir, caplog):
    tier = GatedTier(local_dir)
    w = torch.zeros(10_000)
    handles = []
    caplog.set_level(logging.INFO, logger="ckpt.pipeline")
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tier), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:

        def loop():
            for step in range(1, 21):
                ck.wait_staged()
                w.fill_(step)
                handles.append(ck.save(step, {"w": w}))

        t = threading.Thread(target=loop)
        t.start()
        t.join(60)  # the gate is closed: a save that waited for the tier would never return
        assert not t.is_alive() and len(handles) == 20, "a save waited for the local tier"
        assert all(h.status != "skipped" for h in handles)
        handles[-1].wait("memory")
        # the newest supersedes the one waiting once its watcher hands it over, just after its memory commit
        handles[-2].wait("local", timeout=30)
        # the first snapshot the tier took is being written (the gate: step 1, or a later one where the tier's
        # thread woke after the next snapshot had superseded it), the newest waits; all others were superseded
        first = tier.entered[0]
        superseded = [h.step for h in handles if h.skipped_tiers.get("local", "").startswith("superseded")]
        assert superseded == [s for s in range(1, 20) if s != first], (first, superseded)
        assert tier.entered == [first] and ck.tier_counts["local"].superseded == 18
        assert "superseded by step" in caplog.text
        tier.gate.set()
    assert tier.committed_steps() == [20, first]
    assert handles[-1].tier_status("local") == "done"


def test_persist_every_sets_each_tiers_cadence_and_close_writes_the_newest(tmp_path):
    local = LocalTier(tmp_path / "l")
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=f"file://{tmp_path}/r", local_dir=local),
        policy=ckpt.Policy(
            if_busy="wait", persist_every={"local": 5, "remote": 10}, keep=ckpt.Retention(None, None)
        ),
    ) as ck:
        handles = [ck.save(s, {"s": torch.tensor(s)}) for s in range(1, 13)]
        ck.wait()
        # (the memory tier may have recorded a newer snapshot first: it then says so for this one)
        assert {t: why for t, why in handles[1].skipped_tiers.items() if t != "memory"} == {
            "local": "not due",
            "remote": "not due",
        }
        assert ck.tier_counts["local"].not_due == 9 and ck.tier_counts["remote"].not_due == 10
    assert local.committed_steps() == [12, 11, 6, 1]
    assert ck.remote.committed_steps() == [12, 11, 1]


@pytest.mark.parametrize("bad", [{"disk": 5}, {"local": 0}, {"remote": 5}, {"local": 2.5}])
def test_persist_every_refuses_what_it_cannot_mean(local_dir, bad):
    with pytest.raises((ValueError, TypeError)):  # a step count that is not an int is a TypeError
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every=bad))


@needs_shm
def test_segments_belong_to_one_local_dir_and_one_writer(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=a)) as ck:
        ck.save(1, {"w": torch.ones(100)}).wait()
        assert [c.step for c in ck.memory.committed()] == [1]
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=b)
        ) as other:  # another local tier: another name space
            assert other.memory.committed() == []
        second = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=a))
        with pytest.raises(ckpt.LockedError):  # one writer of a's directory and of its segments
            second.save(2, {"w": torch.ones(100)})
        out = {"w": torch.zeros(100)}
        assert second.restore(out) == 1 and torch.equal(
            out["w"], torch.ones(100)
        )  # reading needs no ownership
        second.close()
        assert shm.segments(prefix=shm.prefix_for(a, 0, create=True)), (
            "a reader's close freed the owner's segments"
        )
    assert shm.segments(prefix=shm.prefix_for(a, 0, create=True)) == []


@needs_shm
def test_a_block_that_raises_keeps_the_memory_tier_for_the_next_process(local_dir):
    with pytest.raises(ZeroDivisionError):
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
        ) as ck:
            ck.save(1, {"w": torch.ones(10)})
            ck.save(2, {"w": torch.full((10,), 2.0)}).wait("memory")
            1 / 0
    out = {"w": torch.zeros(10)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(out) == 2 and ck.last_restore.tier in ("memory", "local")
    assert torch.equal(out["w"], torch.full((10,), 2.0))
    assert (
        shm.free(prefix=shm.prefix_for(local_dir, 0, create=True)) > 0
    )  # the restore-only Checkpointer left them


def test_without_room_in_ram_the_memory_tier_stays_in_the_process(local_dir, monkeypatch, caplog):
    monkeypatch.setattr(shm, "available_bytes", lambda root: 4096)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": torch.ones(1000)}).wait()
        assert all(b.segment is None for b in ck.pool.buffers)
        out = {"w": torch.zeros(1000)}
        assert ck.restore(out) == 1 and ck.last_restore.tier == "memory"
    if shm.shm_root() is not None:  # said once, at WARNING
        assert [r.levelno for r in caplog.records if r.name == "ckpt.pool"].count(logging.WARNING) == 1


def test_the_first_maybe_save_allocates_the_buffers_in_the_background(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=50)
    ) as ck:
        state = {"w": torch.ones(100_000)}
        assert ck.maybe_save(1, state) is None
        ck.pool._prepared.join(60)
        assert len(ck.pool.buffers) == 3 and ck.pool.allocations == 3
        ck.maybe_save(50, state).wait()
        assert ck.pool.allocations == 3  # the save took a prepared buffer


@needs_shm
def test_the_background_allocation_takes_over_what_the_previous_process_left_first(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
    ) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((100_000,), float(s))}).wait("memory")
        ck.close(keep_memory=True)  # as a crash leaves them
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(every_steps=10, persist_every={"local": 1000}),
    ) as ck:
        state = {"w": torch.zeros(100_000)}
        assert ck.maybe_save(3, state) is None  # starts the background allocation
        ck.pool._prepared.join(60)
        # both segments adopted with their snapshots, each slot mapped once; only the third buffer allocated
        assert sorted(b.slot for b in ck.pool.buffers) == [0, 1, 2] and ck.pool.allocations == 1
        assert sorted(b.image_step for b in ck.pool.buffers if b.image_step is not None) == [1, 2]
        assert ck.memory.committed_steps() == [2, 1]
        state["w"].fill_(10.0)
        ck.maybe_save(10, state).wait()
        assert ck.memory.committed_steps() == [
            10,
            2,
            1,
        ]  # into the empty buffer: both earlier ones stayed whole
        state["w"].fill_(20.0)
        ck.maybe_save(20, state).wait()
        assert ck.memory.committed_steps() == [20, 10, 2]  # the oldest went, never the newest
        assert (
            len(list(Path(shm.shm_root()).glob(shm.prefix_for(local_dir, 0, create=True) + "-s*.buf"))) == 3
        )
        out = {"w": torch.zeros(100_000)}
        assert ck.restore(out, step=2) == 2 and ck.last_restore.tier == "memory" and float(out["w"][0]) == 2.0


def _ckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckpt.cli", *args], capture_output=True, text=True, timeout=120
    )


@needs_shm
def test_ckpt_ls_and_gc_show_and_free_the_ram_a_crashed_job_left(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "0", "tear")
    kill_after(proc, "copying")
    out = _ckpt("ls", str(run), "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    # step 1's record went with the copy of step 3 into its buffer: only its local copy is left
    assert [(r["step"], r["tiers"], r["restore"]) for r in rows] == [
        (2, ["memory"], "memory"),
        (1, ["local"], None),
    ]
    mem = json.loads(_ckpt("ls", "--memory", "--json").stdout)
    [group] = [g for g in mem if g["local_dir"] == os.path.realpath(run)]
    assert group["owned"] is False and group["steps"] == [2] and group["bytes"] > 0
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=run)
    ) as ck:  # a live owner: its segments are not freed
        ck.save(3, {"w": torch.ones(10)}).wait()
        refused = _ckpt("gc", "--memory", str(run))
        assert refused.returncode == 1 and shm.segments(prefix=shm.prefix_for(run, 0))
        ck.close(keep_memory=True)
    assert _ckpt("gc", "--memory", str(run)).returncode == 0
    assert shm.segments(prefix=shm.prefix_for(run, 0, create=True)) == []


def test_after_a_rollback_the_snapshot_kept_whole_is_the_newest_on_the_live_branch(local_dir):
    # steps 1-3 saved, then a rollback to 2: the next snapshot (3 on the new branch) must be copied over the
    # abandoned step 3, never over step 2, the newest snapshot the live branch has in RAM meanwhile
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(persist_every={"local": 1000}, if_busy="wait"),
    ) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((10,), float(s))}).wait()
        out = {"w": torch.zeros(10)}
        assert ck.restore(out, step=2) == 2 and ck.timeline.number == 1
        ck.save(3, {"w": torch.full((10,), 30.0)}).wait()
        assert sorted(c.key for c in ck.memory.committed()) == [(0, 2), (1, 3)]
        ck.save(4, {"w": torch.full((10,), 40.0)}).wait()
        assert sorted(c.key for c in ck.memory.committed()) == [(1, 3), (1, 4)]


def test_a_run_restarted_from_scratch_overwrites_the_snapshot_it_replaces_first(local_dir):
    # a previous run left steps 3 and 4 in RAM; a new run that does not restore saves 1, 2, 3 on the same
    # branch: each new snapshot goes over the oldest-committed buffer, the one just committed stays whole
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(persist_every={"local": 1000}, if_busy="wait"),
    ) as ck:
        for s in (3, 4):
            ck.save(s, {"w": torch.full((10,), float(s))}).wait("memory")
        ck.close(keep_memory=True)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(persist_every={"local": 1000}, if_busy="wait"),
    ) as ck:
        ck.save(1, {"w": torch.full((10,), 10.0)}).wait("memory")
        ck.save(2, {"w": torch.full((10,), 20.0)}).wait("memory")
        assert {1, 2} <= {c.step for c in ck.memory.committed()}
        ck.save(3, {"w": torch.full((10,), 30.0)}).wait("memory")
        held = {c.step for c in ck.memory.committed()}
        assert {2, 3} <= held and 4 not in held, held  # the old run's step 4 went before any of the new run's


def test_an_empty_ckpt_shm_dir_means_the_default_never_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPT_SHM_DIR", "")
    root = shm.shm_root()
    assert root is None or root == Path("/dev/shm")
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "l")) as ck:
        ck.save(1, {"w": torch.ones(4)}).wait()
    assert not list(tmp_path.glob("ckpt-*")), "segments landed in the working directory"

"""The RAM that jobs which are gone left in the RAM file system (ckpt.shm.orphans / sweep_orphans): a
Checkpointer that takes its local_dir frees the segments no job can use any more (their directory was
deleted or made anew) and those older than CKPT_SHM_ORPHAN_S, names the others once, and never touches
the segments of a live job or of its own directory (docs/guides/memory.md, "Free it")."""

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import procs, shm


@pytest.fixture
def ram(tmp_path, monkeypatch):
    """A RAM file system of this test's own: the sweep looks at every group in it."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("needs a writable /dev/shm")
    root = Path(os.environ.get("CKPT_SHM_DIR") or "/dev/shm") / f"orphans-{os.getpid()}-{tmp_path.name}"
    root.mkdir()
    monkeypatch.setenv("CKPT_SHM_DIR", str(root))
    monkeypatch.setattr(shm, "_NAMED", set())
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _state(v: float) -> dict:
    return {"w": torch.full((1 << 14,), v)}


def _leave(local_dir: Path, steps=(1, 2)) -> None:
    """A job that saved ``steps`` and closed keeping its snapshots in RAM (as a job killed does)."""
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        for s in steps:
            ck.save(s, _state(float(s))).wait()
        ck.close(keep_memory=True)


def _groups(root: Path) -> dict[str, shm.SegmentInfo]:
    return {g.local_dir: g for g in shm.segments(root)}


@pytest.fixture
def gone(monkeypatch):
    """The processes that wrote the records are gone (this one wrote them: it is told so)."""
    real = procs.alive
    me = os.getpid()
    monkeypatch.setattr(procs, "alive", lambda pid, since=None: pid != me and real(pid, since))


def test_a_deleted_directory_frees_its_segments_at_once(ram, tmp_path, gone, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    _leave(a)
    _leave(b)
    assert set(_groups(ram)) == {str(a), str(b)}
    held = _groups(ram)[str(a)].nbytes
    shutil.rmtree(a)
    caplog.clear()  # (b's job, when it took its directory, named a's segments already)
    with caplog.at_level(logging.INFO, logger="ckpt"):
        freed = shm.sweep_orphans()
    assert freed >= held > 0
    assert set(_groups(ram)) == {str(b)}  # b's job may come back: kept (a day by default)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and str(b) in warned[0].getMessage() and str(a) not in warned[0].getMessage()


def test_a_directory_made_anew_at_the_same_path_frees_the_old_segments(ram, tmp_path, gone):
    a = tmp_path / "a"
    _leave(a)
    shutil.rmtree(a)
    a.mkdir()  # a new directory: a new id, so the old segments can never be its snapshots
    assert shm.sweep_orphans() > 0 and _groups(ram) == {}


def test_a_kept_directory_is_named_once_then_freed_after_the_limit(ram, tmp_path, gone, monkeypatch, caplog):
    a = tmp_path / "a"
    _leave(a)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert shm.sweep_orphans() == 0
        assert shm.sweep_orphans() == 0
    named = [r for r in caplog.records if r.name.startswith("ckpt")]
    assert len(named) == 1 and str(a) in named[0].getMessage()
    assert str(a) in _groups(ram)
    old = time.time() - 7200
    for f in _groups(ram)[str(a)].files:
        os.utime(f, (old, old))
    monkeypatch.setenv("CKPT_SHM_ORPHAN_S", "0")  # never by age
    assert shm.sweep_orphans() == 0 and str(a) in _groups(ram)
    monkeypatch.setenv("CKPT_SHM_ORPHAN_S", "3600")
    assert shm.sweep_orphans() > 0 and _groups(ram) == {}


def test_the_segments_of_a_live_job_and_the_callers_own_are_never_touched(ram, tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=a)) as ck:
        ck.save(1, _state(1.0)).wait()
        old = time.time() - 10 * 86400
        for f in _groups(ram)[str(a)].files:
            os.utime(f, (old, old))
        monkeypatch.setenv("CKPT_SHM_ORPHAN_S", "1")
        assert shm.orphans() == [] and shm.sweep_orphans() == 0  # its writer lives
        shutil.rmtree(a)  # even with its directory gone
        assert shm.orphans() == []
        ck.close(keep_memory=True)
    _leave(b)
    me = os.getpid()
    monkeypatch.setattr(procs, "alive", lambda pid, since=None: pid != me)
    key = shm.local_key(_groups(ram)[str(b)].prefix)
    monkeypatch.setattr(shm, "_NAMED", set())
    shutil.rmtree(b)
    assert shm.sweep_orphans(skip=key) > 0  # a's (directory gone) ...
    assert set(_groups(ram)) == {str(b)}  # ... but not the caller's own


def test_a_checkpointer_that_owns_no_directory_of_its_own_sweeps_nothing(ram, tmp_path, gone, caplog):
    """A process that only reads (restore without owning local_dir) or keeps its snapshots in the process
    leaves the RAM of other jobs alone and says nothing about it."""
    a = tmp_path / "a"
    _leave(a)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "reader"))
        ck.close()
    assert str(a) in _groups(ram) and not [r for r in caplog.records if "hold snapshots of" in r.getMessage()]


def test_a_restarted_job_does_not_take_a_late_ranks_ram_for_a_dead_jobs(ram, tmp_path):
    """A launcher restarts a two-rank job (torchrun's --max-restarts): rank 1 comes to its Checkpointer a second
    after rank 0. Rank 0 looks for dead jobs' RAM only once every rank of its job owns its local_dir, so rank
    1's snapshots (its predecessor's, which it is about to restore) are not named as a dead job's."""
    from helpers import assert_ok, run_ranks

    worker = Path(__file__).parent / "orphans_worker.py"
    assert_ok(run_ranks(worker, str(tmp_path), "leave"))
    restarted = run_ranks(worker, str(tmp_path), "restart")
    assert_ok(restarted)
    assert len(shm.segments(ram)) == 2  # both ranks' snapshots are still there
    counts = [r.stdout.split() for r in restarted]
    assert counts == [["warnings", "0"], ["warnings", "0"]], (counts, restarted[0].stderr[-3000:])


def test_many_dead_jobs_are_named_in_one_line(ram, tmp_path, gone, caplog):
    """A node that dead jobs left RAM on (a test machine, a shared node) gets one warning naming a few
    directories and counting the rest, not a line per job: a process whose stderr nobody reads yet must
    not fill its pipe with them."""
    dirs = [tmp_path / f"job{i}" for i in range(shm.NAMED_AT_MOST + 3)]
    for d in dirs:
        _leave(d, steps=(1,))
    shm._NAMED.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert shm.sweep_orphans() == 0
    [warned] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = warned.getMessage()
    assert sum(str(d) + " " in text for d in dirs) == shm.NAMED_AT_MOST
    assert str(len(dirs)) in text and set(_groups(ram)) == {str(d) for d in dirs}

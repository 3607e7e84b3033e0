"""The memory tier's segments belong to one directory, and a restore loads the copy it listed.

* Segment names derive from the local_dir's path and a random id kept in it (``.ckpt-id``): a directory deleted
  and made anew (to start afresh) never finds the old job's RAM, and no other user can predict the names.
* A rollback's new branch saves a step again: the memory tier then holds two snapshots of that step, and a
  restore loads the one it listed (its timeline's), never the other.
* What dead jobs left in the RAM file system is named at the next job's first save on the node, and freed by a
  policy (more cases: tests/test_shm_orphans.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import ckpt
from ckpt import identity, shm
from ckpt.tiers import LocalTier

pytestmark = pytest.mark.skipif(shm.shm_root() is None, reason="needs a RAM file system for the memory tier")


def _state(value: float, n: int = 1024) -> dict:
    return {"w": torch.full((n,), value)}


def _age(prefix: str, days: float) -> None:
    """Make the segments of ``prefix`` look last written ``days`` ago."""
    then = time.time() - days * 86400
    for g in shm.segments(prefix=prefix):
        for f in g.files:
            os.utime(f, (then, then))


def _dead_job(local_dir, step: int) -> None:
    """A job in a process of its own saves ``step`` and exits without freeing its RAM (as a crash would)."""
    code = (
        "import sys, torch, ckpt\n"
        "ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1]))\n"
        "ck.save(int(sys.argv[2]), {'w': torch.full((1024,), float(sys.argv[2]))}).wait()\n"
        "ck.close(keep_memory=True)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(local_dir), str(step)], check=True, timeout=120)


def test_a_restore_loads_the_copy_of_the_timeline_it_listed(tmp_path):
    """Steps 100 and 200 saved; the process dies (RAM kept). The next one rolls back to 100, changes a tensor
    and saves 100 again (timeline 1); it dies. A third restores step 100 of timeline 1, from memory, with
    timeline 1's bytes (the memory tier also holds timeline 0's step 100, in a slot listed before it)."""
    d = tmp_path / "local"
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
        ck.save(100, _state(100.0)).wait()
        ck.save(200, _state(200.0)).wait()
        ck.close(keep_memory=True)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
        st = _state(0.0)
        assert ck.restore(st, step=100) == 100 and float(st["w"][0]) == 100.0
        st["w"].fill_(101.0)  # the new branch
        ck.save(100, st).wait()
        assert ck.timeline.number == 1
        ck.close(keep_memory=True)
    recs = sorted(
        (r.slot, r.step, r.timeline.number)
        for g in shm.segments(prefix=shm.prefix_for(d, 0, create=True))
        for r in g.records
    )
    # both copies of step 100 in RAM, timeline 0's in the slot listed first
    assert recs[0] == (0, 100, 0) and any(r[1:] == (100, 1) for r in recs[1:]), recs
    st = _state(0.0)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
        assert ck.restore(st) == 100
        assert ck.last_restore.tier == "memory" and ck.last_restore.timeline.number == 1
    assert float(st["w"][0]) == 101.0


def test_deleting_the_directory_starts_afresh_whatever_ram_the_old_job_left(tmp_path, caplog):
    """Job A saves and dies (its RAM kept); the operator deletes local_dir, as NoCheckpointError advises, and
    job B, with another model, starts on the same path: nothing to restore, its saves work, and A's segments
    (which no job can use any more) are freed at B's start."""
    d = tmp_path / "local"
    _dead_job(d, 5)
    old = shm.prefix_for(d, 0, create=True)
    assert shm.segments(prefix=old)
    shutil.rmtree(d)
    with caplog.at_level(logging.INFO, logger="ckpt"):
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
            assert shm.prefix_for(d, 0, create=True) != old
            st = _state(0.0, n=77)  # another model: a restore of A's snapshot would not even fit
            assert ck.restore(st) is None
            ck.save(1, st).wait()
    assert shm.segments(prefix=old) == []  # freed: their directory is gone
    assert any("directory gone" in r.getMessage() for r in caplog.records if r.name == "ckpt.shm")


def test_segment_names_derive_from_the_path_and_an_id_kept_in_the_directory(tmp_path):
    """The names are not a function of the path alone (another local user could take them first): a new
    directory at the same path gets new names, and the id file is this user's, 0600."""
    d = tmp_path / "local"
    d.mkdir()
    assert shm.prefix_for(d, 0) is None  # no id yet: no segment can be this directory's
    first = shm.prefix_for(d, 0, create=True)
    by_path = hashlib.sha256(os.path.realpath(d).encode()).hexdigest()[:16]
    assert first is not None and by_path not in first
    st = os.lstat(d / identity.ID_NAME)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
    assert shm.prefix_for(d, 0) == first  # stable
    shutil.rmtree(d)
    d.mkdir()
    assert shm.prefix_for(d, 0, create=True) not in (None, first)


@pytest.mark.parametrize("bad", ["symlink", "directory", "garbage", "huge"])
def test_an_id_file_that_is_not_one_turns_the_memory_tier_off_and_nothing_else(tmp_path, bad):
    """A link, a directory or a file that holds no id at the id's name: never followed or trusted; the memory
    tier stays in the process (no segments), every other tier works."""
    d = tmp_path / "local"
    d.mkdir()
    path = d / identity.ID_NAME
    if bad == "symlink":
        (tmp_path / "elsewhere").write_text("0" * 32 + "\n")
        os.symlink(tmp_path / "elsewhere", path)
    elif bad == "directory":
        path.mkdir()
    elif bad == "garbage":
        path.write_text("not an id\n")
    else:
        path.write_bytes(b"0" * 100_000)
    assert identity.directory_id(d, create=True) is None
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
        assert ck.memory.space is None
        ck.save(1, _state(1.0)).wait()
        st = _state(0.0)
        assert ck.restore(st) == 1 and float(st["w"][0]) == 1.0
    assert LocalTier(d).committed_steps() == [1]


def test_ram_of_a_dead_job_is_named_at_the_next_start_and_freed_after_the_policys_age(
    tmp_path, caplog, monkeypatch
):
    """A job died and left its segments (its directory kept): the next job on the node names them at its first
    save (they serve the next job on that directory); once older than CKPT_SHM_ORPHAN_S they are freed."""
    a = tmp_path / "a"
    _dead_job(a, 3)
    prefix = shm.prefix_for(a, 0, create=True)
    with caplog.at_level(logging.WARNING, logger="ckpt.shm"):
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "b")) as ck:
            ck.save(1, _state(1.0)).wait()
    assert shm.segments(prefix=prefix), "a dead job's RAM for its directory was freed before its time"
    assert any(str(a) in r.getMessage() for r in caplog.records)
    _age(prefix, days=3)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "c")) as ck:
        ck.save(1, _state(1.0)).wait()
    assert shm.segments(prefix=prefix) == []


def test_a_live_jobs_segments_are_never_swept(tmp_path):
    """A job that is running keeps its segments, whatever their age, when another job starts on the node."""
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "a")) as live:
        live.save(1, _state(1.0)).wait()
        prefix = shm.prefix_for(tmp_path / "a", 0, create=True)
        _age(prefix, days=3)
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "b")) as other:
            other.save(1, _state(1.0)).wait()
        assert shm.segments(prefix=prefix)
        st = _state(0.0)
        assert live.restore(st) == 1

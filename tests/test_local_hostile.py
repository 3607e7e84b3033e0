"""The local tier and the Checkpointer's save/restore guarantees, attacked.

Each test tries hardest to break one guarantee of docs/concepts.md, operations.md, format.md and api.md
where the other test files do not already attack it. Decisions are made on exception types, errno and
the bytes on disk, never on the text of a message. Real processes for the kills and the second writer.

Findings (each was a defect, now fixed; the test named fails without the fix):

* A step of 2**63 or more was accepted by ``save()``: it was committed with a ``COMMIT`` no reader
  accepts, so the save "succeeded" and the checkpoint was unusable (``NoCheckpointError`` on restore).
  ``restore(step=...)`` took ``"3"``, ``True``, ``3.0`` and answered "step 3 is on no tier" while listing
  it; ``strict="no"`` counted as true; a numpy integer step was refused by ``save()``. Now every step
  argument is an integer (numpy's too) in [0, 2**63 - 1], else ``ValueError`` naming the argument, and
  ``strict`` a bool. ``test_steps_outside_64_bits_and_non_integers_are_refused_naming_the_argument``.
* The owner lock was opened through a symbolic link and rewritten: a ``.ckpt-lock`` linked to any file
  truncated that file and wrote the owner's pid into it. A FIFO there gave a bare ``EINVAL`` naming
  nothing, and ``ckpt.tiers.local.owned()`` (used by gc, promote, ls) blocked forever on it. Now the lock
  is opened ``O_NOFOLLOW | O_NONBLOCK`` and checked to be a regular file: ``OSError`` (``ELOOP``,
  ``EISDIR``, ``EEXIST``) naming the path, nothing written. ``test_the_owner_lock_is_never_opened_through_a_link``,
  ``test_a_fifo_or_directory_at_the_owner_lock_is_refused_without_blocking``.
* A restore beside a live writer of the directory (another process's retention, or its re-save of a
  step) failed with ``NoCheckpointError`` while a newer good checkpoint was committed, or fell back to an
  older step and started a spurious new timeline: the candidates listed at the start were pruned or
  exchanged before they were read, and each was taken for a corrupt copy (and marked not verified). Now
  a failed read whose copy changed meanwhile (``LocalTier.copy_id``: the ``COMMIT``'s identity) makes
  the restore list the tiers again (bounded), and the caller's listing is updated so the timeline is
  decided on what is there. ``test_a_restore_whose_candidates_a_live_writer_prunes_loads_the_newer_step``,
  ``test_a_restore_straddling_a_resave_of_the_same_step_reads_the_new_copy``.
* After a rollback (``restore(step=older)``) a ``close()`` before the first save of the new branch wrote
  the abandoned branch's newest snapshot (one a tier had skipped for its cadence) to that tier with the
  *new* branch's timeline: the next run resumed the diverged state as the live branch. Now the pipeline
  forgets a newest snapshot the new branch does not hold.
  ``test_a_rollback_then_close_never_commits_the_abandoned_snapshot_as_live``.
* ``every_seconds`` and ``interval="auto"`` with a clock that steps back (a wall clock as ``clock=``)
  saved nothing until the clock caught up again. Now a clock behind the last save makes a save due.
  ``test_a_clock_that_steps_back_does_not_stop_the_saves``.
* A failed fsync of ``local_dir`` after a step was renamed into place was reported as "older checkpoints
  are untouched" although the step was in place (and, for a re-save, the older copy of it gone); now the
  error says the step is committed and its durability is in doubt. A failure while removing the copy a
  re-save replaced left a full hidden checkpoint in ``local_dir`` for the life of the process (the sweep
  spared every staging directory of a live pid, its own included); ``latest``'s temporary files of a
  killed writer were never removed; and a writer killed in a container left its staging directories for
  good when the restarted process got the same pid (as containers' small pids do) or its pid went to a
  process started later. Now the sweep removes this process's staging directories that a write failed
  to remove or that predate the process, another pid's when that process started after the directory
  was last written, and ``.latest.tmp-*`` of writers that died.
  ``test_eio_or_enospc_at_every_filesystem_call_of_a_save_loses_nothing_and_leaves_nothing``,
  ``test_sigkill_at_every_filesystem_call_of_a_save_loses_nothing_and_the_next_writer_tidies_up``,
  ``test_leftovers_of_writers_that_died_are_swept_even_when_their_pid_came_back``.
* ``EFBIG`` (a file size limit) was reported with the hint "check the local_dir path and its permissions";
  a file named like a step directory made the save fail with the same hint. Now both name their cause.
  ``test_a_file_size_limit_fails_the_save_with_efbig_and_keeps_the_older_checkpoint`` (errno only).
* ``Retention(local=True)`` was taken as 1, and ``Retention(local="2")`` told to "keep at least 1".

Attacks that held (tests below): a real SIGKILL at every file-system call of a fresh save, a re-save of a
committed step and a save after a rollback (the step is never lost or torn); EIO and ENOSPC at each of
those calls; ``RLIMIT_FSIZE`` in a real child; SIGTERM while the disk refuses the preemption save (exit
143, the older checkpoint restores); hostile records: NaN and duplicate keys, 100 000-deep JSON, sizes of
2**60, a 2 GiB sparse data file with records that agree with it, a directory / FIFO / symlink to
/dev/zero where a file is expected, a file where a step directory is expected; non-canonical step names
(``step-1``, 10-digit padding, unicode digits, a trailing newline, ``.tmp``) are neither listed nor
deleted; ``latest`` as a directory or a FIFO; a created_unix in the future; partially overlapping views
restored in place; strict=False with keys missing on either side; a second real process restoring
while the owner saves and prunes with keep=1.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt
import ckpt.tiers.local as local_mod
from ckpt import knobs, procs
from ckpt.format import parse_step_dir, step_dir_name
from ckpt.integrity import checksum
from ckpt.tiers import LocalTier

N = 5000
ROOT = Path(__file__).resolve().parent.parent


def pat(step: int, v: int = 0) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) + step * 1000 + v


@pytest.fixture(autouse=True)
def _no_shared_memory():
    """The memory tier stays in the process, so that what a restore finds is the local tier's."""
    with knobs.override(CKPT_SHM=0), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _committed(d: Path) -> list[int]:
    return sorted(
        s
        for s in map(parse_step_dir, os.listdir(d))
        if s is not None and (d / step_dir_name(s) / "COMMIT").is_file()
    )


def _hidden(d: Path) -> list[str]:
    """The hidden names in ``d`` besides the directory's own lock and id (what a writer left)."""
    from ckpt.identity import ID_NAME

    return sorted(n for n in os.listdir(d) if n.startswith(".") and n not in (local_mod.LOCK_NAME, ID_NAME))


def _restore(d: Path, step: int | None = None) -> tuple[int | None, int | None, list[str], bool]:
    """(step, its value tag, what was skipped, whether the tensor is exactly the step's pattern)."""
    out = {"w": torch.zeros(N), "v": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
        s = ck.restore(out, step=step)
        skipped = list(ck.last_restore.skipped) if ck.last_restore else []
    return s, out["v"], skipped, s is not None and torch.equal(out["w"], pat(s, out["v"] or 0))


def _two_steps(d: Path, keep: int = 5) -> None:
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=keep))
    ) as ck:
        ck.save(1, {"w": pat(1), "v": 0}).wait()
        ck.save(2, {"w": pat(2), "v": 0}).wait()


WORKER = textwrap.dedent("""
    import os, resource, signal, sys, time, warnings
    import torch, ckpt
    warnings.simplefilter("ignore")
    N = 5000
    def pat(step, v=0):
        return torch.arange(N, dtype=torch.float32) + step * 1000 + v
    mode, d = sys.argv[1], sys.argv[2]
    if mode == "save":            # save the steps given (v = 7 for each) with keep=1, then exit
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
        ) as ck:
            for s in map(int, sys.argv[3:]):
                ck.save(s, {"w": pat(s, 7), "v": 7}).wait()
    elif mode == "fsize":         # a file size limit below the next save's data file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
        ) as ck:
            ck.save(1, {"w": pat(1), "v": 0}).wait()
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
            try:
                ck.save(2, {"w": torch.zeros(4 * N), "v": 0}).wait()
                print("saved", flush=True)
            except OSError as e:
                print("errno", e.errno, flush=True)
            ck.save(3, {"w": pat(3)[:10].clone(), "v": 0}).wait()   # small enough: saves go on
    elif mode == "sigterm":       # SIGTERM while the disk refuses the preemption save
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=d),
            policy=ckpt.Policy(every_steps=10**9, keep=ckpt.Retention(local=1)),
            signals=ckpt.Signals(preempt=(signal.SIGTERM,), deadline=20),
        )
        with ck:
            ck.save(1, {"w": pat(1), "v": 0}).wait()
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
            print("ready", flush=True)
            step = 1
            while True:
                step += 1
                ck.maybe_save(step, {"w": torch.zeros(4 * N), "v": 0})
                time.sleep(0.01)
    elif mode == "writer":        # save as fast as it can, keep=1, until killed
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=d),
            policy=ckpt.Policy(keep=ckpt.Retention(local=1), if_busy="wait"),
        ) as ck:
            print("ready", flush=True)
            s = 0
            while True:
                s += 1
                ck.save(s, {"w": pat(s, 7), "v": 7}).wait()
""")


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "hostile_worker.py"
    path.write_text(WORKER)
    env = dict(os.environ, CKPT_SHM="0", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def start(*args: str, **kw) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(path), *map(str, args)], env=env, text=True, **kw)

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        p = start(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    start.run = run
    return start


# -- arguments ----------------------------------------------------------------------------------------
def test_steps_outside_64_bits_and_non_integers_are_refused_naming_the_argument(local_dir):
    import numpy as np

    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        for bad in (2**63, 2**70, -1, True, 3.0, "3", None):
            with pytest.raises(ValueError):
                ck.save(bad, {"w": pat(1)})
            with pytest.raises(ValueError):
                ck.maybe_save(bad, {"w": pat(1)})
        assert _committed(local_dir) == []
        ck.save(2**63 - 1, {"w": pat(1), "v": 0}).wait()
        ck.save(np.int64(3), {"w": pat(3), "v": 0}).wait()  # a numpy integer is an integer
        for bad in (-1, True, 3.0, "3", 2**63):
            with pytest.raises(ValueError):
                ck.restore({"w": torch.zeros(N), "v": None}, step=bad)
        for bad in ("no", None, 0):
            with pytest.raises(TypeError):
                ck.restore({"w": torch.zeros(N), "v": None}, strict=bad)
        out = {"w": torch.zeros(N), "v": None}
        assert ck.restore(out, step=np.int64(3)) == 3 and torch.equal(out["w"], pat(3))
    assert _committed(local_dir) == [3, 2**63 - 1]
    out = {"w": torch.zeros(N), "v": None}
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir)
    ) as ck:  # the largest step is a checkpoint like any other
        assert ck.restore(out) == 2**63 - 1 and ck.last_restore.skipped == []
    assert torch.equal(out["w"], pat(1))
    for bad in (True, "2", 2.5, 0, -1):
        with pytest.raises(ValueError):
            ckpt.Retention(local=bad)


# -- the owner lock ---------------------------------------------------------------------------------
def test_the_owner_lock_is_never_opened_through_a_link(local_dir, tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"not yours")
    os.symlink(victim, local_dir / local_mod.LOCK_NAME)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(OSError) as info:
            ck.save(1, {"w": pat(1)})
        assert info.value.errno == errno.ELOOP
    assert victim.read_bytes() == b"not yours"
    assert _committed(local_dir) == []
    os.unlink(local_dir / local_mod.LOCK_NAME)  # the fix the error names: remove the link
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": pat(1), "v": 0}).wait()
    assert _restore(local_dir)[:3] == (1, 0, [])


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_fifo_or_directory_at_the_owner_lock_is_refused_without_blocking(local_dir, kind):
    lock = local_dir / local_mod.LOCK_NAME
    os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    result: list = []

    def attempt() -> None:
        result.append(local_mod.owned(local_dir))  # gc / promote / ls ask this: it must not block
        try:
            with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
                ck.save(1, {"w": pat(1)})
        except OSError as e:
            result.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "blocked on a FIFO at the owner lock"
    assert result[0] is False
    assert isinstance(result[1], OSError)
    assert result[1].errno == (errno.EISDIR if kind == "dir" else errno.EEXIST)
    assert result[1].filename == str(lock)
    assert _committed(local_dir) == []


# -- full disk, EIO, ENOSPC ------------------------------------------------------------------------------
def test_a_file_size_limit_fails_the_save_with_efbig_and_keeps_the_older_checkpoint(local_dir, worker):
    r = worker.run("fsize", local_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["errno", str(errno.EFBIG)]
    assert _committed(local_dir) == [3]  # 1 pruned by the save of 3, 2 never committed
    assert _hidden(local_dir) == []
    out = {"w": torch.zeros(10), "v": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(out) == 3 and torch.equal(out["w"], pat(3)[:10])


def test_sigterm_while_the_disk_refuses_the_preemption_save_exits_143_and_keeps_the_older_step(
    local_dir, worker
):
    p = worker("sigterm", local_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert _committed(local_dir) == [1]
    assert _restore(local_dir) == (1, 0, [], True)


_FS_CALLS = ("fsync", "rename", "replace", "unlink", "rmdir", "pwrite", "posix_fallocate", "mkdir", "open")


class _Faults:
    """Count every file-system call of the process; at the ``k``-th, ``act()`` (raise, or SIGKILL)."""

    def __init__(self, k: int, act) -> None:
        self.k, self.act, self.n, self.hit, self.saved = k, act, 0, None, {}

    def _tick(self, name: str) -> None:
        self.n += 1
        if self.n == self.k:
            self.hit = name
            self.act()

    def __enter__(self) -> "_Faults":
        for name in _FS_CALLS:
            fn = self.saved[name] = getattr(os, name)

            def wrapped(*a, _fn=fn, _name=name, **kw):
                self._tick(_name)
                return _fn(*a, **kw)

            setattr(os, name, wrapped)
        fn = self.saved["renameat2"] = local_mod.renameat2

        def exchange(*a, _fn=fn):
            self._tick("renameat2")
            return _fn(*a)

        local_mod.renameat2 = exchange
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(local_mod if name == "renameat2" else os, name, fn)


def _target(ck: ckpt.Checkpointer, scenario: str) -> None:
    """What is attacked, after steps 1 and 2 (v=0) are committed."""
    if scenario == "resave":  # step 2 saved again (v=7): an exchange with the committed copy
        ck.save(2, {"w": pat(2, 7), "v": 7}).wait()
    elif scenario == "next":  # step 3 (v=0); keep=2 then deletes step 1
        ck.save(3, {"w": pat(3), "v": 0}).wait()
    else:  # a rollback to 1, then step 2 of the new branch (v=5) replaces the old 2
        ck.restore({"w": torch.zeros(N), "v": None}, step=1)
        ck.save(2, {"w": pat(2, 5), "v": 5}).wait()


_NEW = {"resave": (2, 7), "next": (3, 0), "rollback": (2, 5)}


def _check_after(d: Path, scenario: str, state_new: bool | None) -> None:
    """Every committed step restores exactly; nothing is lost; the newest is the old or the new one."""
    committed = _committed(d)
    assert 2 in committed, "the committed step 2 was lost"
    for s in committed:
        step, v, skipped, exact = _restore(d, step=s)
        assert (step, skipped, exact) == (s, [], True), (s, v, skipped)
    step, v, skipped, exact = _restore(d)
    assert skipped == [] and exact
    assert (step, v) in ((2, 0), _NEW[scenario])
    if state_new is not None:
        assert ((step, v) == _NEW[scenario]) == state_new


@pytest.mark.parametrize("scenario", ["resave", "next", "rollback"])
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_eio_or_enospc_at_every_filesystem_call_of_a_save_loses_nothing_and_leaves_nothing(
    tmp_path, scenario, err
):
    def fail() -> None:
        raise OSError(err, os.strerror(err))

    for k in range(1, 200):
        d = tmp_path / f"{scenario}-{k}"
        with knobs.override(CKPT_CHUNK_BYTES=4096, CKPT_PERSIST_THREADS=1):
            ck = ckpt.Checkpointer(
                storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=2))
            )
            ck.save(1, {"w": pat(1), "v": 0}).wait()
            ck.save(2, {"w": pat(2), "v": 0}).wait()
            raised = None
            with _Faults(k, fail) as faults:
                try:
                    _target(ck, scenario)
                except OSError as e:
                    raised = e
                except ckpt.NoCheckpointError:  # the rollback's restore could not read step 1: nothing saved
                    assert scenario == "rollback"
            if raised is not None:
                assert raised.errno == err
            _check_after(d, scenario, None)
            ck.save(9, {"w": pat(9), "v": 0}).wait()  # the next save works, and tidies up
            ck.close()
        assert _hidden(d) == [], f"call {k} ({faults.hit}) left {_hidden(d)}"
        if faults.hit is None:  # every call of the save was attacked
            assert k > 20
            return
    raise AssertionError("the save never finished")


def _killed_at(d: str, scenario: str, k: int) -> None:
    """A real process, killed for real at its ``k``-th file-system call of the save ``scenario`` makes."""

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    with knobs.override(CKPT_CHUNK_BYTES=4096, CKPT_PERSIST_THREADS=1):
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=2))
        )
        ck.save(1, {"w": pat(1), "v": 0}).wait()
        ck.save(2, {"w": pat(2), "v": 0}).wait()
        with _Faults(k, die):
            _target(ck, scenario)
        ck.close()


@pytest.mark.timeout(900)
# a real process killed at each call takes a quarter of a minute a scenario: the default suite kills the
# "next" save so; the other scenarios with -m slow (every scenario meets an error at every call above)
@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param("resave", marks=pytest.mark.slow),
        "next",
        pytest.param("rollback", marks=pytest.mark.slow),
    ],
)
def test_sigkill_at_every_filesystem_call_of_a_save_loses_nothing_and_the_next_writer_tidies_up(
    tmp_path, scenario
):
    # Each writer is forked from a fork server, a process with no threads: a fork of this test process
    # (whose other threads hold locks at any moment: a store's server, a tier's workers) can hang on one.
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckpt", "test_local_hostile"])
    # every call with CKPT_SLOW=1; every other one by default
    for k in range(1, 200, 1 if os.environ.get("CKPT_SLOW") == "1" else 2):
        d = tmp_path / f"{scenario}-{k}"
        proc = ctx.Process(target=_killed_at, args=(str(d), scenario, k))
        proc.start()
        proc.join(120)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise AssertionError(f"the writer killed at call {k} hung instead")
        killed = proc.exitcode == -signal.SIGKILL
        assert killed or proc.exitcode == 0, proc.exitcode
        _check_after(d, scenario, None if killed else True)
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=5))
        ) as ck:  # the next owner tidies up
            ck.save(9, {"w": pat(9), "v": 0}).wait()
        assert _hidden(d) == [], f"a kill at call {k} left {_hidden(d)} behind the next writer"
        if not killed:
            assert k > 20
            return
    raise AssertionError("the save never finished")


def test_leftovers_of_writers_that_died_are_swept_even_when_their_pid_came_back(local_dir):
    """Containers restart their processes under the same small pids: a staging directory named with this
    process's pid, or with the pid of a live process that started after it was made, is a dead writer's."""
    _two_steps(local_dir)
    host = local_mod._host_tag()
    hour_ago = time.time() - 3600
    before = subprocess.Popen(["sleep", "120"])  # a live writer: started before its directory was made
    time.sleep(0.05)
    dead = subprocess.Popen(["true"])
    dead.wait()

    def staging(step: int, pid: int) -> Path:
        p = local_dir / f".step-{step:09d}.new-{pid}-{host}-0123abcd"
        p.mkdir()
        (p / "rank-00000.bin").write_bytes(b"\0" * 4096)
        return p

    mine = staging(3, os.getpid())  # a predecessor that had this process's pid (it died
    long_ago = procs.started(os.getpid()) - 3600  # before this process started)
    os.utime(mine, (long_ago, long_ago))
    own_live = staging(8, os.getpid())  # this process's own, made since it started: left alone
    recycled = staging(4, 0)  # renamed below, once its pid is known
    os.utime(recycled, (hour_ago, hour_ago))
    after = subprocess.Popen(["sleep", "120"])  # got the pid of the writer that made `recycled`
    recycled = recycled.rename(local_dir / f".step-000000004.new-{after.pid}-{host}-0123abcd")
    os.utime(recycled, (hour_ago, hour_ago))
    live = staging(6, before.pid)
    latest_tmp = local_dir / f".latest.tmp-{dead.pid}-0123456789ab"
    latest_tmp.write_bytes(b"step-000000002\n")
    try:
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=5))
        ) as ck:
            ck.save(5, {"w": pat(5), "v": 0}).wait()
        assert not mine.exists() and not recycled.exists() and not latest_tmp.exists()
        assert live.exists() and own_live.exists(), "a live writer's staging directory was removed"
        assert _committed(local_dir) == [1, 2, 5]
    finally:
        for p in (before, after):
            p.kill()
            p.wait()


# -- a second process on the same directory -----------------------------------------------------------------
def test_a_restore_whose_candidates_a_live_writer_prunes_loads_the_newer_step(local_dir, worker):
    assert worker.run("save", local_dir, 4, 5).returncode == 0
    assert _committed(local_dir) == [5]

    class Racing(LocalTier):
        fired = False

        def restore_into(self, *a, **kw):
            if not Racing.fired:  # the other process commits 6 and prunes 5 just before this one reads 5
                Racing.fired = True
                assert worker.run("save", local_dir, 6).returncode == 0
            return super().restore_into(*a, **kw)

    out = {"w": torch.zeros(N), "v": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=Racing(local_dir))) as ck:
        assert ck.restore(out) == 6
        assert ck.last_restore.skipped == []
        assert ck.timeline.number == 0  # the newest was restored: no rollback, no new branch
    assert Racing.fired and out["v"] == 7 and torch.equal(out["w"], pat(6, 7))


def test_a_restore_straddling_a_resave_of_the_same_step_reads_the_new_copy(local_dir, worker):
    _two_steps(local_dir, keep=1)
    assert _committed(local_dir) == [2]
    real_read, fired = local_mod._read, []

    def read(path):
        raw = real_read(path)
        if path.name == "COMMIT" and not fired:  # COMMIT read; the step is exchanged before its manifest is
            fired.append(True)
            assert worker.run("save", local_dir, 2).returncode == 0
        return raw

    local_mod._read = read
    try:
        out = {"w": torch.zeros(N), "v": None}
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
            assert ck.restore(out) == 2
            assert ck.last_restore.skipped == [] and ck.timeline.number == 0
    finally:
        local_mod._read = real_read
    assert fired and out["v"] == 7 and torch.equal(out["w"], pat(2, 7))


def test_a_second_process_restoring_while_the_owner_saves_and_prunes_with_keep_1(local_dir, worker):
    p = worker("writer", local_dir, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0, seen = time.monotonic(), set()
        while time.monotonic() - t0 < 3 or len(seen) < 3:
            assert time.monotonic() - t0 < 60
            step, v, skipped, exact = _restore(local_dir)
            if step is None:
                continue
            assert exact and v == 7 and skipped == [], (step, v, skipped)
            seen.add(step)
    finally:
        p.kill()
        p.wait()


# -- rollbacks and clocks ---------------------------------------------------------------------------------
def test_a_rollback_then_close_never_commits_the_abandoned_snapshot_as_live(local_dir):
    w = torch.zeros(N)
    ck = ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 10})
    )
    for s in (1, 2, 3):  # the local tier writes 1; 2 and 3 stay in memory (not due there)
        w.copy_(pat(s))
        ck.save(s, {"w": w, "v": 0}).wait()
    assert _committed(local_dir) == [1]
    out = {"w": torch.zeros(N), "v": None}
    assert ck.restore(out, step=2) == 2 and ck.timeline.number == 1  # the loss diverged: back to 2
    ck.close()  # stopped before the first save of the new branch
    for s in _committed(local_dir):
        c = json.loads((local_dir / f"step-{s:09d}" / "COMMIT").read_bytes())
        assert not (s == 3 and c.get("timeline", 0) == 1), (
            "the abandoned step 3 was committed on the new branch"
        )
    step, v, skipped, exact = _restore(local_dir)
    assert step != 3 and exact


def test_a_clock_that_steps_back_does_not_stop_the_saves(local_dir):
    now = [1000.0]
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_seconds=10), clock=lambda: now[0]
    ) as ck:
        now[0] += 11
        assert ck.maybe_save(1, {"w": pat(1), "v": 0}) is not None
        now[0] -= 3600  # NTP steps the wall clock back an hour
        h = ck.maybe_save(2, {"w": pat(2), "v": 0})
        assert h is not None, "no save until the clock catches up an hour later"
        now[0] += 5
        assert ck.maybe_save(3, {"w": pat(3), "v": 0}) is None  # the interval counts from there
        now[0] += 6
        assert ck.maybe_save(4, {"w": pat(4), "v": 0}) is not None
        ck.wait()


# -- hostile files --------------------------------------------------------------------------------------------
def _recommit(d: Path, step: int, commit=None, manifest=None, raw_commit: bytes | None = None) -> None:
    sd = d / f"step-{step:09d}"
    c = json.loads((sd / "COMMIT").read_bytes())
    if manifest is not None:
        raw = manifest(json.loads((sd / "rank-00000.manifest.json").read_bytes()))
        (sd / "rank-00000.manifest.json").write_bytes(raw)
        c["manifests"]["rank-00000.manifest.json"] = checksum(raw)
    if commit is not None:
        c = commit(c)
    (sd / "COMMIT").write_bytes(raw_commit if raw_commit is not None else json.dumps(c).encode())


def _sized(n: int):
    def m(man: dict) -> bytes:
        man["data_bytes"] = n
        man["chunks"] += [0] * (-(-n // man["chunk_bytes"]) - len(man["chunks"]))
        return json.dumps(man).encode()

    return m


HOSTILE = {
    # a duplicate key: the last wins, and the step it names is not the directory's
    "duplicate_key": lambda d, sd: _recommit(
        d, 2, raw_commit=(sd / "COMMIT").read_bytes()[:-1] + b',"step":1}'
    ),
    "json_100k_deep": lambda d, sd: _recommit(d, 2, raw_commit=b"[" * 100_000 + b"]" * 100_000),
    "size_2_60_in_commit": lambda d, sd: _recommit(
        d, 2, commit=lambda c: {**c, "data": {"rank-00000.bin": 2**60}}
    ),
    "size_2_60_everywhere": lambda d, sd: _recommit(
        d,
        2,
        manifest=lambda m: json.dumps(
            {**m, "data_bytes": 2**60, "chunk_bytes": 2**60, "chunks": [0]}
        ).encode(),
        commit=lambda c: {**c, "data": {"rank-00000.bin": 2**60}},
    ),
    "sparse_2gib_agreeing_records": lambda d, sd: (
        os.truncate(sd / "rank-00000.bin", 2**31),
        _recommit(d, 2, manifest=_sized(2**31), commit=lambda c: {**c, "data": {"rank-00000.bin": 2**31}}),
    ),
    "data_file_is_a_directory": lambda d, sd: (
        (sd / "rank-00000.bin").unlink(),
        (sd / "rank-00000.bin").mkdir(),
    ),
    "data_file_is_a_fifo": lambda d, sd: ((sd / "rank-00000.bin").unlink(), os.mkfifo(sd / "rank-00000.bin")),
    "manifest_links_to_dev_zero": lambda d, sd: (
        (sd / "rank-00000.manifest.json").unlink(),
        os.symlink("/dev/zero", sd / "rank-00000.manifest.json"),
    ),
    "commit_is_a_directory": lambda d, sd: ((sd / "COMMIT").unlink(), (sd / "COMMIT").mkdir()),
    "commit_is_a_fifo": lambda d, sd: ((sd / "COMMIT").unlink(), os.mkfifo(sd / "COMMIT")),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_step_2_is_passed_over_for_step_1(local_dir, attack):
    _two_steps(local_dir)
    HOSTILE[attack](local_dir, local_dir / "step-000000002")
    t0 = time.monotonic()
    result: list = []
    t = threading.Thread(target=lambda: result.append(_restore(local_dir)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the restore blocked"
    step, v, skipped, exact = result[0]
    assert (step, v, exact) == (1, 0, True)
    assert time.monotonic() - t0 < 60


def test_nan_created_unix_and_a_created_unix_in_the_future_still_restore_and_order_by_step(local_dir):
    _two_steps(local_dir)
    _recommit(local_dir, 1, commit=lambda c: {**c, "created_unix": time.time() + 10**8})
    _recommit(local_dir, 2, commit=lambda c: {**c, "created_unix": float("nan")})  # json writes a bare NaN
    assert b"NaN" in (local_dir / "step-000000002" / "COMMIT").read_bytes()
    step, v, skipped, exact = _restore(local_dir)
    # a NaN (not written by this library) makes step 2 corrupt or is read as a number; never a crash,
    # and never does the future timestamp of step 1 make it newer than step 2
    assert exact and (step == 2 and skipped == [] or step == 1 and len(skipped) == 1)


def test_names_that_are_not_canonical_step_directories_are_neither_listed_nor_deleted(local_dir):
    _two_steps(local_dir)
    odd = [
        "step-1",
        "step-000000009.tmp",
        "step-\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff19",
        "step-0000000009",
        "step-000000009\n",
        "step-000000009 ",
    ]
    for n in odd:
        shutil.copytree(local_dir / "step-000000002", local_dir / n)
    (local_dir / "step-000000007").write_bytes(b"a file where a step directory goes")
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    ) as ck:
        assert [c.step for c in ck.list()] == [2, 1]
        ck.save(3, {"w": pat(3), "v": 0}).wait()
        ck.save(4, {"w": pat(4), "v": 0}).wait()
        with pytest.raises(OSError) as info:
            ck.save(7, {"w": pat(7), "v": 0}).wait()
        assert info.value.errno == errno.ENOTDIR
    assert _committed(local_dir) == [4]
    for n in odd:
        assert (local_dir / n / "COMMIT").is_file(), f"{n!r} was touched"
    assert (local_dir / "step-000000007").read_bytes() == b"a file where a step directory goes"
    assert _restore(local_dir)[:3] == (4, 0, [])


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_latest_as_a_directory_or_fifo_never_fails_a_save(local_dir, kind):
    _two_steps(local_dir)
    (local_dir / "latest").unlink()
    if kind == "dir":
        (local_dir / "latest").mkdir()
        (local_dir / "latest" / "x").write_bytes(b"x")
    else:
        os.mkfifo(local_dir / "latest")
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(3, {"w": pat(3), "v": 0}).wait()
    assert _restore(local_dir)[:3] == (3, 0, [])
    assert _hidden(local_dir) == []


# -- states ---------------------------------------------------------------------------------------------------
def test_partially_overlapping_views_restore_in_place_into_one_storage(local_dir):
    x = torch.arange(40, dtype=torch.float64)
    state = {"a": x[0:24], "b": x[16:40], "t": x.view(5, 8).t(), "every_other": x[::2], "scalar": x[3]}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, state).wait()
    y = torch.zeros(40, dtype=torch.float64)
    out = {"a": y[0:24], "b": y[16:40], "t": y.view(5, 8).t(), "every_other": y[::2], "scalar": y[3]}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(out) == 1
    assert torch.equal(y, x)


def test_strict_false_with_keys_missing_on_either_side_loads_the_common_ones(local_dir):
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": saved, "extra": {"a": torch.ones(2)}}).wait()
    bigger = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    fresh = bigger[2].weight.detach().clone()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.IncompatibleCheckpointError):
            ck.restore({"model": bigger})
        assert ck.restore({"model": bigger, "more": {"b": torch.zeros(1)}}, strict=False) == 1
    assert torch.equal(bigger[0].weight, saved[0].weight) and torch.equal(bigger[1].bias, saved[1].bias)
    assert torch.equal(bigger[2].weight, fresh)

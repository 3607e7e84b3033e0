"""One live writer per ``local_dir``.

Two Checkpointers writing one directory replace each other's committed steps and prune each
other's saves in flight. The first one to write owns the directory (an ``flock`` on
``local_dir/.ckpt-lock``, held until ``close()``; the kernel drops it when the process dies);
another writer, in another process or this one, gets ``LockedError`` naming the directory and the
owner. Readers (``ckpt ls/verify/inspect``, a Checkpointer that only restores) need no lock.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.cli import main as cli
from ckpt.tiers import RemoteTier
from helpers import run_ranks
from owner_worker import state

HERE = Path(__file__).parent


@pytest.fixture
def owner(local_dir):
    """Another process that saved step 5 (all 1.0) into ``local_dir`` and still has it open."""
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "owner_worker.py"), str(local_dir), "hold"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "saved", line
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _holds(local_dir: Path, step: int = 5) -> float | None:
    target = {"w": torch.empty(10_000), "value": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.restore(target, step=step)
    assert torch.equal(target["w"], torch.full((10_000,), target["value"]))
    return target["value"]


def _files(local_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(local_dir)): p.stat().st_mtime_ns for p in local_dir.rglob("*")}


def test_a_second_process_cannot_write_into_a_live_owners_local_dir(local_dir, owner):
    before = _files(local_dir)
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    try:
        with pytest.raises(ckpt.LockedError) as e:
            ck.save(5, state(2.0))
        assert e.value.pid == owner.pid and e.value.host == socket.gethostname()
        assert (
            e.value.path == str(local_dir)
            and str(local_dir) in str(e.value)
            and str(owner.pid) in str(e.value)
        )
        with pytest.raises(ckpt.LockedError):  # a new step too: retention would prune the owner's steps
            ck.save(6, state(2.0))
    finally:
        ck.close()
    assert _files(local_dir) == before  # the owner's committed step 5 was not replaced
    assert _holds(local_dir) == 1.0


def test_a_sigkilled_owner_leaves_no_lock_behind(local_dir, owner):
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(6, state(3.0)).wait()
    assert _holds(local_dir, 6) == 3.0 and _holds(local_dir, 5) == 1.0


def test_a_second_checkpointer_in_the_same_process_is_refused_until_the_first_closes(local_dir, tmp_path):
    first = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    first.save(1, state(1.0)).wait()
    second = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    with pytest.raises(ckpt.LockedError) as e:
        second.save(1, state(2.0))
    assert e.value.pid == os.getpid()
    link = tmp_path / "link"
    link.symlink_to(local_dir)
    with pytest.raises(ckpt.LockedError):  # the same directory through a symlink
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=link)).save(1, state(2.0))
    first.close()
    second.save(2, state(2.0)).wait()
    second.close()
    assert _holds(local_dir, 1) == 1.0 and _holds(local_dir, 2) == 2.0


def test_readers_need_no_lock(local_dir, owner, tmp_path, capsys):
    assert cli(["ls", str(local_dir)]) == 0
    assert cli(["verify", str(local_dir)]) == 0
    assert cli(["inspect", str(local_dir)]) == 0
    assert _holds(local_dir) == 1.0  # a restore-only Checkpointer
    ckpt.promote(5, "remote", local_dir=local_dir, url=f"file://{tmp_path}/remote")  # reads local_dir only
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=f"file://{tmp_path}/remote", local_dir=tmp_path / "elsewhere")
    ) as ck:
        assert ck.restore({"w": torch.empty(10_000), "value": None}) == 5


def test_gc_and_promote_into_an_owned_local_dir_are_refused(local_dir, owner, tmp_path):
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "other")) as ck:
        for s in (1, 2, 3):
            ck.save(s, state(float(s))).wait()
    before = _files(local_dir)
    with pytest.raises(ckpt.LockedError, match=str(local_dir)):
        ckpt.promote(3, "local", local_dir=local_dir, url=url)
    try:
        status = cli(["gc", str(local_dir), "--keep", "1"])
    except ckpt.LockedError:
        status = "refused"
    assert status != 0
    assert cli(["gc", str(local_dir), "--keep", "1", "--dry-run"]) == 0  # only reads
    assert _files(local_dir) == before
    owner.kill()
    owner.wait()
    ckpt.promote(3, "local", local_dir=local_dir, url=url)
    assert _holds(local_dir, 3) == 3.0


def test_a_forked_child_does_not_keep_the_directory_locked(local_dir):
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "owner_worker.py"), str(local_dir), "fork"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    child = None
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "closed", line
        child = int(line[1])
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir)
        ) as ck:  # the parent closed: the child must not hold it
            ck.save(6, state(6.0)).wait()
    finally:
        proc.kill()
        proc.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert _holds(local_dir, 6) == 6.0


def test_every_rank_refuses_when_one_ranks_local_dir_has_another_owner(tmp_path):
    (tmp_path / "rank-1").mkdir()
    squatter = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "rank-1"))
    squatter.save(1, state(9.0)).wait()
    try:
        results = run_ranks(HERE / "owner_worker.py", str(tmp_path), "rank", timeout=120)
    finally:
        squatter.close()
    out = [r.stdout.strip() for r in results]
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert out[1].startswith("raised LockedError") and str(os.getpid()) in out[1], out
    assert out[0].startswith("raised LockedError") and "rank(s) [1]" in out[0], out
    # rank 0 let go of its own directory when the construction failed
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "rank-0")) as ck:
        ck.save(2, state(2.0)).wait()


def test_a_restore_from_the_remote_tier_writes_nothing_into_a_live_owners_local_dir(
    local_dir, owner, tmp_path
):
    """A restore that reads a farther tier refills ``local_dir`` on the way only where it may write there:
    beside a live owner it restores the remote step and leaves the directory as it was; once the owner is
    gone it refills (without keeping the directory: a trainer can start beside it)."""
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "other")) as ck:
        ck.save(9, state(9.0)).wait()
    before = _files(local_dir)
    target = {"w": torch.empty(10_000), "value": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=local_dir)) as ck:
        assert ck.restore(target) == 9 and ck.last_restore.tier == "remote"
    assert target["value"] == 9.0 and torch.equal(target["w"], torch.full((10_000,), 9.0))
    assert _files(local_dir) == before
    owner.kill()
    owner.wait()
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=local_dir)) as ck:
        assert ck.restore({"w": torch.empty(10_000), "value": None}) == 9 and ck.last_restore.tier == "remote"
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir)
        ) as trainer:  # the reader does not keep the directory
            trainer.save(10, state(10.0)).wait()
    assert _holds(local_dir, 9) == 9.0 and _holds(local_dir, 10) == 10.0  # 9 was refilled


def test_a_file_url_of_an_owned_local_dir_is_that_local_tier(local_dir, owner, tmp_path, capsys):
    """``file://`` + a local tier's directory is that local tier to the commands: listed and verified as one,
    and gc refused while its owner lives (a remote tier there found none of the local steps valid, and pruned
    without the owner's lock). A Checkpointer's remote tier there, or a promote to it, is refused outright."""
    url = f"file://{local_dir}"
    before = _files(local_dir)
    capsys.readouterr()
    assert cli(["ls", url, "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [5]
    assert cli(["verify", url]) == 0
    try:
        status = cli(["gc", url, "--keep", "1"])
    except ckpt.LockedError:
        status = "refused"
    assert status != 0
    assert _files(local_dir) == before
    with pytest.raises(ValueError):
        ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "elsewhere"))
    (tmp_path / "other").mkdir()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "other")) as ck:
        ck.save(7, state(7.0)).wait()
    with pytest.raises(ValueError):
        ckpt.promote(7, "remote", local_dir=tmp_path / "other", url=url)
    assert _files(local_dir) == before


def test_an_owner_whose_lock_file_is_removed_takes_it_again(local_dir):
    """The lock is on the file at local_dir/.ckpt-lock: removed by hand, it no longer keeps a second writer
    out. The owner finds that out before its next write and takes the name again."""
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, state(1.0)).wait()
        (local_dir / ".ckpt-lock").unlink()
        ck.save(2, state(2.0)).wait()
        assert (local_dir / ".ckpt-lock").is_file()
        with pytest.raises(ckpt.LockedError):  # held again: a second writer is refused
            ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)).save(3, state(3.0))
        env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from ckpt.tiers.local import owned; print(owned(sys.argv[1]))",
                str(local_dir),
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        assert out.stdout.split() == ["True"], out.stderr
    assert _holds(local_dir, 2) == 2.0 and _holds(local_dir, 1) == 1.0


def _another_owner_takes(local_dir) -> subprocess.Popen:
    """The lock file is removed by hand; another process takes the directory, saves, and holds it."""
    (local_dir / ".ckpt-lock").unlink()
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "owner_worker.py"), str(local_dir), "hold"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().split()[0] == "saved"
    return proc


def test_an_owner_whose_lock_another_process_took_stops_writing(local_dir, tmp_path):
    """Lock file removed, then another process made a new one and saved: the first owner's next save is
    refused before anything it wrote becomes visible, and the other process's step is untouched."""
    first = ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    )
    try:
        first.save(1, state(1.0)).wait()
        proc = _another_owner_takes(local_dir)
        try:
            with pytest.raises(ckpt.LockedError):
                first.save(6, state(6.0)).wait()
            assert not (local_dir / "step-000000006").exists()
            assert (local_dir / "step-000000005").is_dir()  # not pruned by the first owner's retention
        finally:
            proc.kill()
            proc.wait()
        assert _holds(local_dir, 5) == 1.0
    finally:
        first.close()


def test_an_owner_fenced_out_of_its_directory_writes_nothing_there_again(local_dir, tmp_path):
    """Lock file removed, another process took the directory and saved: the first owner's loss is for good.
    Its later saves, its retention's deletes, a promote and a restore's refill from the remote tier all raise
    LockedError and leave the directory as the live owner has it; a restore there returns the live owner's
    step, never a later one of the fenced writer."""
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=tmp_path / "other")
    ) as ck:  # step 3 on the remote tier only
        ck.save(3, state(3.0)).wait()
    first = ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    )
    try:
        first.save(1, state(1.0)).wait()
        proc = _another_owner_takes(local_dir)
        try:
            theirs = _files(local_dir)
            for s in (6, 7, 8):  # the first refusal, and every save after it
                with pytest.raises(ckpt.LockedError) as e:
                    first.save(s, state(float(s))).wait()
                assert e.value.pid == proc.pid and e.value.path == str(local_dir)
            assert first.local.owner.fenced and not first.local.owner.held
            with pytest.raises(ckpt.LockedError):  # what retention calls
                first.local.delete(5)
            with pytest.raises(ckpt.LockedError):
                first.promote(3, "local")
            with pytest.raises(ckpt.LockedError):  # read from the remote tier, refilled into local_dir
                first.restore({"w": torch.empty(10_000), "value": None}, step=3)
            assert _files(local_dir) == theirs
            assert [s for s in first.local.committed_steps()] == [5, 1]
        finally:
            proc.kill()
            proc.wait()
        target = {"w": torch.empty(10_000), "value": None}
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as reader:
            assert reader.restore(target) == 5
    finally:
        first.close(raise_errors=False)


class _GatedRemote(RemoteTier):
    """A remote tier whose writes wait for the test's gate: uploads still queued when the writer is fenced."""

    def __init__(self, url):
        super().__init__(url)
        self.gate = threading.Event()
        self.started = threading.Event()

    def write(self, step, manifest, data):
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return super().write(step, manifest, data)


def test_uploads_queued_before_a_writer_was_fenced_never_reach_the_remote_tier(local_dir, tmp_path):
    """The remote tier is busy with step 1 when another process takes local_dir; step 2, queued behind it,
    is never uploaded (its handle fails with LockedError, so does wait()), and nothing of the fenced writer
    lands on the remote tier after the upload that was already under way."""
    remote = _GatedRemote(f"file://{tmp_path}/remote")
    first = ckpt.Checkpointer(
        storage=ckpt.Storage(url=remote, local_dir=local_dir),
        policy=ckpt.Policy(if_busy="wait", keep=ckpt.Retention(None, None)),
    )
    try:
        h1 = first.save(1, state(1.0))
        assert remote.started.wait(60)
        h2 = first.save(2, state(2.0))
        h2.wait("local")
        proc = _another_owner_takes(local_dir)
        try:
            remote.gate.set()
            h1.wait("remote", timeout=60)  # under way before the loss: it ends as it began
            with pytest.raises(ckpt.LockedError):
                h2.wait("remote", timeout=60)
            assert remote.committed_steps() == [1]
        finally:
            proc.kill()
            proc.wait()
    finally:
        remote.gate.set()
        first.close(raise_errors=False)

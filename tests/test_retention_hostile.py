"""Retention and the command line's destructive commands, attacked.

The guarantees (docs/operations.md "Retention and disk space", "The command line", "One writer per
local_dir"; docs/api.md "Guarantees that hold off the happy path"; docs/concepts.md "Rollbacks and
timelines"): retention and ``ckpt gc`` never delete the newest committed checkpoint nor the newest one
known to verify, nor anything through a symbolic link; a torn or uncommitted checkpoint is never
restored; ``--dry-run`` deletes nothing; ``gc`` is refused beside a live owner; a command never destroys a
good checkpoint by mistake, and fails with one error line and exit status 1 (2 for a usage mistake).
Decisions are made on exit statuses, exception types, errno, the files present and their bytes, never on
the text of a message. Real processes are SIGKILLed in the middle of retention's deletions.

Also: a ``promote`` (command, function) or a ``Checkpointer`` whose ``file://`` URL is ``local_dir`` itself,
through any path, or one of its step directories, is refused before anything is written (the remote tier's
``COMMIT`` and manifest would replace the local ones); leftovers of crashed writes are those below the live
branch's newest commit, so a new branch's save in flight after a rollback (numbered below the abandoned
steps) is never taken for one; ``gc --memory`` never frees a live owner's segments, also before its first
snapshot record; ``gc --keep`` below 1 is a usage mistake; a ``COMMIT`` on a timeline carries its own
checksum, so one flipped bit in an old one's timeline cannot make it the head.

The attacks: ``gc --keep 1`` and a fresh process's ``keep=1`` save beside a newest step that is
bit-flipped, truncated, without data or manifest, with a garbage or another step's ``COMMIT``, or half
deleted; every step damaged (nothing committed deleted, exit 1); ``--dry-run`` (nothing deleted, not even
leftovers; the same list as the real run); a FIFO, file, links out of the directory, a dangling link, a
link to an own step, a ``COMMIT`` that is a directory or a link, all under a step's name (never followed,
never blocking); links inside a doomed step (only the links go); steps up to 2**63 - 1 and directories
named past 64 bits; sizes of 2**60; commands on a missing path, a file, a FIFO, a link; ``gc`` through
any path to a live writer's directory (refused, the writer goes on) and through a ``file://`` URL of it
(nothing committed deleted); SIGKILL of ``ckpt gc`` and of a saving Checkpointer in the middle of a
deletion (the directory stays owned until the kill; then nothing torn is listed or restored, and the next
gc removes the leftover); ``gc --memory --dry-run`` after such a kill; ``ckpt ls`` and restores in a second
process while gc deletes 39 steps; torn and lying timeline records and a lying ``latest``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.cli import main
from ckpt.format import COMMIT_NAME, data_name, manifest_name
from ckpt.integrity import checksum
from ckpt.tiers import LocalTier
from helpers import verifies

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")

HERE = Path(__file__).parent
NUMEL = 1000


# -- helpers ----------------------------------------------------------------------------------------
def _write(d: Path, *steps: int, url: str | None = None) -> None:
    """Commit ``steps`` to ``d``, each tensor filled with its step; nothing pruned."""
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=d),
        policy=ckpt.Policy(keep=ckpt.Retention(local=None, remote=None)),
    ) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((NUMEL,), float(s))}).wait()


def _sd(d: Path, step: int) -> Path:
    return d / f"step-{step:09d}"


def _committed(d: Path) -> list[int]:
    return sorted(
        int(p.name[5:])
        for p in d.glob("step-*")
        if p.is_dir() and not p.is_symlink() and (p / COMMIT_NAME).is_file()
    )


def _restore(d: Path) -> tuple[int | None, torch.Tensor]:
    """A fresh process's restore of ``d``: the step and the tensor loaded; the tensor must be the
    step's (nothing torn is ever served)."""
    state = {"w": torch.full((NUMEL,), -1.0)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
        step = ck.restore(state)
    if step is not None:
        assert torch.equal(state["w"], torch.full((NUMEL,), float(step))), f"step {step} restored torn"
    return step, state["w"]


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*args])
    return rc, out.getvalue(), err.getvalue()


def _tree(d: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every entry under ``d`` (links not followed): its kind, size and, for a regular file, its bytes."""
    out = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(root, n)
            st = os.lstat(p)
            body = Path(p).read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(p, d)] = (stat.S_IFMT(st.st_mode), st.st_size, body)
    return out


def _recommit(d: Path, step: int, manifest=None, commit=None) -> None:
    """Rewrite ``step``'s manifest (``manifest(dict) -> dict``) and COMMIT so that they still agree."""
    sd = _sd(d, step)
    c = json.loads((sd / COMMIT_NAME).read_bytes())
    if manifest is not None:
        raw = json.dumps(manifest(json.loads((sd / manifest_name(0)).read_bytes()))).encode()
        (sd / manifest_name(0)).write_bytes(raw)
        c["manifests"][manifest_name(0)] = checksum(raw)
    if commit is not None:
        c = commit(c)
    (sd / COMMIT_NAME).write_bytes(json.dumps(c).encode())


# -- keep=1 while the newest checkpoint is damaged --------------------------------------------------
def _flip(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[7] ^= 0x01
    p.write_bytes(bytes(raw))


DAMAGE = {
    "bit_flipped": lambda sd: _flip(sd / data_name(0)),
    "truncated": lambda sd: os.truncate(sd / data_name(0), 100),
    "data_gone": lambda sd: (sd / data_name(0)).unlink(),
    "manifest_gone": lambda sd: (sd / manifest_name(0)).unlink(),
    "manifest_garbage": lambda sd: (sd / manifest_name(0)).write_bytes(b"\x00" * 64),
    "commit_garbage": lambda sd: (sd / COMMIT_NAME).write_bytes(b'{"step": 30'),
    "commit_of_another_step": lambda sd: shutil.copy(
        sd.parent / "step-000000020" / COMMIT_NAME, sd / COMMIT_NAME
    ),
    "uncommitted_half_deleted": lambda sd: ((sd / COMMIT_NAME).unlink(), (sd / data_name(0)).unlink()),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_gc_keep_1_with_the_newest_damaged_keeps_a_good_one_and_restore_finds_it(local_dir, damage):
    _write(local_dir, 10, 20, 30)
    DAMAGE[damage](_sd(local_dir, 30))
    rc, out, err = _cli("gc", str(local_dir), "--keep", "1")
    assert rc == 0
    assert 20 in _committed(local_dir) and verifies(local_dir, 20)
    assert 10 not in _committed(local_dir)
    assert _restore(local_dir)[0] == 20
    # a second gc, and the one after a new save, still never leave only damaged checkpoints
    assert _cli("gc", str(local_dir), "--keep", "1")[0] == 0
    assert _restore(local_dir)[0] == 20


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_fresh_process_with_keep_1_that_saves_beside_a_damaged_newer_step_keeps_its_save(local_dir, damage):
    """A process that never read the old steps saves step 25 (older than the damaged 30) with keep=1:
    30 stays (the newest committed, or an uncommitted leftover newer than every commit), 25 stays (the
    newest this process knows to verify), and a restore finds 25 whatever 30 has become."""
    _write(local_dir, 10, 20, 30)
    DAMAGE[damage](_sd(local_dir, 30))
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    ) as ck:
        ck.save(25, {"w": torch.full((NUMEL,), 25.0)}).wait()
    assert 25 in _committed(local_dir) and verifies(local_dir, 25)
    assert not {10, 20} & set(_committed(local_dir))
    assert _restore(local_dir)[0] == 25


def test_gc_with_every_checkpoint_damaged_deletes_no_committed_one_and_exits_1(local_dir):
    _write(local_dir, 10, 20, 30)
    for s, damage in ((10, "truncated"), (20, "manifest_garbage"), (30, "bit_flipped")):
        DAMAGE[damage](_sd(local_dir, s))
    before = _tree(local_dir)
    rc, out, err = _cli("gc", str(local_dir), "--keep", "1")
    assert rc == 1 and out == ""
    assert {k: v for k, v in _tree(local_dir).items() if k != ".ckpt-lock"} == {
        k: v for k, v in before.items() if k != ".ckpt-lock"
    }


# -- --dry-run deletes nothing ----------------------------------------------------------------------
def test_gc_dry_run_deletes_nothing_not_even_leftovers_and_says_what_gc_would(local_dir):
    _write(local_dir, 10, 20, 30, 40)
    _flip(_sd(local_dir, 40) / data_name(0))
    (_sd(local_dir, 20) / COMMIT_NAME).unlink()  # an uncommitted leftover
    stage = local_dir / ".step-000000050.new-999999-00000000-00000000"  # a staging directory of another host
    stage.mkdir()
    before = _tree(local_dir)
    rc, out, _ = _cli("gc", str(local_dir), "--keep", "1", "--dry-run")
    assert rc == 0
    assert _tree(local_dir) == before
    would = sorted(int(line.split()[-1]) for line in out.splitlines())
    assert would == [10, 20]
    rc, out, _ = _cli("gc", str(local_dir), "--keep", "1")
    assert rc == 0 and sorted(int(line.split()[-1]) for line in out.splitlines()) == would
    assert _committed(local_dir) == [30, 40] and stage.is_dir()


# -- entries with a step's name that are not step directories ----------------------------------------
def _make(kind: str, path: Path, outside: Path) -> None:
    if kind == "file":
        path.write_bytes(b"not a step")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link_to_outside_dir":
        os.symlink(outside, path)
    elif kind == "link_to_outside_file":
        os.symlink(outside / "precious", path)
    elif kind == "dangling_link":
        os.symlink(outside / "nothing-here", path)
    elif kind == "link_to_own_step":
        os.symlink(path.parent / "step-000000010", path)
    elif kind == "dir_with_commit_dir":
        path.mkdir()
        (path / COMMIT_NAME).mkdir()
        (path / COMMIT_NAME / "precious").write_bytes(b"x")
    elif kind == "dir_with_commit_link_to_outside":
        path.mkdir()
        os.symlink(outside / "precious", path / COMMIT_NAME)
    else:
        raise AssertionError(kind)


ODD = [
    "file",
    "fifo",
    "link_to_outside_dir",
    "link_to_outside_file",
    "dangling_link",
    "link_to_own_step",
    "dir_with_commit_dir",
    "dir_with_commit_link_to_outside",
]


def _run_bounded(fn, seconds: float = 60):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    return out[0]


@pytest.mark.parametrize("kind", ODD)
@pytest.mark.parametrize("how", ["gc", "save"])
def test_a_step_name_that_is_no_step_directory_is_never_followed_nor_blocks(local_dir, tmp_path, kind, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious")
    (outside / "sub").mkdir()
    (outside / "sub" / "f").write_bytes(b"f")
    _write(local_dir, 10, 20, 30)
    odd = local_dir / "step-000000015"
    _make(kind, odd, outside)
    outside_before, odd_before = _tree(outside), os.lstat(odd)
    if how == "gc":
        rc, _, _ = _run_bounded(lambda: _cli("gc", str(local_dir), "--keep", "1"))
        assert rc == 0
    else:

        def save():
            with ckpt.Checkpointer(
                storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
            ) as ck:
                ck.save(40, {"w": torch.full((NUMEL,), 40.0)}).wait()

        _run_bounded(save)
    assert _tree(outside) == outside_before
    newest = 30 if how == "gc" else 40
    assert newest in _committed(local_dir) and verifies(local_dir, newest)
    if kind in ("dir_with_commit_dir",):  # an uncommitted directory of our own: may go, never follows
        assert not os.path.lexists(odd) or stat.S_IFMT(os.lstat(odd).st_mode) == stat.S_IFDIR
    else:
        st = os.lstat(odd)
        assert (stat.S_IFMT(st.st_mode), st.st_ino) == (stat.S_IFMT(odd_before.st_mode), odd_before.st_ino)
    assert _restore(local_dir)[0] == newest


def test_links_inside_a_doomed_step_are_removed_never_their_targets(local_dir, tmp_path):
    """A doomed step holding links to a file and a directory outside, to the directory itself and to the
    step that is kept: only the links go."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "precious").write_bytes(b"precious")
    (outside / "sub" / "f").write_bytes(b"f")
    _write(local_dir, 10, 20)
    sd = _sd(local_dir, 10)
    os.symlink(outside / "precious", sd / "a-file")
    os.symlink(outside / "sub", sd / "a-dir")
    os.symlink(local_dir, sd / "the-root")
    os.symlink(_sd(local_dir, 20), sd / "the-kept-step")
    (sd / "nested").mkdir()
    os.symlink(outside, sd / "nested" / "deeper")
    outside_before, kept_before = _tree(outside), _tree(_sd(local_dir, 20))
    assert _cli("gc", str(local_dir), "--keep", "1")[0] == 0
    assert not os.path.lexists(sd)
    assert _tree(outside) == outside_before and _tree(_sd(local_dir, 20)) == kept_before
    assert _restore(local_dir)[0] == 20


# -- steps near 2**63, and past it -------------------------------------------------------------------
def test_steps_at_the_top_of_64_bits_are_ordered_kept_and_pruned_like_any_other(local_dir):
    top = (1 << 63) - 1
    _write(local_dir, 5, top - 1, top)
    rc, out, _ = _cli("ls", str(local_dir), "--json")
    assert rc == 0 and [r["step"] for r in json.loads(out)] == [top, top - 1, 5]
    assert _cli("gc", str(local_dir), "--keep", "1")[0] == 0
    assert _committed(local_dir) == [top]
    assert _restore(local_dir)[0] == top


@pytest.mark.parametrize("name", [str(1 << 63), str(1 << 64), "9" * 30])
def test_a_step_directory_named_past_64_bits_never_costs_the_good_newest(local_dir, name):
    """A copy of step 30 under a name past 2**63 - 1 (no writer makes one) is listed as the newest by
    number; it never verifies (its COMMIT names step 30), so it is never restored and never counted as
    the checkpoint to keep."""
    _write(local_dir, 10, 20, 30)
    shutil.copytree(_sd(local_dir, 30), local_dir / f"step-{name}")
    for cmd in (["ls", str(local_dir)], ["ls", str(local_dir), "--json"], ["inspect", str(local_dir)]):
        rc, _, err = _cli(*cmd)
        assert rc in (0, 1) and "unexpected" not in err
    assert _cli("verify", str(local_dir))[0] == 1
    assert _cli("gc", str(local_dir), "--keep", "1")[0] == 0
    assert _committed(local_dir)[:1] == [30] and verifies(local_dir, 30)
    assert _restore(local_dir)[0] == 30
    _resume_and_save(local_dir, 30, 31, keep=1)
    assert 31 in _committed(local_dir) and _restore(local_dir)[0] == 31


def _resume_and_save(local_dir: Path, restored: int, step: int, keep: int) -> None:
    """A training process: restores (``restored`` expected), saves ``step`` with ``keep`` local checkpoints."""
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=keep))
    ) as ck:
        state = {"w": torch.zeros(NUMEL)}
        assert ck.restore(state) == restored
        state["w"].fill_(step)
        ck.save(step, state).wait()


# -- a manifest and COMMIT claiming 2**60 bytes --------------------------------------------------------
@pytest.mark.parametrize("field", ["data_bytes", "chunk_bytes"])
def test_sizes_of_2_to_the_60_in_the_newest_step_never_crash_a_command_nor_cost_the_good_step(
    local_dir, field
):
    _write(local_dir, 10, 20, 30)
    big = 1 << 60
    if field == "data_bytes":
        _recommit(
            local_dir,
            30,
            manifest=lambda m: {**m, "data_bytes": big},
            commit=lambda c: {**c, "data": {data_name(0): big}},
        )
    else:
        _recommit(local_dir, 30, manifest=lambda m: {**m, "chunk_bytes": big})
    for cmd in ("ls", "inspect", "verify"):
        rc, _, err = _cli(cmd, str(local_dir))
        assert rc in (0, 1) and "unexpected" not in err
    rc, _, err = _cli("gc", str(local_dir), "--keep", "1")
    assert rc == 0 and "unexpected" not in err
    good = [s for s in _committed(local_dir) if verifies(local_dir, s)]
    assert good and _restore(local_dir)[0] == good[-1] >= 20


# -- the command line on a path that is not a checkpoint directory ----------------------------------
@pytest.mark.parametrize("kind", ["missing", "file", "fifo", "link_to_file", "dangling_link"])
@pytest.mark.parametrize(
    "cmd", [["gc", "--keep", "1"], ["gc", "--keep", "1", "--dry-run"], ["ls"], ["verify"], ["inspect"]]
)
def test_a_command_on_a_path_that_is_no_directory_is_status_1_and_changes_nothing(tmp_path, kind, cmd):
    p = tmp_path / "target"
    if kind == "file":
        p.write_bytes(b"precious")
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "link_to_file":
        (tmp_path / "precious").write_bytes(b"precious")
        os.symlink(tmp_path / "precious", p)
    elif kind == "dangling_link":
        os.symlink(tmp_path / "nothing", p)
    before = _tree(tmp_path)
    rc, out, err = _run_bounded(lambda: _cli(cmd[0], str(p), *cmd[1:]))
    assert rc == 1 and err.startswith("ckpt: error: ") and len(err.strip().splitlines()) == 1
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
@pytest.mark.parametrize("keep", ["0", "-3", "1.5", "x"])
def test_gc_keep_below_1_is_a_usage_mistake_and_deletes_nothing(local_dir, keep, dry_run):
    _write(local_dir, 10, 20, 30)
    before = _tree(local_dir)
    rc, out, err = _cli("gc", str(local_dir), "--keep", keep, *dry_run)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert _tree(local_dir) == before


# -- promote between a directory and itself ---------------------------------------------------------
@pytest.mark.parametrize("to", ["remote", "local"])
@pytest.mark.parametrize(
    "where", ["same", "via_link", "trailing_slash", "a_step_of_it", "holds_it_as_a_step"]
)
def test_promote_between_a_local_dir_and_a_url_of_itself_is_refused_and_touches_nothing(tmp_path, to, where):
    local_dir = tmp_path / "local"
    _write(local_dir, 1, 2)
    url = {
        "same": f"file://{local_dir}",
        "trailing_slash": f"file://{local_dir}/",
        "a_step_of_it": f"file://{_sd(local_dir, 2)}",
    }.get(where)
    if where == "via_link":
        os.symlink(local_dir, tmp_path / "link")
        url = f"file://{tmp_path / 'link'}"
    src = local_dir
    if where == "holds_it_as_a_step":  # local_dir lies inside a step directory of the remote tier
        _write(tmp_path / "other", 1)
        url = f"file://{tmp_path / 'other'}"
        src = _sd(tmp_path / "other", 1) / "nested"
        shutil.copytree(local_dir, src)
    before = _tree(tmp_path)
    rc, out, err = _cli(
        "promote",
        str(src),
        url,
        "--step",
        "2" if where != "holds_it_as_a_step" else "1",
        "--to",
        to,
        "--compression",
        "zstd",
        "--no-progress",
    )
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert _tree(tmp_path) == before
    assert _cli("verify", str(local_dir))[0] == 0


def test_promote_to_a_url_elsewhere_inside_local_dir_still_works(local_dir):
    _write(local_dir, 1, 2)
    url = f"file://{local_dir}/remote"
    assert (
        _cli("promote", str(local_dir), url, "--step", "2", "--to", "remote", "--compression", "zstd")[0] == 0
    )
    assert _cli("verify", url)[0] == 0 and _cli("verify", str(local_dir))[0] == 0


def test_the_promote_function_refuses_a_url_naming_local_dir_itself(local_dir):
    _write(local_dir, 1, 2)
    try:
        with pytest.raises(ValueError):
            ckpt.promote(2, "remote", local_dir=local_dir, url=f"file://{local_dir}", compression="zstd")
    finally:
        assert verifies(local_dir, 2)


def test_a_checkpointer_whose_url_is_its_local_dir_is_refused_at_construction(local_dir):
    with pytest.raises(ValueError):
        ckpt.Checkpointer(storage=ckpt.Storage(url=f"file://{local_dir}", local_dir=local_dir)).close()


# -- a live writer owns the directory ---------------------------------------------------------------
@pytest.fixture
def live_writer(tmp_path):
    """A real process saving steps 1, 2, ... into ``tmp_path/local`` without end (tests/killworker.py)."""
    d = tmp_path / "local"
    d.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "killworker.py"), str(d), str(1 << 14), str(4096)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(_committed(d)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        yield d, proc
    finally:
        proc.kill()
        proc.wait()


def test_gc_through_any_path_to_a_live_writers_dir_is_refused_and_the_writer_goes_on(live_writer, tmp_path):
    d, proc = live_writer
    os.symlink(d, tmp_path / "alias")
    for path in (str(d), str(tmp_path / "alias"), str(d) + "/", str(d) + "/."):
        rc, out, err = _cli("gc", path, "--keep", "1")
        assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1
    rc, out, _ = _cli("gc", str(d), "--keep", "1", "--dry-run")  # only reads
    assert rc == 0
    seen = _committed(d)[-1]
    deadline = time.monotonic() + 60
    while _committed(d)[-1] <= seen:  # the writer was not disturbed
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)


def test_gc_of_a_live_writers_dir_as_a_file_url_deletes_none_of_its_checkpoints(live_writer):
    """The remote tier's reading of a local tier's directory: nothing there verifies as a remote
    checkpoint, so nothing committed is deleted (and no lock protects it)."""
    d, proc = live_writer
    proc.send_signal(signal.SIGSTOP)  # a writer frozen mid-save: its committed steps must all stay
    try:
        before = _committed(d)
        rc, _, _ = _cli("gc", f"file://{d}", "--keep", "1")
        assert rc in (0, 1)
        assert _committed(d) == before
    finally:
        proc.send_signal(signal.SIGCONT)


# -- SIGKILL in the middle of retention's deletions --------------------------------------------------
@pytest.mark.parametrize("where", ["uncommitted", "half"])
@pytest.mark.parametrize("mode", ["gc", "save"])
def test_sigkill_in_the_middle_of_a_deletion_leaves_a_good_newest_and_nothing_torn(local_dir, mode, where):
    _write(local_dir, 10, 20, 30)
    env = dict(
        os.environ,
        PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PYTHONWARNINGS="ignore",
    )
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "retention_worker.py"), mode, str(local_dir), where],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["stopped"], line
        half = int(line[1])
        # mid-deletion the directory is owned: no second writer, no second gc, nothing changes
        before = _tree(local_dir)
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
        try:
            with pytest.raises(ckpt.LockedError):
                ck.save(99, {"w": torch.full((NUMEL,), 99.0)}).wait()
        finally:
            ck.close()
        assert _cli("gc", str(local_dir), "--keep", "1")[0] == 1
        assert _tree(local_dir) == before
    finally:
        proc.kill()
        proc.wait()
    newest = 30 if mode == "gc" else 31
    assert os.path.isdir(_sd(local_dir, half)) and half not in _committed(local_dir)
    # the half-deleted step is not listed, not restored; every listed step verifies
    rc, out, _ = _cli("ls", str(local_dir), "--json")
    assert rc == 0 and half not in [r["step"] for r in json.loads(out)]
    assert all(verifies(local_dir, s) for s in _committed(local_dir))
    assert newest in _committed(local_dir)
    assert _restore(local_dir)[0] == newest
    assert _cli("verify", str(local_dir))[0] == 0
    # the killed process held no lock: the next gc runs, and removes the leftover
    assert _cli("gc", str(local_dir), "--keep", "1")[0] == 0
    assert not os.path.lexists(_sd(local_dir, half))
    assert _committed(local_dir) == [newest]


def test_gc_memory_dry_run_frees_nothing_of_a_killed_writers_segments(local_dir):
    """A writer SIGKILLed mid-retention leaves its memory-tier segments: ``gc --memory DIR --dry-run``
    frees nothing (the restore still reads the newest from them), ``gc --memory DIR`` frees them."""
    from ckpt import shm

    _write(local_dir, 10, 20, 30)
    env = dict(
        os.environ,
        PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PYTHONWARNINGS="ignore",
    )
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "retention_worker.py"), "save", str(local_dir), "uncommitted"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().split()[:1] == ["stopped"]
    finally:
        proc.kill()
        proc.wait()
    prefix = shm.prefix_for(local_dir, 0, create=True)

    def held() -> dict[str, bytes]:
        return {str(f): f.read_bytes() for g in shm.segments(prefix=prefix) for f in g.files}

    before = held()
    if not before:
        pytest.skip("no memory tier here (no RAM file system)")
    assert _cli("gc", "--memory", str(local_dir), "--dry-run")[0] == 0
    for cmd in (["ls", str(local_dir)], ["ls", "--memory"], ["gc", str(local_dir), "--dry-run"]):  # read only
        assert _cli(*cmd)[0] == 0
    assert held() == before
    assert _cli("gc", "--memory", str(local_dir))[0] == 0
    assert held() == {}
    assert _restore(local_dir)[0] == 31  # from the local tier alone now


def test_gc_memory_never_frees_a_live_owners_segments_before_its_first_snapshot(
    local_dir, tmp_path, monkeypatch
):
    """A live owner has allocated its memory-tier segments and not yet written a snapshot record (as
    between a first save's allocation and its first memory commit): ``gc --memory DIR`` is refused as
    for any live owner, ``gc --memory`` (every local_dir) keeps them since no record says whose they
    are; once the owner is dead, ``gc --memory DIR`` frees them."""
    from ckpt import shm

    monkeypatch.setenv("CKPT_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    _write(local_dir, 10)
    env = dict(
        os.environ,
        PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PYTHONWARNINGS="ignore",
    )
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "retention_worker.py"), "memory", str(local_dir), "half"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    prefix = shm.prefix_for(local_dir, 0, create=True)

    def held() -> dict[str, int]:
        return {str(f): f.stat().st_ino for g in shm.segments(prefix=prefix) for f in g.files}

    try:
        assert proc.stdout.readline().split() == ["stopped", "0"]
        before = held()
        assert before and all(g.records == [] for g in shm.segments(prefix=prefix))
        rc, out, err = _cli("gc", "--memory", str(local_dir))
        assert rc == 1 and out == ""
        assert _cli("gc", "--memory")[0] == 0
        assert _cli("gc", "--memory", "--dry-run")[0] == 0
        assert held() == before
    finally:
        proc.kill()
        proc.wait()
    assert _cli("gc", "--memory", str(local_dir))[0] == 0
    assert held() == {}


# -- retention racing a second process that lists and restores ---------------------------------------
LISTER = r"""
import json, sys, io, contextlib
from ckpt.cli import main
d, n = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
bad = 0
for _ in range(n):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["ls", d, "--json"])
    if rc != 0 or "unexpected" in err.getvalue():
        bad += 1
        continue
    rows = json.loads(out.getvalue())
    if not rows or max(r["step"] for r in rows) != int(sys.argv[3]):
        bad += 1
print("bad", bad, flush=True)
"""


def test_gc_deleting_many_steps_while_another_process_lists_them(local_dir):
    """A second process running ``ckpt ls`` in a loop while gc deletes 40 steps: every listing succeeds
    and shows the newest step; the newest is never deleted."""
    assert _gc_beside(local_dir, LISTER, "60") == ["bad", "0"]
    assert _committed(local_dir) == [40] and _restore(local_dir)[0] == 40


def _gc_beside(local_dir: Path, script: str, arg: str) -> list[str]:
    """Steps 1-40 written, ``script`` running in a second process (it prints ``ready``, then its verdict)
    while ``ckpt gc --keep 1`` deletes 39 of them; returns the second process's last words."""
    _write(local_dir, *range(1, 41))
    p = subprocess.Popen(
        [sys.executable, "-c", script, str(local_dir), arg, "40"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        rc, out, _ = _cli("gc", str(local_dir), "--keep", "1")
        assert rc == 0 and len(out.splitlines()) == 39
        return p.communicate(timeout=120)[0].split()
    finally:
        p.kill()
        p.wait()


# -- gc of a remote tier beside a live job after a rollback ---------------------------------------------
def test_gc_of_a_url_never_deletes_the_new_branchs_upload_in_flight(tmp_path, monkeypatch):
    """After a rollback (300 abandoned, live head 130) a job uploads step 140 while an operator runs
    ``ckpt gc URL``. 140 is uncommitted and numbered below the abandoned 300, but it is no leftover: gc
    must leave its files, the upload commits, and 140 verifies."""
    from ckpt.tiers.remote import RemoteTier

    url = f"file://{tmp_path}/remote"
    local = tmp_path / "local"
    _write(local, 100, 200, 300, url=url)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=local),
        policy=ckpt.Policy(keep=ckpt.Retention(local=None, remote=None)),
    ) as ck:
        state = _roll_back(ck)
        real, ran = RemoteTier._put, []

        def put(self, path, data, sync_dir=False):
            real(self, path, data, sync_dir)
            if "step-000000140" in path and "/part-" in path and not ran:  # a part is up, no COMMIT yet
                ran.append(_cli("gc", url, "--keep", "3"))

        monkeypatch.setattr(RemoteTier, "_put", put)
        ck.wait_staged()
        state["w"].fill_(140)
        ck.save(140, state).wait()
        monkeypatch.undo()
    assert ran and ran[0][0] == 0
    assert sorted(int(line.split()[-1]) for line in ran[0][1].splitlines()) == [100, 200, 300]
    remote = tmp_path / "remote"
    assert _committed(remote) == [110, 120, 130, 140]
    assert _cli("verify", url, "--step", "140")[0] == 0


def test_leftovers_below_the_live_head_are_still_removed_after_a_rollback(local_dir):
    _rolled_back(local_dir)
    for s in (105, 125):
        _sd(local_dir, s).mkdir()
        (_sd(local_dir, s) / data_name(0)).write_bytes(b"partial")
    rc, out, _ = _cli("gc", str(local_dir), "--keep", "3")
    assert rc == 0
    assert not os.path.lexists(_sd(local_dir, 105)) and not os.path.lexists(_sd(local_dir, 125))
    assert _committed(local_dir) == [110, 120, 130]


RESTORER = r"""
import sys, warnings, torch, ckpt
warnings.simplefilter("ignore")
d, n, newest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
bad = []
with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
    for i in range(n):
        state = {"w": torch.full((1000,), -1.0)}
        want = None if i % 2 else 1 + i % (newest - 1)   # the newest, or an older step being deleted
        try:
            got = ck.restore(state, step=want)
        except (ckpt.errors.NoCheckpointError, FileNotFoundError):   # deleted before (or while) it was read
            if want is None:
                bad.append(("none", i))
            continue
        if got != (newest if want is None else want) or not torch.equal(state["w"], torch.full((1000,), float(got))):
            bad.append((want, got))
print("bad", len(bad), flush=True)
"""


def test_gc_deleting_many_steps_while_another_process_restores_them(local_dir):
    """A second process restores in a loop (the newest, and older steps that gc is deleting) while gc
    deletes 39 of 40 steps: the newest always restores exactly; an older one restores exactly or is
    reported missing (``FileNotFoundError``, or ``NoCheckpointError`` when deleted mid-read), never torn
    nor another step."""
    assert _gc_beside(local_dir, RESTORER, "40") == ["bad", "0"]
    assert _committed(local_dir) == [40]


# -- timelines that lie ------------------------------------------------------------------------------
def _rolled_back(d: Path) -> None:
    """Timeline 0: 100, 200, 300; rolled back to 100; timeline 1: 110, 120, 130."""
    _write(d, 100, 200, 300)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        _roll_back(ck)


def _roll_back(ck: ckpt.Checkpointer) -> dict:
    """Restore step 100 (of 100, 200, 300) and save 110, 120, 130 on the new timeline; returns the state."""
    state = {"w": torch.zeros(NUMEL)}
    assert ck.restore(state, step=100) == 100
    for s in (110, 120, 130):
        ck.wait_staged()
        state["w"].fill_(s)
        ck.save(s, state).wait()
    return state


def test_gc_never_keeps_the_abandoned_branch_over_the_live_one_when_the_live_head_is_damaged(local_dir):
    """The live head 130 fails to verify; the newest that verifies is 120 (live), not 300 (abandoned,
    larger step). gc --keep 1 keeps 130 and 120; a restore gives 120, never the abandoned 300."""
    _rolled_back(local_dir)
    _flip(_sd(local_dir, 130) / data_name(0))
    assert _cli("gc", str(local_dir), "--keep", "1")[0] == 0
    assert _committed(local_dir) == [120, 130]
    assert _restore(local_dir)[0] == 120


def test_a_live_head_whose_commit_is_torn_never_hands_the_newest_to_the_abandoned_branch(local_dir):
    """130's COMMIT is torn (listed as timeline 0): the live branch is still decided by 120's, so
    retention keeps the live steps and removes the abandoned 200 and 300 first, and a restore gives 120."""
    _rolled_back(local_dir)
    (_sd(local_dir, 130) / COMMIT_NAME).write_bytes(b'{"step":130,"world_size":1,"manif')
    assert _cli("gc", str(local_dir), "--keep", "2")[0] == 0
    assert not {200, 300} & set(_committed(local_dir))
    assert {110, 120} <= set(_committed(local_dir))
    assert _restore(local_dir)[0] == 120


def test_a_fork_point_that_lies_past_the_step_never_pulls_the_abandoned_branch_in(local_dir):
    """110's COMMIT claims its branch left timeline 0 after step 100000 (past any step): the record fails
    its own checksum (a record on a timeline carries one), and the live branch is decided by the head
    (130), whose record is true, so 200 and 300 stay abandoned and the newest three live steps are kept."""
    _rolled_back(local_dir)
    p = _sd(local_dir, 110) / COMMIT_NAME
    p.write_bytes(p.read_bytes().replace(b"[[0,100]]", b"[[0,100000]]"))
    with pytest.raises(ckpt.CorruptCheckpointError):
        LocalTier(local_dir).verify(110)
    assert _restore(local_dir)[0] == 130
    assert _cli("gc", str(local_dir), "--keep", "3")[0] == 0
    assert _committed(local_dir) == [100, 120, 130]


def test_one_flipped_bit_in_an_old_commits_timeline_never_costs_the_newest(local_dir):
    _rolled_back(local_dir)
    p = _sd(local_dir, 110) / COMMIT_NAME
    raw = p.read_bytes()
    flipped = raw.replace(b'"timeline":1', b'"timeline":9')  # '1' -> '9': one bit (0x31 -> 0x39)
    assert flipped != raw and sum(a != b for a, b in zip(raw, flipped)) == 1
    p.write_bytes(flipped)
    assert _cli("gc", str(local_dir), "--keep", "1")[0] == 0
    assert 130 in _committed(local_dir)
    assert _restore(local_dir)[0] == 130


@pytest.mark.parametrize("lie", ["names_the_abandoned_head", "names_a_missing_step", "links_outside"])
def test_a_latest_that_lies_is_never_followed(local_dir, tmp_path, lie):
    """``latest`` is advisory: naming the abandoned 300, a step that is not there, or being a link to a
    file outside, it changes neither what a restore picks nor what retention keeps, and a save replaces
    the link, never writes through it."""
    _rolled_back(local_dir)
    latest = local_dir / "latest"
    latest.unlink()
    outside = tmp_path / "precious"
    outside.write_bytes(b"precious")
    if lie == "links_outside":
        os.symlink(outside, latest)
    else:
        latest.write_bytes(b"step-000000300\n" if lie == "names_the_abandoned_head" else b"step-999999999\n")
    assert _restore(local_dir)[0] == 130
    _resume_and_save(local_dir, 130, 140, keep=2)
    assert _committed(local_dir) == [130, 140]
    assert outside.read_bytes() == b"precious"
    assert _restore(local_dir)[0] == 140

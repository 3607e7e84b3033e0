"""The memory tier's files in the RAM file system, attacked.

``/dev/shm`` is shared by every process of the node (and every job of a user): what a restore finds
there may be a link, a FIFO, a file of the wrong size, a record that lies or is nested 100k deep, or a
segment another process changes. Whatever it finds, a restore never hangs, never follows a link out of
the directory, never maps more than the file holds, serves no byte that fails its checksum, and falls
back to the next tier (the local one here, which holds the same step) with the state exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import procs, shm
from ckpt.cli import main as cli_main

pytestmark = [
    pytest.mark.skipif(shm.shm_root() is None, reason="no RAM file system (/dev/shm) here"),
    pytest.mark.timeout(120),
]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(7, generator=g)}


def _leave(local_dir: Path, step: int = 3) -> tuple[dict, Path, Path]:
    """A checkpoint of ``step`` on the local tier and in RAM (kept past close), and its segment and record."""
    state = _state(step)
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    ck.save(step, state).wait()
    ck.close(keep_memory=True)
    root, prefix = shm.shm_root(), shm.prefix_for(local_dir, 0, create=True)
    recs = [p for p in root.iterdir() if p.name.startswith(prefix) and p.name.endswith(".rec")]
    assert len(recs) == 1, sorted(p.name for p in root.iterdir())
    rec = shm.read_snapshot_record(recs[0])
    return state, root / rec.buffer, recs[0]


def _restore(local_dir: Path) -> tuple[int | None, str | None, dict]:
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        step = ck.restore(target)
        tier = ck.last_restore.tier if step is not None else None
    return step, tier, target


def _exact(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_untouched_snapshot_is_restored_from_ram(local_dir):
    state, _, _ = _leave(local_dir)
    step, tier, got = _restore(local_dir)
    assert (step, tier) == (3, "memory") and _exact(got, state)


def _swap(path: Path, make) -> None:
    os.unlink(path)
    make(path)


@pytest.mark.parametrize("which", ["buffer", "record"])
@pytest.mark.parametrize("what", ["fifo", "symlink", "directory"])
def test_a_segment_file_that_is_not_a_regular_file_of_ours_is_never_opened(local_dir, tmp_path, which, what):
    state, buf, rec = _leave(local_dir)
    target = buf if which == "buffer" else rec
    copy = tmp_path / "elsewhere"
    copy.write_bytes(target.read_bytes())
    before = copy.read_bytes()
    if what == "fifo":
        _swap(target, os.mkfifo)  # opening it for reading would block until a writer comes
    elif what == "symlink":
        _swap(target, lambda p: os.symlink(copy, p))
    else:
        _swap(target, os.mkdir)
    step, tier, got = _restore(local_dir)
    assert (step, tier) == (3, "local") and _exact(got, state)
    assert copy.read_bytes() == before  # the link's target was not written


@pytest.mark.parametrize("size", ["truncated", "sparse 2 GiB", "empty"])
def test_a_buffer_of_another_size_is_refused_or_checked(local_dir, size):
    state, buf, rec = _leave(local_dir)
    data_bytes = shm.read_snapshot_record(rec).manifest.data_bytes
    with open(buf, "r+b") as f:
        if size == "truncated":
            f.truncate(data_bytes // 2)  # mapped as the record says: past the end would be SIGBUS
        elif size == "empty":
            f.truncate(0)
        else:
            f.truncate(0)
            f.truncate(2 << 30)  # the right size and more, every byte zero: fails its checksums
    step, tier, got = _restore(local_dir)
    assert (step, tier) == (3, "local") and _exact(got, state)


def _rewrite_record(rec: Path, change) -> None:
    d = json.loads(rec.read_text())
    change(d)
    rec.write_text(json.dumps(d))


@pytest.mark.parametrize(
    "lie",
    [
        "data_bytes 2**60",
        "record and manifest disagree on the step",
        "another slot's buffer",
        "negative slot",
        "100k-deep json",
        "huge record",
        "not json",
        "manifest 100k deep",
        "chunk checksums flipped",
    ],
)
def test_a_record_that_lies_is_refused(local_dir, lie):
    state, buf, rec = _leave(local_dir)
    if lie == "100k-deep json":
        rec.write_text("[" * 100_000 + "]" * 100_000)
    elif lie == "huge record":
        with open(rec, "r+b") as f:
            f.truncate(1 << 30)  # sparse: a reader that slurps it takes 1 GiB
    elif lie == "not json":
        rec.write_bytes(b"\xff\xfe" + os.urandom(64))
    else:

        def change(d):
            m = json.loads(d["manifest"])
            if lie == "data_bytes 2**60":
                m["data_bytes"] = 2**60
            elif lie == "record and manifest disagree on the step":
                d["step"] = 4
            elif lie == "another slot's buffer":
                other = 1 - d["slot"]  # a record naming the other slot's segment (another snapshot's bytes)
                d["buffer"] = d["buffer"].replace(f"-s{d['slot']:02d}.", f"-s{other:02d}.")
                d["slot"] = other
            elif lie == "negative slot":
                d["slot"] = -1
            elif lie == "manifest 100k deep":
                d["manifest"] = "[" * 100_000 + "]" * 100_000
                return
            elif lie == "chunk checksums flipped":
                m["chunks"] = [c ^ 1 for c in m["chunks"]]
            d["manifest"] = json.dumps(m)

        _rewrite_record(rec, change)
    step, tier, got = _restore(local_dir)
    assert step == 3 and _exact(got, state) and tier == "local"


def test_a_buffer_changed_after_its_commit_is_refused(local_dir):
    state, buf, _ = _leave(local_dir)
    with open(buf, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    step, tier, got = _restore(local_dir)
    assert (step, tier) == (3, "local") and _exact(got, state)


@pytest.mark.parametrize("flip", [False, True], ids=["intact", "changed"])
def test_a_segment_taken_over_by_the_next_process_is_checked_before_it_is_served(local_dir, flip):
    """The next process takes the segment over (its first save maps and registers it as one of its own
    buffers); a restore of the snapshot in it afterwards still checks every chunk, once."""
    state, buf, _ = _leave(local_dir)
    if flip:
        with open(buf, "r+b") as f:
            f.seek(4000)
            b = f.read(1)
            f.seek(4000)
            f.write(bytes([b[0] ^ 0x10]))
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
    ) as ck:
        ck.save(5, _state(5)).wait()
        adopted = [b for b in ck.pool.buffers if b.image_step == 3]
        assert len(adopted) == 1 and not adopted[0].checked  # taken over, not yet checked
        assert ck.restore(target, step=3) == 3
        assert ck.last_restore.tier == ("local" if flip else "memory") and _exact(target, state)
        assert adopted[0].checked is (not flip)  # checked once, and only when it held


def test_ls_and_gc_stand_hostile_files_and_free_only_regular_files_of_ours(local_dir, tmp_path, capsys):
    state, buf, rec = _leave(local_dir)
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep me")
    root, prefix = shm.shm_root(), shm.prefix_for(local_dir, 0, create=True)
    link = root / f"{prefix}-s01.buf"
    os.symlink(outside, link)
    fifo = root / f"{prefix}-s01.rec"
    os.mkfifo(fifo)
    deep = root / f"{prefix}-s02.rec"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    try:
        assert cli_main(["ls", str(local_dir), "--memory"]) == 0
        out = capsys.readouterr().out
        assert "3" in out
        assert cli_main(["gc", "--memory", str(local_dir)]) == 0
        assert outside.read_bytes() == b"keep me"
        assert not buf.exists() and not rec.exists() and not deep.exists()
    finally:
        for p in (link, fifo, deep):
            if os.path.lexists(p):
                os.unlink(p)


def test_a_segment_half_made_by_a_killed_process_is_removed_by_the_next_owner(local_dir, tmp_path):
    """A process killed while it reserved a segment (the OOM killer strikes during exactly that) leaves the
    temporary file and its RAM behind; the next process on the same local tier removes it when it takes
    the tier's segments over, and leaves alone what is not its own."""
    root, prefix = shm.shm_root(), shm.prefix_for(local_dir, 0, create=True)
    script = tmp_path / "killed.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        import torch
        import ckpt
        from ckpt import shm
        shm.REGISTER_PIECE, shm.REGISTER_GAP_S = 64 << 10, 0.2   # 8 MiB in 128 paced pieces: ~25 s
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=sys.argv[1]), policy=ckpt.Policy(every_steps=1)
        )
        ck.maybe_save(0, {"w": torch.randn(2 << 20)})
        print("allocating", flush=True)
        time.sleep(600)
    """)
    )
    env = {**os.environ, "CKPT_BUSY_WAIT_MS": "0"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(local_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "allocating"
        deadline = time.monotonic() + 60
        while not [n for n in os.listdir(root) if n.startswith(f".{prefix}-s") and ".new-" in n]:
            assert time.monotonic() < deadline, "no segment was being made"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(60)
    left = [n for n in os.listdir(root) if n.startswith(f".{prefix}-s") and ".new-" in n]
    assert left
    (tmp_path / "another").mkdir()
    other = root / f".{shm.prefix_for(tmp_path / 'another', 0, create=True)}-s00.buf.new-{proc.pid}-abcd1234"
    other.write_bytes(b"x")  # another local tier's: not this owner's to remove
    try:
        state = _state(5)
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
            ck.save(5, state).wait()
            assert not [n for n in os.listdir(root) if n in left]
        assert other.exists()
    finally:
        other.unlink()
    assert _restore(local_dir)[:2] == (5, "local")


def test_a_half_made_segment_of_an_earlier_process_with_this_pid_is_removed(local_dir):
    """Containers restart their processes under the same small pids: a temporary left by a killed process
    whose pid this process got again is not this process's own (it is older than this process) and is
    removed; one this process made (modified since it started) is left to its writer."""
    root, prefix = shm.shm_root(), shm.prefix_for(local_dir, 0, create=True)
    earlier = root / f".{prefix}-s00.buf.new-{os.getpid()}-abcd1234"
    mine = root / f".{prefix}-s01.buf.new-{os.getpid()}-beef5678"
    for p in (earlier, mine):
        p.write_bytes(b"\0" * 8192)
    long_ago = procs.started(os.getpid()) - 3600
    os.utime(earlier, (long_ago, long_ago))
    try:
        assert shm.remove_leftovers(root, prefix) >= 8192
        assert not earlier.exists() and mine.exists()
    finally:
        for p in (earlier, mine):
            p.unlink(missing_ok=True)


# -- a segment read to GPU destinations --------------------------------------------------------------------
import shutil  # noqa: E402

from ckpt import knobs  # noqa: E402
from ckpt.errors import NoCheckpointError  # noqa: E402
from ckpt.scatter import Scatter  # noqa: E402
from ckpt.tiers import memory as memory_mod  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROOMS = ["scratch", "no room"]


class _ClaimsGpu(Scatter):
    """A Scatter whose host destinations count as on a GPU: the memory tier takes its GPU path on this machine."""

    def __init__(self, records, dest):
        super().__init__(records, dest)
        self.to_device = True


def _gpu_path(monkeypatch, device: str, room: str) -> list[bool]:
    """Make a restore read segments the way it reads them into GPU destinations: on ``"cpu"`` with host
    tensors standing in for the GPU's; ``room="no room"``: the GPU has no room for a scratch buffer. Returns
    a list that gets, for each read of a segment, whether it copied (``False``: a check-only pass)."""
    if device == "cpu":
        monkeypatch.setattr(memory_mod, "Scatter", _ClaimsGpu)
        monkeypatch.setattr(
            memory_mod, "_scratch", lambda n, dev: torch.empty(n, dtype=torch.uint8), raising=False
        )
    if room == "no room":

        def no_room(n, dev):
            raise torch.cuda.OutOfMemoryError("no room")

        monkeypatch.setattr(memory_mod, "_scratch", no_room, raising=False)
    reads: list[bool] = []
    real = memory_mod._to_device

    def spy(manifest, fd, sc, *a, **kw):
        reads.append(sc is not None)
        return real(manifest, fd, sc, *a, **kw)

    monkeypatch.setattr(memory_mod, "_to_device", spy)
    return reads


def _leave_alone(local_dir: Path, states: dict[int, dict]) -> dict[int, tuple[Path, Path]]:
    """``states`` saved in 4 KiB chunks and left in RAM; the newest step is in RAM alone (its local copy
    removed). Returns each step's segment and record."""
    with knobs.override(CKPT_CHUNK_BYTES=4096):
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
        for step, state in states.items():
            ck.save(step, state).wait()
        ck.close(keep_memory=True)
    shutil.rmtree(local_dir / f"step-{max(states):09d}")
    root, prefix = shm.shm_root(), shm.prefix_for(local_dir, 0, create=True)
    out = {}
    for p in root.iterdir():
        if p.name.startswith(prefix) and p.name.endswith(".rec"):
            rec = shm.read_snapshot_record(p)
            out[rec.step] = (root / rec.buffer, p)
    assert sorted(out) == sorted(states), out
    return out


def _flip_last_byte(buf: Path, rec: Path) -> None:
    at = shm.read_snapshot_record(rec).manifest.data_bytes - 1  # in the last chunk
    with open(buf, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def _target(keys, device: str) -> tuple[dict, dict]:
    """A state of other values than any saved one, on ``device``, and a copy of it on the host."""
    target = {k: torch.full_like(v, 7.0, device=device) for k, v in _state(0).items() if k in keys}
    return target, {k: v.cpu().clone() for k, v in target.items()}


def _host(state: dict) -> dict:
    return {k: v.cpu() for k, v in state.items()}


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_gpu_restore_of_a_snapshot_whose_last_chunk_fails_leaves_the_state_as_it_was(
    local_dir, monkeypatch, device, room
):
    """The earlier chunks pass their checks; none of their bytes reach the state before the last one has
    passed too, and it does not: no other tier holds the step, and the state is exactly what it was."""
    ((buf, rec),) = _leave_alone(local_dir, {3: _state(3)}).values()
    _flip_last_byte(buf, rec)
    reads = _gpu_path(monkeypatch, device, room)
    target, before = _target(("w", "b"), device)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(NoCheckpointError):
            ck.restore(target)
    assert _exact(_host(target), before)
    assert reads == ([True] if room == "scratch" else [False])  # without room: the check-only pass alone


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_gpu_restore_of_a_snapshot_withdrawn_while_it_was_read_leaves_the_state_as_it_was(
    local_dir, monkeypatch, device, room
):
    """Every chunk passes, but the record goes (its owner took the buffer back) while the segment is read:
    nothing of it reaches the state."""
    ((buf, rec),) = _leave_alone(local_dir, {3: _state(3)}).values()
    _gpu_path(monkeypatch, device, room)
    read = memory_mod._to_device

    def withdrawn(manifest, fd, sc, *a, **kw):
        out = read(manifest, fd, sc, *a, **kw)
        os.unlink(rec)
        return out

    monkeypatch.setattr(memory_mod, "_to_device", withdrawn)
    target, before = _target(("w", "b"), device)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(NoCheckpointError):
            ck.restore(target)
    assert _exact(_host(target), before)


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_key_the_fallback_lacks_keeps_its_value_when_a_gpu_restore_fails_under_strict_false(
    local_dir, monkeypatch, device, room
):
    """Step 3 (with ``a``, in its first chunk) is in RAM alone and fails its last chunk; step 2 (without ``a``)
    is restored instead, and ``a`` keeps the value it had."""
    old = _state(2)
    new = {"a": torch.randn(5, generator=torch.Generator().manual_seed(9)), **_state(3)}
    segs = _leave_alone(local_dir, {2: old, 3: new})
    _flip_last_byte(*segs[3])
    _gpu_path(monkeypatch, device, room)
    target = {
        "a": torch.full((5,), 7.0, device=device),
        "w": torch.zeros(4096, device=device),
        "b": torch.zeros(7, device=device),
    }
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(target, strict=False) == 2
        assert ck.last_restore.tier == "memory" and ck.last_restore.skipped[0].startswith("memory:3")
    got = _host(target)
    assert torch.equal(got["a"], torch.full((5,), 7.0)) and _exact({"w": got["w"], "b": got["b"]}, old)


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("device", DEVICES)
def test_an_intact_snapshot_is_restored_to_gpu_destinations_either_way(local_dir, monkeypatch, device, room):
    state = _state(3)
    _leave_alone(local_dir, {3: state})
    reads = _gpu_path(monkeypatch, device, room)
    target, _ = _target(("w", "b"), device)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(target) == 3 and ck.last_restore.tier == "memory"
    assert _exact(_host(target), state)
    assert reads == ([True] if room == "scratch" else [False, True])  # checked, then read, checked and copied


# ------------------------------------------------- a reader beside a live owner, host destinations


def _rewritten_once_checked(monkeypatch, buf: Path, rec: Path) -> None:
    """The owner takes the buffer back right after the reader found its record standing: the record is
    withdrawn and the buffer rewritten (other bytes), and the reader's check of the record still said yes."""
    real = shm.still_current
    calls = []

    def still_current(r):
        calls.append(1)
        if len(calls) == 1:
            ok = real(r)
            os.unlink(rec)
            size = buf.stat().st_size
            with open(buf, "r+b") as f:
                f.write(os.urandom(size))
            return ok
        return real(r)

    monkeypatch.setattr(shm, "still_current", still_current)


@pytest.mark.parametrize("room", ["room", "no room"])
def test_a_host_restore_beside_a_live_owner_that_takes_the_buffer_back_uses_only_checked_bytes(
    local_dir, monkeypatch, room
):
    """A reader beside a live trainer (an evaluation job on the trainer's local_dir) restores into host
    tensors the snapshot in RAM alone; the trainer takes the buffer back and rewrites it just after the reader
    found the record standing. What reaches the state is the snapshot every chunk of which passed its check,
    never the rewritten bytes: with room, a private copy read and checked before the record was asked (the
    restore is that step's); without room for one, the state is left as it was and the older step restored."""
    old = _state(2)
    new = {"a": torch.randn(5, generator=torch.Generator().manual_seed(9)), **_state(3)}
    segs = _leave_alone(local_dir, {2: old, 3: new})
    monkeypatch.setattr(memory_mod.MemoryTier, "_live_owner", lambda tier: True)
    if room == "no room":
        monkeypatch.setattr(
            memory_mod, "_scratch", lambda n, dev: (_ for _ in ()).throw(MemoryError("no room"))
        )
    _rewritten_once_checked(monkeypatch, *segs[3])
    target = {"a": torch.full((5,), 7.0), "w": torch.zeros(4096), "b": torch.zeros(7)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        step = ck.restore(target, strict=False)
    if room == "room":
        assert step == 3 and _exact(target, new)
    else:  # the check-only pass, then the record gone: nothing copied, the older step restored
        assert step == 2 and torch.equal(target["a"], torch.full((5,), 7.0))
        assert _exact({"w": target["w"], "b": target["b"]}, old)


def test_a_live_owner_is_the_lock_holder_of_the_segments_local_dir(local_dir):
    _leave_alone(local_dir, {3: _state(3)})
    reader = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    assert not reader.memory._live_owner()  # nobody holds local_dir: the segment is read from its mapping
    owner = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    owner._node.own()
    try:
        assert reader.memory._live_owner()
    finally:
        owner.close(keep_memory=True)
    assert not reader.memory._live_owner()
    reader.close(keep_memory=True)

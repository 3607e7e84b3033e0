"""The takeover of a previous process's memory-tier segments (adoption), attacked.

A process that owns ``local_dir`` maps the segments its predecessor left as its own buffers, in a
background thread (:meth:`ckpt.pool.HostPool.adopt_ahead`), with ``checked=False``: the RAM kept those
bytes across the restart, this process never wrote them. What must hold whatever happens:

* a restore never serves a byte of an adopted segment that fails its chunk checksum, whichever chunk it
  is in (first, middle, last, a tail shorter than a chunk, alignment padding): the memory tier raises
  ``CorruptCheckpointError`` and the restore ends bit-identical from the local tier;
* a buffer counts as checked only once every chunk passed, and is checked again after a failure;
  ``MemoryTier.verify`` of an adopted snapshot raises on a changed byte and passes otherwise;
* ``close()`` while the takeover runs stops every thread of the pool, and with ``keep_memory=True`` leaves
  the segments and records as they were, for the next process to restore bit-exact;
* a process SIGKILLed while it takes the segments over, or while it writes a new snapshot into an adopted
  buffer, leaves nothing torn: what is listed restores bit-exact, what was being overwritten is unlisted;
* a save that reuses an adopted buffer withdraws the old record before the first byte changes, so a
  concurrent restore of the old step gets ``LookupError`` (or the local copy), never mixed bytes.

Everything runs on the CPU with 4 KiB chunks (``CKPT_CHUNK_BYTES``), so a state of 18 KB has five chunks,
the last one a 1904-byte tail. Decisions are on types, errno and fields, never on message text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import shm
from ckpt import pool as pool_mod
from ckpt import stage as stage_mod
from ckpt.errors import CorruptCheckpointError, NoCheckpointError
from ckpt.pool import HostPool
from ckpt.tiers import LocalTier
from ckpt.tiers import memory as memory_mod
from ckpt.tiers.memory import MemoryTier, space_for

from helpers import kill_after
import takeover_worker as W

HERE = Path(__file__).parent
CHUNK = 4096
DATA_BYTES = 18288  # W.state(): "a" at [0, 12000), padding to 12288, "b" at [12288, 18288)

pytestmark = [
    pytest.mark.skipif(shm.shm_root() is None, reason="no RAM file system (/dev/shm) here"),
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:step .* is unusable:RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """4 KiB chunks in this process and in the workers it starts."""
    monkeypatch.setenv("CKPT_CHUNK_BYTES", str(CHUNK))


# -- helpers -------------------------------------------------------------------------------------------


def _leave(local_dir: Path, steps=(3,), **kw) -> dict[int, dict]:
    """Save ``steps`` (to RAM and, by default, the local tier) and close keeping the segments in RAM."""
    states = {}
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), **kw)
    for s in steps:
        states[s] = W.state(s)
        ck.save(s, states[s]).wait()
    ck.close(keep_memory=True)
    recs = _records(local_dir)
    assert sorted(recs) == sorted(steps)[-2:], recs
    m = recs[steps[-1]].manifest
    assert (m.data_bytes, m.chunk_bytes, len(m.chunks)) == (DATA_BYTES, CHUNK, 5)
    return states


def _records(local_dir: Path) -> dict[int, shm.SnapshotRecord]:
    out = {}
    for g in shm.segments(prefix=shm.prefix_for(local_dir, 0, create=True)):
        for r in g.records:
            assert r.step not in out, "two records of one step"
            out[r.step] = r
    return out


def _segment(local_dir: Path, step: int) -> Path:
    rec = _records(local_dir)[step]
    return Path(rec.path).with_name(rec.buffer)


def _flip(path: Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _unflipped(path: Path, offset: int, mask: int = 0x10) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(1)[0] ^ mask


def _take_over(ck: ckpt.Checkpointer) -> dict[int, pool_mod.HostBuffer]:
    """Own local_dir (what a collective job's Checkpointer does when it is made, a single process at its
    first save), wait for the background takeover, and return the adopted buffers by step."""
    ck._node.own()
    ck.pool.wait_adopted()
    assert ck.pool.adopt_span is not None and ck.pool.adopt_span[1] is not None  # it ran, and ended
    return {b.image_step: b for b in ck.pool.buffers if b.image_step is not None}


def _exact(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def _foreign(got: dict, before: dict, saved: dict) -> list[str]:
    """Keys of ``got`` holding a word that is neither what was there before the restore nor what was saved
    (a byte no checksum vouched for)."""
    bad = []
    for k in got:
        g, b, s = (t[k].view(torch.int32) for t in (got, before, saved))
        if not bool(((g == b) | (g == s)).all()):
            bad.append(k)
    return bad


class _CountChecks:
    """Counts the chunk checks (``shm.first_bad_chunk``) the memory tier runs."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = shm.first_bad_chunk

        def counted(tensor, manifest):
            self.n += 1
            return real(tensor, manifest)

        monkeypatch.setattr(shm, "first_bad_chunk", counted)


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.is_alive() and t.name in ("ckpt-adopt", "ckpt-prepare")]


def _files(local_dir: Path) -> dict[str, bytes]:
    """The segment files of local_dir's rank 0 (data part of each buffer) and records, by name."""
    out = {}
    for g in shm.segments(prefix=shm.prefix_for(local_dir, 0, create=True)):
        for p in g.files:
            data = p.read_bytes()
            out[p.name] = data[:DATA_BYTES] if p.name.endswith(".buf") else data
    return out


def _start(local_dir: Path, *args: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, str(HERE / "takeover_worker.py"), str(local_dir), *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )


def _kill_after(proc: subprocess.Popen, line: str) -> None:
    kill_after(proc, line)
    assert proc.returncode == -signal.SIGKILL


def _next_process_restores(local_dir: Path, steps: list[int]) -> list[tuple[int, str, str, str]]:
    """A new process owns local_dir, takes the segments over and restores each step: (step, tier, sha, checked)."""
    p = _start(local_dir, "restore", *map(str, steps), stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=100)
    assert p.returncode == 0, err[-3000:]
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("restored ")]
    return [(int(s), tier, sha, checked) for s, tier, sha, checked in rows]


# -- (1) a changed byte of an adopted segment is never served -----------------------------------------------

WHERE = {
    "first byte": 0,
    "middle chunk": 2 * CHUNK + 17,
    "alignment padding": 12100,  # in chunk 2, no tensor's byte: checksummed all the same
    "last byte of the last full chunk": 4 * CHUNK - 1,
    "first byte of the tail": 4 * CHUNK,
    "last byte of the tail": DATA_BYTES - 1,
}


@pytest.mark.parametrize("when", ["before the takeover", "after the takeover"])
@pytest.mark.parametrize("where", list(WHERE))
def test_a_changed_byte_of_an_adopted_segment_is_never_served(local_dir, where, when, monkeypatch):
    """Changed while the RAM held it across the restart, or in the mapping after the takeover (the check is
    the reader's, at the read, not the takeover's)."""
    states = _leave(local_dir)
    seg = _segment(local_dir, 3)
    if when == "before the takeover":
        _flip(seg, WHERE[where])
    checks = _CountChecks(monkeypatch)
    target = W.zeros()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        adopted = _take_over(ck)
        assert set(adopted) == {3} and adopted[3].checked is False and adopted[3].segment is not None
        if when == "after the takeover":
            _flip(seg, WHERE[where])  # the file's pages are the mapping's: the adopted buffer changes with it
            assert adopted[3].tensor[WHERE[where]].item() != _unflipped(seg, WHERE[where])
        assert ck.restore(target) == 3
        info = ck.last_restore
        assert info.tier == "local" and _exact(target, states[3])
        # the memory tier was tried first, through the adopted buffer, and refused it
        assert [s.split(":")[:2] for s in info.skipped] == [["memory", "3"]]
        assert checks.n == 1 and adopted[3].checked is False
        assert ck.memory.verified.get(3) is False


def test_the_memory_tier_itself_raises_corrupt_checkpoint_error_for_an_adopted_segment(local_dir):
    """Inside the tier (not only through restore's fallback): ``load`` raises CorruptCheckpointError, and the
    buffer is neither marked checked nor handed to anyone else while it is read."""
    _leave(local_dir)
    _flip(_segment(local_dir, 3), DATA_BYTES - 1)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        buf = _take_over(ck)[3]
        m = ck.memory.manifest_of(3)
        dest = [torch.empty(i.nbytes, dtype=torch.uint8) if i.alias_of is None else None for i in m.items]
        with pytest.raises(CorruptCheckpointError):
            ck.memory.load(3, m, dest)
        assert buf.checked is False and buf.holds == 0 and buf.image_step == 3
        with pytest.raises(CorruptCheckpointError):
            ck.memory.load(3, m, dest)  # and again: never remembered as good
        assert buf.checked is False


@pytest.mark.parametrize("case", ["only copy", "strict=False"])
def test_a_failed_check_of_an_adopted_segment_leaves_no_unchecked_byte_in_the_state(local_dir, case):
    """``only copy``: the adopted snapshot of step 3 is the one checkpoint there is and fails its check:
    NoCheckpointError, and the state must hold no byte of it. ``strict=False``: step 5 (``a`` and ``extra``)
    is in RAM only and fails its check, step 3 (``a`` alone) is restored instead, successfully: ``extra``,
    a key only the state has, must keep its value (docs/api.md), and at least never hold a changed byte."""
    if case == "only copy":
        states = _leave(local_dir)
        LocalTier(local_dir).delete(3)  # RAM holds the one copy
        newest, flip_at = 3, 100  # a byte of "a"
        target, saved = W.zeros(), states[3]
    else:
        old, new = {"a": W.state(3)["a"]}, {"a": W.state(5)["a"], "extra": W.state(5)["b"]}
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
        )
        ck.save(3, old).wait()  # the first save goes to the local tier too
        ck.save(5, new).wait()  # this one only to RAM ...
        ck.close(keep_memory=True)
        LocalTier(local_dir).delete(5)  # ... (close() wrote it to the local tier as the newest: undone)
        assert sorted(_records(local_dir)) == [3, 5] and LocalTier(local_dir).committed_steps() == [3]
        newest = 5
        extra = next(i for i in _records(local_dir)[5].manifest.items if i.nbytes == 6000)
        flip_at = extra.offset + 40
        target, saved = {"a": torch.zeros(3000), "extra": torch.zeros(1500)}, new
    _flip(_segment(local_dir, newest), flip_at)
    before = {k: v.clone() for k, v in target.items()}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert _take_over(ck)[newest].checked is False
        if case == "only copy":
            with pytest.raises(NoCheckpointError):
                ck.restore(target)
        else:
            assert ck.restore(target, strict=False) == 3 and torch.equal(target["a"], old["a"])
    if case == "only copy":
        assert _foreign(target, before, saved) == []
    else:  # "a" holds step 3 now; "extra" must hold no word that failed its check
        assert _foreign({"extra": target["extra"]}, before, saved) == []


def test_without_a_takeover_a_failed_check_writes_no_byte_into_the_state(local_dir):
    """The contrast: a restore that has not taken the segment over reads it through pread and writes no
    byte of a chunk before it passed (so NoCheckpointError leaves the state as it was)."""
    _leave(local_dir)
    LocalTier(local_dir).delete(3)
    _flip(_segment(local_dir, 3), 100)
    target = W.zeros()
    before = {k: v.clone() for k, v in target.items()}
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir)
    ) as ck:  # restore() alone does not own local_dir
        with pytest.raises(NoCheckpointError):
            ck.restore(target)
        assert ck.pool.buffers == [] and ck.pool.shared is None  # nothing was taken over
    assert _exact(target, before)


def test_an_adopted_record_whose_checksum_lies_is_refused(local_dir):
    """The bytes are intact, the record's checksum of the tail chunk is not: the adopted buffer is checked
    against the record it was taken over with, and refused."""
    states = _leave(local_dir)
    rec = _records(local_dir)[3]
    d = json.loads(Path(rec.path).read_text())
    m = json.loads(d["manifest"])
    m["chunks"][-1] ^= 1
    d["manifest"] = json.dumps(m)
    Path(rec.path).write_text(json.dumps(d))
    target = W.zeros()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        buf = _take_over(ck)[3]
        assert buf.checked is False
        assert ck.restore(target) == 3 and ck.last_restore.tier == "local" and _exact(target, states[3])
        assert buf.checked is False


@pytest.mark.parametrize("size", ["truncated", "empty"])
def test_a_segment_too_small_for_its_record_is_not_taken_over(local_dir, size):
    """Mapping it as the record says would read past its end (SIGBUS): it is refused at the takeover (its
    record withdrawn) and the restore uses the local tier."""
    states = _leave(local_dir)
    seg = _segment(local_dir, 3)
    os.truncate(seg, DATA_BYTES // 2 if size == "truncated" else 0)
    target = W.zeros()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert _take_over(ck) == {}
        assert _records(local_dir) == {}
        assert ck.restore(target) == 3 and ck.last_restore.tier == "local" and _exact(target, states[3])


@pytest.mark.parametrize("flip", [False, True], ids=["intact", "changed"])
def test_a_restore_during_the_takeover_waits_for_it_and_maps_each_segment_once(local_dir, flip, monkeypatch):
    states = _leave(local_dir, steps=(3, 4))
    if flip:
        _flip(_segment(local_dir, 4), CHUNK + 3)
    real = HostPool._adopt_slot
    mapped: list[int] = []

    def slow(self, space, slot, shm_mod):
        time.sleep(0.3)
        buf = real(self, space, slot, shm_mod)
        mapped.append(slot)
        return buf

    monkeypatch.setattr(HostPool, "_adopt_slot", slow)
    target = W.zeros()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck._node.own()
        assert ck.pool._adopting.is_alive()
        assert ck.restore(target) == 4  # no wait_adopted() first
        assert ck.last_restore.tier == ("local" if flip else "memory") and _exact(target, states[4])
        # every slot looked at once (the third holds no snapshot), the two segments mapped once each
        assert sorted(mapped) == [0, 1, 2] and sorted(b.slot for b in ck.pool.buffers) == [0, 1]
        held = {b.image_step: b.checked for b in ck.pool.buffers}
        assert held == {
            3: False,
            4: not flip,
        }  # read from the adopted buffer (checked there), never via pread


# -- (4) checked once, re-checked after a failure; verify ----------------------------------------------------


@pytest.mark.parametrize("flip", [False, True], ids=["intact", "changed"])
def test_an_adopted_buffer_is_checked_once_and_again_after_a_failed_check(local_dir, flip, monkeypatch):
    states = _leave(local_dir)
    if flip:
        _flip(_segment(local_dir, 3), 2 * CHUNK + 1)
    checks = _CountChecks(monkeypatch)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        buf = _take_over(ck)[3]
        for n in (1, 2):
            target = W.zeros()
            assert ck.restore(target) == 3 and _exact(target, states[3])
            assert ck.last_restore.tier == ("local" if flip else "memory")
            # intact: checked by the first restore only; changed: checked (and refused) by each
            assert checks.n == (n if flip else 1)
            assert buf.checked is (not flip)


@pytest.mark.parametrize(
    "flip", [None, 0, CHUNK * 3 + 5, DATA_BYTES - 1], ids=["intact", "first", "middle", "tail"]
)
def test_verify_of_an_adopted_snapshot_raises_on_a_changed_byte_and_passes_otherwise(
    local_dir, flip, monkeypatch
):
    states = _leave(local_dir)
    if flip is not None:
        _flip(_segment(local_dir, 3), flip)
    checks = _CountChecks(monkeypatch)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        buf = _take_over(ck)[3]
        if flip is None:
            (m,) = ck.memory.verify(3)
            assert m.step == 3 and m.data_bytes == DATA_BYTES and buf.checked is True and checks.n == 1
            ck.memory.verify(3)  # checked: not read again
            target = W.zeros()
            assert ck.restore(target) == 3 and ck.last_restore.tier == "memory" and _exact(target, states[3])
            assert checks.n == 1
        else:
            for n in (1, 2):
                with pytest.raises(CorruptCheckpointError):
                    ck.memory.verify(3)
                assert buf.checked is False and checks.n == n and buf.holds == 0
            target = W.zeros()
            assert ck.restore(target) == 3 and ck.last_restore.tier == "local" and _exact(target, states[3])
        assert buf.image_step == 3  # verify withdraws nothing


# -- (2) close while the takeover runs ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["owned when made", "first maybe_save", "first save"])
def test_close_while_the_takeover_runs_stops_its_threads_and_keeps_the_segments_whole(
    local_dir, how, monkeypatch
):
    states = _leave(local_dir, steps=(3, 4))
    before = _files(local_dir)
    real = HostPool._adopt_slot
    inside = threading.Event()

    def slow(self, space, slot, shm_mod):  # a takeover of large segments: it is still running at close()
        inside.set()
        time.sleep(0.3)
        return real(self, space, slot, shm_mod)

    monkeypatch.setattr(HostPool, "_adopt_slot", slow)
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1000))
    if how == "owned when made":
        ck._node.own()
    elif how == "first maybe_save":
        assert (
            ck.maybe_save(1, W.state(1)) is None
        )  # not due: it only owns local_dir and prepares the buffers
    else:
        states[5] = W.state(5)
        ck.save(5, states[5])
    if how != "first save":
        assert inside.wait(10) and ck.pool._adopting is not None and ck.pool._adopting.is_alive()
    ck.close(keep_memory=True)
    assert _pool_threads() == []  # no thread of the pool outlives close()
    monkeypatch.setattr(HostPool, "_adopt_slot", real)
    after = _files(local_dir)
    if how == "first save":
        assert sorted(_records(local_dir)) == [4, 5]  # step 3's buffer (the older) took step 5
        rec4 = _records(local_dir)[4]
        assert after[rec4.buffer] == before[rec4.buffer]
        steps = [5, 4]
    else:
        assert after == before  # segments and records exactly as the previous process left them
        steps = [4, 3]
    got = _next_process_restores(local_dir, steps)
    assert [(s, tier) for s, tier, _, _ in got] == [(s, "memory") for s in steps]
    assert [sha for _, _, sha, _ in got] == [W.digest(states[s]) for s in steps]
    assert [c for _, _, _, c in got] == ["True"] * len(steps)  # checked by the restore that served it


def test_close_without_keep_memory_while_the_takeover_runs_frees_every_segment(local_dir, monkeypatch):
    _leave(local_dir, steps=(3, 4))
    real = HostPool._adopt_slot
    inside = threading.Event()

    def slow(self, space, slot, shm_mod):
        inside.set()
        time.sleep(0.3)
        return real(self, space, slot, shm_mod)

    monkeypatch.setattr(HostPool, "_adopt_slot", slow)
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    ck._node.own()
    assert inside.wait(10)
    ck.close()
    assert _pool_threads() == [] and ck.pool.buffers == []
    time.sleep(0.4)  # nothing the takeover had under way comes back afterwards
    assert shm.segments(prefix=shm.prefix_for(local_dir, 0, create=True)) == []


# -- (3) SIGKILL while the takeover runs, or while a save rewrites an adopted buffer -----------------------


def test_a_process_killed_while_it_takes_the_segments_over_leaves_them_restorable(local_dir):
    states = _leave(local_dir, steps=(3, 4))
    before = _files(local_dir)
    proc = _start(local_dir, "stall-takeover")
    _kill_after(proc, "adopted 0")  # slot 0 mapped, slot 1 not yet: killed in the middle
    assert _files(local_dir) == before
    got = _next_process_restores(local_dir, [4, 3])
    assert [(s, tier, sha) for s, tier, sha, _ in got] == [(s, "memory", W.digest(states[s])) for s in (4, 3)]


def test_a_process_killed_while_it_rewrites_an_adopted_buffer_leaves_no_torn_snapshot(local_dir):
    states = _leave(local_dir, steps=(3, 4))
    old4 = _files(local_dir)[_records(local_dir)[4].buffer]
    proc = _start(local_dir, "stall-save")
    _kill_after(proc, "copying")  # step 5's "a" is in step 3's old buffer, "b" not yet
    recs = _records(local_dir)
    assert sorted(recs) == [4], recs  # step 3's record went before its bytes changed; step 5 never committed
    assert _files(local_dir)[recs[4].buffer] == old4
    # the next process (taking the segments over, or reading them without owning local_dir)
    got = _next_process_restores(local_dir, [4, 3])
    assert got[0][:3] == (4, "memory", W.digest(states[4]))
    assert got[1][:3] == (3, "local", W.digest(states[3]))
    target = W.zeros()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(target) == 4 and ck.last_restore.tier == "memory" and _exact(target, states[4])
        assert 5 not in [c.step for c in ck.memory.committed()]


# -- (5) a save reusing an adopted buffer -----------------------------------------------------------------


def test_a_save_into_an_adopted_buffer_withdraws_its_record_before_the_bytes_change(local_dir, monkeypatch):
    states = _leave(local_dir, steps=(3, 4))
    old = _files(local_dir)
    seg3 = _records(local_dir)[3].buffer
    real = stage_mod._dst
    copied, stalled, go = [0], threading.Event(), threading.Event()

    def stall(buf, rec, t):  # after the first tensor of step 5 landed in step 3's old buffer
        if threading.current_thread().name.startswith("ckpt-stage"):
            copied[0] += 1
            if copied[0] == 2:
                stalled.set()
                go.wait(30)
        return real(buf, rec, t)

    monkeypatch.setattr(stage_mod, "_dst", stall)
    checks = _CountChecks(monkeypatch)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir, max_in_flight=2),
        policy=ckpt.Policy(persist_every={"local": 1000}),
    ) as ck:
        adopted = _take_over(ck)
        assert {s: b.checked for s, b in adopted.items()} == {3: False, 4: False}
        m3 = ck.memory.manifest_of(3)
        states[5] = W.state(5)
        try:
            h = ck.save(5, states[5])
            assert stalled.wait(10)
            assert _files(local_dir)[seg3] != old[seg3]  # the bytes are changing now ...
            assert sorted(_records(local_dir)) == [4]  # ... and step 3's record went first
            assert adopted[3].image_step is None and adopted[3].record is None
            # a restore of step 3 in this process: the tier no longer has it (never the mixed bytes)
            dest = [
                torch.zeros(i.nbytes, dtype=torch.uint8) if i.alias_of is None else None for i in m3.items
            ]
            with pytest.raises(LookupError):
                ck.memory.load(3, m3, dest)
            assert all(d is None or not bool(d.any()) for d in dest)
            # a reader that does not own local_dir (another process's view): not listed, not loadable
            reader = MemoryTier(HostPool(2, None), space_for(local_dir, 0))
            assert 3 not in [c.step for c in reader.committed()]
            with pytest.raises(LookupError):
                reader.load(3, m3, dest)
            with pytest.raises(LookupError):
                reader.verify(3)
            # a whole restore of step 3 meanwhile (a process that does not own local_dir): the local copy
            target = W.zeros()
            with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as other:
                assert other.restore(target, step=3) == 3 and other.last_restore.tier == "local"
            assert _exact(target, states[3])
        finally:
            go.set()
        h.wait()
        buf5 = next(b for b in ck.pool.buffers if b.image_step == 5)
        assert buf5 is adopted[3] and buf5.checked is True  # this process's own bytes now
        assert adopted[4].checked is False  # the other one still waits for its check
        target = W.zeros()
        assert (
            ck.restore(target, step=5) == 5 and ck.last_restore.tier == "memory" and _exact(target, states[5])
        )
        assert checks.n == 0  # its own snapshot: served without a check
        assert sorted(_records(local_dir)) == [4, 5]


def test_readers_racing_saves_that_reuse_adopted_buffers_get_whole_snapshots_or_lookup_error(
    local_dir, monkeypatch
):
    """A thread reads the adopted snapshots of steps 3 and 4 through the memory tier over and over while the
    training thread saves steps 5..10 into the same buffers: each read is the exact bytes of its step or
    ``LookupError``, never a mix; the buffers a save took are checked, the others keep their state."""
    states = _leave(local_dir, steps=(3, 4))
    real = memory_mod._scatter

    def slow_scatter(manifest, dest, data):  # a large snapshot: a save has time to come while it is read
        time.sleep(0.002)
        return real(manifest, dest, data)

    monkeypatch.setattr(memory_mod, "_scatter", slow_scatter)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
    ) as ck:
        _take_over(ck)
        manifests = {s: ck.memory.manifest_of(s) for s in (3, 4)}
        want = {
            s: torch.cat([states[s]["a"].view(torch.uint8), states[s]["b"].view(torch.uint8)]) for s in (3, 4)
        }
        stop, seen, bad = threading.Event(), {"exact": 0, "gone": 0}, []

        def read() -> None:
            while not stop.is_set():
                for s, m in manifests.items():
                    dest = [torch.empty(i.nbytes, dtype=torch.uint8) for i in m.items]
                    try:
                        ck.memory.load(s, m, dest)
                    except LookupError:
                        seen["gone"] += 1
                        continue
                    except BaseException as e:  # noqa: BLE001 - reported below
                        bad.append(repr(e))
                        return
                    if torch.equal(torch.cat(dest), want[s]):
                        seen["exact"] += 1
                    else:
                        bad.append(f"step {s}: mixed bytes")

        t = threading.Thread(target=read)
        t.start()
        try:
            for step in range(5, 11):
                ck.save(step, W.state(step)).wait()
                time.sleep(0.01)
        finally:
            stop.set()
            t.join(30)
        assert not t.is_alive() and bad == [] and seen["exact"] > 0 and seen["gone"] > 0, (seen, bad)
        # the newest is held, and checked (its own bytes); the other buffers hold earlier steps, or an adopted
        # snapshot a reader held while a save needed a buffer (a third buffer is made only when a save found the
        # reader holding the one it would reuse: a matter of timing)
        held = {b.image_step: b.checked for b in ck.pool.buffers}
        assert held.get(10) is True and len(held) == len(ck.pool.buffers) in (2, 3), held
        for step in held:
            target = W.zeros()
            assert ck.restore(target, step=step) == step and ck.last_restore.tier == "memory"
            assert _exact(target, W.state(step))
            assert held[step] or next(b for b in ck.pool.buffers if b.image_step == step).checked

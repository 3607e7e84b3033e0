"""The memory tier's buffer lifecycle: the newest committed snapshot is never lost, never waited for.

Invariants (docs/concepts.md, "The buffer lifecycle"):

1. the newest committed snapshot is never the target of a copy: it stays whole until a newer one is committed;
2. a buffer is free when no tier reads it and it does not hold the newest committed snapshot;
3. a snapshot that finds no free buffer is skipped at once (counted), never waited for by default;
4. a failure of the memory tier's own bookkeeping (record, segment name, ``/dev/shm`` full) costs that snapshot
   its crash survival only: the other tiers still get it;
5. ``close()`` hands the newest snapshot to every tier that lacks it, and no handle stays pending.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import stat
import subprocess
import threading
import time

import pytest
import torch

import ckpt
from ckpt import shm
from ckpt.errors import TornSnapshotError
from ckpt.tiers import LocalTier

pytestmark = pytest.mark.skipif(shm.shm_root() is None, reason="needs a RAM file system for the memory tier")


class GatedLocal(LocalTier):
    """A local tier whose writes wait until the test opens its gate (it holds a buffer as long as the test
    says), and fail while it is ``broken`` (a disk that is gone: nothing reaches it)."""

    def __init__(self, root, gate: threading.Event, **kw):
        super().__init__(root, **kw)
        self.gate = gate
        self.broken = False
        self.started = threading.Event()

    def write(self, step, manifest, data):
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"
        if self.broken:
            raise OSError(errno.EIO, "Input/output error", str(self.root))
        return super().write(step, manifest, data)


def _state(value: float = 0.0) -> dict:
    return {"w": torch.full((4096,), value), "meta": {"v": value}}


def _restored(local_dir, step=None) -> tuple[int | None, float, str | None]:
    """Restore in a new Checkpointer (as a new process on the node would): (step, value, tier)."""
    st = _state(-1.0)
    with ckpt.Checkpointer(local_dir=local_dir) as reader:
        got = reader.restore(st, step=step)
        tier = reader.last_restore.tier if reader.last_restore is not None else None
    return got, float(st["w"][0]), tier


# -- close() ------------------------------------------------------------------------------------------------


def test_close_writes_the_newest_snapshot_to_every_tier_whatever_the_cadence(tmp_path):
    """The README's loop: snapshots every 10 steps, the local tier every 50, the remote every 100, a `with`
    block. The newest snapshot the memory tier committed is on the local and remote tiers after the block,
    and no handle is left pending."""
    handles = []
    with ckpt.Checkpointer(
        f"file://{tmp_path}/remote",
        local_dir=tmp_path / "local",
        every_steps=10,
        persist_every={"local": 50, "remote": 100},
    ) as ck:
        for step in range(121):
            time.sleep(0.005)  # the training step
            st = _state(float(step))
            h = ck.maybe_save(step, st)
            if h is not None:
                handles.append(h)
                if step < 120:  # the copy lands within the next training step; the last one is closed at once
                    h.wait("memory")
    # the newest the memory tier committed (a snapshot is skipped while both tiers still write: three buffers)
    newest = [h for h in handles if h.status != "skipped"][-1]
    for h in handles:
        assert h.done(), f"step {h.step}'s handle is still pending after close()"
        h.wait(timeout=0)
    assert newest.tier_status("local") == "done" and newest.tier_status("remote") == "done"
    assert LocalTier(tmp_path / "local").committed_steps()[0] == newest.step
    with ckpt.Checkpointer(f"file://{tmp_path}/remote", local_dir=tmp_path / "fresh") as reader:
        st = _state(-1.0)
        assert reader.restore(st) == newest.step and reader.last_restore.tier == "remote"
        assert float(st["w"][0]) == float(newest.step)


def test_close_writes_a_snapshot_still_being_copied(tmp_path, slow_staging):
    """close() right after a save whose copy has not landed yet: the copy lands, is committed, and reaches the
    local tier although its cadence skipped it."""
    ck = ckpt.Checkpointer(local_dir=tmp_path, persist_every={"local": 1000})
    first = ck.save(1, _state(1.0))
    first.wait()
    h = ck.save(2, _state(2.0))
    assert h.tier_status("local") == "skipped"  # not due by its cadence
    ck.close()
    assert h.done() and h.tier_status("local") == "done"
    assert LocalTier(tmp_path).committed_steps()[0] == 2
    assert _restored(tmp_path)[:2] == (2, 2.0)


def test_close_after_a_failed_save_writes_the_newest_committed_one(tmp_path, slow_staging):
    """The run's last save fails (a torn snapshot): close() makes the snapshot before it durable, and the
    failed one's handle ends with its error."""
    ck = ckpt.Checkpointer(local_dir=tmp_path, persist_every={"local": 1000})
    ck.save(1, _state(1.0)).wait()
    ok = ck.save(2, _state(2.0))
    ok.wait("memory")
    st = _state(3.0)
    bad = ck.save(3, st)
    st["w"].data.add_(1)  # in place, before the (slow) copy is done: step 3's snapshot is torn
    with pytest.raises(TornSnapshotError):
        ck.close()
    assert bad.status == "failed" and ok.done() and ok.tier_status("local") == "done"
    assert LocalTier(tmp_path).committed_steps()[0] == 2


# -- the newest committed snapshot keeps its buffer ---------------------------------------------------------


def test_a_failed_snapshot_never_costs_the_newest_committed_one(tmp_path, slow_staging):
    """Two buffers; the local tier holds one (a slow write of step 1); step 2 is committed in the other. Step 3
    finds no free buffer: it is skipped, not copied over step 2. Had it been copied there and then failed
    (torn), step 2 would be on no tier although its handle said "done"."""
    gate = threading.Event()
    local = GatedLocal(tmp_path / "local", gate)
    ck = ckpt.Checkpointer(local_dir=local, max_in_flight=2)
    try:
        ck.save(1, _state(1.0)).wait("memory")
        assert local.started.wait(10)  # the local tier reads step 1's buffer, and holds it
        ck.save(2, _state(2.0)).wait("memory")  # committed in the second buffer: the newest
        st = _state(3.0)
        h3 = ck.save(3, st)
        st["w"].data.add_(1)  # would tear step 3's snapshot, had it been taken
        assert h3.status == "skipped" and h3.skip_reason == "busy"
        assert {c.step for c in ck.memory.committed()} >= {2}
        got = _restored(tmp_path / "local")  # a new process on the node, the local tier still empty
        assert got == (2, 2.0, "memory")
    finally:
        gate.set()
        ck.close(raise_errors=False)


def test_a_single_buffer_is_taken_for_the_next_snapshot_once_no_tier_reads_it(tmp_path):
    """Room for one buffer (max_in_flight=1): a snapshot is skipped while the local tier reads the previous
    one; once it is done, the next snapshot takes the buffer (the newest can only be kept whole with two)."""
    gate = threading.Event()
    local = GatedLocal(tmp_path / "local", gate)
    ck = ckpt.Checkpointer(local_dir=local, max_in_flight=1)
    try:
        ck.save(1, _state(1.0)).wait("memory")
        assert local.started.wait(10)
        h2 = ck.save(2, _state(2.0))
        assert (h2.status, h2.skip_reason) == ("skipped", "busy")  # the only buffer is read by the local tier
        gate.set()
        ck.wait("local")
        h = ck.save(3, _state(3.0))
        h.wait()
        assert h.status == "done"
        assert "one buffer" in ck.tier_figures()["memory"].gives_up
    finally:
        gate.set()
        ck.close()
    assert _restored(tmp_path / "local")[:2] == (3, 3.0)


def test_a_single_buffer_whose_snapshot_no_tier_wants_never_blocks_a_waiting_save(tmp_path):
    """One buffer, if_busy="wait", the local tier every 4 snapshots: a snapshot not due anywhere gives its
    buffer to the next save (which would otherwise wait for a tier that never comes)."""
    with ckpt.Checkpointer(
        local_dir=tmp_path,
        max_in_flight=1,
        if_busy="wait",
        every_steps=2,
        persist_every={"local": 4},
        keep=ckpt.Retention(local=1),
    ) as ck:
        done = threading.Event()

        def loop():
            for s in range(1, 9):
                ck.maybe_save(s, _state(float(s)))
            ck.wait()
            done.set()

        threading.Thread(target=loop, daemon=True).start()
        assert done.wait(60), "a save waited for a buffer no tier would let go of"
    assert LocalTier(tmp_path).committed_steps() == [8]


def test_snapshots_every_step_are_taken_while_a_slow_tier_writes(tmp_path):
    """Three buffers, the default: while the local tier is busy with one snapshot, every step is still
    snapshotted (the newest kept whole in a second buffer, the next copied into the third), and the local tier
    writes the newest one each time it is free (newest wins, every superseded one counted)."""
    gate = threading.Event()
    local = GatedLocal(tmp_path / "local", gate)
    ck = ckpt.Checkpointer(local_dir=local, every_steps=1)
    taken = []
    try:
        for step in range(40):
            if step == 30:
                gate.set()  # the disk catches up
            h = ck.maybe_save(step, _state(float(step)))
            if h is not None:
                h.wait("memory")
                taken.append(h)
        ck.wait()
    finally:
        gate.set()
        ck.close()
    committed = [h for h in taken if h.status != "skipped"]
    skips = [(h.step, h.skip_reason) for h in taken if h.status == "skipped"]
    # while the slow tier holds its buffer, it costs no snapshot: a step is skipped only while the buffers are
    # still being allocated in the background (on a loaded machine that low-priority thread may take longer
    # than the loop's 50 ms grace). Once the disk catches up (step 30) a loaded 2-core machine has skipped
    # steps as "busy" (issue 34 note): not asserted away here, only bounded
    assert {why for step, why in skips if step < 30} <= {"allocating"}, skips
    assert all(h.skip_reason is None for h in committed)
    assert len(committed) >= 30, skips
    counts = ck.tier_counts["local"]
    assert counts.persisted >= 2 and counts.superseded >= 10
    assert counts.persisted + counts.superseded + counts.busy + counts.not_due + counts.failed == len(
        committed
    )
    assert LocalTier(tmp_path / "local").committed_steps()[0] == 39
    fig = ck.tier_figures()["memory"]
    assert fig.buffers == 3 and fig.snapshots_skipped == len(taken) - len(committed)


def test_a_skip_costs_the_loop_no_waiting(tmp_path):
    """No free buffer: maybe_save() returns at once (no busy wait by default), skipping the snapshot."""
    gate = threading.Event()
    local = GatedLocal(tmp_path / "local", gate)
    ck = ckpt.Checkpointer(local_dir=local, every_steps=1, max_in_flight=1)
    try:
        ck.save(0, _state(0.0)).wait("memory")
        assert local.started.wait(10)
        t0 = time.perf_counter()
        h = ck.maybe_save(1, _state(1.0))
        took = time.perf_counter() - t0
        assert h is not None and (h.status, h.skip_reason) == ("skipped", "busy")
        assert took < 0.5, f"a skipped snapshot held the loop {took:.3f} s"
        assert ck.skipped == 1
    finally:
        gate.set()
        ck.close()


# -- the memory tier's failures are its own ----------------------------------------------------------------


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A RAM file system of 16 MiB of its own as the memory tier's (mounted where the test may; else skipped)."""
    root = tmp_path / "shm"
    root.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)], capture_output=True
    ).returncode:
        pytest.skip(
            "cannot mount a tmpfs here (needs root); test_a_record_that_cannot_be_written_... covers it"
        )
    monkeypatch.setenv("CKPT_SHM_DIR", str(root))
    yield root
    subprocess.run(["umount", "-l", str(root)], capture_output=True)


def _fill(root) -> None:
    """Take every byte left in ``root`` (a MiB at a time, then a page, then a byte)."""
    fd = os.open(root / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_full_ram_file_system_costs_only_crash_survival(tmp_path, small_shm, caplog):
    """/dev/shm fills up after the buffers were allocated (data loader workers, NCCL): each snapshot's record
    cannot be written. The snapshots still reach the local tier, restore in this process from memory, and the
    loss is said once; once there is room again, records are written again."""
    ck = ckpt.Checkpointer(local_dir=tmp_path / "local", every_steps=1)
    try:
        for step in range(3):
            h = ck.maybe_save(step, _state(float(step)))
            if h is not None:
                h.wait()
        assert len(ck.pool.buffers) == 3 and all(b.segment is not None for b in ck.pool.buffers)
        _fill(small_shm)
        with caplog.at_level(logging.INFO, logger="ckpt"):
            for step in range(3, 8):
                st = _state(float(step))
                st["meta"]["note"] = "x" * 65536  # a longer record than the one withdrawn makes room for
                ck.save(step, st).wait()  # raises if any tier failed
        assert ck.memory.records_failed == 5
        assert ck.tier_figures()["memory"].records_failed == 5
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "ckpt.tiers.memory"]
        assert len(warned) == 1
        assert 7 in LocalTier(tmp_path / "local").committed_steps()
        st = _state(-1.0)
        assert ck.restore(st) == 7 and ck.last_restore.tier == "memory" and float(st["w"][0]) == 7.0
        os.unlink(small_shm / "filler")
        ck.save(8, _state(8.0)).wait()
    finally:
        ck.close(keep_memory=True)
    assert 8 in {r.step for g in shm.segments(small_shm) for r in g.records}


def test_a_record_that_cannot_be_written_costs_only_crash_survival(tmp_path, monkeypatch):
    """The same on any machine: the record's write fails (ENOSPC) for two snapshots; the local tier gets them."""
    real = shm.write_record
    fail = {"n": 2}

    def write_record(*args, **kw):
        if fail["n"]:
            fail["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", "/dev/shm/x.rec")
        return real(*args, **kw)

    monkeypatch.setattr(shm, "write_record", write_record)
    with ckpt.Checkpointer(local_dir=tmp_path, keep=ckpt.Retention(local=None)) as ck:
        for step in range(3):
            ck.save(step, _state(float(step))).wait()
        assert ck.memory.records_failed == 2
    assert LocalTier(tmp_path).committed_steps()[:3] == [2, 1, 0]


def _foreign(path, kind: str) -> None:
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink("/etc/hostname", path)
    elif kind == "other user's file":
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        os.chown(path, 65534, 65534)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink", "other user's file"])
def test_foreign_entries_at_the_segment_names_cost_only_crash_survival(tmp_path, kind, caplog):
    """Entries at every name of the memory tier's segments and records that the job cannot use: every save
    still reaches the local tier, none raises or blocks, and nothing is ever written through them (a
    directory stays; a non-directory entry is replaced by a segment or record renamed over it, never
    followed, opened or mapped)."""
    if kind == "other user's file" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    with open("/etc/hostname", "rb") as f:
        hostname = f.read()
    ck = ckpt.Checkpointer(local_dir=tmp_path / "local", every_steps=1)
    ck._node.own()  # what the first save does: the space of the segments is made by the owner of local_dir
    root, prefix = ck.memory.space.root, ck.memory.space.prefix
    made = []
    for slot in range(3):
        for name in (shm.buffer_name(prefix, slot), shm.record_name(prefix, slot)):
            _foreign(root / name, kind)
            made.append(root / name)
    try:
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            for step in range(6):
                h = ck.maybe_save(step, _state(float(step)))
                if h is not None and h.status != "skipped":
                    h.wait(timeout=30)
            ck.save(6, _state(6.0)).wait(timeout=30)
        assert LocalTier(tmp_path / "local").committed_steps()[0] == 6
        assert any(r.name.startswith("ckpt.") for r in caplog.records)
        st = _state(-1.0)
        assert ck.restore(st) == 6 and float(st["w"][0]) == 6.0
    finally:
        ck.close()
    with open("/etc/hostname", "rb") as f:
        assert f.read() == hostname  # never written through the links
    for p in made:
        if kind == "directory":
            assert stat.S_ISDIR(os.lstat(p).st_mode)
            p.rmdir()


def test_an_allocation_that_fails_leaks_nothing(tmp_path, monkeypatch):
    """Any exception while a buffer is allocated (not only a memory limit): the save raises it, and the next
    save finds the pool as before (no allocation counted as under way forever, which made saves block)."""
    from ckpt.pool import HostPool

    real = HostPool._allocate
    fail = {"n": 2}

    def allocate(self, *args, **kw):
        if fail["n"]:
            fail["n"] -= 1
            raise OSError(errno.EPERM, "Operation not permitted")
        return real(self, *args, **kw)

    monkeypatch.setattr(HostPool, "_allocate", allocate)
    with ckpt.Checkpointer(local_dir=tmp_path) as ck:
        for step in range(2):
            with pytest.raises(OSError):
                ck.save(step, _state(float(step)))
            assert ck.pool._allocating == 0
        done = threading.Event()
        threading.Thread(target=lambda: (ck.save(2, _state(2.0)).wait(), done.set()), daemon=True).start()
        assert done.wait(30), "a save blocked after failed allocations"


# -- a property test of the lifecycle ----------------------------------------------------------------------


@pytest.fixture
def slowish_staging(monkeypatch):
    """CPU staging copies that take 10 ms each: a write right after save() lands before the copy."""
    from helpers import delay_staging

    delay_staging(monkeypatch, 0.01)


@pytest.mark.parametrize("seed", range(8))
def test_random_saves_failures_slow_tiers_and_crashes_never_lose_the_newest_committed(
    tmp_path, seed, slowish_staging
):
    """Random sequences of saves, torn saves, a local tier that stalls, resumes or fails, and crashes of the
    process (its memory tier kept, its disk writes lost from the crash on): after each crash, the newest
    snapshot committed to the memory tier (or a newer one) is restored, bit-exact; every handle ends."""
    rng = random.Random(seed)
    gate = threading.Event()
    values: dict[int, float] = {}  # step -> value, of every snapshot committed to the memory tier
    newest = None
    step = 0
    handles = []
    for life in range(4):
        gate.set()
        local = GatedLocal(tmp_path / "local", gate)
        # (with one buffer the newest cannot be kept whole while the next is copied: two at least)
        ck = ckpt.Checkpointer(local_dir=local, max_in_flight=rng.choice([2, 3]))
        if life:
            st = _state(-1.0)
            got = ck.restore(st)
            assert got is not None and got >= newest, (got, newest)
            assert float(st["w"][0]) == values[got]
        for _ in range(rng.randint(6, 14)):
            step += 1
            op = rng.random()
            if op < 0.25:
                gate.clear()  # the local tier stalls (and holds its buffer)
            elif op < 0.4:
                gate.set()
            elif op < 0.5:
                local.broken = not local.broken
            st = _state(float(step))
            h = ck.save(step, st)
            handles.append(h)
            if rng.random() < 0.35 and h.status != "skipped":
                st["w"].data.add_(0.5)  # in place before the slow copy: torn
            try:
                h.wait("memory", timeout=30)
            except TornSnapshotError:
                continue
            if h.status != "skipped":
                values[step] = float(step)
                newest = step
        local.broken = True  # the crash: no disk write from here on
        gate.set()
        ck.close(raise_errors=False, keep_memory=True)  # its RAM stays for the next process
    for h in handles:
        assert h.done()
    got, value, _ = _restored(tmp_path / "local")
    assert got is not None and got >= newest and value == values[got]


def _read_until(proc, prefix: str, timeout: float) -> list[str]:
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line.strip())
        if line.startswith(prefix):
            return out
    raise AssertionError(f"no {prefix!r} line from the worker: {out[-5:]}")


@pytest.mark.parametrize("buffers", [2, 3])
def test_sigkill_mid_copy_or_at_random_never_loses_the_newest_committed_snapshot(tmp_path, buffers):
    """A real process snapshots every step (its local tier slow, holding a buffer) and is SIGKILLed, in the
    middle of a snapshot's copy or at a random moment; each new process restores at least the newest step the
    killed one had committed to the memory tier, with its values (and never a torn one)."""
    import select
    import signal
    import sys

    rng = random.Random(buffers)
    worker = os.path.join(os.path.dirname(__file__), "lifecycle_worker.py")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
    }
    committed = None
    for mid_copy in (True, False, True):
        stall_at = rng.randint(3, 8) if mid_copy else -1
        proc = subprocess.Popen(
            [sys.executable, worker, str(tmp_path / "local"), str(buffers), str(stall_at)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            restored = _read_until(proc, "restored", 120)[-1].split()
            got = None if restored[1] == "None" else int(restored[1])
            if committed is not None:
                assert got is not None and got >= committed, (got, committed)
                assert float(restored[2]) == float(got)
            if mid_copy:
                lines = _read_until(proc, "copying", 120)
            else:
                lines, deadline = [], time.monotonic() + rng.uniform(0.3, 1.0)
                while time.monotonic() < deadline:
                    if select.select([proc.stdout], [], [], 0.05)[0]:
                        lines.append(proc.stdout.readline())
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            lines += list(proc.stdout)  # what it had printed before the kill
            steps = [int(line.split()[1]) for line in lines if line.startswith("committed")]
            committed = max(steps, default=committed)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    st = {"a": torch.zeros(1 << 18), "b": torch.zeros(1 << 18)}
    with ckpt.Checkpointer(local_dir=tmp_path / "local") as reader:
        got = reader.restore(st)
    assert got is not None and got >= committed
    assert torch.equal(st["a"], torch.full_like(st["a"], float(got))) and torch.equal(st["a"], st["b"])


# -- records in the background (rule 6): committed in the process at once, crash survival one checksum behind --


def _recorded_steps(local_dir) -> set[int]:
    return {r.step for g in shm.segments(prefix=shm.prefix_for(local_dir, 0)) for r in g.records}


def _committed(ck, timeout: float = 30.0) -> None:
    """Until the snapshot being copied has landed and been committed (its buffer no longer staging)."""
    deadline = time.monotonic() + timeout
    while any(b.staging for b in ck.pool.buffers):
        assert time.monotonic() < deadline, "a snapshot copy never landed"
        time.sleep(0.002)


def test_every_snapshot_is_committed_while_records_follow_and_a_waited_one_is_recorded(tmp_path, monkeypatch):
    """A loop that never waits: every snapshot is committed in the process (a buffer is never held for its
    checksums); each handle's memory tier ends recorded or superseded, saying which; a snapshot someone waits
    for is recorded at once even while a slow tier holds a buffer (the record thread would otherwise wait for
    the tier: far longer than this test allows)."""
    from ckpt.tiers import memory

    monkeypatch.setattr(memory, "RECORD_PATIENCE_S", 600.0)
    gate = threading.Event()
    local = GatedLocal(tmp_path / "local", gate)
    ck = ckpt.Checkpointer(local_dir=local, every_steps=1)
    try:
        handles = []
        for step in range(30):
            handles.append(ck.maybe_save(step, _state(float(step))))
            _committed(ck)  # a training step's time: only a record could hold a buffer now
        handles[-1].wait(
            "memory", timeout=60
        )  # the local tier still holds step 0's buffer: urged, not patient
        assert 29 in _recorded_steps(local.root)
        ends = [h for h in handles if h is not None and h.status != "skipped"]
        # a record never holds up a copy: a step is skipped only while the buffers are still being allocated
        assert {h.skip_reason for h in handles if h is not None and h.status == "skipped"} <= {"allocating"}
        assert len(ends) >= 20
        for h in ends:
            h.wait("memory", timeout=60)
            assert h.tier_status("memory") in ("done", "skipped")
            if h.tier_status("memory") == "skipped":  # in this process only: says why
                assert "before its record was written" in h.skipped_tiers["memory"]
        fig = ck.tier_figures()["memory"]
        assert fig.records_written >= 1
        assert fig.records_written + fig.records_superseded >= len(ends) - 1
    finally:
        gate.set()
        ck.close()


def _slow_records(monkeypatch, per_chunk_s: float) -> None:
    """Record passes of many small chunks, each checksummed slowly: a pass outlasts several snapshots."""
    real = shm.checksum

    def slow(data, value=0):
        time.sleep(per_chunk_s)
        return real(data, value)

    monkeypatch.setattr(shm, "checksum", slow)


def test_a_record_pass_gives_its_buffer_up_to_a_new_snapshot_and_publishes_nothing(tmp_path, monkeypatch):
    """Snapshots come faster than their records (a record pass takes ~0.5 s, a step a few ms), while the local
    tier holds one of the three buffers: the pass over a snapshot a newer one replaced gives its buffer up to
    the next snapshot (no step skipped for it), stops, and publishes no record of the bytes being overwritten;
    each handle's memory tier says what happened; the records that end in time make the newest outlive the
    process, and close() records the newest. (A patience long enough for a loaded machine: passes always give
    way here; the next test covers the patience.)"""
    from ckpt.tiers import memory

    monkeypatch.setattr(memory, "RECORD_PATIENCE_S", 600.0)
    _slow_records(monkeypatch, 0.03)
    gate = threading.Event()
    local = GatedLocal(tmp_path / "local", gate)
    with ckpt.knobs.override(CKPT_CHUNK_BYTES=4096, CKPT_PERSIST_THREADS=2):
        ck = ckpt.Checkpointer(local_dir=local, every_steps=1)
        handles = []
        seen: set[int] = set()
        try:
            for step in range(60):
                handles.append(ck.maybe_save(step, _state(float(step))))
                _committed(ck)
                time.sleep(0.01)
                seen |= _recorded_steps(local.root)
        finally:
            gate.set()
            ck.close(keep_memory=True)
    skips = [(h.step, h.skip_reason) for h in handles if h is not None and h.status == "skipped"]
    assert {why for _, why in skips} <= {"allocating"}, skips
    ends = [h for h in handles if h is not None and h.status != "skipped"]
    assert len(ends) >= 50
    gave_up = [
        h
        for h in ends
        if h.tier_status("memory") == "skipped"
        and "its buffer was taken for step" in h.skipped_tiers["memory"]
    ]
    assert gave_up, "no record pass gave its buffer up"
    # a record is published only for bytes that are still the snapshot: every record seen named a step whose
    # snapshot was then in that slot (a reader checks the chunks; here nothing published may fail them)
    assert all(h.tier_status("memory") in ("done", "skipped") for h in ends)
    assert _recorded_steps(local.root) and max(_recorded_steps(local.root)) == ends[-1].step
    assert _restored(local.root)[:3] == (ends[-1].step, float(ends[-1].step), "memory")


def test_a_record_pass_keeps_its_buffer_once_no_record_was_written_for_a_while(tmp_path, monkeypatch):
    """Two buffers, snapshots so frequent that no record pass ends before its buffer is wanted again: each
    pass gives way while a record is recent, and once none was written for the record patience the pass in
    progress keeps its buffer (a snapshot is skipped for it, said as busy), so that the RAM holds a snapshot
    that outlives the process at least that often."""
    from ckpt.tiers import memory

    monkeypatch.setattr(memory, "RECORD_PATIENCE_S", 0.3)
    _slow_records(monkeypatch, 0.05)
    run = tmp_path / "run"
    with ckpt.knobs.override(CKPT_CHUNK_BYTES=4096, CKPT_PERSIST_THREADS=1):
        ck = ckpt.Checkpointer(local_dir=run, every_steps=1, max_in_flight=2, persist_every={"local": 10**6})
        handles = []
        recorded_during: set[int] = set()
        try:
            deadline = time.monotonic() + 20
            step = 0
            while time.monotonic() < deadline and not recorded_during:
                handles.append(ck.maybe_save(step, _state(float(step))))
                _committed(ck)
                recorded_during |= _recorded_steps(run)
                step += 1
        finally:
            ck.close()
    assert recorded_during, "no record was written while snapshots came faster than a record pass"
    taken = [h for h in handles if h is not None and h.status != "skipped"]
    assert any("its buffer was taken for step" in h.skipped_tiers.get("memory", "") for h in taken)
    assert any(h is not None and h.skip_reason == "busy" for h in handles)


def test_a_record_thread_that_stopped_does_not_cost_the_newest_its_record_at_close(tmp_path, monkeypatch):
    """The thread that writes the records dies (an error it did not expect) with the newest snapshot still
    waiting for its record: a close that keeps the RAM writes that record all the same."""
    from ckpt.tiers import memory

    real = memory.MemoryTier._record_passes
    calls = []

    def dies_first(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the record thread's first run fails")
        return real(self)

    monkeypatch.setattr(memory.MemoryTier, "_record_passes", dies_first)
    run = tmp_path / "run"
    ck = ckpt.Checkpointer(local_dir=run, persist_every={"local": 1000})
    h = ck.save(1, _state(1.0))
    _committed(ck)
    deadline = time.monotonic() + 30
    while ck.memory._recorder is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread has stopped, the record not written
    assert calls and 1 not in _recorded_steps(run) and h.tier_status("memory") == "pending"
    ck.close(keep_memory=True)
    assert _recorded_steps(run) == {1} and h.tier_status("memory") == "done"
    assert _restored(run)[:3] == (1, 1.0, "memory")


def test_a_snapshot_whose_watcher_wakes_first_is_still_committed_after_the_older_one(tmp_path, monkeypatch):
    """Each snapshot's copy has a watcher thread that commits it to the memory tier. The older snapshot's
    watcher wakes last (a loaded machine): the newer step must still be the newest committed (kept whole,
    recorded, restored), never superseded by the older one committing after it."""
    from ckpt import stage

    real = stage.Snapshot.wait_copied

    def older_wakes_late(self):
        real(self)
        if self.step == 1:
            time.sleep(0.5)  # step 2's copy lands and its watcher asks to commit meanwhile

    monkeypatch.setattr(stage.Snapshot, "wait_copied", older_wakes_late)
    run = tmp_path / "run"
    ck = ckpt.Checkpointer(local_dir=run, every_steps=1, persist_every={"local": 1000}, if_busy="wait")
    h1 = ck.maybe_save(1, _state(1.0))
    h2 = ck.maybe_save(2, _state(2.0))
    h2.wait("memory", timeout=60)
    h1.wait("memory", timeout=60)  # committed (and recorded or superseded) after step 2's watcher asked
    assert h2.tier_status("memory") == "done", h2.skipped_tiers
    with ck.pool._cv:
        newest = max((b for b in ck.pool.buffers if b.image_step is not None), key=ck.pool._rank)
    assert newest.image_step == 2
    ck.close(keep_memory=True)
    assert max(_recorded_steps(run)) == 2
    assert _restored(run)[:3] == (2, 2.0, "memory")


def test_a_block_that_raises_leaves_the_newest_snapshot_recorded_and_close_leaves_no_record(tmp_path):
    """The newest snapshot outlives a block that raised (its record is written before the block's exit
    returns, however fast the saves came); a plain close frees the RAM and writes no record after it."""
    run = tmp_path / "run"
    handles = []
    with pytest.raises(RuntimeError):
        with ckpt.Checkpointer(local_dir=run, every_steps=1, persist_every={"local": 1000}) as ck:
            for step in range(1, 25):
                handles.append(ck.maybe_save(step, _state(float(step))))
            raise RuntimeError("the loop failed")
    newest = max(h.step for h in handles if h.status != "skipped")  # a save finding no free buffer is skipped
    fig = ck.tier_figures()["memory"]
    assert max(_recorded_steps(run)) == newest, (
        sorted(_recorded_steps(run)),
        [
            (h.step, h.status, h.tier_status("memory"), h.errors, h.skipped_tiers)
            for h in handles
            if h.status != "skipped"
        ],
        fig.records_written,
        fig.records_superseded,
        ck.memory.records_failed,
    )
    assert _restored(run)[:2] == (newest, float(newest))
    ck2 = ckpt.Checkpointer(local_dir=run, every_steps=1)
    ck2.restore(_state())
    for step in range(25, 40):
        ck2.maybe_save(step, _state(float(step)))
    ck2.close()
    time.sleep(0.2)  # a record thread that outlived close() would write now
    assert shm.segments(prefix=shm.prefix_for(run, 0)) == []

"""close() gives the host staging memory back; errors are raised once; HostMemoryError tells the truth.

Whether the staging buffer is freed is checked on its storage itself (a weak reference to the
storage expires when the last tensor, view or numpy array over it goes), not through process
memory figures. Failing tiers are subclasses of the real ones.
"""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import ckpt
from ckpt import shm
from ckpt.pool import HostPool, SharedSpace
from ckpt.tiers import LocalTier, RemoteTier

MiB = 1 << 20


def storage_of(ck: ckpt.Checkpointer) -> list[StorageWeakRef]:
    return [StorageWeakRef(b.tensor.untyped_storage()) for b in ck.pool.buffers]


class SlowLocal(LocalTier):
    """Writes only once ``go`` is set."""

    def __init__(self, root, go: threading.Event, entered: threading.Event):
        super().__init__(root)
        self.go, self.entered = go, entered

    def write(self, step, manifest, data):
        self.entered.set()
        assert self.go.wait(60)
        return super().write(step, manifest, data)


class FullLocal(LocalTier):
    """A disk that is full: fails after having looked at the data (a local holds a view of it)."""

    def write(self, step, manifest, data):
        head = data[:16]  # noqa: F841 - a live view of the host buffer in this frame
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(self.root))


class FailingRemote(RemoteTier):
    def write(self, step, manifest, data, *args, **kwargs):
        head = data[:16]  # noqa: F841
        raise OSError(errno.EIO, "upload failed (injected)", self.url)


# -- freeing the staging memory --------------------------------------------------------------------


def test_close_frees_the_host_buffer(local_dir):
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    ck.save(1, {"w": torch.randn(100_000)}).wait()
    refs = storage_of(ck)
    assert refs and not any(r.expired() for r in refs)  # the memory tier keeps it between saves
    ck.close()
    assert ck.pool.buffers == [] and ck.pool.nbytes == 0
    assert all(r.expired() for r in refs), "close() left the staging buffer allocated"


def test_a_buffer_still_persisting_at_close_is_freed_when_its_persist_ends(tmp_path):
    go, entered = threading.Event(), threading.Event()
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=SlowLocal(tmp_path / "l", go, entered)))
    ck.save(1, {"w": torch.randn(100_000)})
    assert entered.wait(60)
    refs = storage_of(ck)
    closer = threading.Thread(target=ck.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not any(r.expired() for r in refs)  # still being written: kept
    go.set()
    closer.join(60)
    assert not closer.is_alive()
    assert all(r.expired() for r in refs)
    assert LocalTier(tmp_path / "l").committed_steps() == [1]


def test_the_pool_frees_a_busy_buffer_when_it_is_released_after_close():
    pool = HostPool(2, None, pin=False)
    a = pool.acquire(1000, block=True, step=1)
    b = pool.acquire(1000, block=True, step=2)
    pool.release(b)
    ra, rb = StorageWeakRef(a.tensor.untyped_storage()), StorageWeakRef(b.tensor.untyped_storage())
    pool.close()
    assert rb.expired() and not ra.expired()
    pool.release(a)
    assert ra.expired() and pool.buffers == []
    with pytest.raises(ckpt.CheckpointError, match="closed"):
        pool.acquire(1000, block=True, step=3)


def test_a_failed_save_does_not_keep_the_buffer_alive_after_close(tmp_path):
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=FullLocal(tmp_path / "l")))
    h = ck.save(1, {"w": torch.randn(100_000)})
    with pytest.raises(OSError) as info:
        h.wait()
    assert info.value.errno == errno.ENOSPC
    refs = storage_of(ck)
    ck.close()
    # the user still holds the handle and its error (with its traceback): neither may pin the buffer
    assert h.errors and all(r.expired() for r in refs)


def test_a_closed_checkpointer_is_safe_to_drop(local_dir):
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    ck.save(1, {"w": torch.randn(1000)}).wait()
    workers = [lane.thread for lane in ck._pipeline.lanes.values()]
    ck.close()
    ref = weakref.ref(ck)
    del ck
    gc.collect()
    assert ref() is None
    assert not any(
        w.is_alive() for w in workers
    )  # this checkpointer's threads (other tests' may still be finishing)


# -- errors raised once ----------------------------------------------------------------------------


def test_an_error_raised_by_handle_wait_is_not_raised_again_at_the_end_of_the_with_block(tmp_path):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=FullLocal(tmp_path / "l"))) as ck:
        h = ck.save(1, {"w": torch.randn(1000)})
        with pytest.raises(OSError):
            h.wait()
    # no exception at the end of the block


def test_wait_reports_every_failed_save_but_close_does_not_repeat_it(tmp_path):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=FullLocal(tmp_path / "l"))) as ck:
        h = ck.save(1, {"w": torch.randn(1000)})
        with pytest.raises(OSError):
            h.wait()
        with pytest.raises(OSError):
            ck.wait()  # "did every save so far succeed?": no


def test_an_error_nobody_saw_is_raised_at_close(tmp_path):
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=FullLocal(tmp_path / "l")))
    h = ck.save(1, {"w": torch.randn(1000)})
    while not h.done():
        h._all.wait(1)
    with pytest.raises(OSError) as info:
        ck.close()
    assert info.value.errno == errno.ENOSPC


def test_an_error_the_library_waited_on_internally_is_still_raised_at_close(tmp_path):
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=FullLocal(tmp_path / "l")))
    ck.save(1, {"w": torch.randn(1000)})
    ck.restore({"w": torch.empty(1000)})  # waits for the save internally, without raising its error
    with pytest.raises(OSError):
        ck.close()


def test_seeing_one_tier_fail_does_not_hide_another_tiers_failure(tmp_path):
    remote = FailingRemote(f"file://{tmp_path}/r")
    ck = ckpt.Checkpointer(storage=ckpt.Storage(url=remote, local_dir=FullLocal(tmp_path / "l")))
    h = ck.save(1, {"w": torch.randn(1000)})
    with pytest.raises(OSError) as seen:
        h.wait("local")
    assert seen.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as info:
        ck.close()
    assert info.value.errno == errno.EIO  # the remote failure was never shown


# -- HostMemoryError -------------------------------------------------------------------------------


def _state(nbytes: int) -> dict:
    return {"w": torch.zeros(nbytes // 4)}


def test_host_memory_error_after_the_state_grew_reports_what_is_allocated(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir, host_memory_limit=3 * MiB)) as ck:
        ck.save(1, _state(MiB)).wait()
        assert ck.pool.nbytes == 2 * MiB
        with pytest.raises(ckpt.HostMemoryError) as info:
            ck.save(2, _state(4 * MiB))
        e = info.value
        assert (e.needed, e.allocated, e.limit) == (4 * MiB, 2 * MiB, 3 * MiB)
        msg = str(e)
        assert "4.0 MiB" in msg and "2.0 MiB" in msg and "3.0 MiB" in msg and "host_memory_limit" in msg
        assert "0.0 MiB" not in msg
        # the refused save changed nothing: the memory tier still holds step 1, its buffer is reused
        assert [(i.step, i.tiers[0]) for i in ck.list()] == [(1, "memory")]
        ck.save(3, _state(MiB)).wait()
        assert ck.pool.allocations == 1


def test_host_memory_error_counts_every_buffer(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir, host_memory_limit=5 * MiB, max_in_flight=2)
    ) as ck:
        go = [ck.save(s, _state(MiB)) for s in (1, 2)]  # two buffers of 2 MiB (one may still be busy)
        for h in go:
            h.wait()
        assert ck.pool.nbytes == 4 * MiB
        with pytest.raises(ckpt.HostMemoryError) as info:
            ck.save(3, _state(4 * MiB))
        assert (info.value.needed, info.value.allocated, info.value.limit) == (4 * MiB, 4 * MiB, 5 * MiB)


def test_a_grown_state_frees_the_smaller_buffer_before_allocating_the_new_one(local_dir, monkeypatch):
    from ckpt import pool as pool_mod

    seen = []
    real = pool_mod.HostBuffer

    class Spy(real):
        def __init__(self, nbytes, pin, **kwargs):
            seen.append([r.expired() for r in old])
            super().__init__(nbytes, pin, **kwargs)

    # one buffer: with two, the newest snapshot's buffer stays whole while the grown state takes the other
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir, max_in_flight=1)) as ck:
        ck.save(1, _state(MiB)).wait()
        old = storage_of(ck)
        monkeypatch.setattr(pool_mod, "HostBuffer", Spy)
        ck.save(2, _state(8 * MiB)).wait()
    assert seen == [[True]], "the old buffer was still allocated while the bigger one was allocated"


# -- the background allocation ---------------------------------------------------------------------


@pytest.mark.parametrize("keep_shared", [False, True])
def test_close_stops_the_background_allocation_between_two_pieces(tmp_path, monkeypatch, keep_shared):
    """close() stops prepare()'s paced allocation where it stands and waits for its thread: nothing of the
    pool runs after close() returns (a daemon thread inside torch at interpreter exit aborts the process),
    and no segment, whole or half-made, appears in the RAM directory after it."""
    monkeypatch.setattr(shm, "REGISTER_PIECE", 64 << 10)
    monkeypatch.setattr(shm, "REGISTER_GAP_S", 0.05)  # 128 pieces of 8 MiB: 6.4 s unstopped
    reserved, started = [], threading.Event()
    fallocate = os.posix_fallocate

    def counting(fd, offset, length):
        reserved.append(offset)
        started.set()
        return fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", counting)
    root = tmp_path / "shm"
    root.mkdir()
    pool = HostPool(2, None, pin=False)
    pool.share(SharedSpace(root, shm.prefix_for(tmp_path / "l", 0, create=True), str(tmp_path / "l")))
    pool.prepare(8 << 20)
    assert started.wait(60)
    thread = pool._prepared
    pool.close(keep_shared=keep_shared)
    assert not thread.is_alive()
    n = len(reserved)
    assert 0 < n < 128, "the allocation ran to its end instead of stopping"
    assert os.listdir(root) == [] and pool.buffers == []
    thread.join(0.3)
    assert len(reserved) == n and os.listdir(root) == []  # nothing more after close() returned


@pytest.mark.parametrize("closes", [True, False])
def test_a_process_that_exits_during_the_background_allocation_exits_cleanly(tmp_path, closes):
    """A short run (or a restore followed by a few steps) ends while the buffers are still being allocated
    in the background: whether it closes the Checkpointer or leaves that to the exit hook, no thread of
    ours is still running when the interpreter finalizes, and the process exits 0."""
    script = tmp_path / "short.py"
    script.write_text(
        textwrap.dedent(f"""
        import atexit, sys, threading
        import torch
        import ckpt
        from ckpt import shm
        shm.REGISTER_PIECE, shm.REGISTER_GAP_S = 64 << 10, 0.05
        # atexit hooks run after threading's exit hooks (where ckpt finishes what was not closed)
        atexit.register(lambda: print("left", sorted(t.name for t in threading.enumerate()
                                                     if t.name.startswith("ckpt-")), flush=True))
        state = {{"w": torch.nn.Parameter(torch.randn(2 << 20))}}
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1]), policy=ckpt.Policy(every_steps=1))
        ck.maybe_save(0, state)   # starts the background allocation (8 MiB in 128 paced pieces)
        if {closes}:
            ck.close()
    """)
    )
    env = {**os.environ, "CKPT_BUSY_WAIT_MS": "0"}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "l")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "left []" in out.stdout.splitlines(), out.stdout + out.stderr
    root = os.environ.get("CKPT_SHM_DIR")
    if root and not closes:  # the exit hook keeps the memory tier for the next process: no half-made segment
        assert not [
            f
            for f in os.listdir(root)
            if f.startswith(".") and shm.prefix_for(tmp_path / "l", 0, create=True) in f
        ]


def test_no_thread_of_ours_outlives_close(tmp_path):
    """A whole life (background allocation, saves on every tier, a restore, close) leaves no ckpt thread."""

    def ours():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("ckpt-"))

    before = ours()
    state = {"w": torch.nn.Parameter(torch.randn(1000))}
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=f"file://{tmp_path}/r", local_dir=tmp_path / "l"),
        policy=ckpt.Policy(every_steps=1),
    ) as ck:
        for step in range(4):
            ck.maybe_save(step, state)
        ck.wait()  # the tiers let go of the buffers (an explicit save finding none free would be skipped)
        ck.save(4, state).wait()
        assert ck.restore(state) == 4
    assert ours() == before

"""The host memory of the memory tier: reusable buffers for snapshots, pinned (or shared and registered).

:class:`HostPool` owns the buffers a snapshot is copied into and the tiers read from: at most ``slots``
of them, allocated in the background (paced, so the training loop never waits on a page fault or a
``cudaHostRegister`` of gigabytes), under ``host_memory_limit``. Its lifecycle keeps the promise of the
memory tier: the buffer of the newest committed snapshot is never taken by a new one (while room for two
buffers exists), a buffer is free when no tier reads it, and a snapshot that cannot get a buffer is skipped
(counted) rather than made to wait. A :class:`SharedSpace` puts the buffers in the RAM file system, as named
segments a later process on the node takes over (:mod:`ckpt.shm`). :class:`HostBuffer` is one buffer.

Copies to the host in flight in this process are counted here (``_copy_began`` / ``_copy_ended``): the
pieces of a background allocation are registered between them, never beside one.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import psutil
import torch

from . import priority, shm as _shm
from .errors import CheckpointError, HostMemoryError

__all__ = ["HostBuffer", "HostPool", "SharedSpace"]

log = logging.getLogger(__name__)

_GRANULE = 2 << 20  # pool capacity is rounded up to this
# What allocating a buffer runs at before one was measured in this process (GB/s): on an H200 node, 8 GB of
# cudaHostAlloc took 3.45 s, a 6.9 GiB shared-memory segment created, mapped and registered 3.7 s.
_ALLOC_GBPS = 2.0
# A save of maybe_save() waits for a buffer the background allocation should finish within this many seconds
# (a small state's: milliseconds), whatever CKPT_BUSY_WAIT_MS says
_ALLOC_GRACE_S = 0.05
# How long close() waits for prepare()'s thread to stop (seconds): it stops between two 64 MiB pieces, so
# this is only reached by a file system that blocks one posix_fallocate or mapping for that long.
_PREPARE_JOIN_S = 60


class _Flag(threading.local):
    paced = False
    stop: threading.Event | None = None


# set in prepare()'s thread: segments registered there go in paced pieces, and stop when the pool closes
_background = _Flag()

# Snapshot copies to the host in flight in this process (device-to-host DMA enqueued and not yet landed). The
# background allocation of more buffers registers its pieces between them (ckpt.shm.quiet): a snapshot taken
# beside a registration blocked the loop 0.4-0.8 s on an H200 node, and waiting for the whole allocation
# before the first snapshot (three 7.4 GB buffers: 15 s) left the first minutes of a job without one.
_dma_cv = threading.Condition()
_dma_in_flight = 0
#: the longest a background allocation waits for the copies in flight before its next piece (seconds)
_QUIET_WAIT_S = 1.0


def _copy_began() -> None:
    global _dma_in_flight
    with _dma_cv:
        _dma_in_flight += 1


def _copy_ended() -> None:
    global _dma_in_flight
    with _dma_cv:
        _dma_in_flight = max(0, _dma_in_flight - 1)
        _dma_cv.notify_all()


def _no_copy_in_flight() -> None:
    with _dma_cv:
        _dma_cv.wait_for(lambda: _dma_in_flight == 0, timeout=_QUIET_WAIT_S)


def _copy_in_flight() -> bool:
    return _dma_in_flight > 0


_shm.quiet = _no_copy_in_flight
_shm.copying = _copy_in_flight


class HostBuffer:
    """One host staging buffer: pinned memory of this process, or a shared-memory segment
    (:mod:`ckpt.shm`, registered with the CUDA driver) that outlives it.

    ``holds`` counts who uses the bytes now (the snapshot copy being taken, each tier reading
    them); a buffer with no holds may be taken for the next snapshot. ``image_step`` /
    ``manifest`` / ``image_timeline`` describe the whole snapshot it holds for the memory tier
    (``None``: none), and ``record`` its commit record when it is a segment.
    """

    def __init__(self, nbytes: int, pin: bool, segment: Any = None, slot: int = 0) -> None:
        self.segment = segment
        self.slot = slot
        if segment is not None:
            self.tensor = segment.tensor
            self.pinned = segment.registered
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin, device="cpu")
            self.pinned = pin
        self.holds = 0
        self.staging = False  # a snapshot copy is being taken into it (one of the holds)
        self.image_step: int | None = None  # step whose snapshot the buffer holds, for the memory tier
        self.manifest: Any = None  # and that snapshot's manifest
        self.image_timeline: Any = None  # and its timeline
        self.image_order = 0.0  # when it was committed (the newest is the last committed, which a
        # rollback's new branch makes the newest whatever its step number)
        self.record: Any = None  # its shared-memory commit record, if any
        # told once its record is written in the background (None) or never will be (why): MemoryTier.commit
        self.on_record: Any = None
        # while the memory tier's record pass reads it (one of the holds): whether that pass gives the buffer up
        # to a new snapshot now (a callable), and the step of the snapshot that took it (the pass then stops)
        self.record_yields: Any = None
        self.record_taken: int | None = None
        # its bytes are this process's own (a snapshot it copied, a replica it received and checked) or were
        # checked against their record since it was taken over; False for a segment adopted from a previous
        # process: readers check every chunk before they use it (the RAM kept it across the restart, not us)
        self.checked = True
        # its snapshot was taken by a previous process (a segment taken over with the snapshot in it), not by
        # this one: a restore of it after a crash may be the only copy left (Checkpointer.restore persists it)
        self.inherited = False
        self.views: dict[tuple, torch.Tensor] = {}  # typed views into the buffer, reused across saves

    @property
    def busy(self) -> bool:
        return self.holds > 0

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def memoryview(self, nbytes: int) -> memoryview:
        return memoryview(self.tensor.numpy())[:nbytes]

    def forget_image(self) -> bool:
        """Drop the snapshot this buffer holds (its image only; the record is the pool's to withdraw). Returns
        whether it was still waiting for its record (whoever waited is told it will not be written)."""
        callback, self.on_record = self.on_record, None
        if callback is not None:  # taken back (for a newer snapshot, or freed) before its record was written
            callback(
                "its buffer was taken back before its record was written (it was in this process's "
                "memory only)"
            )
        self.image_order = 0.0
        self.image_step = None
        self.manifest = None
        self.image_timeline = None
        self.record = None
        return callback is not None

    def free(self) -> None:
        """Give the memory back now: drop the buffer and every view this object keeps of it (a
        snapshot object that outlives the pool then holds no host memory)."""
        self.views = {}
        if self.segment is not None:
            self.segment.release()
        self.tensor = torch.empty(0, dtype=torch.uint8, device="cpu")
        self.forget_image()


@dataclass
class SharedSpace:
    """Where a pool keeps its buffers as shared-memory segments: ``root`` (the RAM file system),
    ``prefix`` (:func:`ckpt.shm.prefix_for`) and the ``local_dir`` it belongs to."""

    root: Any
    prefix: str
    local_dir: str


class HostPool:
    """At most ``slots`` host buffers, allocated when first needed (or ahead, by :meth:`prepare`) and
    reused across saves.

    ``limit`` caps the total bytes (``host_memory_limit``); ``None`` derives it from the memory
    psutil reports available when a buffer is (re)allocated. When the limit leaves room for fewer
    buffers than ``slots`` and ``shrink`` is set (the default number of buffers), the pool keeps as
    many as fit (at least one) and says so once. With :meth:`share`, buffers are shared-memory
    segments (adopting a segment a previous process left, with its committed snapshot), else
    pinned memory of this process. :meth:`close` frees every buffer (one still held: once released).

    A save that may be skipped (``maybe_save``'s, under ``if_busy="skip"``) asks :meth:`wait_free` first,
    then :meth:`acquire` with ``inline=False``: it waits a bounded time for a buffer and never allocates
    one in the training thread while :meth:`prepare`'s background allocation runs (seconds per buffer of
    pinned or registered memory, which that save would otherwise stall the loop for).
    """

    def __init__(self, slots: int, limit: int | None, pin: bool | None = None, shrink: bool = False) -> None:
        if slots < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {slots}")
        self.slots = slots
        self.limit = limit
        self.shrink = shrink
        self.unrecorded_dropped = (
            0  # snapshots whose buffer was taken for a newer one before their record was written
        )
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffers: list[HostBuffer] = []
        self.allocations = 0
        self.shared: SharedSpace | None = None
        self._device: int | None = None  # see _note_device
        self._closed = False
        self._allocating = 0  # allocations under way outside the lock
        self._cv = threading.Condition()
        self._prepared: threading.Thread | None = None
        self._adopting: threading.Thread | None = None  # adopt_ahead()'s thread
        #: (start, end) of adopt_ahead()'s run in time.monotonic() seconds (end None while it runs)
        self.adopt_span: tuple[float, float | None] | None = None
        self._stop = threading.Event()  # close(): prepare()'s thread stops between two pieces
        self._preparing: float | None = None  # when prepare()'s background allocation started, while it runs
        self._growing: tuple[float, int] | None = (
            None  # (start, bytes) of the background allocation under way
        )
        self.alloc_gbps: float | None = None  # the rate buffers were allocated at in this process (GB/s)
        self._reserved: set[int] = set()  # slots being allocated
        self._warned_shm = False
        self.holds_what = "the memory tier keeps its snapshots"  # for messages: what the buffers are for
        #: the timeline (:class:`~ckpt.policy.Timeline`) the next snapshots go to (``None``: not known); the
        #: buffer kept whole while the next snapshot is copied is the newest on its branch
        self.live: Any = None

    @property
    def nbytes(self) -> int:
        return sum(b.capacity for b in self.buffers)

    @property
    def preparing(self) -> float | None:
        """Seconds :meth:`prepare`'s background allocation has been running (``None``: it is not)."""
        started = self._preparing
        return None if started is None else time.monotonic() - started

    def share(self, space: SharedSpace | None) -> None:
        """Keep the buffers allocated from now on in shared memory (``None``: in this process)."""
        with self._cv:
            self.shared = space
        self._note_device()

    def _note_device(self) -> None:
        """Remember the calling (training) thread's CUDA device: segments are registered in its context.
        A background thread's current device is 0, and registering there would open a context on GPU 0
        for every rank of the node."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._device = torch.cuda.current_device()

    def adopt_ahead(self) -> None:
        """Start :meth:`adopt` in a background thread (once), so that a restore that comes later finds the
        previous process's segments mapped and registered: it then copies a snapshot to the GPU at the
        pinned rate instead of reading it through the host's cores (``pread`` into pinned chunks). Taking a
        segment over costs about 0.2 s per 3.7 GB (mapping its pages, ``cudaHostRegister``); anything the
        caller does meanwhile (building the model) hides it. Every later :meth:`adopt` waits for it. Not
        started while CUDA is not yet initialized in this process (the segments are registered in the calling
        thread's device's context, which is not known before): a later call, or the first save, does it."""
        if self.pin and torch.cuda.is_available() and not torch.cuda.is_initialized():
            return  # this rank's GPU is not known yet: registering now would be in GPU 0's context (see _note_device)
        self._note_device()
        with self._cv:
            if self._adopting is not None or self.shared is None or self._closed:
                return

            def run() -> None:
                from . import shm

                _background.stop = self._stop  # close() stops it between two registered pieces
                start = time.monotonic()
                self.adopt_span = (start, None)
                try:
                    self.adopt()
                except shm.AllocationStopped:
                    pass
                except Exception as e:  # noqa: BLE001 - the restore reads the segments through pread instead
                    log.warning("taking over the memory tier's segments ahead failed (%s)", e)
                finally:
                    self.adopt_span = (start, time.monotonic())

            self._adopting = threading.Thread(target=run, name="ckpt-adopt", daemon=True)
            self._adopting.start()

    def wait_adopted(self) -> None:
        """:meth:`adopt_ahead`'s thread has finished (returns at once when none runs)."""
        t = self._adopting
        if t is not None and t is not threading.current_thread():
            t.join()

    def adopt(self) -> None:
        """Take over the shared-memory segments a previous owner of the same local tier left, with the
        snapshots committed in them (the memory tier lists them as before), as this pool's buffers; the
        half-made ones it left (killed while allocating) are removed. Their bytes are checked by whoever
        reads them first (:attr:`HostBuffer.checked`)."""
        from . import shm

        self.wait_adopted()
        space = self.shared
        if space is None:
            return
        shm.remove_leftovers(space.root, space.prefix)  # what a writer killed mid-allocation left
        for slot in range(self.slots):
            with self._cv:
                if (
                    any(b.slot == slot for b in self.buffers)
                    or slot in self._reserved
                    or len(self.buffers) >= self.slots
                ):
                    continue  # taken, or being allocated
                self._reserved.add(slot)  # being taken over: counted like an allocation (it registers)
                self._allocating += 1
            buf = None
            try:
                buf = self._adopt_slot(space, slot, shm)
            finally:
                with self._cv:
                    self._reserved.discard(slot)
                    self._allocating -= 1
                    if buf is not None:
                        self.buffers.append(buf)
                    self._cv.notify_all()

    def _adopt_slot(self, space: SharedSpace, slot: int, shm: Any) -> HostBuffer | None:
        """Map and register segment ``slot`` with the snapshot its record describes (``None``: it has none,
        or it is unusable: its record is withdrawn then)."""
        rec = shm.record_of(space.root, space.prefix, slot)
        path = space.root / shm.buffer_name(space.prefix, slot)
        if rec is None:
            return None
        try:
            seg = shm.Segment.open(path, rec.manifest.data_bytes, writable=True)
        except OSError as e:
            log.warning("memory-tier segment %s is unusable (%s): not adopted", path, e)
            shm.remove_record(space.root, space.prefix, slot)
            return None
        if self.pin:
            seg.register(self._device, paced=_background.paced, stop=_background.stop)
        buf = HostBuffer(0, self.pin, segment=seg, slot=slot)
        buf.image_step, buf.manifest, buf.image_timeline, buf.record = (
            rec.step,
            rec.manifest,
            rec.timeline,
            rec,
        )
        buf.image_order = rec.created_unix
        buf.checked = False
        buf.inherited = True
        return buf

    def prepare(self, nbytes: int) -> None:
        """In a background thread (once): take over the segments a previous owner left (:meth:`adopt`), then
        allocate the missing buffers for a state of ``nbytes``, so that the first save does not pay for the
        allocation (seconds for pinned or registered memory)."""
        self._note_device()
        with self._cv:
            if self._prepared is not None or self._closed:
                return

            def run() -> None:
                from . import shm

                priority.lower_this_thread()
                _background.paced = True  # beside a training loop: registered in paced pieces
                _background.stop = self._stop
                try:
                    self.adopt()  # a previous process's segments first (their snapshots stay listed), here:
                    self._prepare_buffers(
                        nbytes
                    )  # a save adopting beside this allocation could map a slot twice
                except shm.AllocationStopped:
                    pass  # close(): what was under way is undone, its segments are left as they were
                except Exception as e:  # noqa: BLE001 - the save allocates (and reports) itself
                    log.warning(
                        "allocating the snapshot buffers ahead failed (%s); the first save allocates", e
                    )
                finally:
                    with self._cv:
                        self._preparing = None  # from now on a save may allocate itself
                        self._cv.notify_all()

            self._preparing = time.monotonic()
            self._growing = (
                self._preparing,
                nbytes,
            )  # the first buffer, from now (the thread may start late)
            self._prepared = threading.Thread(target=run, name="ckpt-prepare", daemon=True)
            self._prepared.start()

    def _prepare_buffers(self, nbytes: int) -> None:
        """:meth:`prepare`'s thread: allocate buffers of ``nbytes`` until the pool has ``slots`` of them."""
        while True:
            with self._cv:
                if self._closed or len(self.buffers) + self._allocating >= self.slots:
                    return
                self._allocating += 1
                self._growing = (time.monotonic(), nbytes)
                self._cv.notify_all()  # a save waiting for a buffer learns how long this one takes
            try:
                buf = self._allocate(nbytes, -1, self._free_slot())
            except HostMemoryError as e:
                with self._cv:
                    self._allocating -= 1
                    if self.buffers and self.shrink:
                        self._shrink(e)
                    self._cv.notify_all()
                return
            except BaseException:
                with self._cv:
                    self._allocating -= 1
                    self._cv.notify_all()
                raise
            with self._cv:
                self._allocating -= 1
                if self._closed:
                    buf.free()
                    return
                self.buffers.append(buf)
                self._cv.notify_all()

    def acquire(
        self,
        nbytes: int,
        block: bool,
        step: int,
        reclaim: Callable[[HostBuffer, bool, int], bool] | None = None,
        inline: bool = True,
    ) -> HostBuffer | None:
        """A buffer of at least ``nbytes`` for a new snapshot, held once and marked ``staging``. A buffer
        no one holds is free. Without ``block``, returns ``None`` when no buffer is free and none will be
        without a tier finishing (it waits for a copy still landing, a record pass of the memory tier, or an
        allocation under way); with ``block``, it waits for a tier too. Of the free buffers, one holding no
        snapshot goes first, then the oldest snapshot; with none free and room for another, it is allocated
        here (seconds for GBs of pinned memory), unless ``inline`` is false and :meth:`prepare`'s background allocation is
        running: then it waits for that. ``reclaim``, called under the pool's lock:
        ``reclaim(buf, True, step)`` asks whether ``buf`` may be taken (``False``: it counts as busy),
        ``reclaim(buf, False, step)`` says it is taken for ``step`` (whoever still wanted its snapshot
        lets go of it)."""
        from . import shm

        self._note_device()
        with self._cv:
            while True:
                self._check_open()
                found, buf = self._pick(nbytes, step, reclaim, inline)
                if found:
                    if buf is not None and reclaim is not None:
                        reclaim(buf, False, step)
                    break
                if (
                    not block
                    and not self._allocating
                    and not any(
                        b.staging or (b.holds == 1 and b.record_yields is not None) for b in self.buffers
                    )
                ):
                    return None  # (a copy landing, or a record pass, lets go of its buffer within moments)
                self._cv.wait()
            if buf is not None and buf.capacity >= nbytes:
                self._withdraw(buf, shm)
                if (
                    buf.holds
                ):  # a record pass that gives way: it stops at its next chunk and publishes nothing
                    buf.record_taken = step
                buf.holds, buf.staging = buf.holds + 1, True
                return buf
            if buf is not None:
                buf.holds = 1  # reserved while it is replaced by a larger one (its snapshot stays until then)
            self._allocating += 1
        try:
            new = self._allocate(
                nbytes, step, buf.slot if buf is not None else self._free_slot(), replacing=buf
            )
        except BaseException as e:  # whatever failed, the counter and the reservation are given back
            with self._cv:
                self._allocating -= 1
                if buf is not None:
                    buf.holds = 0
                self._cv.notify_all()
                if not (isinstance(e, HostMemoryError) and buf is None and self.buffers and self.shrink):
                    raise
                self._shrink(e)
            return self.acquire(nbytes, block, step, reclaim, inline)
        with self._cv:
            self._allocating -= 1
            if buf is not None and buf in self.buffers:
                self.buffers.remove(buf)
            new.holds, new.staging = 1, True
            self.buffers.append(new)
            self._cv.notify_all()
            return new

    def _pick(
        self, nbytes: int, step: int, reclaim: Callable[[HostBuffer, bool, int], bool] | None, inline: bool
    ) -> tuple[bool, HostBuffer | None]:
        """(under the lock) What :meth:`acquire` can do now: ``(True, buf)``, take the free ``buf`` (replaced
        by a larger one if it is too small); ``(True, None)``, allocate another; ``(False, None)``, nothing
        yet. Without ``inline``, nothing is allocated while the background allocation runs.

        A buffer is free when no one holds it and it does not hold the newest committed snapshot: that one
        stays whole until a newer one is committed, so a snapshot that then fails (torn, killed mid-copy)
        costs nothing that was committed. With room for one buffer only, that promise cannot be kept: the
        newest snapshot's buffer is taken once no tier reads it (a snapshot that then fails leaves the memory
        tier empty, and a restore falls back to the other tiers)."""
        grow = inline or self._preparing is None  # may the caller allocate now
        newest = max((b for b in self.buffers if b.image_step is not None), default=None, key=self._rank)
        free = [
            b
            for b in self.buffers
            if (b.holds == 0 and (grow or b.capacity >= nbytes))
            or (b is not newest and b.capacity >= nbytes and self._record_gives_way(b))
        ]
        free.sort(key=lambda b: (b.capacity < nbytes, b.holds > 0, b.image_step is not None, self._rank(b)))
        free = [b for b in free if reclaim is None or reclaim(b, True, step)]
        others = [b for b in free if b is not newest]
        if others:
            return True, others[0]
        if grow and len(self.buffers) + self._allocating < self.slots:
            return True, None  # another buffer, rather than the newest snapshot's
        if newest in free and newest.holds == 0 and self.slots == 1:
            return True, newest
        return False, None

    @staticmethod
    def _record_gives_way(b: HostBuffer) -> bool:
        """(under the lock) Whether ``b``'s only hold is the memory tier's record pass over a snapshot a newer one
        replaced, and that pass gives the buffer up to a new snapshot now (see MemoryTier._record_passes), or was
        told to already (it is stopping: it publishes nothing, whatever the buffer holds by then)."""
        return (
            b.holds == 1
            and not b.staging
            and b.record_yields is not None
            and (b.record_taken is not None or b.record_yields())
        )

    def wait_free(
        self,
        nbytes: int,
        step: int,
        timeout: float,
        reclaim: Callable[[HostBuffer, bool, int], bool] | None = None,
    ) -> bool:
        """Wait at most ``timeout`` seconds until :meth:`acquire` with ``inline=False`` would take a buffer
        at once: one is free (or room for one, with no background allocation running). Returns whether it
        would. What it waits for: :meth:`prepare`'s allocation, a snapshot copy landing, a tier letting go
        of a buffer. It answers at once when no buffer can come in time (none exists yet and the allocation
        under way needs longer: :meth:`_allocation_outlasts`). A save that may be skipped asks this first; in
        a collective job every rank asks before the ranks agree, so that their answers (and hence the skip)
        are the same."""
        start = time.monotonic()
        deadline = start + timeout
        with self._cv:
            while True:
                self._check_open()
                # An allocation that should end within _ALLOC_GRACE_S (a small state's buffer) is waited for up to
                # that long, whatever the timeout: skipping for it would cost the snapshot and save the loop nothing.
                ends = self._allocation_ends()
                soon = ends is not None and ends - time.monotonic() <= _ALLOC_GRACE_S
                # Even paced (ckpt.shm.Segment.create / register), a snapshot taken beside a pinned buffer's
                # allocation blocked the loop 0.4-0.8 s on an H200 node (2026-11-25), while the same snapshots
                # once the buffers were there blocked it 10-15 ms. So a buffer already there is taken while
                # the others are allocated, whose pieces are then registered between snapshot copies
                # (ckpt.shm.quiet), never beside one; with no buffer yet, the save is skipped (counted).
                pinned = self._pinned_allocation()
                if self._pick(nbytes, step, reclaim, inline=False)[0]:
                    return True
                if pinned and not self.buffers:
                    limit = start + _ALLOC_GRACE_S if soon else start
                else:
                    limit = max(deadline, start + _ALLOC_GRACE_S) if soon else deadline
                left = limit - time.monotonic()
                if left <= 0 or (not soon and self._allocation_outlasts(left)):
                    return False
                self._cv.wait(left)

    def allocation_outlasts(self, seconds: float) -> bool:
        """Whether a save now would find no buffer within ``seconds`` because of the background allocation
        (see :meth:`_allocation_outlasts`)."""
        with self._cv:
            return self._allocation_outlasts(seconds)

    def _allocation_outlasts(self, seconds: float) -> bool:
        """(under the lock) Whether no buffer can come within ``seconds``: none exists (so no tier will let go
        of one) and the background allocation under way needs longer, at the rate buffers were allocated at
        here, or else at ``_ALLOC_GBPS``; always while the first pinned buffer is being allocated in the
        background. A save then skips at once instead of waiting out its bound."""
        if self.buffers:
            return False  # a tier may let go of one at any moment
        if self._pinned_allocation():
            return True
        ends = self._allocation_ends()
        return ends is not None and ends - time.monotonic() > seconds

    def _allocation_ends(self) -> float | None:
        """(under the lock) When the buffer the background allocation is making now should be there
        (``time.monotonic()``), at the rate buffers were allocated at here, or else at ``_ALLOC_GBPS``;
        ``None`` when none is being made."""
        if self._preparing is None or self._growing is None:
            return None
        started, nbytes = self._growing
        return started + nbytes / (self.alloc_gbps or _ALLOC_GBPS) / 1e9

    def _pinned_allocation(self) -> bool:
        """(under the lock) Whether a pinned (registered) buffer is being allocated in the background."""
        return self.pin and self._preparing is not None and self._allocating > 0

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("the host staging pool is closed (the Checkpointer was closed)")

    def _shrink(self, error: HostMemoryError) -> None:
        """Keep the buffers there are: the limit leaves no room for another (said once)."""
        if self.slots > len(self.buffers):
            log.warning(
                "only %d snapshot buffer(s) fit (%s): %s. Raise host_memory_limit for %d buffers",
                len(self.buffers),
                error,
                "the newest committed snapshot is kept whole in one, so a new snapshot waits (if_busy='wait') "
                "or is skipped (if_busy='skip') while a tier reads the other"
                if len(self.buffers) == 2
                else "a new snapshot waits or is skipped while a tier reads the one buffer, and otherwise takes "
                "it: one that then fails leaves the memory tier empty",
                self.slots,
            )
            self.slots = len(self.buffers)

    def _withdraw(self, buf: HostBuffer, shm: Any) -> None:
        """Before ``buf`` is written again: its snapshot leaves the memory tier (its record first). A record
        that cannot be removed is logged, and the write goes on: a reader checks every chunk against the
        record, so the bytes written under it fail their checksums and are never served."""
        if buf.segment is not None and self.shared is not None:
            try:
                shm.remove_record(self.shared.root, self.shared.prefix, buf.slot)
            except OSError as e:
                log.warning(
                    "could not withdraw the memory tier's record of slot %d (%s): a reader will find its "
                    "chunks rewritten and pass over it",
                    buf.slot,
                    e,
                )
        if buf.forget_image():
            self.unrecorded_dropped += 1

    def _free_slot(self) -> int:
        with self._cv:
            used = {b.slot for b in self.buffers} | self._reserved
            slot = next(i for i in range(len(used) + 1) if i not in used)
            self._reserved.add(slot)
            return slot

    def describe_busy(self) -> str:
        """What each buffer is doing, for a message: how many are being copied into, read by a tier, holding
        the newest committed snapshot (kept whole), or being allocated."""
        with self._cv:
            newest = max((b for b in self.buffers if b.image_step is not None), default=None, key=self._rank)
            counts = collections.Counter(
                "being copied into"
                if b.staging
                else "being checksummed for its record"
                if b.holds == 1 and b.record_yields is not None
                else "read by a tier"
                if b.holds
                else "holding the newest committed snapshot"
                if b is newest
                else "free"
                for b in self.buffers
            )
            if self._allocating:
                counts["being allocated"] += self._allocating
        return ", ".join(f"{n} {what}" for what, n in counts.items()) or "none allocated yet"

    def has_free(self) -> bool:
        """Whether :meth:`acquire` without ``block`` would return a buffer (one is free, may be added, is
        held only by a copy still landing, or is being allocated: it waits for those two)."""
        with self._cv:
            newest = max((b for b in self.buffers if b.image_step is not None), default=None, key=self._rank)
            return (
                len(self.buffers) + self._allocating < self.slots
                or self._allocating > 0
                or any(
                    b.holds == 0
                    or (b.staging and b.holds == 1)
                    or (b is not newest and self._record_gives_way(b))
                    for b in self.buffers
                )
            )

    def hold(self, buf: HostBuffer) -> None:
        with self._cv:
            buf.holds += 1
            self._cv.notify_all()  # the memory tier's records prefer a buffer a tier holds (MemoryTier._pick_record)

    def release(self, buf: HostBuffer, staged: bool = False) -> None:
        """Drop one hold of ``buf`` (``staged``: the hold of its snapshot copy, which has landed or failed)."""
        with self._cv:
            if staged:
                buf.staging = False
            buf.holds = max(0, buf.holds - 1)
            if self._closed and buf.holds == 0:  # the persist that held it ended after close(): free it now
                self._drop(buf)
            self._cv.notify_all()

    def close(self, keep_shared: bool = False) -> None:
        """Free every buffer that is not held now, and each held one when it is released. Idempotent.
        Shared-memory segments are removed too (their RAM is given back), unless ``keep_shared``.

        :meth:`prepare`'s background allocation is stopped first (between two of its pieces, within
        milliseconds) and waited for: no thread of the pool outlives it, and no segment appears after it.
        A daemon thread still inside torch when the interpreter finalizes aborts the process."""
        from . import shm

        with self._cv:
            self._closed = True
            self._stop.set()
            self._cv.notify_all()
            threads = [self._prepared, self._adopting]
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(_PREPARE_JOIN_S)
                if thread.is_alive():
                    log.warning(
                        "the memory tier's background allocation did not stop within %d s of close()",
                        _PREPARE_JOIN_S,
                    )
        with self._cv:
            for b in [b for b in self.buffers if b.holds == 0]:
                self._drop(b)
            self._cv.notify_all()
            space = self.shared
        if space is not None and not keep_shared:
            shm.free(space.root, space.prefix)

    def _drop(self, buf: HostBuffer) -> None:
        if buf in self.buffers:
            self.buffers.remove(buf)
        buf.free()

    def newest_image(self) -> HostBuffer | None:
        with self._cv:
            imgs = [b for b in self.buffers if b.image_step is not None]
            return max(imgs, key=self._rank) if imgs else None

    def _rank(self, b: HostBuffer) -> tuple[bool, float]:
        """How much a buffer's snapshot is worth keeping (larger: more): a snapshot on the branch the next
        ones go to (:attr:`live`) over one a rollback abandoned, then the last committed."""
        live = (
            self.live is None
            or b.image_step is None
            or self.live.holds(getattr(b.image_timeline, "number", 0), b.image_step)
        )
        return live, b.image_order

    def commit_order(self) -> float:
        """(under the lock) The order of a snapshot committed now: after every one this pool holds (its
        wall-clock time, as a record's ``created_unix``, never behind one already held)."""
        return max([time.time()] + [b.image_order + 1e-6 for b in self.buffers])

    def _allocate(self, nbytes: int, step: int, slot: int, replacing: HostBuffer | None = None) -> HostBuffer:
        """A new buffer of at least ``nbytes`` in ``slot``; ``replacing`` (a free buffer too small for the
        state, which grew) is freed first, once the limit is known to allow the new one. Called without
        the pool's lock (it may take seconds)."""
        try:
            return self._allocate_unlocked(nbytes, step, slot, replacing)
        finally:
            with self._cv:
                self._reserved.discard(slot)

    def _allocate_unlocked(
        self, nbytes: int, step: int, slot: int, replacing: HostBuffer | None
    ) -> HostBuffer:
        cap = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
        with self._cv:
            allocated = self.nbytes
            count = len(self.buffers)
        others = allocated - (replacing.capacity if replacing is not None else 0)  # what stays allocated
        if self.limit is not None:
            limit, why = self.limit, "host_memory_limit"
        else:  # what this pool holds already would be available to it, too
            limit, why = (
                int(0.8 * psutil.virtual_memory().available) + allocated,
                "80% of available host memory (the default of host_memory_limit)",
            )
        if others + cap > limit >= others + nbytes:
            cap = limit - others  # the rounding alone would cross the limit
        if others + cap > limit:
            kind = "pinned" if self.pin else "pageable"
            have = (
                f"{_mib(allocated)} of {kind} staging memory is allocated already in {count} "
                f"buffer(s) (max_in_flight={self.slots})"
            )
            if replacing is not None:
                have += (
                    f", of which the {_mib(replacing.capacity)} buffer of a smaller earlier state would be "
                    "freed to make room"
                )
            raise HostMemoryError(
                f"staging step {step} needs a host buffer of {_mib(nbytes)}: {have}, so {_mib(others + nbytes)} "
                f"would be needed in all, over the {_mib(limit)} allowed by {why}. Pass "
                f"Checkpointer(host_memory_limit=...) of at least {others + nbytes} bytes"
                f"{', or a smaller max_in_flight' if others else ''}",
                needed=nbytes,
                allocated=allocated,
                limit=limit,
            )
        if replacing is not None:  # give its memory back before asking for more: peak = the new buffer
            from . import shm

            with self._cv:
                self._withdraw(replacing, shm)
                if replacing in self.buffers:
                    self.buffers.remove(replacing)
            replacing.free()
        t0 = time.perf_counter()
        buf = self._shared_buffer(cap, slot)
        if buf is None:
            buf = HostBuffer(cap, self.pin, slot=slot)
        self.allocations += 1
        took = time.perf_counter() - t0
        if took > 0:
            self.alloc_gbps = cap / took / 1e9
        log.info(
            "allocated %.2f GiB %s host staging buffer in %.3f s",
            cap / 2**30,
            "shared-memory" if buf.segment is not None else "pinned" if self.pin else "pageable",
            took,
        )
        return buf

    def _shared_buffer(self, cap: int, slot: int) -> HostBuffer | None:
        """A shared-memory segment of ``cap`` bytes for ``slot``, or ``None`` (in-process memory then)
        when the pool is not shared or the RAM file system has no room (said once, with the size)."""
        from . import shm

        space = self.shared
        if space is None:
            return None
        path = space.root / shm.buffer_name(space.prefix, slot)
        seg = None
        try:
            shm.remove_record(space.root, space.prefix, slot)
            try:
                st = os.lstat(path)
                old = st.st_blocks * 512 if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() else 0
            except FileNotFoundError:
                old = 0
            free = shm.available_bytes(space.root) + old
            if free < cap:
                raise OSError(errno.ENOSPC, f"{_mib(free)} free, {_mib(cap)} needed", str(space.root))
            seg = shm.Segment.create(path, cap, paced=_background.paced, stop=_background.stop)
            if self.pin:
                seg.register(self._device, paced=_background.paced, stop=_background.stop)
        except OSError as e:
            # the memory tier's trouble alone: this buffer lives in the process (the snapshots in it do not
            # outlive the process), every other tier gets them as before
            if seg is not None:  # made, then refused: its RAM goes back
                seg.release()
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if not self._warned_shm:
                self._warned_shm = True
                log.warning(
                    "%s in this process's memory, so they do not outlive it: a %s segment could not be made "
                    "at %s (%s); it needs %d buffer(s) of that size free in %s, as regular files of this "
                    "user (enlarge it: docker --shm-size, or a Kubernetes emptyDir with medium: Memory)",
                    self.holds_what,
                    _mib(cap),
                    e.filename or path,
                    e.strerror or e,
                    self.slots,
                    space.root,
                )
            return None
        return HostBuffer(cap, self.pin, segment=seg, slot=slot)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

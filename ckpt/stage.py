"""Phase 1: snapshot the state into a reusable host buffer, overlapped with training.

CUDA tensors are copied device-to-host on a side stream into a pinned buffer
that is allocated on the first save and reused. ``save()`` only enqueues the
copies; it never waits for them. Two fences keep the snapshot consistent:

* module buffers (BatchNorm running statistics, which the forward pass itself
  updates in place) are copied first, and the compute stream waits on that
  small copy's event, so the next forward cannot overwrite them mid-copy;
* every optimizer's ``step()`` waits for the whole copy, on the GPU
  (``Stream.wait_event`` from a global step pre-hook), since the step is what
  mutates parameters and optimizer state.

Anything else that mutates state in place between ``save()`` and the next
optimizer step (an EMA update, say) must call ``Checkpointer.wait_staged()``
first. Such a mutation fails the save with :class:`~ckpt.errors.TornSnapshotError`
naming the tensor, instead of persisting a torn snapshot, through two checks:

* the tensor version counter: when a snapshot is fenced, a tensor whose
  ``_version`` moved since ``save()`` is reported (conservative: on the GPU, a
  write that the host cannot prove came after the copy is reported too);
* a value fingerprint (:func:`_fingerprint`), for writes the counter misses
  (through ``.data``, which has a counter of its own, or a numpy view): taken at
  ``save()`` ordered before anything the caller does next (synchronously for CPU
  tensors, on the caller's stream for CUDA tensors) and compared with the
  fingerprint of the host copy once it has landed, before the snapshot is
  published or persisted. Exact for the snapshot itself: a write that lands
  after the copy is never reported; one that leaves the fingerprint unchanged
  (an exact permutation of words) is not seen.

The copy is enqueued in chunks (:class:`_PacedCopy`): a first burst by ``save()``, then one chunk at a
time, each once the previous one has landed, by a thread of its own. While a stream has device-to-host
copies queued, another stream's device-to-host copy waits for them: a small copy of the training loop
(``loss.item()``) would otherwise wait behind the whole snapshot, the GPU idle. The optimizer step's
pre-hook enqueues whatever is left at once before it waits.

CPU tensors take the same path: a staging thread copies them into the pool
(the buffers-first copy is done before ``save()`` returns), so CPU-only tests
exercise the asynchronous logic.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import queue
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import psutil
import torch

from . import knobs, priority, shm as _shm
from .errors import CheckpointError, HostMemoryError, RefusedStateError, TornSnapshotError
from .format import Manifest, ItemRecord
from .plan import Entry

__all__ = ["HostBuffer", "HostPool", "SharedSpace", "Snapshot", "SnapshotStats", "stage", "wait_all_staged"]

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


_shm.quiet = _no_copy_in_flight


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
        self.staging = False                 # a snapshot copy is being taken into it (one of the holds)
        self.image_step: int | None = None   # step whose snapshot the buffer holds, for the memory tier
        self.manifest: Any = None            # and that snapshot's manifest
        self.image_timeline: Any = None      # and its timeline
        self.image_order = 0.0               # when it was committed (the newest is the last committed, which a
                                             # rollback's new branch makes the newest whatever its step number)
        self.record: Any = None              # its shared-memory commit record, if any
        # its bytes are this process's own (a snapshot it copied, a replica it received and checked) or were
        # checked against their record since it was taken over; False for a segment adopted from a previous
        # process: readers check every chunk before they use it (the RAM kept it across the restart, not us)
        self.checked = True
        # its snapshot was taken by a previous process (a segment taken over with the snapshot in it), not by
        # this one: a restore of it after a crash may be the only copy left (Checkpointer.restore persists it)
        self.inherited = False
        self.views: dict[tuple, torch.Tensor] = {}   # typed views into the buffer, reused across saves

    @property
    def busy(self) -> bool:
        return self.holds > 0

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def memoryview(self, nbytes: int) -> memoryview:
        return memoryview(self.tensor.numpy())[:nbytes]

    def forget_image(self) -> None:
        self.image_order = 0.0
        self.image_step = None
        self.manifest = None
        self.image_timeline = None
        self.record = None

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
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffers: list[HostBuffer] = []
        self.allocations = 0
        self.shared: SharedSpace | None = None
        self._device: int | None = None   # see _note_device
        self._closed = False
        self._allocating = 0      # allocations under way outside the lock
        self._cv = threading.Condition()
        self._prepared: threading.Thread | None = None
        self._adopting: threading.Thread | None = None   # adopt_ahead()'s thread
        #: (start, end) of adopt_ahead()'s run in time.monotonic() seconds (end None while it runs)
        self.adopt_span: tuple[float, float | None] | None = None
        self._stop = threading.Event()   # close(): prepare()'s thread stops between two pieces
        self._preparing: float | None = None   # when prepare()'s background allocation started, while it runs
        self._growing: tuple[float, int] | None = None   # (start, bytes) of the background allocation under way
        self.alloc_gbps: float | None = None   # the rate buffers were allocated at in this process (GB/s)
        self._reserved: set[int] = set()   # slots being allocated
        self._warned_shm = False
        self.holds_what = "the memory tier keeps its snapshots"   # for messages: what the buffers are for
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
            return   # this rank's GPU is not known yet: registering now would be in GPU 0's context (see _note_device)
        self._note_device()
        with self._cv:
            if self._adopting is not None or self.shared is None or self._closed:
                return

            def run() -> None:
                from . import shm

                _background.stop = self._stop   # close() stops it between two registered pieces
                start = time.monotonic()
                self.adopt_span = (start, None)
                try:
                    self.adopt()
                except shm.AllocationStopped:
                    pass
                except Exception as e:   # noqa: BLE001 - the restore reads the segments through pread instead
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
        shm.remove_leftovers(space.root, space.prefix)   # what a writer killed mid-allocation left
        for slot in range(self.slots):
            with self._cv:
                if any(b.slot == slot for b in self.buffers) or slot in self._reserved or \
                        len(self.buffers) >= self.slots:
                    continue   # taken, or being allocated
                self._reserved.add(slot)   # being taken over: counted like an allocation (it registers)
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
        buf.image_step, buf.manifest, buf.image_timeline, buf.record = rec.step, rec.manifest, rec.timeline, rec
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
                _background.paced = True   # beside a training loop: registered in paced pieces
                _background.stop = self._stop
                try:
                    self.adopt()   # a previous process's segments first (their snapshots stay listed), here:
                    self._prepare_buffers(nbytes)   # a save adopting beside this allocation could map a slot twice
                except shm.AllocationStopped:
                    pass   # close(): what was under way is undone, its segments are left as they were
                except Exception as e:   # noqa: BLE001 - the save allocates (and reports) itself
                    log.warning("allocating the snapshot buffers ahead failed (%s); the first save allocates", e)
                finally:
                    with self._cv:
                        self._preparing = None   # from now on a save may allocate itself
                        self._cv.notify_all()

            self._preparing = time.monotonic()
            self._growing = (self._preparing, nbytes)   # the first buffer, from now (the thread may start late)
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
                self._cv.notify_all()   # a save waiting for a buffer learns how long this one takes
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

    def acquire(self, nbytes: int, block: bool, step: int,
                reclaim: Callable[[HostBuffer, bool, int], bool] | None = None,
                inline: bool = True) -> HostBuffer | None:
        """A buffer of at least ``nbytes`` for a new snapshot, held once and marked ``staging``. A buffer
        no one holds is free. Without ``block``, returns ``None`` when no buffer is free and none will be
        without a tier finishing (it waits for a copy still landing, or an allocation under way); with
        ``block``, it waits for a tier too. Of the free buffers, one holding no snapshot goes first, then
        the oldest snapshot; with none free and room for another, it is allocated here (seconds for GBs
        of pinned memory), unless ``inline`` is false and :meth:`prepare`'s background allocation is
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
                if not block and not self._allocating and not any(b.staging for b in self.buffers):
                    return None
                self._cv.wait()
            if buf is not None and buf.capacity >= nbytes:
                self._withdraw(buf, shm)
                buf.holds, buf.staging = 1, True
                return buf
            if buf is not None:
                buf.holds = 1   # reserved while it is replaced by a larger one (its snapshot stays until then)
            self._allocating += 1
        try:
            new = self._allocate(nbytes, step, buf.slot if buf is not None else self._free_slot(), replacing=buf)
        except BaseException as e:   # whatever failed, the counter and the reservation are given back
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

    def _pick(self, nbytes: int, step: int, reclaim: Callable[[HostBuffer, bool, int], bool] | None,
              inline: bool) -> tuple[bool, HostBuffer | None]:
        """(under the lock) What :meth:`acquire` can do now: ``(True, buf)``, take the free ``buf`` (replaced
        by a larger one if it is too small); ``(True, None)``, allocate another; ``(False, None)``, nothing
        yet. Without ``inline``, nothing is allocated while the background allocation runs.

        A buffer is free when no one holds it and it does not hold the newest committed snapshot: that one
        stays whole until a newer one is committed, so a snapshot that then fails (torn, killed mid-copy)
        costs nothing that was committed. With room for one buffer only, that promise cannot be kept: the
        newest snapshot's buffer is taken once no tier reads it (a snapshot that then fails leaves the memory
        tier empty, and a restore falls back to the other tiers)."""
        grow = inline or self._preparing is None   # may the caller allocate now
        newest = max((b for b in self.buffers if b.image_step is not None), default=None, key=self._rank)
        free = [b for b in self.buffers if b.holds == 0 and (grow or b.capacity >= nbytes)]
        free.sort(key=lambda b: (b.capacity < nbytes, b.image_step is not None, self._rank(b)))
        free = [b for b in free if reclaim is None or reclaim(b, True, step)]
        others = [b for b in free if b is not newest]
        if others:
            return True, others[0]
        if grow and len(self.buffers) + self._allocating < self.slots:
            return True, None   # another buffer, rather than the newest snapshot's
        if newest in free and self.slots == 1:
            return True, newest
        return False, None

    def wait_free(self, nbytes: int, step: int, timeout: float,
                  reclaim: Callable[[HostBuffer, bool, int], bool] | None = None) -> bool:
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
            return False   # a tier may let go of one at any moment
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
            log.warning("only %d snapshot buffer(s) fit (%s): %s. Raise host_memory_limit for %d buffers",
                        len(self.buffers), error,
                        "the newest committed snapshot is kept whole in one, so a new snapshot waits (if_busy='wait') "
                        "or is skipped (if_busy='skip') while a tier reads the other" if len(self.buffers) == 2 else
                        "a new snapshot waits or is skipped while a tier reads the one buffer, and otherwise takes "
                        "it: one that then fails leaves the memory tier empty", self.slots)
            self.slots = len(self.buffers)

    def _withdraw(self, buf: HostBuffer, shm: Any) -> None:
        """Before ``buf`` is written again: its snapshot leaves the memory tier (its record first). A record
        that cannot be removed is logged, and the write goes on: a reader checks every chunk against the
        record, so the bytes written under it fail their checksums and are never served."""
        if buf.segment is not None and self.shared is not None:
            try:
                shm.remove_record(self.shared.root, self.shared.prefix, buf.slot)
            except OSError as e:
                log.warning("could not withdraw the memory tier's record of slot %d (%s): a reader will find its "
                            "chunks rewritten and pass over it", buf.slot, e)
        buf.forget_image()

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
                "being copied into" if b.staging else "read by a tier" if b.holds else
                "holding the newest committed snapshot" if b is newest else "free" for b in self.buffers)
            if self._allocating:
                counts["being allocated"] += self._allocating
        return ", ".join(f"{n} {what}" for what, n in counts.items()) or "none allocated yet"

    def has_free(self) -> bool:
        """Whether :meth:`acquire` without ``block`` would return a buffer (one is free, may be added, is
        held only by a copy still landing, or is being allocated: it waits for those two)."""
        with self._cv:
            return len(self.buffers) + self._allocating < self.slots or self._allocating > 0 or \
                any(b.holds == 0 or (b.staging and b.holds == 1) for b in self.buffers)

    def hold(self, buf: HostBuffer) -> None:
        with self._cv:
            buf.holds += 1

    def release(self, buf: HostBuffer, staged: bool = False) -> None:
        """Drop one hold of ``buf`` (``staged``: the hold of its snapshot copy, which has landed or failed)."""
        with self._cv:
            if staged:
                buf.staging = False
            buf.holds = max(0, buf.holds - 1)
            if self._closed and buf.holds == 0:   # the persist that held it ended after close(): free it now
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
                    log.warning("the memory tier's background allocation did not stop within %d s of close()",
                                _PREPARE_JOIN_S)
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
        live = self.live is None or b.image_step is None or \
            self.live.holds(getattr(b.image_timeline, "number", 0), b.image_step)
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

    def _allocate_unlocked(self, nbytes: int, step: int, slot: int, replacing: HostBuffer | None) -> HostBuffer:
        cap = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
        with self._cv:
            allocated = self.nbytes
            count = len(self.buffers)
        others = allocated - (replacing.capacity if replacing is not None else 0)   # what stays allocated
        if self.limit is not None:
            limit, why = self.limit, "host_memory_limit"
        else:   # what this pool holds already would be available to it, too
            limit, why = int(0.8 * psutil.virtual_memory().available) + allocated, \
                "80% of available host memory (the default of host_memory_limit)"
        if others + cap > limit >= others + nbytes:
            cap = limit - others   # the rounding alone would cross the limit
        if others + cap > limit:
            kind = "pinned" if self.pin else "pageable"
            have = f"{_mib(allocated)} of {kind} staging memory is allocated already in {count} " \
                   f"buffer(s) (max_in_flight={self.slots})"
            if replacing is not None:
                have += f", of which the {_mib(replacing.capacity)} buffer of a smaller earlier state would be " \
                        "freed to make room"
            raise HostMemoryError(
                f"staging step {step} needs a host buffer of {_mib(nbytes)}: {have}, so {_mib(others + nbytes)} "
                f"would be needed in all, over the {_mib(limit)} allowed by {why}. Pass "
                f"Checkpointer(host_memory_limit=...) of at least {others + nbytes} bytes"
                f"{', or a smaller max_in_flight' if others else ''}",
                needed=nbytes, allocated=allocated, limit=limit)
        if replacing is not None:   # give its memory back before asking for more: peak = the new buffer
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
        log.info("allocated %.2f GiB %s host staging buffer in %.3f s", cap / 2**30,
                 "shared-memory" if buf.segment is not None else "pinned" if self.pin else "pageable", took)
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
            if seg is not None:   # made, then refused: its RAM goes back
                seg.release()
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if not self._warned_shm:
                self._warned_shm = True
                log.warning("%s in this process's memory, so they do not outlive it: a %s segment could not be made "
                            "at %s (%s); it needs %d buffer(s) of that size free in %s, as regular files of this "
                            "user (enlarge it: docker --shm-size, or a Kubernetes emptyDir with medium: Memory)",
                            self.holds_what, _mib(cap), e.filename or path, e.strerror or e, self.slots, space.root)
            return None
        return HostBuffer(cap, self.pin, segment=seg, slot=slot)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class SnapshotStats:
    """Timings of one save (seconds) and its size."""

    step: int
    nbytes: int = 0
    stall_s: float = 0.0          # time save() blocked the caller
    wait_s: float = 0.0           # part of the stall spent waiting for a free buffer
    stage_s: float | None = None  # device-to-host copy time
    persist_s: dict[str, float] = field(default_factory=dict)
    skipped_tiers: dict[str, str] = field(default_factory=dict)   # tiers that did not write it, and why

    @property
    def stage_gbps(self) -> float | None:
        """The device-to-host copy's rate, GB/s (10^9 bytes), or ``None`` before it was timed."""
        return self.nbytes / self.stage_s / 1e9 if self.stage_s else None

    def persist_gbps(self, tier: str) -> float | None:
        """State bytes per second persisted to ``tier``, GB/s, or ``None`` when it did not write this save."""
        s = self.persist_s.get(tier)
        return self.nbytes / s / 1e9 if s else None


class Snapshot:
    """One state captured into a host buffer; fenced once the copy is known to be ordered."""

    def __init__(self, step: int, entries: list[Entry], records: list[ItemRecord], data_bytes: int,
                 manifest: Manifest, buffer: HostBuffer, stats: SnapshotStats, timeline: Any = None) -> None:
        self.step = step
        #: the :class:`~ckpt.policy.Timeline` it was taken on: every tier commits it with this one, whatever
        #: the Checkpointer's timeline is by the time the tier gets to it (a rollback may come in between)
        self.timeline = timeline
        self.seq: int | None = None   # its place in the order snapshots are handed to the tiers (the pipeline's)
        self.entries = entries
        self.records = records
        self.data_bytes = data_bytes
        self.manifest = manifest
        self.buffer = buffer
        self.stats = stats
        self.error: BaseException | None = None
        self._cuda_done: torch.cuda.Event | None = None
        self._cuda_start: torch.cuda.Event | None = None
        self._cuda_device: torch.device | None = None   # the GPU whose side stream copies the state
        self._cpu_done = threading.Event()
        self._cpu_thread: threading.Thread | None = None   # the CPU tensors' copy, once started
        self._dma = False   # counted among the copies in flight (_copy_began) until the landing check saw it land
        self._lock = threading.Lock()
        self._fenced = False
        self._t0 = time.perf_counter()
        # Value checks of the CUDA tensors' copies: (key, record, dtype, shape, words) per tensor, their
        # fingerprints at save() (copied to the host on the side stream), and the paced copy itself,
        # which hands over its chunks, each with the event that says it has landed (verified as they land).
        self._checks: list[tuple[str, ItemRecord, torch.dtype, torch.Size, bool]] = []
        self._fp_host: torch.Tensor | None = None
        self._fp_after: torch.Tensor | None = None   # the same fingerprints once the copy was taken (host)
        self._copy: _PacedCopy | None = None
        self._verified = False
        self._verify_lock = threading.Lock()


    @classmethod
    def of_image(cls, step: int, buffer: HostBuffer, manifest: Manifest | None, timeline: Any) -> "Snapshot":
        """The snapshot of ``step`` that ``buffer`` holds already (``manifest`` describes it; ``None``: none could
        be had, for a snapshot that fails): nothing to copy, fenced, for the tiers to write as they write a new
        one (a snapshot a previous process took and did not persist)."""
        nbytes = manifest.data_bytes if manifest is not None else 0
        stats = SnapshotStats(step, nbytes=nbytes, stage_s=0.0)
        snap = cls(step, [], manifest.items if manifest is not None else [], nbytes, manifest, buffer, stats,
                   timeline)
        snap._cpu_done.set()
        snap._fenced = True
        return snap

    def _dma_landed(self) -> None:
        """Its copy to the host is no longer in flight (counted once)."""
        if self._dma:
            self._dma = False
            _copy_ended()

    # -- fences -------------------------------------------------------------------------------
    @property
    def fenced(self) -> bool:
        return self._fenced

    def fence_on_device(self) -> None:
        """Order the current stream after the copy (no host sync for CUDA), then check versions. The
        copies not yet enqueued are enqueued now, at once: the caller is about to change the state."""
        if self._fenced:
            return
        if self._copy is not None:
            self._copy.finish_now()
        if self._cuda_done is not None:   # the current stream of the state's GPU, not of the current GPU
            torch.cuda.current_stream(self._cuda_device).wait_event(self._cuda_done)
        self._cpu_done.wait()
        self._fence()

    def wait_copied(self) -> None:
        """Block the calling thread until every byte is in the host buffer and checked, then fence."""
        self._verify_cuda_copies()
        if self._copy is not None:
            self._copy.enqueued.wait()   # (returns at once after the verification: it waited for the end)
        if self._cuda_done is not None:
            self._cuda_done.synchronize()
        self._cpu_done.wait()
        thread = self._cpu_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()   # it has signalled; joined, no thread of the copy outlives the snapshot's watcher
        self._fence()
        if self.stats.stage_s is None:
            if self._cuda_start is not None:
                self.stats.stage_s = self._cuda_start.elapsed_time(self._cuda_done) / 1e3
            else:
                self.stats.stage_s = time.perf_counter() - self._t0

    def _verify_cuda_copies(self) -> None:
        """Compare each CUDA tensor's fingerprint at save() with its fingerprint once its copy was taken (both
        computed on the GPU, the second on the side stream after the last copy and before the optimizer step
        may run: equal, the copy read the values of save()). The host reads none of the snapshot's bytes for
        it: the memory tier's commit checksums the buffer once, after the copy (checksumming it while the copy
        landed slowed the copy by a third and a snapshot every 10 steps cost the loop +3.2% instead of +0.4%
        on an H200 node). Done once, by the first caller."""
        with self._verify_lock:
            if self._verified or self._copy is None:
                return
            torn: list[str] = []
            try:
                for _ in self._copy.landed():   # until every chunk is enqueued and ``done`` recorded after them
                    pass
                self._cuda_done.synchronize()   # the copy has landed and the second fingerprints are on the host
                if self.error is None and self._fp_host is not None and self._fp_after is not None:
                    before, after = self._fp_host.tolist(), self._fp_after.tolist()
                    torn = [self._checks[i][0] for i, (a, b) in enumerate(zip(before, after)) if a != b]
            finally:
                self._dma_landed()
                self._verified = True
                self._checks, self._fp_host, self._fp_after = [], None, None
        if torn:
            self._torn(torn)

    def _torn(self, keys: list[str]) -> None:
        """Fail the save: the host copy of ``keys`` differs from their values at save()."""
        more = f" (and {len(keys) - 1} more: {', '.join(repr(k) for k in keys[1:4])}{', ...' if len(keys) > 4 else ''})" \
            if len(keys) > 1 else ""
        with self._lock:
            if self.error is None:
                self.error = TornSnapshotError(
                    f"tensor {keys[0]!r}{more} was written in place after save() and before its snapshot copy "
                    f"was complete: the copy differs from its value at save(), so step {self.step}'s save is "
                    "dropped rather than persisted torn. Writes through .data, a numpy view or torch.no_grad() "
                    "are not seen by version counters; call Checkpointer.wait_staged() before in-place updates "
                    "outside optimizer.step() (an EMA update, say)", keys=keys)

    def _fence(self) -> None:
        with self._lock:
            if self._fenced:
                return
            self._fenced = True
            if self.error is None:
                for e in self.entries:
                    if not e.is_buffer and e.tensor._version != e.version:
                        self.error = TornSnapshotError(
                            f"tensor {e.key!r} was modified in place while step {self.step}'s snapshot copy "
                            "could still be in flight, so this save is dropped rather than persisted torn. "
                            "Call Checkpointer.wait_staged() before in-place updates outside optimizer.step() "
                            "(an EMA update, say)", keys=[e.key])
                        break
            self.entries = []   # drop tensor references: the copy no longer needs them
        _forget(self)


# Snapshots whose copies the next optimizer step must wait for.
_pending: list[Snapshot] = []
_pending_lock = threading.Lock()
_hook_handle: Any = None


def _forget(s: Snapshot) -> None:
    with _pending_lock:
        if s in _pending:
            _pending.remove(s)


def _fence_pending() -> None:
    with _pending_lock:
        snaps = list(_pending)
    for s in snaps:
        s.fence_on_device()


def _optimizer_pre_hook(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Make the optimizer's update wait for pending snapshot copies.

    ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS)
    runs forward and backward inside the closure: the wait then goes into the
    closure, after backward and right before the update, so the copy still
    overlaps forward and backward. ``args[0]`` is the optimizer itself.
    """
    if not _pending:
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        _fence_pending()
        return None

    def fenced_closure() -> Any:
        loss = closure()
        _fence_pending()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": fenced_closure}
    return (args[0], fenced_closure, *args[2:]), kwargs


def _ensure_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook_handle = register_optimizer_step_pre_hook(_optimizer_pre_hook)


def wait_all_staged() -> None:
    """Host-wait for every pending snapshot copy in this process and fence it."""
    with _pending_lock:
        snaps = list(_pending)
    for s in snaps:
        s.wait_copied()


def _dst(buf: HostBuffer, rec: ItemRecord, t: torch.Tensor) -> torch.Tensor:
    return _view(buf, rec, t.dtype, t.shape)


def _copies(buf: HostBuffer, rec: ItemRecord, t: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (destination, source) pairs that copy ``t`` into its place in ``buf``: one, or, in a shared
    segment where the item spans registration pieces, one per part inside a piece (a CUDA copy may not
    span two registrations: :func:`ckpt.shm.pieces`)."""
    dst = _dst(buf, rec, t)
    if buf.segment is None:
        return [(dst, t)]
    return list(_within_pieces(dst, t, rec.offset))


def _within_pieces(dst: torch.Tensor, src: torch.Tensor, offset: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``dst := src`` (``dst`` a contiguous view at byte ``offset`` of a segment) as copies that each stay
    inside one registration piece: as bytes where ``src`` is plain and contiguous, else by halving the
    leading dimension (a row that still spans a boundary: its own elements) down to parts that fit."""
    n = dst.numel() * dst.element_size()
    piece = _shm.REGISTER_PIECE
    if n == 0 or dst.dim() == 0 or offset // piece == (offset + n - 1) // piece:
        yield dst, src
        return
    if src.is_contiguous() and not (src.is_complex() or src.is_conj() or src.is_neg()):
        d, s_ = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for a, b in _shm.pieces(offset, n):
            yield d[a - offset:b - offset], s_[a - offset:b - offset]
        return
    if dst.shape[0] == 1:
        yield from _within_pieces(dst[0], src[0], offset)
        return
    half = dst.shape[0] // 2
    yield from _within_pieces(dst[:half], src[:half], offset)
    yield from _within_pieces(dst[half:], src[half:], offset + half * (n // dst.shape[0]))


def _view(buf: HostBuffer, rec: ItemRecord, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    key = (rec.offset, dtype, shape)
    view = buf.views.get(key)
    if view is None:   # the same state saves into the same views every time: build them once
        view = buf.views[key] = buf.tensor[rec.offset:rec.offset + rec.nbytes].view(dtype).view(shape)
    return view


# -- value fingerprints ---------------------------------------------------------------------------------
# Version counters miss writes through .data (a counter of its own), numpy views and numpy arrays.
# So each saved tensor's fingerprint is taken at save(), ordered before anything the caller does
# next (on the CPU: before save() returns; on CUDA: on the caller's stream), and compared with the
# same fingerprint of its host copy once that has landed. A mismatch fails the save.

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fits_words(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be read in place as whole 64-bit words (the fast form)."""
    return t.is_contiguous() and (t.numel() * t.element_size()) % 8 == 0 and t.data_ptr() % 8 == 0


def _as_ints(t: torch.Tensor, words: bool) -> torch.Tensor:
    """``t``'s bytes as integers, in place: 64-bit words (``words``), or integers of its item size
    (a complex tensor as its real and imaginary parts)."""
    if words:
        return t.reshape(-1).view(torch.int64)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def _fingerprint(t: torch.Tensor, words: bool) -> int:
    """The sum, wrapping modulo 2**64, of ``t``'s bytes read as integers: as 64-bit words when
    ``words`` (contiguous, whole aligned words: the fast form), otherwise as integers of its item
    size (any layout). Read in place, without a temporary copy of ``t``. Integer addition modulo
    2**64 gives the same result in any order, so it is exact and equal on every device for equal
    bytes, and any change confined to one word (or element) changes it; a permutation does not.
    On the CPU numpy sums (one thread, GIL released, and several times faster than torch's widening
    integer sums); on CUDA :func:`_fingerprint_on_device` gives the same number."""
    if t.device.type != "cpu":
        return int(_fingerprint_on_device(t, words))
    return int(_as_ints(t, words).numpy().sum(dtype=np.int64))


def _fingerprint_on_device(t: torch.Tensor, words: bool) -> torch.Tensor:
    """:func:`_fingerprint` as a 0-dim int64 tensor, computed on ``t``'s device and current stream."""
    return _as_ints(t, words).sum(dtype=torch.int64)


def _fingerprints(pairs: list[tuple[Entry, ItemRecord]]) -> tuple[list[bool], torch.Tensor | list[int] | None]:
    """Each tensor's form (words or items: the copy lands at ``rec.offset`` and must allow the same
    form) and fingerprint at this point of the caller's thread (CPU tensors: a list of ints) or stream
    (CUDA tensors: stacked in one int64 tensor on the device)."""
    # A lazily conjugated or negated view's bytes are not its values (the copy holds the values):
    # such rare tensors are resolved into a temporary first.
    srcs = [e.tensor.resolve_conj().resolve_neg() if e.tensor.is_conj() or e.tensor.is_neg() else e.tensor
            for e, _ in pairs]
    words = [_fits_words(t) and r.offset % 8 == 0 for t, (_, r) in zip(srcs, pairs)]
    if not pairs:
        return words, None
    if srcs[0].device.type == "cpu":
        return words, [_fingerprint(t, w) for t, w in zip(srcs, words)]
    return words, _GRAPHS.fingerprints(srcs, words)


class _FingerprintGraphs:
    """The CUDA tensors' fingerprints of one save, as one CUDA graph launch instead of one reduction
    launch per tensor (584 for a 1.24 B model with AdamW: ~12 ms of the host's time in ``save()``, while
    the GPU waits for the loop's next launches).

    A graph reads fixed addresses, so it serves only the same tensors at the same addresses, shapes,
    strides and forms as when it was captured (the key); a model and optimizer keep their tensors in
    place across steps, so the key repeats. It is captured the second time in a row a key is seen (a
    state made of new tensors each time never pays for a capture) and replayed on the caller's stream,
    ordered like the launches it replaces; the result is cloned out of the graph's memory, so a later
    replay never overwrites a save's fingerprints still being read. One graph per device; a capture that
    fails (e.g. inside the caller's own capture) falls back to the launches for good."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple] = {}     # device -> the key of the last save
        self._graph: dict[int, tuple[tuple, Any, torch.Tensor]] = {}   # device -> (key, graph, output)
        self._off = False   # a capture failed
        self._lock = threading.Lock()

    @staticmethod
    def _launch(srcs: list[torch.Tensor], words: list[bool]) -> torch.Tensor:
        return torch.stack([_fingerprint_on_device(t, w) for t, w in zip(srcs, words)])

    def fingerprints(self, srcs: list[torch.Tensor], words: list[bool]) -> torch.Tensor:
        dev = srcs[0].device.index if srcs[0].device.index is not None else torch.cuda.current_device()
        if self._off or not knobs.get("CKPT_FINGERPRINT_GRAPH") or torch.cuda.is_current_stream_capturing() or any(t.device != srcs[0].device for t in srcs):
            return self._launch(srcs, words)
        key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, w) for t, w in zip(srcs, words))
        with self._lock:
            held = self._graph.get(dev)
            if held is not None and held[0] == key:
                held[1].replay()   # on the current stream: ordered like the launches it stands for
                return held[2].clone()
            again = self._seen.get(dev) == key
            self._seen[dev] = key
            if not again:
                return self._launch(srcs, words)
            try:
                graph = self._capture(srcs, words)
            except Exception as e:   # noqa: BLE001 - the launches give the same numbers
                log.info("fingerprints stay one launch per tensor: capturing them as a CUDA graph failed (%s: %s)",
                         type(e).__name__, e)
                self._off = True
                return self._launch(srcs, words)
            self._graph[dev] = (key, *graph)
            graph[0].replay()
            return graph[1].clone()

    def _capture(self, srcs: list[torch.Tensor], words: list[bool]) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            out = self._launch(srcs, words)
        torch.cuda.current_stream().wait_stream(side)
        return graph, out


_GRAPHS = _FingerprintGraphs()
_GRAPHS_AFTER = _FingerprintGraphs()   # the second fingerprints, on the side stream (a graph of their own)


# -- the paced device-to-host copy -------------------------------------------------------------------
# While one stream has device-to-host copies queued, a device-to-host copy of another stream waits for
# them (one H200, 2026-11-24: a 4-byte .item() on the compute stream waited 67 ms behind 4 GiB queued on
# the side stream, in one copy, in 64 MiB chunks, or on a high-priority stream alike); it gets the copy
# engine as soon as the side stream has none queued, even for microseconds. Enqueued all at once, a
# 7.4 GB snapshot held the first sync of the next step (the HF forward's .all().item(), loss.item()) for
# the rest of its 135 ms copy, the GPU idle meanwhile: ~120 ms per snapshot. So the copy is enqueued in
# chunks: a first burst by save() (it starts at once, whatever the threads do next), then one chunk at a
# time, each after the previous one has landed, by a thread of its own: a sync of the loop waits for at
# most the burst once, then for at most one chunk (~1 ms). The pacing costs ~10% of the copy's speed
# (135 -> ~148 ms), still overlapped with forward and backward; the optimizer step's pre-hook enqueues
# whatever is left at once.

_COPY_CHUNK = 64 << 20   # bytes per chunk: one event each; a tensor larger than this is copied in pieces
_COPY_BURST = 4          # chunks save() enqueues itself (~5 ms of copy at 55 GB/s)
_COPIES_AHEAD = 1        # then: chunks enqueued and not yet landed, at most


def _chunks(buf: HostBuffer, items: list[tuple[torch.Tensor, ItemRecord]], chunk: int) -> Iterator[tuple[list, list[int]]]:
    """The copies of ``items`` into ``buf`` in chunks of about ``chunk`` bytes: per chunk, the (destination,
    source) pairs and the items whose last byte it copies. A contiguous tensor larger than a chunk is
    split (as bytes) across chunks; any other tensor is copied whole."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    done: list[int] = []
    size = 0
    for i, (t, rec) in enumerate(items):
        n = rec.nbytes
        if n > chunk and t.is_contiguous() and not (t.is_complex() or t.is_conj() or t.is_neg()):
            src = t.reshape(-1).view(torch.uint8)
            dst = buf.tensor[rec.offset:rec.offset + n]
            off = 0
            while off < n:
                k = min(chunk - size, n - off)
                if buf.segment is not None:   # a CUDA copy may not span two registration pieces
                    at = rec.offset + off
                    k = min(k, (at // _shm.REGISTER_PIECE + 1) * _shm.REGISTER_PIECE - at)
                pairs.append((dst[off:off + k], src[off:off + k]))
                size += k
                off += k
                if size >= chunk and off < n:
                    yield pairs, done
                    pairs, done, size = [], [], 0
        else:
            if size and size + n > chunk:
                yield pairs, done
                pairs, done, size = [], [], 0
            pairs.extend(_copies(buf, rec, t))
            size += n
        done.append(i)
        if size >= chunk:
            yield pairs, done
            pairs, done, size = [], [], 0
    if pairs or done:
        yield pairs, done


class _PacedCopy:
    """The copy of a snapshot's CUDA tensors (after its module buffers) on the side stream, enqueued a
    chunk at a time: a first burst by ``save()``, the rest by a thread of its own as earlier chunks land,
    or all at once by :meth:`finish_now` (the optimizer step's pre-hook, which must order itself after
    the whole copy). ``done`` is recorded after the last chunk; :meth:`landed` yields each chunk's event
    with the items it completes, in order, until the end."""

    def __init__(self, snap: Snapshot, items: list[tuple[torch.Tensor, ItemRecord]], stream: torch.cuda.Stream,
                 done: torch.cuda.Event, after: Callable[[], None] | None = None) -> None:
        self.snap = snap
        self.stream = stream
        self.done = done
        self.after = after   # enqueued after the last copy and before ``done`` (on the stream)
        self.enqueued = threading.Event()   # every copy is enqueued and ``done`` recorded
        self._chunks: Iterator[tuple[list, list[int]]] | None = _chunks(snap.buffer, items, _COPY_CHUNK)
        self._lock = threading.Lock()       # one thread enqueues at a time
        self._landed: queue.SimpleQueue = queue.SimpleQueue()

    def start(self) -> None:
        """Enqueue the first burst of chunks now (the caller's thread), and start the thread that enqueues
        the rest."""
        ahead = [self._next() for _ in range(max(_COPY_BURST, _COPIES_AHEAD))]
        if self.enqueued.is_set():
            return
        # Not a daemon, like the CPU staging thread: it holds tensor references until it has enqueued
        # the last copy (milliseconds to a fraction of a second), and shutdown waits for that.
        try:
            threading.Thread(target=self._run, args=([e for e in ahead if e is not None],),
                             name=f"ckpt-copy-{self.snap.step}", daemon=False).start()
        except RuntimeError:   # no thread to be had: enqueue the rest now, unpaced
            self.finish_now()

    def _next(self) -> torch.cuda.Event | None:
        """Enqueue the next chunk (``None``: there is none left); after the last, record ``done``."""
        with self._lock:
            if self._chunks is None:
                return None
            try:
                with torch.cuda.stream(self.stream):
                    pairs, idxs = next(self._chunks, (None, None))
                    if pairs is None:
                        self._end()
                        return None
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                self._landed.put((ev, idxs))
                return ev
            except BaseException as e:
                self._fail(e)
                return None

    def _run(self, ahead: list[torch.cuda.Event]) -> None:
        try:
            torch.cuda.set_device(self.stream.device)
            inflight = collections.deque(ahead)
            while True:
                while len(inflight) >= _COPIES_AHEAD:
                    inflight.popleft().synchronize()   # releases the GIL
                ev = self._next()
                if ev is None:
                    return
                inflight.append(ev)
        except BaseException as e:  # reported on the save handle by the pipeline
            with self._lock:
                self._fail(e)

    def finish_now(self) -> None:
        """Enqueue every copy left, at once (the caller's thread), and ``done`` after them."""
        while self._next() is not None:
            pass

    def landed(self) -> Iterator[tuple[torch.cuda.Event, list[int]]]:
        """Each enqueued chunk's event and the items it completes, in order, until the copy is enqueued
        to its end (blocks while the next chunk is not enqueued yet)."""
        while True:
            item = self._landed.get()
            if item is None:
                return
            yield item

    def _end(self) -> None:
        """(under the lock, on the stream) No copy is left to enqueue: enqueue ``after``, record ``done``, let go
        of the tensors, tell the waiters."""
        try:
            after, self.after = self.after, None
            if after is not None:
                after()
            self.done.record(self.stream)
        finally:
            self._chunks = None
            self._landed.put(None)
            self.enqueued.set()

    def _fail(self, e: BaseException) -> None:
        """(under the lock) Enqueuing failed: the save fails; the copies already enqueued land first."""
        if self.snap.error is None:
            self.snap.error = e
        if self.enqueued.is_set():
            return
        self._chunks = None
        self.after = None
        try:
            self.stream.synchronize()   # no copy may still be writing into a buffer handed back
            self.done.record(self.stream)
        except BaseException:   # noqa: BLE001 - the error above is the one reported
            pass
        finally:
            self._landed.put(None)
            self.enqueued.set()


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream_for(cuda: list[tuple[Entry, ItemRecord]], side_stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """The side stream of the GPU that holds the state's CUDA tensors: ``side_stream`` where it is that GPU's,
    else one made for it once. torch runs a copy on the current stream of the copied tensor's GPU, so copies
    of a state on another GPU than the current one (``model.to("cuda:1")`` without ``set_device``) would
    escape a side stream of the current GPU, and the snapshot would count as copied before it was.
    Raises :class:`~ckpt.errors.RefusedStateError` for a state spread over several GPUs of one process."""
    devices = sorted({e.tensor.device for e, _ in cuda}, key=str)
    if len(devices) > 1:
        keys = {str(d): next(e.key for e, _ in cuda if e.tensor.device == d) for d in devices}
        raise RefusedStateError(
            f"the state's CUDA tensors are on {len(devices)} GPUs of this process ({keys}): a snapshot is "
            "copied on one GPU's side stream; run one process per GPU (torchrun), or save each GPU's part "
            "with a Checkpointer of its own")
    device = devices[0]
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if side_stream.device == device:
        return side_stream
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _stage_cuda(snap: Snapshot, cuda: list[tuple[Entry, ItemRecord]], side_stream: torch.cuda.Stream) -> None:
    compute = torch.cuda.current_stream()
    checked = [(e, r) for e, r in cuda if not e.is_buffer]
    # on the caller's stream: ordered before anything the caller enqueues after save()
    words, fp_dev = _fingerprints(checked)
    side_stream.wait_stream(compute)   # the copy must see the step that was just computed
    start = torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side_stream):
        start.record(side_stream)
        if fp_dev is not None:
            snap._fp_host = torch.empty(len(checked), dtype=torch.int64, pin_memory=True, device="cpu")
            snap._fp_host.copy_(fp_dev, non_blocking=True)
            fp_dev.record_stream(side_stream)   # not reused by the caller's stream before this copy read it
        bufs = [(e, r) for e, r in cuda if e.is_buffer]
        if bufs:
            for e, r in bufs:
                for dst, src in _copies(snap.buffer, r, e.tensor):
                    dst.copy_(src, non_blocking=True)
            buf_ev = torch.cuda.Event()
            buf_ev.record(side_stream)
            compute.wait_event(buf_ev)   # next forward waits for this small copy, on the GPU
    snap._checks = [(e.key, r, e.tensor.dtype, e.tensor.shape, w) for (e, r), w in zip(checked, words)]
    snap._cuda_start, snap._cuda_done, snap._cuda_device = start, done, side_stream.device
    srcs = [e.tensor.resolve_conj().resolve_neg() if e.tensor.is_conj() or e.tensor.is_neg() else e.tensor
            for e, _ in checked]

    def after() -> None:   # on the side stream, after the last copy: the values the copy read
        if srcs:
            fp = _GRAPHS_AFTER.fingerprints(srcs, words)
            snap._fp_after = torch.empty(len(srcs), dtype=torch.int64, pin_memory=True, device="cpu")
            snap._fp_after.copy_(fp, non_blocking=True)
        srcs.clear()

    snap._copy = _PacedCopy(snap, [(e.tensor, r) for e, r in checked], side_stream, done, after)
    snap._copy.start()


@torch.no_grad()
def stage(snap: Snapshot, side_stream: torch.cuda.Stream | None) -> None:
    """Enqueue the copies of ``snap``'s tensors into its buffer; returns before they finish."""
    _ensure_hook()
    with _pending_lock:
        _pending.append(snap)
    work = [(e, r) for e, r in zip(snap.entries, snap.records) if r.alias_of is None and r.nbytes > 0]
    cuda = [(e, r) for e, r in work if e.tensor.device.type == "cuda"]
    cpu = [(e, r) for e, r in work if e.tensor.device.type == "cpu"]
    other = [e.key for e, r in work if e.tensor.device.type not in ("cuda", "cpu")]
    if other:
        raise TypeError(f"tensors on devices other than cpu and cuda cannot be staged yet: {other[:3]}")
    # Module buffers on the CPU: copied now, before the caller's next forward can touch them.
    for e, r in cpu:
        if e.is_buffer:
            _dst(snap.buffer, r, e.tensor).copy_(e.tensor)
    rest = [(e, r) for e, r in cpu if not e.is_buffer]
    rest_words, rest_fp = _fingerprints(rest)   # the values at save(): before save() returns
    if cuda:
        if side_stream is None:
            raise RuntimeError("CUDA tensors in the state but no side stream")
        side_stream = _side_stream_for(cuda, side_stream)
        _copy_began()
        snap._dma = True
        try:
            with torch.cuda.device(side_stream.device):   # the state's GPU: its streams, not the current GPU's
                _stage_cuda(snap, cuda, side_stream)
        except BaseException:
            side_stream.synchronize()   # no copy may still be writing into a buffer handed back
            snap._dma_landed()
            raise
    if rest:
        expected = rest_fp

        @torch.no_grad()
        def copy_cpu() -> None:
            priority.lower_this_thread()
            try:
                torn = []
                for (e, r), words, fp in zip(rest, rest_words, expected):
                    dst = _dst(snap.buffer, r, e.tensor)
                    dst.copy_(e.tensor)
                    if _fingerprint(dst, words) != fp:   # the copy is not the value at save()
                        torn.append(e.key)
                if torn:
                    snap._torn(torn)
                if not cuda:
                    # The copy is complete and this thread knows it exactly: fence here, so that
                    # later in-place writes are ordered after the copy and never reported.
                    snap.stats.stage_s = time.perf_counter() - snap._t0
                    snap._fence()
            except BaseException as exc:  # reported on the save handle by the pipeline
                snap.error = exc
            finally:
                snap._cpu_done.set()
        # Not a daemon, for the reason given where the pipeline starts its watcher thread: it
        # drops tensor references after signalling, so shutdown must wait for it (milliseconds).
        snap._cpu_thread = threading.Thread(target=copy_cpu, name=f"ckpt-stage-{snap.step}", daemon=False)
        snap._cpu_thread.start()
    else:
        snap._cpu_done.set()

"""The memory tier: the newest snapshots, in host memory, readable after the process dies.

Each host buffer of the snapshot pool (:class:`ckpt.pool.HostPool`) holds at most one whole
snapshot. In this process the memory tier needs no I/O and no checksum pass: when it is at least
as new as anything on disk, restore uses it first, at host-to-device bandwidth. When the buffers
are shared-memory segments (:mod:`ckpt.shm`, the default on Linux), each committed snapshot also
gets a commit record with per-chunk checksums, so a *new* process on the same node (after SIGKILL,
an OOM kill, a NCCL timeout) restores from RAM: it checks every chunk before any byte is used and
passes over a snapshot whose record was withdrawn or rewritten while it read (the buffer was being
written again). A snapshot being written when its process died has no record and is never served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .. import knobs, shm
from ..errors import CorruptCheckpointError
from ..format import ItemRecord, Manifest
from ..integrity import checksum
from ..policy import Committed, Timeline
from ..scatter import Scatter
from ..pool import HostBuffer, HostPool, SharedSpace
from .base import StepInfo, Tier, TierFigures, register

__all__ = ["MemoryTier", "space_for"]

log = logging.getLogger(__name__)

#: seconds since the last record was written after which a record pass in progress keeps its buffer instead of
#: giving it up to a new snapshot (see MemoryTier._pick_record): the most a crash costs while snapshots come
#: faster than their records can be written
RECORD_PATIENCE_S = 5.0


@register
class MemoryTier(Tier):
    """Snapshots held in ``pool``'s buffers and, with ``space``, those a previous process left in its
    shared-memory segments (``space``: where this local tier's and rank's segments live).

    Its commit is phase 1's: :meth:`commit` takes a host buffer the snapshot was copied into (no bytes
    move); retention is the number of buffers (``max_in_flight``), each reused for a newer snapshot once
    its record is withdrawn."""

    name = "memory"
    nearness = 0
    durable = False
    needs = None  # every Checkpointer has one
    built_after = ("local",)  # its segments are named from local_dir's identity

    @classmethod
    def for_storage(cls, storage: Any, built: dict[str, Any], pool: Any, rank: int) -> "MemoryTier | None":
        """The memory tier over ``pool``, in the shared-memory space of ``rank`` under the local tier."""
        if cls.name != MemoryTier.name:
            return super().for_storage(storage, built, pool, rank)
        return cls(pool, space_for(built["local"].root, rank))

    def __init__(self, pool: HostPool, space: SharedSpace | None = None) -> None:
        self.pool = pool
        self.space = space
        self.rank = 0
        self.verified: dict[int, bool] = {}
        self.timeline = (
            Timeline()
        )  # the timeline of the snapshots committed from now on (the Checkpointer sets it)
        self._ahead: _ReadAhead | None = None
        self.records_failed = (
            0  # snapshots whose record could not be written (they did not outlive the process)
        )
        self.skipped = 0  # saves skipped: no buffer was free (counted by the Checkpointer)
        self._record_error: tuple | None = (
            None  # the cause of the last such failure (logged loudly when it changes)
        )
        # the records written in the background (commit(..., recorded=...)): the thread writing them, whether
        # the pipeline is closing (the newest is then recorded whatever it costs), and the counts
        self._recorder: threading.Thread | None = None
        self._settling = False
        self._abandon = False
        self._recorded_at: float | None = (
            None  # when the last record was written (monotonic), or the first commit
        )
        self.records_written = 0  # records written in the background
        self.records_superseded = 0  # snapshots a newer one replaced before their record was written

    # -- commit -----------------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        manifest: Manifest,
        buffer: HostBuffer,
        checksums: list[int] | None = None,
        timeline: Timeline | None = None,
        record_required: bool = False,
        recorded: Callable[[str | None], None] | None = None,
    ) -> None:
        """Mark ``buffer`` as holding the complete, fenced snapshot of ``step``; a shared-memory buffer
        gets its record (chunk checksums computed now, or ``checksums`` already checked against the
        bytes) before the snapshot counts as held. ``timeline``: the snapshot's (default: this tier's).

        ``recorded`` (a snapshot just taken by this process): the snapshot counts as held in this process at
        once, and its record (what makes it outlive the process) is written in the background, by one thread,
        newest first: ``recorded(None)`` once it is, ``recorded(reason)`` when a newer snapshot was recorded
        first or its buffer was taken back (this one then lives in this process's memory only). Checksumming a
        large snapshot can take longer than a training step: the copy's buffer is free for the next snapshot
        meanwhile, and a record pass gives its buffer up to a new snapshot (see :meth:`_pick_record`). Without
        shared memory (nothing to record) ``recorded(None)`` is called at once.

        A record the RAM file system refuses costs the snapshot its crash survival only (it is held in this
        process, said once in the log, counted in :attr:`records_failed`), unless ``record_required`` (a
        peer's replica, whose sender is told it is committed only once it outlives this process): then the
        ``OSError`` is raised and nothing is held. A snapshot of the same step and timeline held in another
        buffer no one reads (an earlier run's, saved again) is withdrawn: one copy of a step per timeline."""
        record = None
        space = self.pool.shared
        timeline = self.timeline if timeline is None else timeline
        later = (
            recorded is not None and checksums is None and buffer.segment is not None and space is not None
        )
        if buffer.segment is not None and space is not None and not later:
            sums = (
                checksums
                if checksums is not None
                else shm.chunk_checksums(
                    buffer.tensor, manifest.data_bytes, manifest.chunk_bytes, background=True
                )
            )
            held = dataclasses.replace(manifest, chunks=sums)
            try:
                record = shm.write_record(
                    space.root, space.prefix, buffer.slot, step, timeline, held, space.local_dir
                )
            except OSError as e:
                if record_required:
                    raise
                self._record_failed(step, space, held, e)
            if len(manifest.chunks) != len(sums):
                manifest.chunks = sums  # the tiers that read this buffer next (the peer tier) reuse them
        with self.pool._cv:
            buffer.manifest = manifest
            buffer.image_timeline = timeline
            buffer.image_step = step
            buffer.image_order = self.pool.commit_order()
            buffer.record = record
            buffer.checked = True  # bytes this process copied
            buffer.inherited = False
            for b in self.pool.buffers:
                if (
                    b is not buffer
                    and b.image_step == step
                    and (b.image_timeline or Timeline()) == timeline
                    and not b.holds
                ):
                    self.pool._withdraw(b, shm)
            if later:
                buffer.on_record = recorded
                if self._recorded_at is None:  # the record patience counts from the first snapshot
                    self._recorded_at = time.monotonic()
                self._kick()
        if recorded is not None and not later:
            recorded(None)

    # -- records written in the background ----------------------------------------------------------
    def _kick(self) -> None:
        """(under the pool's lock) Start the recording thread if none runs."""
        if self._recorder is None or not self._recorder.is_alive():
            # a daemon: at exit the pipelines are closed first (Pipeline.close settles the records), and a
            # process that exits without that loses only records, which the next process does without
            self._recorder = threading.Thread(
                target=self._record_loop, name="ckpt-memory-record", daemon=True
            )
            self._recorder.start()
        self.pool._cv.notify_all()

    def _pick_record(self) -> HostBuffer | None:
        """(under the pool's lock) The buffer whose record the recording thread writes next: the newest
        snapshot still waiting for one (the callbacks of older ones are told they were superseded), ``None``
        when none waits or the tier closes without keeping its segments (the waiting ones are told).

        The pass never costs a snapshot: once a newer snapshot is committed, a new one may take the buffer
        of the one being recorded (the pass stops, nothing is published), as long as a record was written in
        the last :data:`RECORD_PATIENCE_S` seconds; past that, the pass in progress keeps its buffer (a
        snapshot due meanwhile may be skipped), so that a crash never costs more than about that much."""
        waiting = sorted(
            (b for b in self.pool.buffers if b.on_record is not None and b.image_step is not None),
            key=lambda b: -b.image_order,
        )
        if self._abandon:  # closing without keeping the segments: no record would outlive the close
            for b in waiting:
                callback, b.on_record = b.on_record, None
                callback("the memory tier closed (freeing its RAM) before its record was written")
            return None
        if not waiting:
            return None
        pick = waiting[0]
        for b in waiting[1:]:
            callback, b.on_record = b.on_record, None
            self.records_superseded += 1
            callback(
                f"superseded by step {pick.image_step} before its record was written (it was in this "
                f"process's memory only)"
            )
        return pick

    def _gives_way(self) -> bool:
        """(under the pool's lock) Whether a record pass in progress gives its buffer up to a new snapshot now."""
        return (
            not (self._settling or self.pool._closed)
            and time.monotonic() - (self._recorded_at or 0.0) < RECORD_PATIENCE_S
        )

    def _record_loop(self) -> None:
        try:
            self._record_passes()
        except BaseException as e:  # noqa: BLE001 - never die silently: settle() starts another if one still waits
            with self.pool._cv:
                self._recorder = None
                self.pool._cv.notify_all()
            log.warning(
                "the memory tier's record thread stopped (%s: %s); the next commit or close() starts another",
                type(e).__name__,
                e,
            )

    def _record_passes(self) -> None:
        from .. import priority

        priority.lower_this_thread()  # a checksum pass over the whole snapshot, beside training
        cv = self.pool._cv
        while True:
            with cv:
                buf = self._pick_record()
                if buf is None:
                    self._recorder = None
                    cv.notify_all()
                    return
                buf.holds += 1
                buf.record_yields, buf.record_taken = self._gives_way, None
                callback, buf.on_record = buf.on_record, None
                step, timeline, manifest, space = (
                    buf.image_step,
                    buf.image_timeline,
                    buf.manifest,
                    self.pool.shared,
                )
            reason = None

            @contextlib.contextmanager
            def unless_taken(record: shm.SnapshotRecord):
                with (
                    cv
                ):  # a new snapshot takes the buffer under this lock: it finds the record published or none
                    go = buf.record_taken is None
                    yield go
                    if go:  # a snapshot that takes the buffer from now on withdraws this record first
                        buf.record = record
                        self.records_written += 1
                        self._recorded_at = time.monotonic()

            def taken() -> str:
                self.records_superseded += 1
                return (
                    f"its buffer was taken for step {buf.record_taken} before its record was written (it was "
                    f"in this process's memory only)"
                )

            try:
                if space is None:  # the pool closed meanwhile (its segments are gone or kept unrecorded)
                    reason = "the memory tier closed before its record was written"
                else:
                    sums = shm.chunk_checksums(
                        buf.tensor,
                        manifest.data_bytes,
                        manifest.chunk_bytes,
                        background=True,
                        stop=lambda: buf.record_taken is not None,
                    )
                    if sums is None:
                        reason = taken()
                    else:
                        held = dataclasses.replace(manifest, chunks=sums)
                        try:
                            if (
                                shm.write_record(
                                    space.root,
                                    space.prefix,
                                    buf.slot,
                                    step,
                                    timeline,
                                    held,
                                    space.local_dir,
                                    guard=unless_taken,
                                )
                                is None
                            ):
                                reason = taken()
                        except OSError as e:  # as commit's: held in this process only, said once, counted
                            self._record_failed(step, space, held, e)
                        if reason is None and len(manifest.chunks) != len(sums):
                            manifest.chunks = (
                                sums  # the tiers that read this buffer next (the peer tier) reuse them
                            )
            except BaseException as e:  # noqa: BLE001 - the snapshot stays in this process's memory
                self.records_failed += 1
                log.warning(
                    "the record of step %d in the memory tier failed (%s: %s): it is in this process's "
                    "memory only",
                    step,
                    type(e).__name__,
                    e,
                )
            finally:
                with cv:  # one step: a save never finds the buffer held by a pass that no longer gives way
                    buf.record_yields, buf.record_taken = None, None
                    self.pool.release(buf)
            try:
                callback(reason)
            except Exception as e:  # noqa: BLE001 - a handle's bookkeeping never stops the records of the others
                log.warning(
                    "telling the handle of step %d its record's outcome failed (%s: %s)",
                    step,
                    type(e).__name__,
                    e,
                )

    def settle(self, timeout: float | None = None, write: bool = True) -> bool:
        """Write the record of the newest snapshot still waiting for one, whatever buffers that holds (close:
        no copy comes after), and wait until no record is being written; ``write=False`` (a close that frees
        the segments): write none, only wait for the one being written. Returns False when ``timeout``
        (seconds) ran out first. A snapshot still waiting once the thread is gone (it stopped on an error)
        gets a thread of its own: close() never leaves the newest unrecorded where the segments stay."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.pool._cv:
            self._settling = True
            self._abandon = not write
            restarts = 0
            try:
                while True:
                    idle = self._recorder is None or not self._recorder.is_alive()
                    if idle:
                        if not write:
                            self._pick_record()  # no thread to tell the waiting snapshots: tell them here
                            return True
                        waiting = [
                            b.image_step
                            for b in self.pool.buffers
                            if b.on_record is not None and b.image_step is not None
                        ]
                        if not waiting:
                            return True
                        if restarts == 3:
                            log.warning(
                                "the memory tier could not write the record of step(s) %s: they stay in "
                                "this process's memory only",
                                sorted(waiting),
                            )
                            return True
                        restarts += 1
                        self._kick()  # a snapshot still waits for its record and no thread writes it
                    self.pool._cv.notify_all()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self.pool._cv.wait(0.05 if left is None else min(0.05, left))
            finally:
                self._settling = False

    def _record_failed(self, step: int, space: SharedSpace, held: Manifest, error: OSError) -> None:
        """A record could not be written (``/dev/shm`` full, a foreign entry at its name): the snapshot stays in
        this process's memory tier and goes to every other tier as usual, but does not outlive the process.
        Counted (:meth:`figures`), and logged: at WARNING the first time and whenever the cause changes."""
        self.records_failed += 1
        path = space.root / shm.record_name(space.prefix, 0)
        need = len(held.to_bytes()) + 512
        cause = (error.errno, type(error))
        loud = cause != self._record_error
        self._record_error = cause
        log.log(
            logging.WARNING if loud else logging.INFO,
            "step %d is in the memory tier of this process only, not in RAM that outlives it: its record "
            "could not be written in %s (%s; it needs %d bytes there: %s). The local and remote tiers still "
            "get it (%d snapshot(s) so far without a record)",
            step,
            space.root,
            error.strerror or error,
            need,
            path.name.replace("-s00", "-sNN"),
            self.records_failed,
        )

    # -- listing ----------------------------------------------------------------------------------
    def _held(self) -> list[HostBuffer]:
        """The buffers holding a snapshot, the last committed first (lookups take the newest of a step)."""
        with self.pool._cv:
            return sorted(
                (b for b in self.pool.buffers if b.image_step is not None and b.manifest is not None),
                key=lambda b: -b.image_order,
            )

    def _left(self) -> list[shm.SnapshotRecord]:
        """Records of segments this process has not taken over (a previous process's snapshots)."""
        if self.space is None:
            return []
        with self.pool._cv:
            mine = {b.slot for b in self.pool.buffers if b.segment is not None}
            shared = self.pool.shared is not None
        out = []
        for g in shm.segments(self.space.root, self.space.prefix):
            for rec in g.records:
                if not (shared and rec.slot in mine):
                    out.append(rec)
        return out

    def committed(self) -> list[Committed]:
        """The snapshots held, with the timeline each was saved on."""
        out = [Committed(b.image_step, b.image_timeline or Timeline()) for b in self._held()]
        seen = {c.key for c in out}
        out += [
            Committed(r.step, r.timeline) for r in self._left() if (r.timeline.number, r.step) not in seen
        ]
        return out

    def manifest(self, step: int, timeline: Timeline) -> Manifest | None:
        """The manifest of the snapshot of ``step`` on ``timeline`` still held, if any (the newest such)."""
        for b in self._held():
            if b.image_step == step and (b.image_timeline or Timeline()) == timeline:
                return b.manifest
        rec = self._record(step, timeline)
        return rec.manifest if rec is not None else None

    def _record(self, step: int, timeline: Timeline | None) -> shm.SnapshotRecord | None:
        recs = [r for r in self._left() if r.step == step and (timeline is None or r.timeline == timeline)]
        return max(recs, key=lambda r: r.created_unix) if recs else None

    def manifest_of(self, step: int, timeline: Timeline | None = None) -> Manifest:
        """The manifest of the snapshot of ``step`` held (``LookupError`` when it is no longer held)."""
        m = (
            self.manifest(step, timeline)
            if timeline is not None
            else next((b.manifest for b in self._held() if b.image_step == step), None)
            or (lambda r: r.manifest if r is not None else None)(self._record(step, None))
        )
        if m is None:
            raise LookupError(f"step {step} is no longer in host memory")
        return m

    def inherited(self, step: int, timeline: Timeline) -> bool:
        """Whether the snapshot of ``step`` on ``timeline`` held here was taken by a previous process (one that
        died, or closed keeping its segments), not by this one."""
        for b in self._held():
            if b.image_step == step and (b.image_timeline or Timeline()) == timeline:
                return b.inherited
        return self._record(step, timeline) is not None

    def hold_image(self, step: int, timeline: Timeline, manifest: Manifest) -> HostBuffer:
        """The buffer of this process's pool holding the snapshot ``manifest`` describes (of ``step`` on
        ``timeline``), held (:meth:`HostPool.release` it), its every chunk checked where it was taken over from a
        previous process and not checked since. ``LookupError`` when no buffer holds it (its segment was not
        taken over), ``CorruptCheckpointError`` when a chunk fails its checksum."""
        with self.pool._cv:
            buf = next(
                (
                    b
                    for b in self.pool.buffers
                    if b.image_step == step
                    and b.manifest == manifest
                    and (b.image_timeline or Timeline()) == timeline
                ),
                None,
            )
            if buf is None:
                raise LookupError(f"step {step} is not in a host buffer of this process")
            buf.holds += 1
        try:
            if not buf.checked:
                self._load_adopted(buf, buf.manifest, None)
        except BaseException:
            self.pool.release(buf)
            raise
        return buf

    def describe(self, step: int, timeline: Timeline | None = None) -> StepInfo:
        """The segment (or this process's memory) holding ``step``, its bytes and when it was committed."""
        for b in self._held():
            if b.image_step == step and (timeline is None or (b.image_timeline or Timeline()) == timeline):
                where = (
                    str(b.segment.path) if b.segment is not None else f"host memory of process {os.getpid()}"
                )
                return StepInfo(where, b.manifest.data_bytes, b.manifest.created_unix, 1)
        rec = self._record(step, timeline)
        if rec is None:
            return StepInfo()
        return StepInfo(
            str(Path(rec.path).with_name(rec.buffer)), rec.manifest.data_bytes, rec.created_unix, 1
        )

    def location(self) -> str:
        if self.space is not None:
            return f"{self.space.root}/{self.space.prefix}-*"
        return f"host memory of process {os.getpid()}"

    def where(self, step: int) -> str:
        return f"step {step} in host memory ({self.describe(step).path})"

    def delete(self, step: int) -> None:
        """Withdraw the snapshot of ``step``: its record goes first (no reader is served it from then on);
        the buffer stays allocated for the next snapshot. A buffer being read or persisted is left alone
        (``OSError(EBUSY)``)."""
        found = False
        with self.pool._cv:
            for b in self.pool.buffers:
                if b.image_step != step:
                    continue
                if b.holds:
                    raise OSError(errno.EBUSY, f"the snapshot of step {step} is being read or persisted")
                self.pool._withdraw(b, shm)  # its record first, then the image
                found = True
        for rec in self._left():
            if rec.step == step and rec.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(rec.path)
                found = True
        self.verified.pop(step, None)
        if not found:
            raise FileNotFoundError(errno.ENOENT, f"step {step} is not in host memory")

    def bytes_held(self) -> int | None:
        """RAM of the shared-memory segments (or this process's buffers) holding snapshots."""
        return self.nbytes() if self.space is not None else self.pool.nbytes

    def capacity_bytes(self) -> int | None:
        """What the host buffers may take: ``host_memory_limit`` when set, else the RAM file system's room."""
        if self.pool.limit is not None:
            return self.pool.limit
        if self.space is not None:
            return shm.available_bytes(self.space.root) + self.nbytes()
        return None

    def say_kept(self, loud: bool) -> None:
        """Log the RAM this tier's segments keep once the Checkpointer is gone, and how to free it (at WARNING
        when ``loud``: the process did not close the Checkpointer itself, or its block raised)."""
        if self.space is None or self.pool.shared is None:  # not the owner: none of the segments are its own
            return
        kept = self.nbytes()
        if kept:
            log.log(
                logging.WARNING if loud else logging.INFO,
                "the memory tier keeps %.2f GB of RAM in %s for the next process on this node (it restores from "
                "it); `ckpt gc --memory %s` frees it",
                kept / 1e9,
                self.location(),
                self.space.local_dir,
            )

    def figures(self) -> TierFigures:
        """:meth:`Tier.figures`, with the buffers, the snapshots skipped for want of a free one, those that
        stayed in this process only, and what fewer than three buffers give up."""
        slots = self.pool.slots
        gives_up = None
        if slots == 2:
            gives_up = (
                "two buffers: while a tier reads one snapshot, the newest is kept whole in the other and "
                "every new snapshot is skipped until the tier is done"
            )
        elif slots == 1:
            gives_up = (
                "one buffer: a new snapshot is skipped while a tier reads the previous one and otherwise "
                "takes its buffer; a snapshot that then fails leaves the memory tier empty"
            )
        return dataclasses.replace(
            super().figures(),
            buffers=slots,
            snapshots_skipped=self.skipped,
            records_failed=self.records_failed,
            gives_up=gives_up,
            records_written=self.records_written,
            records_superseded=self.records_superseded + self.pool.unrecorded_dropped,
        )

    def newest(self) -> tuple[int, Manifest] | None:
        buf = self.pool.newest_image()
        if buf is None or buf.manifest is None:
            return None
        return buf.image_step, buf.manifest

    def nbytes(self) -> int:
        """RAM the shared-memory segments of this local tier and rank take (0 without them)."""
        if self.space is None:
            return 0
        return sum(g.nbytes for g in shm.segments(self.space.root, self.space.prefix))

    # -- reading ----------------------------------------------------------------------------------
    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None]) -> None:
        """Copy snapshot ``step`` into ``dest``. From this process's buffer as it is; from a segment a
        previous process left, after checking every chunk (``CorruptCheckpointError`` naming the
        segment) and, afterwards, that its record was not withdrawn meanwhile (``LookupError``). A segment this
        process took over (adopted) is checked on the host's threads, then copied at the pinned rate."""
        self.pool.wait_adopted()  # a segment being taken over is read from its mapping once it is
        with self.pool._cv:
            # the snapshot listed and described by ``manifest``, never another of the same step: a rollback's new
            # branch saves the same step again, with other bytes (its manifest's chunk checksums and creation time
            # differ), and only the copy that was listed may be loaded
            buf = next(
                (b for b in self.pool.buffers if b.image_step == step and b.manifest is manifest), None
            ) or next((b for b in self.pool.buffers if b.image_step == step and b.manifest == manifest), None)
            if buf is not None:
                buf.holds += 1  # not taken for a new snapshot while it is read
        if buf is not None:
            try:
                early = self._ahead.take(buf, manifest) if self._ahead is not None else None
                if early is not None:  # read onto the GPU (and checked) while the ranks agreed
                    _scatter(manifest, dest, early)
                elif buf.checked:
                    _scatter(manifest, dest, buf.tensor[: manifest.data_bytes])
                else:
                    self._load_adopted(buf, manifest, dest)
            finally:
                self.pool.release(buf)
            return
        rec = next((r for r in self._left() if r.step == step and r.manifest == manifest), None)
        if rec is None:
            raise LookupError(f"step {step} is no longer in host memory (not the copy that was listed)")
        self._load_segment(rec, dest)

    def _load_adopted(
        self, buf: HostBuffer, manifest: Manifest, dest: list[torch.Tensor | None] | None
    ) -> None:
        """Check, then copy (``dest``), a snapshot in a segment this process took over but has not checked yet:
        every chunk is checked on the I/O threads first (0.05 s per 3.7 GB on 16 threads), and only a snapshot
        whose every chunk passed is copied to its destinations (registered memory: straight to the GPU); one
        that fails raises ``CorruptCheckpointError`` naming the segment and leaves ``dest`` as it was (a key
        the fallback checkpoint lacks keeps its value under ``strict=False``). From then on the buffer
        counts as checked."""
        held = buf.manifest if buf.manifest is not None else manifest
        data = buf.tensor[: held.data_bytes]
        first = shm.first_bad_chunk(data, held)
        if first is not None:
            c = held.chunk_bytes
            raise CorruptCheckpointError(
                f"{buf.segment.path if buf.segment is not None else 'host memory'}: bytes [{first * c}, "
                f"{min((first + 1) * c, held.data_bytes)}) of the memory tier's snapshot of step {buf.image_step} "
                "(taken over from the previous process) fail their checksum"
            )
        buf.checked = True
        if dest is not None:
            _scatter(manifest, dest, data)

    def _load_segment(self, rec: shm.SnapshotRecord, dest: list[torch.Tensor | None] | None) -> None:
        """Check, then copy (``dest``), the snapshot of ``rec`` in a segment a previous process left: nothing is
        copied into ``dest`` before every chunk passed its checksum and the record was found still standing, so a
        snapshot that fails its checks leaves ``dest`` as it was. Destinations on a GPU, and host ones while a
        live process owns the segment's local tier (it may take the buffer back and rewrite it meanwhile), get a
        private copy checked before any of it is used (:func:`_checked_copy`, which says what remains open
        where there is no room for one); host destinations with no live owner beside are copied from a mapping
        of the segment once every chunk passed there (nobody writes it). Raises what :func:`_judge` raises."""
        path = Path(rec.path).with_name(rec.buffer)
        sc = Scatter(rec.manifest.items, dest) if dest is not None else None
        if sc is not None and (sc.to_device or self._live_owner()):
            fd = shm.open_for_read(path, rec.manifest.data_bytes)
            try:
                bad, copied = _checked_copy(rec, fd, sc, _gpu_of(dest))
            finally:
                os.close(fd)
            if not copied:  # copied: every byte of it checked while its record stood, whatever happens now
                _judge(rec, path, bad)
            return
        seg = shm.Segment.open(path, rec.manifest.data_bytes, writable=False)
        try:
            data = seg.tensor[: rec.manifest.data_bytes]
            bad = shm.first_bad_chunk(data, rec.manifest)
            if bad is None and dest is not None and shm.still_current(rec):
                _scatter(rec.manifest, dest, data)
            _judge(rec, path, bad)
        finally:
            seg.release()

    def _live_owner(self) -> bool:
        """Whether a live process (this one included) owns the local tier these segments belong to."""
        from .local import owned

        return self.space is not None and owned(self.space.local_dir)

    # -- reading ahead ----------------------------------------------------------------------------
    def read_ahead(self, device: torch.device) -> None:
        """Start copying this rank's newest snapshot in host memory onto ``device`` (the state's GPU), in the
        background, while the ranks of a collective restore agree on a step: where they agree on that
        snapshot, :meth:`load` copies it into place device to device instead of over the host link. The
        snapshot is checked first where it was taken over from a previous process, and a copy is made only
        where the GPU has room for twice the snapshot and 1 GiB more (a peer tier may need the same again
        to serve a replica); nothing is written into the state before :meth:`load`. Ended (its GPU memory
        given back) by :meth:`end_read_ahead`."""
        if self._ahead is None and knobs.get("CKPT_READ_AHEAD"):
            self._ahead = _ReadAhead(self, device)

    def end_read_ahead(self) -> None:
        """Give back what :meth:`read_ahead` took (once its copy, if one runs, has landed)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.end()

    def verify(self, step: int, timeline: Timeline | None = None) -> list[Manifest]:
        """Check every chunk of the snapshot of ``step`` a previous process left (this process's own
        buffers hold bytes that never left it); returns its manifest (this rank's one copy, in a list as every
        tier's ``verify``). Raises ``CorruptCheckpointError`` / ``LookupError``."""
        self.pool.wait_adopted()
        rec = self._record(step, timeline)
        if rec is None:
            with self.pool._cv:
                buf = next(
                    (
                        b
                        for b in self._held()
                        if b.image_step == step
                        and (timeline is None or (b.image_timeline or Timeline()) == timeline)
                    ),
                    None,
                )
                if buf is None:
                    raise LookupError(f"step {step} is not in host memory")
                buf.holds += 1  # not taken for a new snapshot while it is checked
            try:
                if not buf.checked:  # taken over from the previous process: its bytes are checked once
                    self._load_adopted(buf, buf.manifest, None)
                return [buf.manifest]
            finally:
                self.pool.release(buf)
        self._load_segment(rec, None)
        return [rec.manifest]


class _ReadAhead:
    """:meth:`MemoryTier.read_ahead`: one thread copies the newest snapshot's buffer (held meanwhile, so no new
    snapshot takes it) into a GPU buffer of its size; :meth:`take` hands that buffer to a load of the same
    snapshot (the same buffer, committed at the same time), waiting for the copy where it is of that snapshot;
    anything else, or a failure, leaves the load to read the host buffer as without it."""

    def __init__(self, tier: MemoryTier, device: torch.device) -> None:
        self.tier, self.device = tier, device
        self._lock = threading.Lock()
        self.target: tuple[HostBuffer, float] | None = None  # the buffer and its image's commit order
        self.data: torch.Tensor | None = None
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="ckpt-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pool = self.tier.pool
        try:
            pool.wait_adopted()
            with pool._cv:
                buf = pool.newest_image()
                if buf is None or buf.manifest is None or self._ended:
                    return
                buf.holds += 1
                with self._lock:
                    self.target = (buf, buf.image_order)
            try:
                n = buf.manifest.data_bytes
                cuda = self.device.type == "cuda"
                free = torch.cuda.mem_get_info(self.device)[0] if cuda else None
                if free is not None and free < 2 * n + (1 << 30):
                    log.info(
                        "no room on %s to read the memory tier's snapshot of step %d ahead (%d bytes free)",
                        self.device,
                        buf.image_step,
                        free,
                    )
                    return
                if not buf.checked:  # taken over from the previous process: checked once, now
                    self.tier._load_adopted(buf, buf.manifest, None)
                with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
                    data = torch.empty(n, dtype=torch.uint8, device=self.device)  # on the current stream: the
                    side = torch.cuda.Stream(self.device) if cuda else None  # allocator's for later reuse
                    if side is not None:
                        side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                        for a, b in shm.pieces(0, n):
                            data[a:b].copy_(buf.tensor[a:b], non_blocking=cuda)
                    if side is not None:
                        side.synchronize()
                with self._lock:
                    if not self._ended:
                        self.data = data
                log.info(
                    "the memory tier's snapshot of step %d was read onto %s ahead of the restore (%d bytes)",
                    buf.image_step,
                    self.device,
                    n,
                )
            finally:
                pool.release(buf)
        except Exception as e:  # noqa: BLE001 - the load reads the host buffer as without it
            log.info(
                "reading the memory tier's newest snapshot onto %s ahead failed (%s: %s)",
                self.device,
                type(e).__name__,
                e,
            )

    def take(self, buf: HostBuffer, manifest: Manifest) -> torch.Tensor | None:
        """The copy of ``buf``'s snapshot on the GPU, if that is what was read ahead and it is still the image
        ``buf`` holds (called with ``buf`` held: it cannot change meanwhile); ``None`` otherwise."""
        with self._lock:
            target = self.target
        if target is None or target[0] is buf:  # not started yet, or reading this one: its result decides
            self._thread.join()
            with self._lock:
                target = self.target
        if (
            target is None
            or target[0] is not buf
            or buf.image_order != target[1]
            or buf.manifest is None
            or buf.manifest.data_bytes != manifest.data_bytes
            or buf.manifest.chunks != manifest.chunks
        ):
            return None
        with self._lock:
            data, self.data = self.data, None
        return data

    def end(self) -> None:
        """Drop the copy (the caching allocator keeps its memory for the training) once the thread is done: a
        copy still running is never kept (``_run`` keeps its result only while not ended)."""
        with self._lock:
            self._ended = True
            self.data = None
        self._thread.join()


def _judge(rec: shm.SnapshotRecord, path: Path, bad: int | None) -> None:
    """After a read of ``rec``'s segment: a chunk that failed its checksum while the record still
    stands is corruption; one that failed because the owner was rewriting the buffer (the record is
    gone or changed) means the snapshot is no longer there (``LookupError``: restore moves on)."""
    current = shm.still_current(rec)
    if bad is not None and current:
        c = rec.manifest.chunk_bytes
        raise CorruptCheckpointError(
            f"{path}: bytes [{bad * c}, {min((bad + 1) * c, rec.manifest.data_bytes)}) of the memory tier's "
            f"snapshot of step {rec.step} fail their checksum"
        )
    if bad is not None or not current:
        raise LookupError(
            f"the memory tier's snapshot of step {rec.step} in {path} was being replaced while it was read"
        )


def _checked_copy(
    rec: shm.SnapshotRecord, fd: int, sc: Scatter, device: torch.device | None
) -> tuple[int | None, bool]:
    """Copy the snapshot of ``rec`` (``fd``: its segment) to ``sc``'s destinations, none of them written before
    every chunk passed its checksum. The chunks are read and checked (:func:`_to_device`) into a scratch buffer
    of the snapshot's size on ``device`` (a destination's GPU; ``None``: host memory), then, when every one
    passed and the record still stands, copied from there into place; the scratch buffer goes back to the
    allocator. Where there is no room for it (the GPU's memory; host memory, where less than the snapshot and
    a quarter more is available), two passes over the segment: the first reads and checks every chunk and
    copies nothing; only when all passed and the record still stands, the second reads them again, checks
    each again and copies it. A segment that changes between or during the two passes (its owner took it back
    and rewrote it) is found by the second pass's checks, or by :func:`_judge` from its record, and refused,
    but the chunks the second pass copied before the change stay in ``dest``: the one window this way
    leaves. Returns the first chunk that failed (``None``: none did) and whether the whole snapshot was copied
    into place (then it is the committed one: its owner withdraws a record before it writes the buffer again,
    and the record stood once every chunk had passed)."""
    manifest = rec.manifest
    try:
        scratch = _scratch(manifest.data_bytes, device)
    except (torch.cuda.OutOfMemoryError, MemoryError):
        log.info(
            "no room for %d bytes on %s to check the memory tier's snapshot of step %d in: every chunk is "
            "checked first, then read, checked and copied again",
            manifest.data_bytes,
            device or "the host",
            rec.step,
        )
        bad = _to_device(manifest, fd, None)
        if bad is not None or not shm.still_current(rec):
            return bad, False
        bad = _to_device(manifest, fd, sc)  # every chunk checked again as it is copied
        return bad, bad is None
    log.info(
        "the memory tier's snapshot of step %d is checked in %d bytes on %s before it is copied into place",
        rec.step,
        manifest.data_bytes,
        scratch.device,
    )
    whole = Scatter(
        [ItemRecord("", "uint8", [manifest.data_bytes], scratch.device.type, 0, manifest.data_bytes)],
        [scratch],
    )
    try:
        bad = _to_device(manifest, fd, whole)
        if bad is not None or not shm.still_current(rec):
            return bad, False
        sc.open_streams()
        try:
            sc.copy(scratch, 0)
        finally:
            sc.synchronize()
        return None, True
    finally:
        del whole, scratch  # every copy out of it has landed: the allocator may hand it out again


def _gpu_of(dest: list[torch.Tensor | None]) -> torch.device | None:
    """The device of the first destination on a GPU (``None``: none is)."""
    return next((d.device for d in dest if d is not None and d.device.type == "cuda"), None)


def _scratch(nbytes: int, device: torch.device | None) -> torch.Tensor:
    """A buffer of ``nbytes`` on ``device`` (``None``: host memory) to check a snapshot in
    (``torch.cuda.OutOfMemoryError`` / ``MemoryError``: no room; in host memory, where less than ``nbytes``
    and a quarter more is available, so a restore never pushes the node into swapping or its OOM killer)."""
    if device is None:
        import psutil

        if psutil.virtual_memory().available < nbytes + nbytes // 4:
            raise MemoryError(f"{nbytes} bytes of host memory to check a snapshot in")
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _to_device(manifest: Manifest, fd: int, sc: Scatter | None) -> int | None:
    """Copy a segment's snapshot to its destinations chunk by chunk: each chunk is read from the RAM
    file system into one of a small ring of pinned buffers (a ``pread``, no page faults on a mapping
    of another process's file), its checksum checked there, then sent to the device on a side stream
    while the next chunks are read and checked, on ``CKPT_IO_THREADS`` threads. A chunk that fails is
    not copied, but those before it may have been: a caller that must leave the destinations as they were
    copies into a buffer of its own (:func:`_checked_copy`). ``sc=None``: every chunk is read and checked, and
    nothing copied. Returns the first chunk that failed its checksum (``None``: none did)."""
    chunk = manifest.chunk_bytes
    n = len(manifest.chunks)
    pinned = (
        sc is not None and torch.cuda.is_available()
    )  # sent to a GPU from pinned memory; a check alone sends none
    ring: queue.Queue = queue.Queue()
    for _ in range(min(n, max(2, knobs.get("CKPT_RESTORE_BUFFERS")))):
        ring.put(
            (
                torch.empty(
                    min(chunk, manifest.data_bytes), dtype=torch.uint8, pin_memory=pinned, device="cpu"
                ),
                None,
            )
        )
    if sc is not None:
        sc.open_streams()
    bad: list[int] = []

    def one(i: int) -> None:
        buf, ev = ring.get()
        try:
            for e in ev or ():
                e.synchronize()  # the previous copies out of this buffer have landed
            off = i * chunk
            length = min(chunk, manifest.data_bytes - off)
            view = memoryview(buf.numpy())[:length]
            got = 0
            while got < length:  # pread releases the GIL
                k = os.preadv(fd, [view[got:]], off + got)
                if k <= 0:
                    raise OSError(
                        errno.EIO, f"the segment ended at byte {off + got} of {manifest.data_bytes}"
                    )
                got += k
            if checksum(view) != manifest.chunks[i]:
                bad.append(i)
                return
            if sc is not None:
                sc.copy(buf[:length], off)
                ev = sc.record()
        finally:
            ring.put((buf, ev))

    try:
        with ThreadPoolExecutor(knobs.get("CKPT_IO_THREADS"), thread_name_prefix="ckpt-memory-read") as ex:
            for f in [ex.submit(one, i) for i in range(n)]:
                f.result()
    finally:
        if sc is not None:
            sc.synchronize()
    return min(bad) if bad else None


def _scatter(manifest: Manifest, dest: list[torch.Tensor | None], data: torch.Tensor) -> None:
    """Copy an image's bytes ``data`` (host memory: a snapshot buffer or segment; or a copy of one on a GPU) into
    ``dest``, piece by registration piece (a CUDA copy may not span two: :func:`ckpt.shm.pieces`)."""
    sc = Scatter(manifest.items, dest)

    def copy() -> None:
        for a, b in shm.pieces(0, data.numel()):
            sc.copy(data[a:b], a)

    sc.open_streams()
    try:
        copy()
    finally:
        sc.synchronize()


def space_for(local_dir: str | os.PathLike, rank: int, create: bool = False) -> SharedSpace | None:
    """Where the memory tier of ``local_dir``'s rank ``rank`` keeps its segments (``None``: shared
    segments are off, there is no RAM file system, or the directory has no id and ``create`` is false or
    it cannot hold one: :func:`ckpt.identity.directory_id`)."""
    root = shm.shm_root()
    prefix = None if root is None else shm.prefix_for(local_dir, rank, create)
    if prefix is None:
        return None
    return SharedSpace(root, prefix, os.path.realpath(os.fspath(local_dir)))

"""Phase 2: persist snapshots in the background, each tier at its own pace.

A watcher thread per snapshot waits for its device-to-host copy (on the host, in
the background) and commits it to the memory tier. Each slower tier (local, peer,
remote) has a worker thread of its own with a queue of snapshots to write: it reads
them straight from their host buffer, commits, applies retention and lets go of the
buffer (the peer tier's write is its collective exchange of replicas). A tier that
is still busy when a newer snapshot arrives does not make anyone wait: with
``coalesce``, the newer snapshot replaces the one waiting in its queue (newest wins;
the replaced one is reported as *superseded* on its handle and counted per tier), so
a slow disk writes fewer snapshots, never older ones, and training never waits for
it. Without ``coalesce`` (``if_busy="wait"``) every snapshot reaches every tier in
order, and saves wait for a free buffer instead.

A failure cleans up the partial files, is logged, is recorded on the save's
handle (``handle.wait()`` raises it) and on the checkpointer
(``Checkpointer.wait()`` raises it); training goes on and older checkpoints
stay untouched.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Iterable

from . import knobs, priority
from .policy import TierCadence, TimelineCopies, elapsed
from .format import Manifest
from .pool import HostBuffer, HostPool
from .stage import Snapshot, SnapshotStats
from .tiers import MemoryTier
from .tiers.base import PersistingTier

__all__ = ["SaveHandle", "Pipeline"]

log = logging.getLogger(__name__)

_live: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


def _finish_at_exit() -> None:
    """At interpreter exit, let every pipeline that was not closed finish its queued saves.

    Runs before the interpreter finalizes. Its worker is a daemon thread (it must not keep a
    process alive by itself), and a daemon thread still working when the interpreter
    finalizes is killed where it stands: inside torch code that releases the GIL (freeing a
    tensor, say) that aborts the whole process ("terminate called without an active
    exception", seen after a SIGTERM-ed Lightning run had made its save durable). Saves in
    flight are completed rather than lost; a process that must not wait calls ``os._exit``.
    Registered with ``threading``'s exit hooks where available: those run before the
    interpreter joins threads and before ``concurrent.futures`` stops accepting work, which
    the local and remote writers need.
    """
    limit = knobs.get("CKPT_EXIT_WAIT_S")
    deadline = time.monotonic() + limit if limit > 0 else None
    for pipe in list(_live):
        busy = pipe.in_flight()
        if busy:
            log.info(
                "finishing checkpoint(s) of step(s) %s before the process exits%s",
                sorted(busy),
                f" (at most {limit} s, CKPT_EXIT_WAIT_S)" if deadline is not None else "",
            )
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        # a process that did not close(): its snapshots stay in RAM, and the newest reaches every tier (alone; in
        # a collective job the other ranks may be gone, and a tier that needs their word would wait for them)
        done = pipe.close(timeout=left, keep_shared=True, flush=pipe.independent)
        pipe.memory.say_kept(loud=True)
        if not done:
            log.error(
                "exiting before checkpoint(s) of step(s) %s finished persisting (CKPT_EXIT_WAIT_S=%d s "
                "passed); they are not committed, older checkpoints are intact. Raise CKPT_EXIT_WAIT_S "
                "(0: no limit) or wait() for saves before exiting",
                sorted(pipe.in_flight()),
                limit,
            )


getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, say) inherits the parent's pipelines but none of their threads:
    they are the parent's to finish. Nothing of them may run at the child's exit (its exit hooks run
    :func:`_finish_at_exit`): their lock may be held by a thread that does not exist in the child (the
    exit would hang), and their buffers are the parent's (pinned memory a forked child cannot unregister)."""
    _live.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _drop_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback (and those of its
    causes). The error lives on in the save handle and the Checkpointer until raised; its frames
    would otherwise keep views of the host buffer, and so the whole staging memory, alive after
    close(). File names and line numbers stay, so the traceback still prints."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


class SaveHandle:
    """The progress of one save, tier by tier.

    Tiers: ``"memory"`` (the snapshot is complete in host memory and, in shared memory, its record written:
    it outlives the process; ``"skipped"``, "superseded by step N", when a newer snapshot's record was
    written first), ``"local"``, ``"peer"`` and, with a
    URL, ``"remote"``. ``status`` is ``"pending"``, ``"done"``, ``"failed"`` or ``"skipped"`` (no host
    buffer was free: the snapshot was not taken at all). A tier that does not write this snapshot
    finishes at once without error and says why in :attr:`skipped_tiers` (``tier_status(tier)`` is then
    ``"skipped"``): ``"superseded by step N"`` (the tier was busy and wrote the newer snapshot
    instead), ``"not due"`` (its ``persist_every`` cadence), or ``"busy"`` (busy on this rank or
    another of a collective job). A snapshot not taken at all says why in :attr:`skip_reason`.
    """

    def __init__(self, step: int, tiers: list[str], stats: SnapshotStats) -> None:
        self.step = step
        self.tiers = list(tiers)
        self.stats = stats
        self.errors: dict[str, BaseException] = {}
        self.skipped_tiers: dict[str, str] = {}
        self._events = {t: threading.Event() for t in tiers}
        self._skipped = False
        self.skip_reason: str | None = None
        """Why the snapshot was not taken (``status == "skipped"``), else ``None``: ``"allocating"`` (the host
        buffers were still being allocated in the background) or ``"busy"`` (every buffer was being copied
        into, read by a tier, or held the newest committed snapshot, on this rank or another)."""
        self._all = threading.Event()
        self._raised: list[BaseException] = []  # errors wait() raised to its caller
        self._lock = threading.Lock()

    @property
    def status(self) -> str:
        """``"pending"``, ``"done"``, ``"failed"`` (a tier failed: :attr:`errors`) or ``"skipped"``."""
        if self._skipped:
            return "skipped"
        if self.errors:
            return "failed"
        return "done" if self._all.is_set() else "pending"

    def tier_status(self, tier: str) -> str:
        """``"pending"``, ``"done"``, ``"failed"`` or ``"skipped"`` for one tier."""
        ev = self._event(tier)
        if self._skipped or tier in self.skipped_tiers:
            return "skipped"
        if tier in self.errors:
            return "failed"
        return "done" if ev.is_set() else "pending"

    @property
    def error(self) -> BaseException | None:
        """The first tier's failure, or ``None``."""
        return next(iter(self.errors.values()), None)

    def done(self, tier: str | None = None) -> bool:
        """Whether ``tier`` (every tier when ``None``) finished, successfully or not."""
        if tier is None:
            return self._all.is_set()
        return self._event(tier).is_set()

    def wait(self, tier: str | None = None, timeout: float | None = None) -> "SaveHandle":
        """Block until ``tier`` (every tier when ``None``) finished; raise its error if it failed.

        Raises ``TimeoutError`` after ``timeout`` seconds. An error raised here is not raised
        again by ``Checkpointer.wait()`` or ``close()`` (those raise the failures not yet seen).
        A tier that skipped this snapshot returns at once (see :attr:`skipped_tiers`).
        """
        err = self._wait_quietly(tier, timeout)
        if err is not None:
            with self._lock:
                if not any(err is e for e in self._raised):
                    self._raised.append(err)
            raise err
        return self

    def _wait_quietly(self, tier: str | None = None, timeout: float | None = None) -> BaseException | None:
        """:meth:`wait` for the library's own use: returns the error instead of raising it, and does not
        count it as shown to the user."""
        ev = self._all if tier is None else self._event(tier)
        if not ev.wait(timeout):
            raise TimeoutError(f"step {self.step}: tier {tier or 'all'} not done after {timeout} s")
        return self.errors.get(tier) if tier is not None else self.error

    def _was_raised(self, error: BaseException) -> bool:
        """Whether :meth:`wait` raised ``error`` to its caller already."""
        with self._lock:
            return any(error is e for e in self._raised)

    def _event(self, tier: str) -> threading.Event:
        if tier not in self._events:
            raise ValueError(f"unknown tier {tier!r}; this save goes to {self.tiers}")
        return self._events[tier]

    def _finish(self, tier: str, error: BaseException | None = None) -> None:
        if error is not None:
            self.errors[tier] = error
        self._events[tier].set()
        if all(e.is_set() for e in self._events.values()):
            self._all.set()

    def _skip_tier(self, tier: str, reason: str) -> None:
        self.skipped_tiers[tier] = reason
        self.stats.skipped_tiers[tier] = reason
        self._finish(tier)

    def _reopen(self, tier: str) -> None:
        """The tier writes this snapshot after all (at close: the newest snapshot reaches every tier)."""
        self.skipped_tiers.pop(tier, None)
        self.stats.skipped_tiers.pop(tier, None)
        self._all.clear()
        self._events[tier].clear()

    def _fail_rest(self, error: BaseException) -> None:
        for t, ev in self._events.items():
            if not ev.is_set():
                self._finish(t, error)

    def _skip(self, reason: str) -> None:
        self._skipped = True
        self.skip_reason = reason
        for t in self._events:
            self._finish(t)

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, status={self.status!r})"


class _Job:
    """A snapshot handed to a tier: written unless a newer one supersedes it first (``keep``: never).
    ``restored``: a snapshot a previous process took, handed over after a restore (:meth:`Pipeline.persist_restored`)."""

    __slots__ = ("snap", "handle", "keep", "held", "restored")

    def __init__(self, snap: Snapshot, handle: SaveHandle, keep: bool, restored: bool = False) -> None:
        self.snap, self.handle, self.keep, self.held, self.restored = snap, handle, keep, False, restored


class TierCounts:
    """What one tier did with the snapshots taken so far (``Checkpointer.tier_counts``)."""

    def __init__(self) -> None:
        self.persisted = 0  # snapshots committed on the tier
        self.superseded = 0  # handed to it, then replaced by a newer one before it started (newest wins)
        self.busy = 0  # not handed to it: busy (on some rank of a collective job) when taken
        self.not_due = 0  # not handed to it: its persist_every cadence
        self.failed = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))

    def __repr__(self) -> str:
        return "TierCounts(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")"


class _Lane:
    """One persisting tier's worker thread and its queue."""

    def __init__(self, tier: PersistingTier, every: int | None, auto: TierCadence | None = None) -> None:
        self.tier = tier
        self.name = tier.name
        self.every = every
        self.auto = auto  # interval="auto": seconds between copies, from measured costs
        self.last_time: float | None = None  # clock time of the newest snapshot handed to this tier
        self.queue: collections.deque[_Job] = collections.deque()
        self.current: _Job | None = None
        self.last_taken: int | None = None  # step of the newest snapshot handed to this tier
        self.newest: Snapshot | None = None  # that snapshot
        self.written: Snapshot | None = None  # the newest snapshot this tier committed
        self.restoring = 0  # restored snapshots assigned to it, not handed over yet
        self.counts = TierCounts()
        self.thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self.current is not None or bool(self.queue) or self.restoring > 0

    def due(self, step: int, now: float) -> bool:
        """Whether a snapshot of ``step`` is due on this tier by its cadence (steps between copies, or with
        ``interval="auto"`` the seconds its measured cost makes worth it)."""
        if self.every is None and self.auto is not None:
            gap = self.auto.seconds
            return gap is None or self.last_time is None or elapsed(now, self.last_time, gap)
        return (
            self.every is None
            or self.last_taken is None
            or step < self.last_taken
            or step - self.last_taken >= self.every
        )


class Pipeline:
    """The background persister: a worker per persisting tier, each at its own pace.

    ``coalesce``: a tier busy when a newer snapshot is committed writes the newer one next and skips
    the one waiting (newest wins); else every snapshot handed to a tier is written in order.
    ``independent``: this process alone decides (not a collective job), so a buffer whose snapshot
    is still waiting for a tier may be taken for a newer snapshot, which that tier then gets instead;
    in a collective job the ranks decide together at ``save()`` and a waiting snapshot keeps its
    buffer. ``every``: steps between copies per tier (``None``: as often as it keeps up).

    ``tiers``: the persisting tiers (:class:`~ckpt.tiers.base.PersistingTier`), one worker each, in
    the order of their nearness.
    """

    def __init__(
        self,
        pool: HostPool,
        memory: MemoryTier,
        tiers: list[PersistingTier],
        retention: Callable[[list[str]], None],
        on_error: Callable[[SaveHandle, BaseException], None],
        *,
        coalesce: bool = False,
        independent: bool = True,
        every: dict[str, int] | None = None,
        auto: dict[str, TierCadence] | None = None,
        clock: Callable[[], float] = time.monotonic,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.pool = pool
        # raises (LockedError) once the writer lost its directory to another process: no tier gets a snapshot
        # of a fenced writer from then on, those queued before included (see OwnerLock.reassert)
        self._fence = fence
        self.memory = memory
        self.coalesce = coalesce
        self.independent = independent
        every, auto = every or {}, auto or {}
        self.clock = clock
        self.lanes: dict[str, _Lane] = {
            t.name: _Lane(t, every.get(t.name), auto.get(t.name))
            for t in sorted(tiers, key=lambda t: t.nearness)
        }
        self._retention = retention
        self._on_error = on_error
        self._cv = pool._cv  # one lock for the buffers and the queues: a buffer changes hands atomically
        self._staging: set[int] = set()
        self._newest: tuple[Snapshot, SaveHandle] | None = None  # the last snapshot submitted
        self._committed: tuple[Snapshot, SaveHandle] | None = None  # the newest committed to the memory tier
        # per snapshot still being copied (by its submission number): the tiers it goes to once it has landed
        # (decided at submit; close() adds the tiers that skipped the newest, see flush)
        self._assigned: dict[int, set[str]] = {}
        self._orphaned: set[str] = set()  # tiers whose waiting snapshot lost its buffer to the next one
        self._closing = False
        self._closed = False
        self._watchers: list[threading.Thread] = []
        # Snapshots reach the tiers in the order they were taken: each watcher hands its snapshot over
        # only after the one before it did, so an older snapshot never supersedes a newer one, and every rank
        # queues the same order. The memory tier commits them in that order too (``_taken`` / ``_committing``,
        # the snapshots of ``submit`` only): the last committed is the newest, which the pool keeps whole and
        # records first, whichever watcher thread the scheduler wakes first.
        self._submitted = 0
        self._handed = 0
        self._taken = 0
        self._committing = 0
        for lane in self.lanes.values():
            lane.thread = threading.Thread(
                target=self._run, args=(lane,), name=f"ckpt-persist-{lane.name}", daemon=True
            )
            lane.thread.start()
        _live.add(self)

    # -- what the save path asks --------------------------------------------------------------------
    @property
    def tiers(self) -> list[str]:
        return list(self.lanes)

    def counts(self) -> dict[str, TierCounts]:
        return {n: lane.counts for n, lane in self.lanes.items()}

    def busy_tiers(self) -> list[int]:
        """1 for each persisting tier (in :attr:`tiers` order) that is writing or has a snapshot waiting."""
        with self._cv:
            return [int(lane.busy()) for lane in self.lanes.values()]

    def note_step(self, seconds: float) -> None:
        """One training step took ``seconds`` (for the tiers' ``interval="auto"`` costs)."""
        with self._cv:
            writing = {n: lane.current is not None for n, lane in self.lanes.items()}
        for n, lane in self.lanes.items():
            if lane.auto is not None:
                lane.auto.step(seconds, writing[n])

    def cadences(self) -> dict[str, TierCadence]:
        return {n: lane.auto for n, lane in self.lanes.items() if lane.auto is not None}

    def due(self, step: int) -> dict[str, bool]:
        now = self.clock()
        with self._cv:
            return {n: lane.due(step, now) for n, lane in self.lanes.items()}

    def in_flight(self) -> set[int]:
        """Steps still being staged, waiting for a tier or being written."""
        with self._cv:
            out = set(self._staging)
            for lane in self.lanes.values():
                out |= {j.snap.step for j in lane.queue}
                if lane.current is not None:
                    out.add(lane.current.snap.step)
            return out

    def reclaim(self, buf: Any, ask: bool, step: int) -> bool:
        """For :meth:`HostPool.acquire` (under the lock): a buffer whose snapshot still waits for a tier
        may be taken only by an independent, coalescing pipeline; when it is, that tier gets the new
        snapshot instead (:meth:`take_orphaned`)."""
        waiting = [(lane, j) for lane in self.lanes.values() for j in lane.queue if j.snap.buffer is buf]
        if ask:
            return not waiting or (self.coalesce and self.independent and not any(j.keep for _, j in waiting))
        for lane, j in waiting:
            lane.queue.remove(j)
            self._orphaned.add(lane.name)
            self._supersede(lane, j, step)
        return True

    def take_orphaned(self) -> set[str]:
        with self._cv:
            out, self._orphaned = self._orphaned, set()
            return out

    # -- submitting ---------------------------------------------------------------------------------
    def submit(
        self, snap: Snapshot, handle: SaveHandle, take: dict[str, str | None], keep: bool = False
    ) -> None:
        """Hand ``snap`` to the memory tier and to each tier in ``take`` whose reason is ``None`` (the others
        skip it for that reason: ``"not due"`` or ``"busy"``). ``keep``: never superseded (a drain)."""
        with self._cv:
            self._staging.add(snap.step)
            seq, self._submitted = self._submitted, self._submitted + 1
            turn, self._taken = self._taken, self._taken + 1
            self._assigned[seq] = {n for n, r in take.items() if r is None and n in self.lanes}
            snap.seq = seq
            for name, lane in self.lanes.items():
                reason = take.get(name, "not due")
                if reason is None:
                    lane.last_taken, lane.newest, lane.last_time = snap.step, snap, self.clock()
                else:
                    if reason == "busy":
                        lane.counts.busy += 1
                    else:
                        lane.counts.not_due += 1
                    handle._skip_tier(name, reason)
            self._newest = (snap, handle)
        # The memory tier does not queue behind earlier persists: a watcher publishes it as soon as
        # the copy has landed, while the tiers may still be writing older snapshots.
        # Not a daemon: interpreter shutdown joins it before finalizing. It lets go of the snapshot's
        # tensors before it ends, and a daemon freeing the last reference to a tensor while the
        # interpreter finalizes aborts the process (see _finish_at_exit).
        t = threading.Thread(
            target=self._watch,
            args=(snap, handle, keep, seq, turn),
            name=f"ckpt-staged-{snap.step}",
            daemon=False,
        )
        with self._cv:
            self._watchers = [w for w in self._watchers if w.is_alive()] + [t]
        t.start()

    def _watch(self, snap: Snapshot, handle: SaveHandle, keep: bool, seq: int, turn: int) -> None:
        priority.lower_this_thread()  # the memory tier's commit checksums the whole snapshot
        try:
            snap.wait_copied()
        except BaseException as e:
            snap.error = snap.error or e
        with self._cv:  # committed after the snapshot taken before it, however the copies' watchers wake
            while self._committing < turn:
                self._cv.wait()
        try:
            if snap.error is None:
                # held here at once; the record that makes it outlive the process follows in the background
                self.memory.commit(
                    snap.step,
                    snap.manifest,
                    snap.buffer,
                    timeline=snap.timeline,
                    recorded=lambda why: (
                        handle._finish(self.memory.name)
                        if why is None
                        else handle._skip_tier(self.memory.name, why)
                    ),
                )
        except BaseException as e:
            snap.error = snap.error or e
        with self._cv:
            self._committing = turn + 1
            self._cv.notify_all()
            while self._handed != seq:  # the snapshot taken before this one goes to the tiers first
                self._cv.wait()
            self._handed += 1
            self._cv.notify_all()
            self._staging.discard(snap.step)
            assigned = self._assigned.pop(seq, set())
            lanes = [lane for n, lane in self.lanes.items() if n in assigned]
            if snap.error is None:
                self._committed = (snap, handle)
            elif self.independent:
                lanes = []  # no tier waits for this rank's word on it: nothing to hand over
            for lane in lanes:
                self._enqueue(lane, _Job(snap, handle, keep))
            self.pool.release(snap.buffer, staged=True)  # the copy's own hold
        if snap.error is not None:
            snap.buffer.forget_image()
            log.error("checkpoint of step %d failed: %s", snap.step, snap.error)
            self._on_error(handle, snap.error)
            handle._fail_rest(snap.error)

    def persist_restored(
        self,
        step: int,
        timeline: Any,
        manifest: Manifest | None,
        tiers: list[str],
        obtain: Callable[[], HostBuffer],
        handle: SaveHandle,
    ) -> None:
        """Hand the snapshot of ``step`` (on ``timeline``, described by ``manifest``) that a restore read from the
        memory tier to ``tiers``, in the background, as if it had just been taken: the snapshot a previous process
        took and did not get to persist there (it was killed while the local tier wrote it, say; ``manifest`` is
        ``None`` only where ``obtain`` fails: this rank has nothing to write). ``obtain()``,
        run on a thread of its own, returns the pool's buffer holding it, held, and checked against its checksums
        (it takes the previous process's segments over first where needed); it may raise, which fails ``handle``
        on those tiers (a tier whose commit needs every rank is told this rank has nothing). The tiers get it
        before any snapshot submitted after this call, as every rank of a collective job does, and it is never
        superseded; until then each counts as busy (:meth:`busy_tiers`). ``handle`` reports it per tier."""
        with self._cv:
            self._staging.add(step)
            seq, self._submitted = self._submitted, self._submitted + 1
            self._assigned[seq] = set(tiers)
            for name in tiers:
                lane = self.lanes[name]
                lane.restoring += 1
                lane.last_taken, lane.last_time = step, self.clock()
        t = threading.Thread(
            target=self._watch_restored,
            args=(step, timeline, manifest, seq, obtain, handle),
            name=f"ckpt-restored-{step}",
            daemon=False,
        )
        with self._cv:
            self._watchers = [w for w in self._watchers if w.is_alive()] + [t]
        t.start()

    def _watch_restored(
        self,
        step: int,
        timeline: Any,
        manifest: Manifest | None,
        seq: int,
        obtain: Callable[[], HostBuffer],
        handle: SaveHandle,
    ) -> None:
        priority.lower_this_thread()  # checking a snapshot taken over from a previous process reads all of it
        buf: HostBuffer | None = None
        error: BaseException | None = None
        try:
            buf = obtain()
        except BaseException as e:  # noqa: BLE001 - reported on the handle and by wait()
            error = e
        # a copy of the manifest: the tiers fill in their own fields (checksums, codecs) as they write it
        snap = Snapshot.of_image(
            step,
            buf if buf is not None else HostBuffer(0, pin=False),
            dataclasses.replace(manifest) if manifest is not None else None,
            timeline,
        )
        snap.error = error
        with self._cv:
            while self._handed != seq:  # the snapshots submitted before it go to the tiers first
                self._cv.wait()
            self._handed += 1
            self._cv.notify_all()
            self._staging.discard(step)
            assigned = self._assigned.pop(seq, set())
            for name in assigned:
                self.lanes[name].restoring -= 1
            if error is None or not self.independent:  # a tier that needs this rank's word gets it
                for name in assigned:
                    self._enqueue(self.lanes[name], _Job(snap, handle, keep=True, restored=True))
            if buf is not None:
                self.pool.release(buf)  # obtain()'s hold: the tiers' jobs keep the buffer from here
        if error is not None:
            log.error(
                "step %d, restored from the memory tier, could not be written to the %s tier(s): %s",
                step,
                ", ".join(sorted(assigned)),
                error,
            )
            _drop_locals(error)
            self._on_error(handle, error)
            handle._fail_rest(error)

    def _enqueue(self, lane: _Lane, job: _Job) -> None:
        """(under the lock) Queue ``job`` on ``lane``; coalescing, it replaces the snapshots waiting there."""
        if self.coalesce and job.snap.error is None:
            for old in [j for j in lane.queue if not j.keep and j.snap.error is None]:
                lane.queue.remove(old)
                self._supersede(lane, old, job.snap.step)
        if not self.independent or not self.coalesce:
            job.held = True  # waits with its buffer held: decided on every rank alike, never taken away
            job.snap.buffer.holds += 1
        lane.queue.append(job)

    def _supersede(self, lane: _Lane, job: _Job, by: int | None) -> None:
        lane.counts.superseded += 1
        if job.held:
            job.snap.buffer.holds = max(0, job.snap.buffer.holds - 1)
        reason = f"superseded by step {by}" if by is not None else "superseded by a newer snapshot"
        log.info(
            "step %d is not written to the %s tier: %s (the tier was busy; %d superseded there so far)",
            job.snap.step,
            lane.name,
            reason,
            lane.counts.superseded,
        )
        job.handle._skip_tier(lane.name, reason)

    # -- the workers --------------------------------------------------------------------------------
    def _run(self, lane: _Lane) -> None:
        priority.lower_this_thread()  # its writer threads inherit it: the training thread keeps the CPU
        while True:
            with self._cv:
                while not lane.queue and not (self._closing and not self._staging):
                    self._cv.wait()
                if not lane.queue:
                    if self._closing and not self._staging:
                        return
                    continue
                job = lane.queue.popleft()
                if not job.held:
                    job.snap.buffer.holds += 1
                    job.held = True
                lane.current = job
            try:
                self._persist(job, lane)
            except BaseException as e:  # noqa: BLE001 - a bug must not stop the tier for good
                log.exception("the %s tier's worker failed on step %d", lane.name, job.snap.step)
                self._release(job, lane)
                job.handle._finish(lane.name, e)
            with self._cv:
                lane.current = None
                self._cv.notify_all()

    def _release(self, job: _Job, lane: _Lane) -> None:
        with self._cv:
            if job.held:
                job.held = False
                job.snap.buffer.holds = max(0, job.snap.buffer.holds - 1)
                if self.pool._closed and job.snap.buffer.holds == 0:
                    self.pool._drop(job.snap.buffer)
            self._cv.notify_all()

    def _run_write(self, job: _Job, lane: _Lane, write: Callable[[], float]) -> BaseException | None:
        t0 = time.perf_counter()
        try:
            job.handle.stats.persist_s[lane.name] = write()
            wall = (
                time.perf_counter() - t0
            )  # what the tier took, as the loop lives it (a tier may report less)
            lane.counts.persisted += 1
            if lane.auto is not None:
                lane.auto.wrote(wall)
            lane.tier.measured_write(job.snap.data_bytes, wall)
            return None
        except BaseException as e:
            lane.counts.failed += 1
            log.error("checkpoint of step %d failed on the %s tier: %s", job.snap.step, lane.name, e)
            _drop_locals(e)
            self._on_error(job.handle, e)
            return e

    def _prune(self, tiers: list[str], step: int) -> None:
        try:
            self._retention(tiers)
        except OSError as e:  # retention trouble never fails a committed save
            log.warning("retention after step %d failed: %s", step, e)

    def _persist(self, job: _Job, lane: _Lane) -> None:
        """Write ``job``'s snapshot to ``lane``'s tier from its host buffer and apply retention there."""
        snap, handle, tier = job.snap, job.handle, lane.tier
        refused = None
        if snap.error is None and self._fence is not None:
            try:
                self._fence()
            except BaseException as e:  # noqa: BLE001 - reported on the handle, raised by wait()
                refused = e
        if snap.error is not None or refused is not None:
            # a tier whose write needs every rank (a job tier, the peer exchange) waits for this rank's word
            try:
                tier.abstain(snap.step)
            except BaseException as e:  # noqa: BLE001 - the snapshot's own error is what the handle reports
                log.error("the %s tier's part in step %d failed on this rank: %s", lane.name, snap.step, e)
            self._release(job, lane)
            if refused is not None:
                lane.counts.failed += 1
                log.error("step %d is not written to the %s tier: %s", snap.step, lane.name, refused)
                self._on_error(handle, refused)
            handle._finish(lane.name, snap.error or refused)
            return
        data = snap.buffer.memoryview(snap.data_bytes)

        def write() -> float:  # committed with the timeline the snapshot was taken on
            if snap.timeline is None or not isinstance(tier, TimelineCopies):
                return tier.write(snap.step, snap.manifest, data)
            with tier.copying(snap.step, snap.timeline):
                return tier.write(snap.step, snap.manifest, data)

        error = self._run_write(job, lane, write)
        del data  # no view of the buffer may outlive the hold (a waiter may exit the process at once)
        if error is None:
            if job.restored:
                log.info(
                    "step %d, restored from the memory tier, is on the %s tier now (%.2f s)",
                    snap.step,
                    lane.name,
                    handle.stats.persist_s.get(lane.name, 0.0),
                )
            with self._cv:
                lane.written = snap
            self._prune([lane.name], snap.step)
        self._release(job, lane)  # before reporting: a save right after handle.wait() finds the buffer free
        handle._finish(lane.name, error)

    # -- closing ------------------------------------------------------------------------------------
    def flush(self, tiers: Iterable[str] | None = None) -> SaveHandle | None:
        """Hand the newest snapshot to every tier (of ``tiers``, default all) that has not got it (skipped for
        its cadence, or busy), so that each tier ends with it, and return its handle (``None``: no snapshot).
        Alone, the newest committed to the memory tier (a save that failed after it does not count); in a
        collective job, the last one taken, on every rank alike (a rank whose copy failed tells the tier,
        which needs every rank's word). A snapshot still being copied gets its tiers once it has landed."""
        with self._cv:
            newest = self._committed if self.independent else self._newest
            if newest is None or newest[1]._skipped:
                return None
            snap, handle = newest
            seq = snap.seq if snap.seq in self._assigned else None  # not handed to the tiers yet
            for name, lane in self.lanes.items():
                if tiers is not None and name not in tiers:
                    continue
                if lane.newest is snap or lane.written is snap:
                    continue  # handed to it (waiting, being written or written) or committed there
                if self.independent and snap.buffer.manifest is not snap.manifest and seq is None:
                    # the newest committed snapshot keeps its buffer (HostPool._pick): cannot happen
                    log.error(
                        "step %d is not written to the %s tier at close: its host buffer was taken",
                        snap.step,
                        name,
                    )
                    continue
                handle._reopen(name)
                lane.last_taken, lane.newest = snap.step, snap
                if seq is not None:  # still being copied: its watcher hands it over once the copy has landed
                    self._assigned.setdefault(seq, set()).add(name)
                    continue
                self._enqueue(lane, _Job(snap, handle, True))
            self._cv.notify_all()
            return handle

    def branch_left(self, old: Any, new: Any) -> None:
        """The saves go on ``new`` (a :class:`~ckpt.policy.Timeline`) from now on, after a rollback from
        ``old``: the newest snapshot taken on ``old`` past the fork is the abandoned branch's, and is never
        handed to a tier at close (a tier would commit it with ``new``'s timeline, and the next restore
        would resume the abandoned branch as if it were the live one)."""
        with self._cv:
            if self._newest is not None and not new.holds(old.number, self._newest[0].step):
                self._newest = None
            if self._committed is not None and not new.holds(old.number, self._committed[0].step):
                self._committed = None

    def close(self, timeout: float | None = None, keep_shared: bool = False, flush: bool = True) -> bool:
        """Let every snapshot still being copied land, hand the newest to every tier that has not got it
        (``flush``: :meth:`flush`), persist everything handed over, then stop the workers (idempotent).

        ``timeout`` (seconds, ``None``: no limit) bounds the wait; returns False when a worker
        was still persisting when it ran out (it is then left to the interpreter). ``keep_shared``:
        leave the memory tier's shared-memory segments in RAM for the next process.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._closed:
            self._closed = True
            _live.discard(self)
            for t in list(self._watchers):  # the snapshots being copied are committed (or fail) first
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if flush:
                self.flush()
            with self._cv:
                self._closing = True
                self._cv.notify_all()
        for t in list(self._watchers):
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._cv:
            self._cv.notify_all()
        for lane in self.lanes.values():
            lane.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        alive = any(lane.thread.is_alive() for lane in self.lanes.values())
        # the newest snapshot's record is written (it outlives the process) where the segments stay
        self.memory.settle(
            None if deadline is None else max(0.0, deadline - time.monotonic()), write=keep_shared or alive
        )
        # the host buffers go now; one still held by a persist that outlived `timeout`, once it is released
        self.pool.close(keep_shared=keep_shared or alive)
        return not alive

"""Taking one snapshot: a host buffer for it, or a skip; and the parts that carry it to the tiers.

A save of :class:`~ckpt.Checkpointer` copies the state into one of the memory tier's host buffers
(:class:`~ckpt.pool.HostPool`). Which buffer, how long the save may wait for one, and what happens when
none is free (the snapshot is skipped at once, counted and logged, and in a multi-process job every
rank skips it together) are decided here, by :class:`Taking`; :func:`stage_or_release` stages the copy.
:class:`Persisting` wires the parts that take it from there (the persist pipeline, the schedule of which
tier writes which snapshot, retention after each commit, the hand-over of a snapshot restored from RAM).
"""

from __future__ import annotations

import collections
import logging
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import knobs
from .format import Manifest
from .pipeline import Pipeline, SaveHandle
from .plan import flatten, layout
from .policy import Retention, Schedule, Timeline, retain, tier_cadences
from .pool import HostPool
from .restore import HandOver
from .stage import Snapshot, SnapshotStats, stage

__all__ = [
    "Taking",
    "Taken",
    "Persisting",
    "stage_or_release",
    "SkipLog",
    "manifest_for",
    "step_arg",
    "MAX_STEP",
]

# skipped saves are logged where users were told to look for them (docs/operations.md: ``ckpt.api``)
log = logging.getLogger("ckpt.api")

# Why a save found no host buffer (ordered: the ranks agree on the largest).
_FREE, _HELD, _ALLOCATING = 0, 1, 2
#: the largest step a checkpoint records (COMMIT and manifests hold 64-bit integers)
MAX_STEP = (1 << 63) - 1


class SkipLog:
    """The log of skipped saves: the first of each cause at WARNING, then at most one a minute per cause
    (with how many it stood for), the others at INFO. A loop that skips every snapshot for a while does not
    flood the log, and each skip is still in it."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._warned: dict[int, float] = {}  # cause -> when it was last logged at WARNING
        self._quiet: dict[int, int] = collections.Counter()  # cause -> skips at INFO since then

    def note(self, step: int, cause: int, where: str | None, pool: HostPool, waited: float) -> None:
        """Log the skip of ``step`` for ``cause``, found on ``where`` (``None``: a single-process job)."""
        now = time.monotonic()
        loud = cause not in self._warned or now - self._warned[cause] >= self.every_s
        more = ""
        if loud:
            if self._quiet[cause]:
                more = f" ({self._quiet[cause]} more skipped for this reason since the last warning)"
            self._warned[cause], self._quiet[cause] = now, 0
        else:
            self._quiet[cause] += 1
        on = f" on {where}" if where else ""
        if cause == _ALLOCATING:
            running = pool.preparing
            why = (
                f"the host buffers are still being allocated in the background{on}"
                + (
                    f" (for {running:.1f} s so far)"
                    if running is not None and where != "another rank"
                    else ""
                )
                + f"; waited {waited:.2f} s for one (CKPT_BUSY_WAIT_MS). A save does not allocate them in the "
                "training loop meanwhile; the allocation started at the first maybe_save(), saves resume when it "
                "ends. Call maybe_save() from the first step, or raise CKPT_BUSY_WAIT_MS to wait longer"
            )
        else:
            why = (
                f"no host buffer was free{on} ({pool.describe_busy() if where != 'another rank' else 'there'}; "
                f"waited {waited:.2f} s, if_busy='skip'). Raise max_in_flight (host_memory_limit must leave room "
                "for that many state-sized buffers), set persist_every, or save less often"
            )
        log.log(
            logging.WARNING if loud else logging.INFO, "skipped the save of step %d: %s%s", step, why, more
        )


@dataclass
class Taken:
    """What :meth:`Taking.take` found for one snapshot."""

    buffer: Any  # the host buffer to copy into; ``None``: the snapshot was skipped
    busy: dict[str, int]  # per persisting tier, whether it is busy (on any rank, in a collective job)
    allocations: int  # the pool's allocations before the save (more after it: it allocated one)


class Taking:
    """Where each snapshot's host buffer comes from, or why the snapshot is skipped.

    ``pool``: the host buffers; ``memory``: the memory tier (it counts the skips too); ``pipeline``: the
    persisting tiers (what each is busy with, the buffers they can give back); ``ranks``: the job's ranks
    (``None``: this process decides alone); ``node``: the ownership of ``local_dir``. For
    :meth:`snapshot`: ``replicated`` (the top-level keys every rank holds), ``job`` (``[rank, world]``
    in a collective job) and ``side_stream`` (the CUDA stream the copies run on, or ``None``).
    """

    def __init__(
        self,
        pool: HostPool,
        memory: Any,
        pipeline: Any,
        ranks: Any,
        node: Any,
        replicated: frozenset[str] = frozenset(),
        job: list[int] | None = None,
        side_stream: Any = None,
    ) -> None:
        self.pool, self.memory, self.pipeline, self.ranks, self.node = pool, memory, pipeline, ranks, node
        self.replicated, self.job, self.side_stream = replicated, job, side_stream
        self.skipped = 0  # snapshots skipped for want of a buffer
        self._skips = SkipLog()
        self.prepared = False  # the first maybe_save() started allocating the buffers
        self._prepared_sync = False  # the first save took over a previous process's segments

    def prepare(self, state: Mapping[str, Any], on_unsupported: str) -> None:
        """Once, at the first :meth:`~ckpt.Checkpointer.maybe_save`: own ``local_dir`` and allocate the
        snapshot buffers for ``state`` in the background (taking over the segments a previous process left
        first), so that the first save does not wait for the allocation."""
        self.prepared = True
        self._prepared_sync = True  # the background allocation adopts the previous process's segments itself
        self.node.own()
        try:
            plan = flatten(state, on_unsupported)
            nbytes = layout(plan.entries, knobs.get("CKPT_ALIGN_BYTES"))[1]
        except Exception:  # noqa: BLE001 - the save itself reports what is wrong with the state
            return
        self.pool.prepare(nbytes)

    def take(self, step: int, data_bytes: int, stats: Any, handle: Any, wait: bool, patient: bool) -> Taken:
        """A buffer of ``data_bytes`` for the snapshot of ``step``, or ``Taken.buffer is None``: the snapshot
        is skipped (counted, logged, and said on ``handle``). ``wait``: block until a buffer is free (never
        skipped). Not ``patient`` (:meth:`~ckpt.Checkpointer.maybe_save`'s own saves): wait at most
        ``CKPT_BUSY_WAIT_MS``, and never allocate a buffer while the background allocation runs. In a
        collective job the ranks agree: all skip the snapshot, or none does (a collective then)."""
        t_wait = time.perf_counter()
        allocations = self.pool.allocations
        pipe = self.pipeline
        busy = dict.fromkeys(pipe.tiers, 0)
        if not self._prepared_sync and not self.pool.buffers:
            self._prepared_sync = True
            self.pool.adopt()  # no maybe_save() came first: take over a previous process's segments now
        here = cause = _FREE  # why this rank, and why the ranks together, found no buffer
        if not wait and not patient:
            # a buffer within CKPT_BUSY_WAIT_MS, or the snapshot is skipped: the loop never stalls for seconds
            # on the background allocation (nor allocates beside it) or on the tiers. Each rank waits for its
            # own buffer first, then the ranks agree on what they found: all skip, or none does.
            free = self.pool.wait_free(data_bytes, step, knobs.get("CKPT_BUSY_WAIT_MS") / 1e3, pipe.reclaim)
            here = cause = _FREE if free else _ALLOCATING if self.pool.preparing is not None else _HELD
            if self.ranks is not None:
                reply = self.ranks.max([here] + pipe.busy_tiers())
                cause, busy = reply[0], dict(zip(pipe.tiers, reply[1:]))
            # block: every rank found a buffer free just now (only a reader of the memory tier holds one briefly)
            buf = (
                None
                if cause != _FREE
                else self.pool.acquire(data_bytes, block=True, step=step, reclaim=pipe.reclaim, inline=False)
            )
        elif not wait and self.ranks is not None:
            # on several ranks: all skip a snapshot (or a tier) when it is busy on any, so they commit the same steps
            here = _FREE if self.pool.has_free() else _HELD
            reply = self.ranks.max([here] + pipe.busy_tiers())
            cause, busy = reply[0], dict(zip(pipe.tiers, reply[1:]))
            buf = (
                None
                if cause != _FREE
                else self.pool.acquire(data_bytes, block=False, step=step, reclaim=pipe.reclaim)
            )
        else:
            buf = self.pool.acquire(data_bytes, block=wait, step=step, reclaim=pipe.reclaim)
        stats.wait_s = time.perf_counter() - t_wait
        if buf is None:
            self.skipped += 1
            self.memory.skipped += 1
            if cause == _FREE:  # a copy that was still landing left its buffer to the tiers
                here = cause = _HELD
            where = None if self.ranks is None else "this rank" if here == cause else "another rank"
            self._skips.note(step, cause, where, self.pool, stats.wait_s)
            handle._skip("allocating" if cause == _ALLOCATING else "busy")
        return Taken(buf, busy, allocations)

    def snapshot(
        self,
        step: int,
        state: Mapping[str, Any],
        tiers: list[str],
        timeline: Timeline | None,
        wait: bool,
        patient: bool,
        on_unsupported: str,
    ) -> tuple[SaveHandle, Snapshot | None, Taken]:
        """Flatten ``state`` (``on_unsupported``: :func:`~ckpt.plan.flatten`'s), take a host buffer for its
        snapshot of ``step`` (:meth:`take`, with ``wait`` and ``patient``) and stage the copy into it, the
        snapshot recording ``timeline``. Returns the save's handle (to ``tiers``), the snapshot (``None``:
        skipped, as the handle says) and what :meth:`take` found."""
        plan = flatten(state, on_unsupported)
        records, data_bytes = layout(plan.entries, knobs.get("CKPT_ALIGN_BYTES"))
        stats = SnapshotStats(step, nbytes=data_bytes)
        handle = SaveHandle(step, tiers, stats)
        taken = self.take(step, data_bytes, stats, handle, wait, patient)
        if taken.buffer is None:
            return handle, None, taken
        manifest = manifest_for(step, plan, records, data_bytes, self.replicated, self.job)
        snap = Snapshot(step, plan.entries, records, data_bytes, manifest, taken.buffer, stats, timeline)
        stage_or_release(snap, taken.buffer, self.pool, self.side_stream)
        return handle, snap, taken


@dataclass
class Persisting:
    """The parts of one Checkpointer that carry its snapshots to the tiers, wired together by :meth:`build`:
    ``pipeline`` (:class:`~ckpt.pipeline.Pipeline`: a background writer per persisting tier), ``schedule``
    (:class:`~ckpt.policy.Schedule`: which snapshots are due, and on which tiers), ``taking``
    (:class:`Taking`: each snapshot's host buffer) and ``handover`` (:class:`~ckpt.restore.HandOver`: a
    snapshot restored from RAM alone goes to the durable tiers)."""

    pipeline: Pipeline
    schedule: Schedule
    taking: Taking
    handover: HandOver

    @classmethod
    def build(
        cls,
        stack: Any,
        node: Any,
        ranks: Any,
        handles: Any,
        interval: Any,
        keep: Retention,
        *,
        coalesce: bool,
        every: dict[str, int],
        mtbf: dict[str, float] | None,
        clock: Callable[[], float],
        replicated: frozenset[str],
        job: list[int] | None,
        side_stream: Any,
    ) -> "Persisting":
        """The parts for the tiers of ``stack`` (:class:`~ckpt.tiers.stack.Tiers`, its peer tier added) and the
        host buffers of ``node`` (:class:`~ckpt.ownership.Ownership` of ``local_dir``, whose loss fences every
        write). ``handles``: the Checkpointer's :class:`~ckpt.handles.Handles` (failures and hand-overs are
        reported there); ``interval``: the snapshot cadence; ``keep``: the retention applied after each
        commit; ``coalesce``: newest wins on a busy tier (``if_busy="skip"``); ``every``: the
        ``persist_every`` cadences; ``mtbf``: per tier, with ``interval="auto"`` (``None`` otherwise): each
        persisting tier without a cadence in ``every`` gets its own (:func:`~ckpt.policy.tier_cadences`)."""
        pool, memory, persisting = node.pool, stack.memory, stack.persisting
        cadences = tier_cadences(persisting, mtbf, every) if mtbf is not None else {}

        def retention(tiers: list[str]) -> None:  # after a commit on ``tiers``: never a step still in flight
            retain((stack.get(name) for name in tiers), keep, pipeline.in_flight())

        pipeline = Pipeline(
            pool,
            memory,
            persisting,
            retention,
            handles.failed,
            coalesce=coalesce,
            independent=ranks is None,
            every=every,
            auto=cadences,
            clock=clock,
            fence=node.still_owner,
        )
        handover = HandOver(memory, stack.own, pipeline, node, stack.names, stack.remote, handles.track)
        schedule = Schedule(interval, pipeline, pool, ranks, clock, bool(cadences))
        taking = Taking(pool, memory, pipeline, ranks, node, replicated, job, side_stream)
        return cls(pipeline, schedule, taking, handover)

    def interrupted(self) -> None:
        """Ctrl-C in the ``with`` block: say that the checkpoints being written are finished before the exit."""
        busy = sorted(self.pipeline.in_flight())
        log.warning(
            "interrupted: finishing the checkpoint(s)%s before exiting (Ctrl-C again abandons them; older "
            "checkpoints stay intact)",
            f" of step(s) {busy}" if busy else "",
        )

    @staticmethod
    def abandoned() -> None:
        """A second Ctrl-C while they were finished: say what it cost."""
        log.warning("abandoned the checkpoint(s) still being written; the committed ones are intact")


def stage_or_release(snap: Snapshot, buf: Any, pool: HostPool, side_stream: Any) -> None:
    """Stage ``snap`` into its host buffer ``buf`` (:func:`~ckpt.stage.stage`, on ``side_stream``); when that
    fails, no copy is left running into ``buf``, which goes back to ``pool``, and the error is raised."""
    try:
        stage(snap, side_stream)
    except BaseException:
        snap._fence()
        pool.release(buf, staged=True)
        raise


def manifest_for(
    step: int, plan: Any, records: list, data_bytes: int, replicated: frozenset[str], job: list[int] | None
) -> Manifest:
    """The manifest of one snapshot of ``plan`` (:func:`~ckpt.plan.flatten`) laid out as ``records``
    (:func:`~ckpt.plan.layout`); ``replicated``: the top-level keys whose plain tensors every rank holds;
    ``job``: ``[rank, world]`` in a collective job. Its chunks' checksums are filled in as it is staged."""
    shared = (
        [i for i, e in enumerate(plan.entries) if not e.sharded and e.key.split("/", 1)[0] in replicated]
        if replicated
        else []
    )
    return Manifest(
        step=step,
        rank=0,
        world_size=1,
        data_bytes=data_bytes,
        chunk_bytes=knobs.get("CKPT_CHUNK_BYTES"),
        chunks=[],
        items=records,
        tree=plan.tree,
        job=job,
        replicated=shared or None,
    )


def step_arg(step: Any, what: str) -> int:
    """``step`` as a Python int: an integer (numpy's too, not a bool) from 0 to 2**63 - 1, the range every
    ``COMMIT`` and manifest records; anything else is a ``ValueError`` naming the argument."""
    if not isinstance(step, bool):
        try:
            n = operator.index(step)
        except TypeError:
            n = None
        if n is not None and 0 <= n <= MAX_STEP:
            return n
    raise ValueError(
        f"{what}: step must be an int from 0 to 2**63 - 1 (a checkpoint records a 64-bit step), got {step!r}"
    )

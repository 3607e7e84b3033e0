"""``Checkpointer``: the public entry point for plain training loops."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import time
from typing import Any, Callable, Mapping

import torch

from .catalog import CheckpointInfo, catalog
from .config import IfBusy, Policy, Storage, check_storage, resolve
from .errors import CheckpointError
from .handles import Handles
from .metrics import Metrics, Record
from .ownership import Ownership
from .pipeline import SaveHandle
from .policy import (
    EVERY_TIER,
    AutoInterval,
    Retention,
    Timeline,
    newest_timeline,
    plain_interval,
    switch_timeline,
)
from .preempt import Listening, Signals
from .promotion import copy_step, endpoints
from .ranks import collective_job, job_ranks
from .restore import RestoreInfo, held_anywhere, restore_state
from .pool import HostPool
from .saving import Persisting, step_arg
from .stage import SnapshotStats, wait_all_staged
from .tiers import LocalTier
from .tiers.base import TierFigures
from .tiers.stack import Tiers, default_local_dir

__all__ = ["Checkpointer", "CheckpointInfo", "IfBusy"]


class Checkpointer:
    """Two-phase checkpointing of a training state: snapshot now, persist in the background.

    Args:
        storage: where checkpoints go, a :class:`~ckpt.Storage` (``local_dir`` is required, or
            ``$CKPT_LOCAL_DIR``; each field documented there). ``ck.storage`` shows what is used.
        policy: when snapshots are taken and what each tier keeps, a :class:`~ckpt.Policy` (each field
            documented there). ``ck.policy`` shows what is used.
        signals: a :class:`~ckpt.Signals`: what signals do inside the ``with`` block (preemption: save, make
            durable, exit; a save request: save, make durable, keep training), e.g.
            ``ckpt.Signals(preempt=(signal.SIGTERM,), save=(signal.SIGUSR1,))``.
        on_metrics: called with a flat record (``dict`` of ``str -> int | float``) after
            each save finished on every tier and after each restore, on the thread
            driving the Checkpointer (see :meth:`metrics` and :mod:`ckpt.metrics`).
        clock: seconds clock for ``every_seconds`` and ``interval="auto"``
            (injectable for tests).
        collective: whether the ranks of a multi-process job agree (default: when ``torch.distributed`` is
            initialised with more than one rank). Then constructing the Checkpointer, :meth:`restore`, and
            :meth:`maybe_save` with ``every_seconds``, ``interval="auto"`` or ``signals`` are collective: call
            them on every rank (each method states its contract; docs/api.md, "Collective contract"). The
            agreement runs over a CPU (gloo) group, never synchronising the GPU. ``False``: every rank decides
            alone (for code that checkpoints from one rank only).

    Each field of ``Storage`` and ``Policy`` may be given as a keyword instead, each option once
    (``ValueError`` naming one given both ways); ``url`` may be the first positional argument; a tuple of
    preemption signals with ``drain_deadline``, ``drain_tier`` and ``on_preempt`` is a ``Signals``.

    A ``state`` is a dict of name -> value: modules, optimizers, any object with ``state_dict()``, tensors
    (DTensor shards with their layout), numpy arrays, JSON-safe values, and dicts/lists of those
    (docs/api.md, "What a state may hold"). Each process saves its own; in a multi-process job give each
    rank its own ``local_dir`` and all ranks one ``url``.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        local_dir: str | os.PathLike | LocalTier | None = None,
        storage_options: dict[str, Any] | None = None,
        compression: str | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep: Retention | int | Mapping[str, int | None] | None = None,
        max_in_flight: int | None = None,
        if_busy: str | IfBusy = IfBusy.SKIP,
        persist_every: Mapping[str, int] | None = None,
        host_memory_limit: int | None = None,
        on_unsupported: str = "error",
        interval: str | None = None,
        mtbf: float | Mapping[str, float] | None = None,
        restart_cost: float = 0.0,
        signals: Signals | tuple = (),
        drain_deadline: float = 30.0,
        drain_tier: str = "local",
        on_preempt: str = "exit",
        clock: Callable[[], float] = time.monotonic,
        collective: bool | None = None,
        replicated: tuple[str, ...] | list[str] = (),
        peers: bool | int | None = None,
        on_metrics: Callable[[Record], Any] | None = None,
        storage: Storage | None = None,
        policy: Policy | None = None,
    ) -> None:
        # the grouped options (ckpt.config) and the flat keywords are one set: each given once
        defaults = {k: p.default for k, p in inspect.signature(Checkpointer.__init__).parameters.items()}
        self.storage, self.policy = resolve(storage, policy, locals(), defaults)
        st, po = self.storage, self.policy
        self.storage = dataclasses.replace(st, local_dir=default_local_dir(st.local_dir))
        self.if_busy = IfBusy(po.if_busy)  # the Policy checked it, and interval and on_unsupported
        check_storage(self.storage)
        self.replicated = frozenset(st.replicated)
        interval = plain_interval(po.every_steps, po.every_seconds, po.interval, clock)
        self.signals = Signals.from_arguments(signals, drain_deadline, drain_tier, on_preempt)
        self.drain_deadline = self.signals.deadline
        self.drain_tier = self.signals.drain_tier
        self.on_preempt = self.signals.on_preempt
        # the with block's signal handlers, and the watcher that drains a preemption outside the loop
        self._listening = Listening(
            self.signals, lambda tier: self._pipeline.flush(tiers=(tier,)), lambda: self._closed
        )
        self._metrics = Metrics(on_metrics)
        self.on_unsupported = po.on_unsupported
        collective = collective_job(collective)
        self.pool = HostPool(st.max_in_flight or 3, st.host_memory_limit, shrink=st.max_in_flight is None)
        # which tiers there are (ckpt.tiers.stack): the settings that name tiers are checked against them
        self._stack = Tiers.build(self.storage, self.pool, torch.distributed.get_rank() if collective else 0)
        self.memory, self.local, self.remote = self._stack.memory, self._stack.local, self._stack.remote
        self.signals.check_tiers(self._stack.planned_persisting)
        self.persist_every = self._stack.check_cadences(po.persist_every or {})
        self.keep = self._stack.check_retention(po.keep if po.keep is not None else Retention())
        mtbf = self._stack.per_tier(po.mtbf, "mtbf") if interval is None else None
        if interval is None:  # interval="auto", from the memory tier's MTBF
            interval = AutoInterval(mtbf[self.memory.name], po.restart_cost, clock=clock)
        self.interval = interval
        self.history: collections.deque[SnapshotStats] = collections.deque(maxlen=10_000)
        self.last_restore: RestoreInfo | None = None
        self._handles = Handles()
        self._side_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        # last: creating the group is a collective, and every rank must get this far to join it
        self.ranks = job_ranks(collective)
        self._job = [self.ranks.rank, self.ranks.world] if self.ranks is not None else None
        self._node = Ownership(self.local, self.memory, self.pool, self.ranks)  # local_dir's lock, segments
        # a collective job: each rank owns its local_dir; one url: the job tier
        self._node.join_job(self.remote)
        try:
            self._stack.add_peer(self.ranks, st.peers)
            self.peer = self._stack.peer
            # the pipeline, the schedule, the host buffers' taking and the hand-over (ckpt.saving.Persisting)
            self._persisting = parts = Persisting.build(
                self._stack,
                self._node,
                self.ranks,
                self._handles,
                self.interval,
                self.keep,
                coalesce=self.if_busy is IfBusy.SKIP,
                every=self.persist_every,
                mtbf=mtbf,  # interval="auto": each persisting tier without a persist_every cadence gets its own
                clock=clock,
                replicated=self.replicated,
                job=self._job,
                side_stream=self._side_stream,
            )
            self._pipeline, self._schedule, self._taking = parts.pipeline, parts.schedule, parts.taking
            if self._node.owned:  # again now that the peer tier's NCCL group has started CUDA on this GPU
                self.pool.adopt_ahead()
        except BaseException:
            self._node.disown()
            raise
        self._timeline: Timeline | None = None  # the saves' timeline: decided by restore() or the first save
        self._closed = False
        self._exit_error = False  # __exit__ is closing after the block raised

    # -- context manager ----------------------------------------------------------------------------
    def __enter__(self) -> "Checkpointer":
        self._listening.listen()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                self._persisting.interrupted()
            # a block that raised keeps the memory tier in RAM for the process that resumes, and says so
            self._exit_error = exc_type is not None
            self.close(raise_errors=exc_type is None, keep_memory=exc_type is not None)
        except KeyboardInterrupt:
            if exc_type is None:
                raise
            self._persisting.abandoned()
        finally:
            self._listening.unlisten()

    # -- saving ---------------------------------------------------------------------------------------
    def maybe_save(self, step: int, state: Mapping[str, Any], *, final: bool = False) -> SaveHandle | None:
        """Save if the policy says so (see ``every_steps``/``every_seconds``); returns at once.

        ``state`` is the state *after* ``step``: a restore returns ``step`` and the loop continues at ``step +
        1``. With ``if_busy="skip"`` a save that finds no host buffer free (the tiers hold them all, or their
        background allocation, started by the first call, is still running) is skipped at once (its handle's
        status is ``"skipped"``); ``CKPT_BUSY_WAIT_MS`` sets how long to wait for one instead.

        ``final=True`` (``final=step == total_steps - 1`` in the loop): the loop's last step, saved whatever
        the policy, never skipped (it waits for a host buffer) and written to every tier whatever its
        ``persist_every`` cadence; :meth:`close` (the ``with`` block's end) waits until it is durable. A loop
        that may stop early (a ``break``) calls :meth:`save` with its last step after the loop instead.

        Raises ``ValueError`` when the Checkpointer has no policy (no ``every_steps``, ``every_seconds`` or
        ``interval``) and no ``signals``: such a call would never save.

        Inside the ``with`` block, after a signal of ``signals``: a preemption saves ``step``, waits until it
        is durable and exits (or raises); a save request saves ``step``, waits until it is durable on
        ``save_tier`` (at most ``save_deadline`` seconds) and returns its handle.
        """
        step = step_arg(step, "maybe_save(step=...)")
        if not isinstance(final, bool):
            raise TypeError(f"maybe_save(final=...) must be True or False, got {final!r}")
        self._schedule.require_policy(self.signals)
        return self._maybe_save(step, state, final)

    def _maybe_save(self, step: int, state: Mapping[str, Any], final: bool = False) -> SaveHandle | None:
        """:meth:`maybe_save` without its check of a policy (the Hugging Face callback's own saves follow the
        Trainer's save schedule, and call it for the signals and ``every_steps`` alone)."""
        self._metrics.poll()
        # a signal's save waits for a buffer rather than being skipped; its tier writes it even when busy or not due
        requested = self._listening.act(step, lambda tier: self._save(step, state, force=tier), self.ranks)
        if requested is not None:  # a save request's save, durable on its tier
            return requested
        if not self._taking.prepared:
            self._taking.prepare(state, self.on_unsupported)
        due = self._schedule.due(step)
        # final: the same on every rank (the loop's bound is); it waits for a buffer rather than being skipped
        if final:
            return self._save(step, state, force=EVERY_TIER)
        if not due:
            return None
        return self._save(step, state, patient=False)

    @property
    def preempted(self) -> int | None:
        """The preemption signal received (``None`` if none)."""
        return self._listening.received

    @property
    def save_requested(self) -> int | None:
        """The save signal received and not yet served by a save (``None`` if none)."""
        return self._listening.save_requested

    def metrics(self) -> list[Record]:
        """The records (:mod:`ckpt.metrics`) of the saves that finished on every tier and the restores since
        the last call, oldest first: flat dicts of ``str -> int | float`` (``ckpt/save/stall_ms``,
        ``ckpt/save/local_gbps``, ``ckpt/restore/seconds``, ...) for TensorBoard, W&B or a Lightning logger.
        At most the newest 1000 are kept between calls."""
        return self._metrics.take()

    def interval_report(self) -> dict[str, Any]:
        """With ``interval="auto"``: the snapshot interval, its measured cost, MTBF and expected fraction
        lost; and under ``"tiers"``, per persisting tier without a ``persist_every`` cadence, its interval
        (``None``: as soon as it can, still measuring), the training time one of its writes costs
        (``cost_s``), its MTBF and its last write's seconds (see :class:`~ckpt.policy.TierCadence`)."""
        return self._schedule.report()

    @property
    def skipped(self) -> int:
        """Snapshots skipped as a whole because no host buffer was free (see :class:`IfBusy`)."""
        return self._taking.skipped

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and persist it in the background.

        Returns once the copies are enqueued (phase 1 overlaps the caller's next forward/backward; the next
        ``optimizer.step()`` waits for it on the GPU). The snapshot goes to the memory tier, then to each
        slower tier by its ``persist_every`` cadence and ``if_busy`` (see :class:`IfBusy`; the handle says
        which tiers skipped it and why). In a collective job with ``if_busy="skip"`` it is collective: call it
        on every rank (the ranks agree which tiers are free, so that all of them write the same steps). Raises
        :class:`~ckpt.errors.RefusedStateError` for a value that needs pickle,
        :class:`~ckpt.errors.HostMemoryError` past ``host_memory_limit``, and
        :class:`~ckpt.errors.LockedError` when another live Checkpointer owns ``local_dir`` (see
        ``local_dir``).
        """
        return self._save(step, state)

    def _save(
        self, step: int, state: Mapping[str, Any], force: str | None = None, patient: bool = True
    ) -> SaveHandle:
        """:meth:`save`; ``force``: a tier that must write this snapshot (a drain), busy or not, or
        ``EVERY_TIER`` (a loop's final step: every tier); a forced save waits for a buffer, never skipped. Not
        ``patient`` (:meth:`maybe_save`'s own saves): under ``if_busy="skip"`` it waits at most
        ``CKPT_BUSY_WAIT_MS`` for a buffer, and never allocates one while the background allocation runs."""
        self._check_open()
        step = step_arg(step, "save(step=...)")
        self._node.own()
        if self._timeline is None:  # no restore() first: the saves continue the newest checkpoint's branch
            self._use_timeline(newest_timeline(self._stack.own))
        t0 = time.perf_counter()
        wait = self.if_busy is IfBusy.WAIT or force is not None
        handle, snap, taken = self._taking.snapshot(
            step, state, self.tiers, self._timeline, wait, patient, self.on_unsupported
        )
        stats = handle.stats
        if snap is None:  # skipped: counted and logged
            stats.stall_s = time.perf_counter() - t0
            self._metrics.track(handle)
            return handle
        takes = self._schedule.takes(step, taken.busy, force)
        self._pipeline.submit(snap, handle, takes, keep=force is not None)
        self.interval.saved(step)
        stats.stall_s = time.perf_counter() - t0
        previous = self.history[-1] if self.history and self.if_busy is IfBusy.WAIT else None
        local_s = previous.persist_s.get(self.local.name) if previous else None  # what interval="auto" learns
        self._schedule.record(stats, taken.allocations, local_s)
        self._handles.track(handle)
        self.history.append(stats)
        self._metrics.track(handle)
        return handle

    def wait_staged(self) -> None:
        """Block until every snapshot copy has landed in host memory.

        Call it before modifying state tensors in place outside ``optimizer.step()`` (an EMA update, say)
        while a save may be in flight.
        """
        wait_all_staged()

    def wait(self, tier: str | None = None) -> None:
        """Block until every save so far finished ``tier`` (all tiers when ``None``).

        Raises the first failure since the last ``wait()`` (also when a ``handle.wait()`` raised it already:
        this reports on every save); the failure was also logged when it happened.
        """
        self._handles.wait_quietly(tier)  # failures are raised below
        self._metrics.poll()
        self._handles.raise_failures(include_seen=True)

    # -- restoring ------------------------------------------------------------------------------------
    def restore(self, state: dict, step: int | None = None, strict: bool = True) -> int | None:
        """Load the newest verified checkpoint (or ``step``) into ``state`` in place.

        Returns the step it was saved at, or ``None`` when no checkpoint exists on any tier. Corrupt or torn
        checkpoints are skipped with a warning naming the file; :class:`~ckpt.errors.NoCheckpointError` if
        none is usable. ``strict=False`` loads the keys common to both.

        Collective in a multi-process job (``collective``): every rank returns the same step, the newest that
        all of them hold and can load (older ones are tried when a rank finds its copy corrupt); a rank that
        cannot load a step because it does not fit the state makes every rank raise. A checkpoint on the job
        tier saved by another number of ranks or in another sharding is resharded into the live layout
        (``last_restore.tier`` is ``"remote"``).

        A snapshot restored from RAM alone (a previous process's) is written to each durable tier that lacks
        it, in the background (docs/guides/memory.md, "After a crash"); :meth:`wait` waits for it and raises
        its failures. This makes the Checkpointer the owner of a ``local_dir`` no live process owns.
        """
        self._check_open()
        if step is not None:
            step = step_arg(step, "restore(step=...)")
        if not isinstance(strict, bool):
            raise TypeError(f"restore(strict=...) must be True or False, got {strict!r}")
        # snapshots still being copied become the memory tier first; with the peer tier, the persist thread's
        # exchanges must be over: a restore may use the same peer group to send a held replica back. Failures
        # stay for wait() / close().
        self._handles.wait_quietly(None if self.peer is not None else self.memory.name, swallow=True)
        own, parts = self._stack.own, self._persisting  # the ranks agree on one step, or it restores alone
        info = restore_state(
            state, step, strict, own, self.ranks, self.peer, self._job, self._use_timeline, parts.handover
        )
        self.last_restore = info
        if info is not None:
            self._metrics.restored(info)
        return None if info is None else info.step

    def restorable(self) -> bool:
        """Whether :meth:`restore` (of the newest step) will load a checkpoint: ``True`` when some rank holds
        one on any of its tiers, or a peer holds a replica for it; ``restore()`` then returns a step or
        raises, and returns ``None`` only when this is ``False``. Ask before building the model, to build it
        empty for the restore to fill (:func:`ckpt.empty_params`, docs/guides/launchers.md, "Restart fast")
        and normally on a job's first start.

        Collective in a multi-process job, like :meth:`restore` (one integer all-reduce): every rank gets the
        same answer, so a replaced rank with nothing of its own builds as its peers do.
        """
        self._check_open()
        self._handles.wait_quietly(None if self.peer is not None else self.memory.name, swallow=True)
        return held_anywhere(self._stack.own, self.peer, self.ranks)

    @property
    def timeline(self) -> Timeline:
        """The timeline the next save goes to (:class:`~ckpt.policy.Timeline`).

        Set by :meth:`restore`: the restored checkpoint's when it is the newest committed one on any tier,
        else a new timeline (one more than the largest seen) that branches off at the restored step, so that a
        later restore resumes the saves that follow and never the abandoned branch. Without a restore, the
        first save continues the newest checkpoint's timeline.
        """
        if self._timeline is None:
            return newest_timeline(self._stack.own)
        return self._timeline

    def _use_timeline(self, timeline: Timeline) -> None:
        """Make ``timeline`` the one the next saves record, on every tier (:func:`ckpt.policy.switch_timeline`)."""
        self._timeline = switch_timeline(
            self._timeline, timeline, self._handles.settle, self._pipeline, self.pool, list(self._stack)
        )

    @property
    def tier_counts(self) -> dict[str, Any]:
        """Per persisting tier, what it did with the snapshots so far (:class:`~ckpt.pipeline.TierCounts`:
        ``persisted``, ``superseded``, ``busy``, ``not_due``, ``failed``)."""
        return self._pipeline.counts()

    def tier_figures(self) -> dict[str, TierFigures]:
        """Per tier, nearest first, its capacity and cost figures (:class:`~ckpt.tiers.base.TierFigures`:
        steps and bytes held, capacity, and the writes and reads measured in this process with their
        throughput). Lists each tier (a remote tier: one listing of the store)."""
        return {t.name: t.figures() for t in sorted(self._stack, key=lambda t: t.nearness)}

    @property
    def tiers(self) -> list[str]:
        """The tiers a save goes to, nearest first."""
        return self._stack.names

    def promote(self, step: int, to: str) -> bool:
        """Copy committed checkpoint ``step`` to tier ``to`` (any durable tier of this Checkpointer: ``"remote"``,
        ``"local"``, a tier of one's own), verifying every byte.

        The source is the nearest other tier that stores ``step`` (``to="remote"`` uploads it from the local
        tier; ``to="local"`` downloads it from the remote tier, or copies it from a nearer tier of one's own,
        making this Checkpointer the owner of ``local_dir``, see there). The destination's copy of ``step``, if
        any, is replaced only by a complete, verified new one: a promote that fails, or a process killed at any
        point of it, leaves the destination as it was (its old copy or, once the switch happened, the new one).
        Returns ``False`` without writing when the destination already holds the same checkpoint and it
        verifies.

        Raises ``ValueError`` naming the tiers when ``to`` is not one of its durable tiers,
        ``FileNotFoundError`` if no other tier holds ``step``, :class:`~ckpt.errors.CorruptCheckpointError`
        naming the file if the source's bytes fail their checksums, and an ``OSError`` naming the URL (or
        directory) when the transfer or the destination fails. Saves of ``step`` still in flight are waited for
        first. On a job tier ``promote(step, "remote")`` is collective and does not replace a step committed
        there.
        """
        self._check_open()
        self._handles.settle(step)  # the pipeline's own write of this step comes first
        src, dst = endpoints(self._stack.own, step, to)
        if dst is self.local:
            self._node.own()
        return copy_step(src, dst, step)

    def list(self) -> list[CheckpointInfo]:
        """Checkpoints visible on any tier, newest first: the live branch by ``(timeline, step)``, then the
        abandoned branch of a rollback (``abandoned=True``), each newest first."""
        return catalog(self._stack.own)

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self, raise_errors: bool = True, keep_memory: bool = False) -> None:
        """Write the newest snapshot to every tier that does not hold it yet (skipped for its cadence or as
        busy), finish persisting every save, stop the background workers (within milliseconds) and free the
        host buffers, the memory tier's shared memory included unless ``keep_memory`` (the next process on
        this node may restore from it; one that only handed a previous process's snapshot over leaves it as
        it was). No thread of the Checkpointer outlives it. Collective in a collective job.

        When ``raise_errors``, raises the first failure the user has not seen: one that neither
        ``handle.wait()`` nor :meth:`wait` raised already. ``__exit__`` calls it (without raising, and keeping
        the memory tier, when the block itself raised).
        """
        if self._closed:
            return
        self._closed = True
        self._node.close(self._pipeline, self.peer, keep_memory, bool(self.history), loud=self._exit_error)
        self._handles.clear()
        self._metrics.poll()
        if raise_errors:
            self._handles.raise_failures()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

"""``Checkpointer``: the public entry point for plain training loops."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import inspect
import operator
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from . import knobs
from .config import Policy, Storage, merge
from .errors import CheckpointError, Preempted
from .format import Manifest
from .metrics import Metrics, Record
from .ownership import Ownership
from .pipeline import Pipeline, SaveHandle
from .plan import flatten, layout
from .policy import (AutoInterval, Committed, Interval, Retention, TierCadence, Timeline, live_and_abandoned,
                     prune)
from .preempt import PreemptionGuard, Signals, drain, drain_outside, save_on_request
from .promotion import copy_between
from .ranks import Ranks, check_elastic_store, distributed_world
from .restore import AgreedRestore, HandOver, RestoreInfo, listing as _listing, restore as _restore
from .restore import resume_timeline as _resume_timeline
from .pool import HostPool
from .stage import Snapshot, SnapshotStats, stage, wait_all_staged
from .tiers import LocalTier
from .tiers.base import TierFigures
from .tiers.stack import Tiers, default_local_dir

__all__ = ["Checkpointer", "CheckpointInfo", "IfBusy"]

_STORAGE_FIELDS = [f.name for f in dataclasses.fields(Storage)]
_POLICY_FIELDS = [f.name for f in dataclasses.fields(Policy)]

log = logging.getLogger(__name__)


class IfBusy(str, enum.Enum):
    """What a save does when the tiers are slower than the snapshots.

    ``SKIP`` (the default): the loop never waits for a slow tier. A tier still busy with an older
    snapshot writes the newest one next and skips those in between (newest wins; each skipped one
    is reported as superseded on its handle and counted in ``Checkpointer.tier_counts``); a save
    that finds no free host buffer (each is read by a tier, being copied into, or holds the newest
    committed snapshot, which is never overwritten) is skipped as a whole, at once (its handle's status
    is ``"skipped"``, counted in ``Checkpointer.skipped``). A save of :meth:`~Checkpointer.maybe_save`
    waits for a buffer at most ``CKPT_BUSY_WAIT_MS`` (default 0), also while the buffers are still being
    allocated in the background (it never allocates one beside that).

    ``WAIT``: every snapshot reaches every tier, in order (subject to ``persist_every``); a save
    that finds every host buffer in use blocks until one is free (the stall is on the handle).
    """

    WAIT = "wait"
    SKIP = "skip"


# Why a save found no host buffer (ordered: the ranks agree on the largest).
_FREE, _HELD, _ALLOCATING = 0, 1, 2
#: the largest step a checkpoint records (COMMIT and manifests hold 64-bit integers)
_MAX_STEP = (1 << 63) - 1
#: ``_save(force=...)``: every tier writes the snapshot, due or busy (``maybe_save(final=True)``)
_EVERY_TIER = "*"


class _SkipLog:
    """The log of skipped saves: the first of each cause at WARNING, then at most one a minute per cause
    (with how many it stood for), the others at INFO. A loop that skips every snapshot for a while does not
    flood the log, and each skip is still in it."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._warned: dict[int, float] = {}   # cause -> when it was last logged at WARNING
        self._quiet: dict[int, int] = collections.Counter()   # cause -> skips at INFO since then

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
            why = (f"the host buffers are still being allocated in the background{on}"
                   + (f" (for {running:.1f} s so far)" if running is not None and where != "another rank" else "")
                   + f"; waited {waited:.2f} s for one (CKPT_BUSY_WAIT_MS). A save does not allocate them in the "
                   "training loop meanwhile; the allocation started at the first maybe_save(), saves resume when it "
                   "ends. Call maybe_save() from the first step, or raise CKPT_BUSY_WAIT_MS to wait longer")
        else:
            why = (f"no host buffer was free{on} ({pool.describe_busy() if where != 'another rank' else 'there'}; "
                   f"waited {waited:.2f} s, if_busy='skip'). Raise max_in_flight (host_memory_limit must leave room "
                   "for that many state-sized buffers), set persist_every, or save less often")
        log.log(logging.WARNING if loud else logging.INFO, "skipped the save of step %d: %s%s", step, why, more)


@dataclass
class CheckpointInfo:
    """A checkpoint visible on at least one tier."""

    step: int
    tiers: list[str]
    path: str | None
    nbytes: int | None
    created_unix: float | None
    timeline: int = 0          # its timeline (see ckpt.policy.Timeline)
    abandoned: bool = False    # on the branch a rollback left: restored only when asked for by step


class Checkpointer:
    """Two-phase checkpointing of a training state: snapshot now, persist in the background.

    Args:
        storage: where checkpoints go, a :class:`~ckpt.Storage`: ``local_dir`` (required, or
            ``$CKPT_LOCAL_DIR``), ``url``, ``storage_options``, ``compression``, ``peers``, ``replicated``,
            ``max_in_flight``, ``host_memory_limit`` (each documented there). ``ck.storage`` shows what is
            used.
        policy: when snapshots are taken and what each tier keeps, a :class:`~ckpt.Policy`:
            ``every_steps``, ``every_seconds``, ``interval``, ``mtbf``, ``restart_cost``, ``persist_every``,
            ``if_busy``, ``keep``, ``on_unsupported`` (each documented there). ``ck.policy`` shows what is
            used.
        signals: a :class:`~ckpt.Signals`: what signals do inside the ``with`` block (preemption: save, make
            durable, exit; a save request: save, make durable, keep training), e.g.
            ``ckpt.Signals(preempt=(signal.SIGTERM,), save=(signal.SIGUSR1,))``.
        on_metrics: called with a flat record (``dict`` of ``str -> int | float``) after
            each save finished on every tier and after each restore, on the thread
            driving the Checkpointer (see :meth:`metrics` and :mod:`ckpt.metrics`).
        clock: seconds clock for ``every_seconds`` and ``interval="auto"``
            (injectable for tests).
        collective: whether the ranks of a multi-process job agree (default: when
            ``torch.distributed`` is initialised with more than one rank). Then
            constructing the Checkpointer, :meth:`restore`, and :meth:`maybe_save`
            with ``every_seconds``, ``interval="auto"`` or ``signals`` are collective:
            call them on every rank. ``restore`` loads the newest step that every
            rank can load; time-based policies, ``if_busy="skip"`` (which makes
            :meth:`save` collective too) and preemption signals save the same
            steps everywhere. The agreement runs over a CPU (gloo) group, never
            synchronising the GPU. ``False``: every rank decides alone (for code
            that checkpoints from one rank only).

    Shorthand: each field of ``Storage`` and ``Policy`` may be given as a keyword argument instead
    (``Checkpointer("s3://bucket/run", local_dir="/nvme/ckpt", every_steps=10)``), each option once
    (``ValueError`` naming one given both ways); ``url`` may be the first positional argument. A tuple of
    preemption signals with ``drain_deadline``, ``drain_tier`` and ``on_preempt`` is shorthand for
    ``Signals(preempt=..., deadline=..., drain_tier=..., on_preempt=...)``.

    A ``state`` is a dict of name -> value: ``nn.Module``, optimizer, LR
    scheduler, any object with ``state_dict()``/``load_state_dict()``, tensors,
    numpy arrays, JSON-safe values, and dicts/lists of those. Each process saves
    its own state (CPU or one GPU per process): a full replica in data-parallel
    jobs, its shards of DTensors (FSDP2, tensor parallel) with their layout. In a
    multi-process job give each rank its own ``local_dir`` and all ranks one
    ``url``. A rank's own copies (memory, local) load only into the layout they
    were saved from; when the world size, mesh or placements changed, restore
    passes them over and reshards from the job tier.
    """

    def __init__(self, url: str | None = None, *, local_dir: str | os.PathLike | LocalTier | None = None,
                 storage_options: dict[str, Any] | None = None, compression: str | None = None,
                 every_steps: int | None = None,
                 every_seconds: float | None = None, keep: Retention | int | None = None,
                 max_in_flight: int | None = None, if_busy: str | IfBusy = IfBusy.SKIP,
                 persist_every: Mapping[str, int] | None = None, host_memory_limit: int | None = None,
                 on_unsupported: str = "error", interval: str | None = None,
                 mtbf: float | Mapping[str, float] | None = None,
                 restart_cost: float = 0.0, signals: Signals | tuple = (), drain_deadline: float = 30.0,
                 drain_tier: str = "local", on_preempt: str = "exit",
                 clock: Callable[[], float] = time.monotonic, collective: bool | None = None,
                 replicated: tuple[str, ...] | list[str] = (), peers: bool | int | None = None,
                 on_metrics: Callable[[Record], Any] | None = None, storage: Storage | None = None,
                 policy: Policy | None = None) -> None:
        # the grouped options (ckpt.config) and the flat keywords are one set: each given once
        defaults = {k: p.default for k, p in inspect.signature(Checkpointer.__init__).parameters.items()}
        here = locals()
        self.storage = merge(storage, Storage, {f: (tuple(here[f]) if f == "replicated" and isinstance(here[f], list)
                                                    else here[f]) for f in _STORAGE_FIELDS if f in here}, defaults)
        self.policy = merge(policy, Policy, {f: here[f] for f in _POLICY_FIELDS}, defaults)
        (url, local_dir, storage_options, compression, peers, replicated, max_in_flight, host_memory_limit) = (
            getattr(self.storage, f) for f in ("url", "local_dir", "storage_options", "compression", "peers",
                                               "replicated", "max_in_flight", "host_memory_limit"))
        (every_steps, every_seconds, interval, mtbf, restart_cost, persist_every, if_busy, keep, on_unsupported) = (
            getattr(self.policy, f) for f in ("every_steps", "every_seconds", "interval", "mtbf", "restart_cost",
                                              "persist_every", "if_busy", "keep", "on_unsupported"))
        self.storage = dataclasses.replace(self.storage, local_dir=default_local_dir(local_dir))
        try:
            self.if_busy = IfBusy(if_busy)
        except ValueError:
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}") from None
        if isinstance(replicated, str) or not all(isinstance(k, str) for k in replicated):
            raise ValueError(f"replicated must be a tuple of top-level state keys, got {replicated!r}")
        self.replicated = frozenset(replicated)
        if on_unsupported not in ("error", "skip"):
            raise ValueError(f"on_unsupported must be 'error' or 'skip', got {on_unsupported!r}")
        if host_memory_limit is not None and host_memory_limit <= 0:
            raise ValueError(f"host_memory_limit must be a positive number of bytes, got {host_memory_limit!r}")
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be a positive number of host buffers, got {max_in_flight!r}")
        self.keep = keep if keep is not None else Retention()
        if interval is None:
            self.interval: Interval | AutoInterval = Interval(every_steps, every_seconds, clock)
        elif interval == "auto":
            if every_steps is not None or every_seconds is not None:
                raise ValueError("interval='auto' picks the interval itself: drop every_steps / every_seconds")
        else:
            raise ValueError(f"interval must be None or 'auto', got {interval!r}")
        self.signals = Signals.from_arguments(signals, drain_deadline, drain_tier, on_preempt)
        self.drain_deadline = self.signals.deadline
        self.drain_tier = self.signals.drain_tier
        self.on_preempt = self.signals.on_preempt
        self._guard: PreemptionGuard | None = None
        self._preempt_watch: tuple[threading.Thread, threading.Event] | None = None
        self._drain_lock = threading.Lock()
        self._draining: str | None = None        # "loop" or "outside": who drains a preemption
        self._outside: Preempted | None = None   # a drain outside the loop, for the next maybe_save to raise
        self._forcing = False   # a signal's save: never skipped (if_busy="skip"), it waits for a buffer
        self._metrics = Metrics(on_metrics)
        self.on_unsupported = on_unsupported
        world = distributed_world()
        if collective and world <= 1:
            raise ValueError("collective=True needs torch.distributed initialised with more than one rank "
                             "(call init_process_group first, or leave collective=None)")
        collective = world > 1 if collective is None else collective
        self.pool = HostPool(max_in_flight or 3, host_memory_limit, shrink=max_in_flight is None)
        # which tiers there are (ckpt.tiers.stack): the settings that name tiers are checked against them
        self._stack = Tiers.build(self.storage, self.pool, torch.distributed.get_rank() if collective else 0)
        self.memory, self.local, self.remote = self._stack.memory, self._stack.local, self._stack.remote
        self.signals.check_tiers(self._stack.planned)
        self.persist_every = self._stack.check_cadences(persist_every or {})
        mtbf = self._stack.per_tier(mtbf, "mtbf") if interval == "auto" else {}
        if interval == "auto":
            self.interval = AutoInterval(mtbf[self.memory.name], restart_cost, clock=clock)
        self.history: collections.deque[SnapshotStats] = collections.deque(maxlen=10_000)
        self.skipped = 0
        self._skips = _SkipLog()
        self.last_restore: RestoreInfo | None = None
        self._handles: list[SaveHandle] = []
        self._failures: list[tuple[SaveHandle, BaseException]] = []
        self._lock = threading.Lock()
        self._side_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        # last: creating the group is a collective, and every rank must get this far to join it
        self.ranks = Ranks() if collective else None
        if self.ranks is not None:
            check_elastic_store()   # a torchrun restart of this job would fail before it gets here again
        self._job = [self.ranks.rank, self.ranks.world] if self.ranks is not None else None
        self._node = Ownership(self.local, self.memory, self.pool, self.ranks)   # local_dir's lock, segments
        if self.ranks is not None and self._node.own_for_job(self.remote.url if self.remote is not None else None):
            # decided from gathered facts, so every rank joins (a collective) or none does
            self.remote.join_job(Ranks(timeout_s=knobs.get("CKPT_COMMIT_TIMEOUT_S"), own_group=True))
        try:
            self._stack.add_peer(self.ranks, peers)
            self.peer = self._stack.peer
            # a time-based policy decides by each rank's clock: those decisions are agreed in maybe_save
            self._agree_due = self.ranks is not None and (isinstance(self.interval, AutoInterval)
                                                          or self.interval.every_seconds is not None)
            persisting = self._stack.persisting
            # interval="auto": each persisting tier not given a persist_every cadence gets its own
            cadences = {t.name: TierCadence(t.name, mtbf[t.name])
                        for t in persisting if t.name not in self.persist_every} if interval == "auto" else {}
            self._pipeline = Pipeline(self.pool, self.memory, persisting, self._apply_retention, self._failed,
                                      coalesce=self.if_busy is IfBusy.SKIP,
                                      independent=self.ranks is None, every=self.persist_every, auto=cadences,
                                      clock=clock, fence=self._node.still_owner)
            self._handover = HandOver(self.memory, self._stack.own, self._pipeline, self._node, self.tiers,
                                      self.remote, self._track)
            self._clock = clock
            self._auto_tiers = bool(cadences)
            self._last_step_at: float | None = None
            if self._node.owned:   # again now that the peer tier's NCCL group has started CUDA on this rank's GPU
                self.pool.adopt_ahead()
        except BaseException:
            self._node.disown()
            raise
        self._timeline: Timeline | None = None   # the saves' timeline: decided by restore() or the first save
        self._prepared = False        # the first maybe_save() started allocating the buffers
        self._prepared_sync = False   # the first save took over a previous process's segments
        self._closed = False
        self._exit_error = False      # __exit__ is closing after the block raised

    # -- context manager ----------------------------------------------------------------------------
    def __enter__(self) -> "Checkpointer":
        self._listen()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                busy = sorted(self._pipeline.in_flight())
                log.warning("interrupted: finishing the checkpoint(s)%s before exiting (Ctrl-C again abandons "
                            "them; older checkpoints stay intact)", f" of step(s) {busy}" if busy else "")
            # a block that raised keeps the memory tier in RAM for the process that resumes, and says so
            self._exit_error = exc_type is not None
            self.close(raise_errors=exc_type is None, keep_memory=exc_type is not None)
        except KeyboardInterrupt:
            if exc_type is None:
                raise
            log.warning("abandoned the checkpoint(s) still being written; the committed ones are intact")
        finally:
            self._unlisten()

    def _listen(self, preempt: bool = True) -> None:
        """Install the handlers of ``signals`` (main thread only); ``preempt=False``: the save requests
        only (for a framework that handles preemption itself, as Lightning does)."""
        wanted = (self.signals.preempt if preempt else ()), self.signals.save
        if self._guard is None and any(wanted):
            self._guard = PreemptionGuard(*wanted)
            self._guard.install()
            if wanted[0] and self.signals.outside_loop_after is not None:
                stop = threading.Event()
                watcher = threading.Thread(target=self._watch_preemption, args=(self._guard, stop),
                                           name="ckpt-preempt-watch", daemon=True)
                self._preempt_watch = (watcher, stop)
                watcher.start()

    def _unlisten(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.uninstall()
        watch, self._preempt_watch = self._preempt_watch, None
        if watch is not None:
            watch[1].set()

    def _watch_preemption(self, guard: PreemptionGuard, stop: threading.Event) -> None:
        """A preemption that no maybe_save() acted on within ``signals.outside_loop_after`` seconds: drain
        the newest snapshot in RAM from this thread, then exit (or leave :class:`Preempted` for the next
        maybe_save to raise). See :class:`~ckpt.preempt.Signals`."""
        while not stop.wait(0.1):
            signum, since = guard.received, guard.received_at
            if signum is None or since is None or time.monotonic() - since < self.signals.outside_loop_after:
                continue
            if self._closed:   # close() is making every snapshot durable already; the block's end follows
                return
            with self._drain_lock:
                if self._draining is not None:
                    return
                self._draining = "outside"
            step, durable = drain_outside(lambda tier: self._pipeline.flush(tiers=(tier,)), signum, self.signals,
                                          since)
            if self.signals.on_preempt == "exit":
                for h in logging.getLogger().handlers + logging.getLogger("ckpt").handlers:
                    with contextlib.suppress(Exception):
                        h.flush()
                for f in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        f.flush()
                os._exit(128 + signum)   # the main thread is elsewhere: no unwinding, the RAM stays
            self._outside = Preempted(signum, step if step is not None else -1, durable)
            return

    # -- saving ---------------------------------------------------------------------------------------
    def maybe_save(self, step: int, state: Mapping[str, Any], *, final: bool = False) -> SaveHandle | None:
        """Save if the policy says so (see ``every_steps``/``every_seconds``); returns at once.

        ``state`` is the state *after* ``step``: a restore returns ``step`` and
        the loop continues at ``step + 1``. With ``if_busy="skip"`` a save that finds
        no host buffer free (the tiers hold them all, or their background allocation,
        started by the first call, is still running) is skipped at once (its handle's status is
        ``"skipped"``); ``CKPT_BUSY_WAIT_MS`` sets how long to wait for one instead.

        ``final=True`` (``final=step == total_steps - 1`` in the loop): the loop's last step, saved
        whatever the policy, never skipped (it waits for a host buffer) and written to every tier
        whatever its ``persist_every`` cadence; :meth:`close` (the ``with`` block's end) waits until it
        is durable. So the finished run's newest checkpoint is its final state, and running the script
        again restores it and trains nothing. A loop that may stop early (a ``break``) calls
        :meth:`save` with its last step after the loop instead.

        Raises ``ValueError`` when the Checkpointer has no policy (no ``every_steps``,
        ``every_seconds`` or ``interval``) and no ``signals``: such a call would never save.

        Inside the ``with`` block, after a signal of ``signals``: a preemption saves
        ``step``, waits until it is durable and exits (or raises); a save request saves
        ``step``, waits until it is durable on ``save_tier`` (at most ``save_deadline``
        seconds) and returns its handle.
        """
        step = _step_arg(step, "maybe_save(step=...)")
        if not isinstance(final, bool):
            raise TypeError(f"maybe_save(final=...) must be True or False, got {final!r}")
        if isinstance(self.interval, Interval) and self.interval.every_steps is None and \
                self.interval.every_seconds is None and not (self.signals.preempt or self.signals.save):
            raise ValueError("maybe_save() has no policy to follow, so it would never save: pass every_steps=, "
                             "every_seconds= or interval='auto' (with mtbf=) to ckpt.Checkpointer (or in "
                             "ckpt.Policy), or call save() where the loop should save")
        return self._maybe_save(step, state, final)

    def _maybe_save(self, step: int, state: Mapping[str, Any], final: bool = False) -> SaveHandle | None:
        """:meth:`maybe_save` without its check of a policy (the Hugging Face callback's own saves follow the
        Trainer's save schedule, and call it for the signals and ``every_steps`` alone)."""
        self._metrics.poll()
        if self._outside is not None:   # drained outside the loop, on_preempt="raise"
            raise self._outside
        if self._guard is not None and self._guard.active:
            preempt, requested = self._guard.poll(self.ranks)   # collective over the ranks' CPU group
            if preempt:   # wins over a save request
                with self._drain_lock:
                    outside = self._draining == "outside"
                    self._draining = self._draining or "loop"
                if outside:   # the watcher drains the newest snapshot in RAM: it exits or leaves Preempted
                    watch = self._preempt_watch
                    if watch is not None:
                        watch[0].join()
                    if self._outside is not None:
                        raise self._outside
                drain(lambda: self._forced_save(step, state, self.signals.drain_tier), step, preempt, self.signals,
                      self._guard)
            if requested:
                self._guard.save_requested = None   # a request arriving from here on asks for another save
                return save_on_request(lambda: self._forced_save(step, state, self.signals.save_tier), step,
                                       requested, self.signals)
        if not self._prepared:
            self._prepare(state)
        if self._auto_tiers:   # a step's time, for the tiers' interval="auto" costs
            now = self._clock()
            if self._last_step_at is not None:
                self._pipeline.note_step(now - self._last_step_at)
            self._last_step_at = now
        due = self.interval.due(step)
        if due and isinstance(self.interval, AutoInterval) and self.interval.seconds is None and \
                self.pool.allocation_outlasts(knobs.get("CKPT_BUSY_WAIT_MS") / 1e3):
            due = False   # "as soon as it can" means once a buffer can be there: no skip per step meanwhile
        if self._agree_due:
            due = bool(self.ranks.max([int(due)])[0])   # clocks differ between ranks: save if any says so
        if final:   # the same on every rank: the loop's bound is
            self._forcing = True   # waits for a buffer rather than being skipped
            try:
                return self._save(step, state, force=_EVERY_TIER)
            finally:
                self._forcing = False
        if not due:
            return None
        return self._save(step, state, patient=False)

    def _prepare(self, state: Mapping[str, Any]) -> None:
        """Once, at the first :meth:`maybe_save`: own ``local_dir`` and allocate the snapshot buffers for
        ``state`` in the background (taking over the segments a previous process left first), so that
        the first save does not wait for the allocation."""
        self._prepared = True
        self._prepared_sync = True   # the background allocation adopts the previous process's segments itself
        self._node.own()
        try:
            plan = flatten(state, self.on_unsupported)
            nbytes = layout(plan.entries, knobs.get("CKPT_ALIGN_BYTES"))[1]
        except Exception:   # noqa: BLE001 - the save itself reports what is wrong with the state
            return
        self.pool.prepare(nbytes)

    @property
    def preempted(self) -> int | None:
        """The preemption signal received (``None`` if none)."""
        return None if self._guard is None else self._guard.received

    @property
    def save_requested(self) -> int | None:
        """The save signal received and not yet served by a save (``None`` if none)."""
        return None if self._guard is None else self._guard.save_requested

    def _forced_save(self, step: int, state: Mapping[str, Any], tier: str) -> SaveHandle:
        """A signal's save: it waits for a buffer rather than being skipped, and ``tier`` writes it even
        when busy or not due."""
        self._forcing = True
        try:
            return self._save(step, state, force=tier)
        finally:
            self._forcing = False

    def metrics(self) -> list[Record]:
        """The records (:mod:`ckpt.metrics`) of the saves that finished on every tier and the restores
        since the last call, oldest first: flat dicts of ``str -> int | float`` (``ckpt/save/stall_ms``,
        ``ckpt/save/local_gbps``, ``ckpt/restore/seconds``, ...) for TensorBoard, W&B or a Lightning
        logger. At most the newest 1000 are kept between calls."""
        return self._metrics.take()

    def interval_report(self) -> dict[str, Any]:
        """With ``interval="auto"``: the snapshot interval, its measured cost, MTBF and expected fraction
        lost; and under ``"tiers"``, per persisting tier without a ``persist_every`` cadence, its interval
        (``None``: as soon as it can, still measuring), the training time one of its writes costs
        (``cost_s``), its MTBF and its last write's seconds (see :class:`~ckpt.policy.TierCadence`)."""
        if not isinstance(self.interval, AutoInterval):
            raise ValueError("interval_report() needs Checkpointer(interval='auto', mtbf=...)")
        return {**self.interval.report(), "tiers": {n: c.report() for n, c in self._pipeline.cadences().items()}}

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and persist it in the background.

        Returns once the copies are enqueued (phase 1 overlaps the caller's next
        forward/backward; the next ``optimizer.step()`` waits for it on the GPU).
        The snapshot goes to the memory tier, then to each slower tier by its
        ``persist_every`` cadence and ``if_busy`` (see :class:`IfBusy`; the handle
        says which tiers skipped it and why). In a collective job with
        ``if_busy="skip"`` it is collective: call it on every rank (the ranks agree
        which tiers are free, so that all of them write the same steps).
        Raises :class:`~ckpt.errors.RefusedStateError` for a value that needs
        pickle, :class:`~ckpt.errors.HostMemoryError` past ``host_memory_limit``,
        and :class:`~ckpt.errors.LockedError` when another live Checkpointer owns
        ``local_dir`` (see ``local_dir``).
        """
        return self._save(step, state)

    def _save(self, step: int, state: Mapping[str, Any], force: str | None = None,
              patient: bool = True) -> SaveHandle:
        """:meth:`save`; ``force``: a tier that must write this snapshot (a drain), busy or not, or
        ``_EVERY_TIER`` (a loop's final step: every tier). Not
        ``patient`` (:meth:`maybe_save`'s own saves): under ``if_busy="skip"`` it waits at most
        ``CKPT_BUSY_WAIT_MS`` for a buffer, and never allocates one while the background allocation runs."""
        self._check_open()
        step = _step_arg(step, "save(step=...)")
        self._node.own()
        if self._timeline is None:   # no restore() first: the saves continue the newest checkpoint's branch
            self._use_timeline(self._newest_timeline())
        t0 = time.perf_counter()
        plan = flatten(state, self.on_unsupported)
        records, data_bytes = layout(plan.entries, knobs.get("CKPT_ALIGN_BYTES"))
        stats = SnapshotStats(step, nbytes=data_bytes)
        handle = SaveHandle(step, self.tiers, stats)
        t_wait = time.perf_counter()
        allocations = self.pool.allocations
        wait = self.if_busy is IfBusy.WAIT or self._forcing
        pipe = self._pipeline
        busy = dict.fromkeys(pipe.tiers, 0)
        if not self._prepared_sync and not self.pool.buffers:
            self._prepared_sync = True
            self.pool.adopt()   # no maybe_save() came first: take over a previous process's segments now
        here = cause = _FREE   # why this rank, and why the ranks together, found no buffer
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
            buf = None if cause != _FREE else \
                self.pool.acquire(data_bytes, block=True, step=step, reclaim=pipe.reclaim, inline=False)
        elif not wait and self.ranks is not None:
            # on several ranks: all skip a snapshot (or a tier) when it is busy on any, so they commit the same steps
            here = _FREE if self.pool.has_free() else _HELD
            reply = self.ranks.max([here] + pipe.busy_tiers())
            cause, busy = reply[0], dict(zip(pipe.tiers, reply[1:]))
            buf = None if cause != _FREE else \
                self.pool.acquire(data_bytes, block=False, step=step, reclaim=pipe.reclaim)
        else:
            buf = self.pool.acquire(data_bytes, block=wait, step=step, reclaim=pipe.reclaim)
        stats.wait_s = time.perf_counter() - t_wait
        if buf is None:
            self.skipped += 1
            self.memory.skipped += 1
            if cause == _FREE:   # a copy that was still landing left its buffer to the tiers
                here = cause = _HELD
            where = None if self.ranks is None else "this rank" if here == cause else "another rank"
            self._skips.note(step, cause, where, self.pool, stats.wait_s)
            handle._skip("allocating" if cause == _ALLOCATING else "busy")
            stats.stall_s = time.perf_counter() - t0
            self._metrics.track(handle)
            return handle
        shared = [i for i, e in enumerate(plan.entries)
                  if not e.sharded and e.key.split("/", 1)[0] in self.replicated] if self.replicated else []
        manifest = Manifest(step=step, rank=0, world_size=1, data_bytes=data_bytes,
                            chunk_bytes=knobs.get("CKPT_CHUNK_BYTES"), chunks=[], items=records, tree=plan.tree,
                            job=self._job, replicated=shared or None)
        snap = Snapshot(step, plan.entries, records, data_bytes, manifest, buf, stats, self._timeline)
        try:
            stage(snap, self._side_stream)
        except BaseException:
            snap._fence()
            self.pool.release(buf, staged=True)
            raise
        due = pipe.due(step)
        if self.ranks is not None and self._auto_tiers:   # each rank's clock and costs: due on all if due on any
            due = dict(zip(pipe.tiers, (bool(v) for v in self.ranks.max([int(due[t]) for t in pipe.tiers]))))
        orphaned = pipe.take_orphaned()   # tiers whose waiting snapshot this buffer held: they get this one
        take = {t: None if force in (t, _EVERY_TIER) or t in orphaned or (due[t] and not busy[t]) else
                ("not due" if not due[t] else "busy") for t in pipe.tiers}
        pipe.submit(snap, handle, take, keep=force is not None)
        self.interval.saved(step)
        stats.stall_s = time.perf_counter() - t0
        if isinstance(self.interval, AutoInterval):
            previous = self.history[-1] if self.history else None
            # saves that wait for the tiers (if_busy="wait") cannot come faster than the local tier writes;
            # with newest wins the snapshot cadence is the memory tier's alone (each tier has its own)
            # a save that allocated its buffer paid a one-time cost (seconds for GB of pinned memory), not the
            # snapshot's: the interval is set from what every snapshot costs the loop
            once = stats.wait_s if self.pool.allocations > allocations else 0.0
            self.interval.record(stats.stall_s - once, previous.persist_s.get(self.local.name)
                                 if previous and self.if_busy is IfBusy.WAIT else None)
        self._track(handle)
        self.history.append(stats)
        self._metrics.track(handle)
        return handle

    def _track(self, handle: SaveHandle) -> None:
        """Keep ``handle`` among those :meth:`wait` and :meth:`close` wait for (the finished ones go)."""
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]

    def wait_staged(self) -> None:
        """Block until every snapshot copy has landed in host memory.

        Call it before modifying state tensors in place outside
        ``optimizer.step()`` (an EMA update, say) while a save may be in flight.
        """
        wait_all_staged()

    def wait(self, tier: str | None = None) -> None:
        """Block until every save so far finished ``tier`` (all tiers when ``None``).

        Raises the first failure since the last ``wait()`` (also when a
        ``handle.wait()`` raised it already: this reports on every save); the
        failure was also logged when it happened.
        """
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            h._wait_quietly(tier)   # failures are raised below
        self._metrics.poll()
        self._raise_failures(include_seen=True)

    # -- restoring ------------------------------------------------------------------------------------
    def restore(self, state: dict, step: int | None = None, strict: bool = True) -> int | None:
        """Load the newest verified checkpoint (or ``step``) into ``state`` in place.

        Returns the step it was saved at, or ``None`` when no checkpoint exists
        on any tier. Corrupt or torn checkpoints are skipped with a warning
        naming the file; :class:`~ckpt.errors.NoCheckpointError` if none is
        usable. ``strict=False`` loads the keys common to both.

        Collective in a multi-process job (``collective``): every rank returns the
        same step, the newest that all of them hold and can load (older ones are
        tried when a rank finds its copy corrupt); a rank that cannot load a step
        because it does not fit the state makes every rank raise. A checkpoint on
        the job tier saved by another number of ranks or in another sharding is
        resharded into the live layout (``last_restore.tier`` is ``"remote"``).

        A snapshot loaded from the memory tier that a previous process took (one killed before its
        local tier, or its remote tier by cadence, had it) and that no durable tier holds is written to
        each tier that lacks it, in the background, right after the return: a second failure (the node
        rebooting, which empties its RAM) then loses nothing. :meth:`wait` waits for it; its failures are
        raised there. This makes the Checkpointer the owner of ``local_dir`` where no live process owns it
        (as a save does); beside another live owner it writes nothing.
        """
        self._check_open()
        if step is not None:
            step = _step_arg(step, "restore(step=...)")
        if not isinstance(strict, bool):
            raise TypeError(f"restore(strict=...) must be True or False, got {strict!r}")
        with self._lock:
            handles = list(self._handles)
        for h in handles:       # snapshots still being copied become the memory tier first
            try:
                # with the peer tier, the persist thread's exchanges must be over: a restore may use
                # the same peer group to send a held replica back. Failures stay for wait() / close().
                h._wait_quietly(None if self.peer is not None else self.memory.name)
            except BaseException:
                pass
        if self.ranks is not None:
            info = self._restore_agreed(state, step, strict)
        else:
            listed = _listing(self._stack.own)
            info = _restore(state, self._stack.own, step, strict, self._job, listed=listed, refill=self._node.may_refill())
            restored = None if info is None else Committed(info.step, info.timeline)
            self._use_timeline(_resume_timeline(restored, [e for e, _ in listed]))
            if info is not None:
                held: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
                for e, tier in listed:
                    held[tier.name].add(e.key)
                self._handover.persist(info, self._handover.unpersisted(info, held, [e for e, _ in listed]))
        self.last_restore = info
        if info is not None:
            self._metrics.restored(info)
        return None if info is None else info.step

    @property
    def timeline(self) -> Timeline:
        """The timeline the next save goes to (:class:`~ckpt.policy.Timeline`).

        Set by :meth:`restore`: the restored checkpoint's when it is the newest committed one on any
        tier, else a new timeline (one more than the largest seen) that branches off at the restored
        step, so that a later restore resumes the saves that follow and never the abandoned branch.
        Without a restore, the first save continues the newest checkpoint's timeline.
        """
        if self._timeline is None:
            return self._newest_timeline()
        return self._timeline

    def _newest_timeline(self) -> Timeline:
        """The newest checkpoint's timeline, on any tier (0 when there is none). A remote tier that cannot
        be listed now is left out (logged): a save must not fail on it before its upload even starts."""
        entries = []
        for tier in self._stack.own:
            try:
                entries += tier.committed()
            except OSError as e:
                log.warning("could not list the %s tier to find the newest checkpoint's timeline (%s); using the "
                            "other tiers'", tier.name, e)
        live = live_and_abandoned(entries)[0]
        return live[0].timeline if live else Timeline()

    def _use_timeline(self, timeline: Timeline) -> None:
        """Make ``timeline`` the one the next saves record, on every tier."""
        if self._timeline is not None and timeline != self._timeline:
            with self._lock:
                handles = list(self._handles)
            for h in handles:   # saves still persisting were taken on the previous timeline: they commit on it
                try:
                    h.wait()
                except BaseException:
                    pass
            self._pipeline.branch_left(self._timeline, timeline)
        self._timeline = timeline
        with self.pool._cv:
            self.pool.live = timeline   # a snapshot a rollback abandoned is the first to be overwritten
        for tier in list(self._stack):
            tier.timeline = timeline   # the peer tier sends it with each replica

    def _restore_agreed(self, state: dict, step: int | None, strict: bool) -> RestoreInfo | None:
        """:meth:`restore` when the ranks must agree (:class:`ckpt.restore.AgreedRestore`)."""
        job_tier = self.remote is not None and self.remote.job is not None
        return AgreedRestore(self.ranks, self._stack.own, self.peer, self.memory, self._job, self._use_timeline,
                             self._handover.unpersisted, self._handover.persist, job_tier).run(state, step, strict)

    @property
    def tier_counts(self) -> dict[str, Any]:
        """Per persisting tier, what it did with the snapshots so far (:class:`~ckpt.pipeline.TierCounts`:
        ``persisted``, ``superseded``, ``busy``, ``not_due``, ``failed``)."""
        return self._pipeline.counts()

    def tier_figures(self) -> dict[str, TierFigures]:
        """Per tier, nearest first, its capacity and cost figures (:class:`~ckpt.tiers.base.TierFigures`:
        steps and bytes held, capacity, and the writes and reads measured in this process with their
        throughput). Lists each tier (a remote tier: one listing of the store)."""
        return {t.name: t.figures() for t in sorted(list(self._stack),
                                                     key=lambda t: t.nearness)}

    @property
    def tiers(self) -> list[str]:
        """The tiers a save goes to, nearest first."""
        return self._stack.names

    def promote(self, step: int, to: str) -> bool:
        """Copy committed checkpoint ``step`` to tier ``to`` (``"remote"`` or ``"local"``), verifying every byte.

        ``to="remote"`` uploads it from the local tier; ``to="local"`` downloads it
        from the remote tier (making this Checkpointer the owner of ``local_dir``,
        see there). The destination's copy of ``step``, if any, is replaced only by a
        complete, verified new one: a promote that fails, or a process killed at any
        point of it, leaves the destination as it was (its old copy or, once the
        switch happened, the new one). Returns ``False`` without writing when the
        destination already holds the same checkpoint and it verifies.

        Raises ``FileNotFoundError`` if the source tier does not hold ``step``,
        :class:`~ckpt.errors.CorruptCheckpointError` naming the file if the source's
        bytes fail their checksums, and an ``OSError`` naming the URL (or ``local_dir``)
        when the transfer or the destination fails. Saves of ``step`` still in flight
        are waited for first. On a job tier ``promote(step, "remote")`` is collective
        and does not replace a step committed there.
        """
        self._check_open()
        if to not in ("remote", "local"):
            raise ValueError(f"to must be 'remote' or 'local', got {to!r}")
        if self.remote is None:
            raise ValueError("promote(to='remote') needs Checkpointer(url=...)" if to == "remote" else
                             "promote(to='local') copies from the remote tier: pass Checkpointer(url=...)")
        with self._lock:
            pending = [h for h in self._handles if h.step == step]
        for h in pending:   # the pipeline's own write of this step comes first
            try:
                h.wait()
            except BaseException:
                pass
        if to == "local":
            self._node.own()
        return copy_between(self.local, self.remote, step, to)

    def list(self) -> list[CheckpointInfo]:
        """Checkpoints visible on any tier, newest first: the live branch by ``(timeline, step)``, then
        the abandoned branch of a rollback (``abandoned=True``), each newest first."""
        listed = _listing(self._stack.own)
        live, abandoned = live_and_abandoned(e for e, _ in listed)
        gone = {e.key for e in abandoned}
        found: dict[tuple[int, int], CheckpointInfo] = {}
        for e, tier in sorted(listed, key=lambda c: c[1].nearness):
            info = found.get(e.key)
            if info is None:
                info = found[e.key] = CheckpointInfo(e.step, [], None, None, None, e.timeline.number, e.key in gone)
            info.tiers.append(tier.name)
            d = tier.describe(e.step, e.timeline)
            if info.nbytes is None:
                info.nbytes, info.created_unix = d.nbytes, d.created_unix
            if info.path is None and tier.durable:   # where it lies on disk or in storage
                info.path = d.path
        order = [e.key for e in live + abandoned]
        return [found[k] for k in dict.fromkeys(order)]

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self, raise_errors: bool = True, keep_memory: bool = False) -> None:
        """Write the newest snapshot to every tier that does not hold it yet (a tier that skipped it
        for its cadence or because it was busy), finish persisting every save, stop the background
        workers (a background allocation of the host buffers still under way stops where it stands,
        within milliseconds), and free the host buffers: the memory tier goes with them, its shared
        memory included, unless ``keep_memory`` (then the next process on this node may restore from
        it). No thread of the Checkpointer outlives it. Safe to drop the object afterwards. Collective
        in a collective job. A Checkpointer that owns ``local_dir`` only because its :meth:`restore` wrote a
        previous process's snapshot to the durable tiers, and took no snapshot itself, leaves the memory
        tier as it found it.

        When ``raise_errors``, raises the first failure the user has not seen: one that neither
        ``handle.wait()`` nor :meth:`wait` raised already. ``__exit__`` calls it (without raising,
        and keeping the memory tier, when the block itself raised).
        """
        if self._closed:
            return
        self._closed = True
        try:
            keep_memory = keep_memory or (self._node.by_restore and not self.history)
            self._pipeline.close(keep_shared=keep_memory or not self._node.owned)
            if keep_memory and self._node.owned:
                self.memory.say_kept(loud=self._exit_error)
            if self.peer is not None:   # the replicas this rank holds: freed with its own snapshots, or kept
                self.peer.close(keep_shared=keep_memory or not self._node.owned)
        finally:
            self._node.disown()   # every write is over: another process may own local_dir now
        with self._lock:
            self._handles = []
        self._metrics.poll()
        if raise_errors:
            self._raise_failures()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    def _failed(self, handle: SaveHandle, error: BaseException) -> None:
        with self._lock:
            self._failures.append((handle, error))

    def _raise_failures(self, include_seen: bool = False) -> None:
        """Raise the first failure recorded since the last call (the others are logged). Those a
        ``handle.wait()`` raised to the user already count only when ``include_seen`` (``wait()``, which
        reports on every save, sets it; ``close()`` does not: it raises what the user never saw)."""
        with self._lock:
            failures, self._failures = self._failures, []
        if not include_seen:
            failures = [(h, e) for h, e in failures if not h._was_raised(e)]
        if failures:
            handle, err = failures[0]
            if len(failures) > 1:
                log.error("%d saves failed; raising the first (step %d)", len(failures), handle.step)
            raise err

    def _apply_retention(self, tiers: list[str]) -> None:
        """Retention after a commit. What counts as verified here (the newest such step is always kept,
        and with none nothing committed is deleted): a step this process committed to that tier itself
        (checksums computed from its own host buffer, or, for a copy, every chunk checked against the
        sender's), or read back in full from it; never a step it saw fail verification."""
        busy = self._pipeline.in_flight()
        for name in tiers:
            tier = self._stack.get(name)
            if not tier.prunes_here():
                continue
            prune(tier, tier.keep_of(self.keep), busy,
                  verified=lambda s, record=tier.verified: record.get(s) is True)

def _step_arg(step: Any, what: str) -> int:
    """``step`` as a Python int: an integer (numpy's too, not a bool) from 0 to 2**63 - 1, the range every
    ``COMMIT`` and manifest records; anything else is a ``ValueError`` naming the argument."""
    if not isinstance(step, bool):
        try:
            n = operator.index(step)
        except TypeError:
            n = None
        if n is not None and 0 <= n <= _MAX_STEP:
            return n
    raise ValueError(f"{what}: step must be an int from 0 to 2**63 - 1 (a checkpoint records a 64-bit step), "
                     f"got {step!r}")

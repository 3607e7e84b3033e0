"""``Checkpointer``: the public entry point for plain training loops."""

from __future__ import annotations

import collections
import enum
import logging
import os
import secrets
import signal as _signal
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from . import knobs
from .errors import CheckpointError, NoCheckpointError, Preempted
from .format import COMMIT_NAME, Manifest
from .pipeline import Pipeline, SaveHandle
from .plan import flatten, layout
from .policy import AutoInterval, Interval, Retention, prune
from .ranks import Ranks, distributed_world
from .restore import RestoreInfo, restore as _restore
from .stage import HostPool, Snapshot, SnapshotStats, stage, wait_all_staged
from .tiers import LocalTier, MemoryTier, PeerTier, RemoteTier

__all__ = ["Checkpointer", "CheckpointInfo", "IfBusy", "promote"]

log = logging.getLogger(__name__)


class IfBusy(str, enum.Enum):
    """What ``save()`` does when every host buffer still holds a snapshot being persisted."""

    WAIT = "wait"   # block until the oldest finishes persisting (the stall is reported on the handle)
    SKIP = "skip"   # return a handle with status "skipped"; logged and counted, never silent


@dataclass
class CheckpointInfo:
    """A checkpoint visible on at least one tier."""

    step: int
    tiers: list[str]
    path: str | None
    nbytes: int | None
    created_unix: float | None


class Checkpointer:
    """Two-phase checkpointing of a training state: snapshot now, persist in the background.

    Args:
        url: the durable remote tier, any fsspec URL (``s3://bucket/run``,
            ``gs://...``, ``file:///...``, ``memory://...``), or ``None``.
            Resolved once with ``storage_options``; uploads run beside the local
            write, straight from host memory. In a multi-process job (``collective``)
            give every rank the same url: it becomes the *job tier*, one step
            directory holding every rank's files, committed by rank 0 once all
            ranks' uploads succeeded, and restorable on another number of ranks,
            into another mesh or placements, or into one process holding whole
            tensors (resharding by overlap of shards).
        storage_options: passed to fsspec for ``url`` (endpoint, credentials,
            retry configuration).
        compression: ``None`` or ``"zstd"`` (byte-shuffled, per chunk) for the
            remote tier.
        local_dir: directory of the local tier, on fast local storage (default:
            ``$CKPT_LOCAL_DIR``), or a :class:`~ckpt.tiers.LocalTier` instance
            (a subclass, say, for fault injection or a custom layout).
        every_steps / every_seconds: the policy of :meth:`maybe_save`.
        keep: :class:`Retention` (default: 2 checkpoints in ``local_dir``).
        max_in_flight: snapshots held in host memory at once (one host buffer,
            the size of the state, each).
        if_busy: ``"wait"`` (default) or ``"skip"``: what a save does when all
            ``max_in_flight`` buffers are still being persisted.
        host_memory_limit: bytes of host staging memory allowed (default: 80%
            of what psutil reports available when a buffer is allocated).
            Exceeding it raises :class:`~ckpt.errors.HostMemoryError`.
        on_unsupported: ``"error"`` (default) refuses a value that is not
            JSON-safe, naming its key; ``"skip"`` leaves such values out
            (logged), so they are not restored. Pickle is never used.
        interval: ``"auto"`` picks the Young/Daly optimum interval from the
            measured cost of recent saves and ``mtbf`` (mean time between
            failures, seconds; ``restart_cost`` seconds per failure), updated as
            measurements come in; see :meth:`interval_report`.
        signals: e.g. ``(signal.SIGTERM,)``: inside the ``with`` block these only
            set a flag; the next :meth:`maybe_save` forces a save, waits until it
            is durable on ``drain_tier`` (at most ``drain_deadline`` seconds), then
            exits with status ``128 + signal`` (``on_preempt="exit"``) or raises
            :class:`~ckpt.errors.Preempted` (``on_preempt="raise"``). ``drain_tier="peer"``
            (with ``peers=``) waits until the peer rank, on another node, has committed
            this rank's copy: durable off the draining node at network speed.
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
        replicated: top-level state keys whose plain tensors are the same on every
            rank (a DDP model and its optimizer: ``("model", "optim")``). On a job
            tier only rank 0 uploads them; the other ranks' restores read them from
            rank 0's files. DTensor shards are never treated as replicated. Every
            rank's local tier keeps its full state either way. Default: none.
        peers: the peer tier (collective jobs): ``True`` sends every locally committed
            checkpoint to the same local rank on the next node (a distance of
            ``$LOCAL_WORLD_SIZE`` ranks, as torchrun sets it; 1 on one node), an int
            sets that distance. Each rank keeps its source's copies under
            ``<local_dir>/peers/``; a rank whose own copies are gone (a replaced node)
            gets them back from its peer at restore, before any remote download.
            ``handle.wait("peer")`` returns once the peer has committed this rank's copy.

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
                 every_seconds: float | None = None, keep: Retention | None = None, max_in_flight: int = 1,
                 if_busy: str | IfBusy = IfBusy.WAIT, host_memory_limit: int | None = None,
                 on_unsupported: str = "error", interval: str | None = None, mtbf: float | None = None,
                 restart_cost: float = 0.0, signals: tuple = (), drain_deadline: float = 30.0,
                 drain_tier: str = "local", on_preempt: str = "exit",
                 clock: Callable[[], float] = time.monotonic, collective: bool | None = None,
                 replicated: tuple[str, ...] | list[str] = (), peers: bool | int | None = None) -> None:
        local_dir = local_dir if local_dir is not None else os.environ.get("CKPT_LOCAL_DIR")
        if local_dir is None:
            raise ValueError("Checkpointer needs a local tier: pass local_dir=... or set $CKPT_LOCAL_DIR")
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
        self.keep = keep if keep is not None else Retention()
        if interval is None:
            self.interval: Interval | AutoInterval = Interval(every_steps, every_seconds, clock)
        elif interval == "auto":
            if every_steps is not None or every_seconds is not None:
                raise ValueError("interval='auto' picks the interval itself: drop every_steps / every_seconds")
            self.interval = AutoInterval(mtbf, restart_cost, clock=clock)
        else:
            raise ValueError(f"interval must be None or 'auto', got {interval!r}")
        if drain_tier not in ("local", "remote", "peer") or (drain_tier == "remote" and url is None) \
                or (drain_tier == "peer" and not peers):
            raise ValueError(f"drain_tier must be 'local', 'remote' together with a url, or 'peer' together with "
                             f"peers=; got {drain_tier!r}")
        if on_preempt not in ("exit", "raise"):
            raise ValueError(f"on_preempt must be 'exit' or 'raise', got {on_preempt!r}")
        if signals and not drain_deadline > 0:
            raise ValueError(f"drain_deadline must be a positive number of seconds, got {drain_deadline!r}")
        self.drain_deadline = drain_deadline
        self.drain_tier = drain_tier
        self.on_preempt = on_preempt
        self._signals = tuple(signals)
        self._guard = None
        self.on_unsupported = on_unsupported
        self.local = local_dir if isinstance(local_dir, LocalTier) else LocalTier(local_dir)
        self.remote = (url if isinstance(url, RemoteTier) else RemoteTier(url, storage_options, compression=compression)) \
            if url is not None else None
        if url is None and compression is not None:
            raise ValueError("compression applies to the remote tier: pass a url too, or compression=None")
        self.pool = HostPool(max_in_flight, host_memory_limit)
        self.memory = MemoryTier(self.pool)
        self.history: collections.deque[SnapshotStats] = collections.deque(maxlen=10_000)
        self.skipped = 0
        self.last_restore: RestoreInfo | None = None
        self._handles: list[SaveHandle] = []
        self._failures: list[tuple[SaveHandle, BaseException]] = []
        self._lock = threading.Lock()
        self._side_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        world = distributed_world()
        if collective and world <= 1:
            raise ValueError("collective=True needs torch.distributed initialised with more than one rank "
                             "(call init_process_group first, or leave collective=None)")
        # last: creating the group is a collective, and every rank must get this far to join it
        self.ranks = Ranks() if (world > 1 if collective is None else collective) else None
        self._job = [self.ranks.rank, self.ranks.world] if self.ranks is not None else None
        if self.ranks is not None:
            self._check_own_storage()
        self.peer = self._make_peer(peers)
        # a time-based policy decides by each rank's clock: those decisions are agreed in maybe_save
        self._agree_due = self.ranks is not None and (isinstance(self.interval, AutoInterval)
                                                      or self.interval.every_seconds is not None)
        self._pipeline = Pipeline(self.pool, self.memory, self.local, self.remote, self._apply_retention,
                                  self._failed, self.peer)
        self._closed = False

    # -- context manager ----------------------------------------------------------------------------
    def __enter__(self) -> "Checkpointer":
        if self._signals:
            from .integrations.signals import PreemptionGuard

            self._guard = PreemptionGuard(self._signals)
            self._guard.install()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close(raise_errors=exc_type is None)
        finally:
            if self._guard is not None:
                self._guard.uninstall()

    # -- saving ---------------------------------------------------------------------------------------
    def maybe_save(self, step: int, state: Mapping[str, Any]) -> SaveHandle | None:
        """Save if the policy says so (see ``every_steps``/``every_seconds``); returns at once.

        ``state`` is the state *after* ``step``: a restore returns ``step`` and
        the loop continues at ``step + 1``.
        """
        if self._guard is not None and self._guard.active:
            signum = self._guard.agreed(self.ranks)   # collective when torch.distributed is initialised
            if signum:
                self._drain(step, state, signum)
        due = self.interval.due(step)
        if self._agree_due:
            due = bool(self.ranks.max([int(due)])[0])   # clocks differ between ranks: save if any says so
        if not due:
            return None
        return self.save(step, state)

    @property
    def preempted(self) -> int | None:
        """The preemption signal received (``None`` if none)."""
        return None if self._guard is None else self._guard.received

    def _drain(self, step: int, state: Mapping[str, Any], signum: int) -> None:
        name = _signal.Signals(signum).name
        t0 = time.perf_counter()
        log.warning("%s received: saving step %d and making it durable on the %s tier within %.0f s",
                    name, step, self.drain_tier, self.drain_deadline)
        durable = False
        try:
            handle = self.save(step, state)
            handle.wait(self.drain_tier, timeout=max(0.0, self.drain_deadline - (time.perf_counter() - t0)))
            durable = True
            log.warning("step %d is durable on the %s tier after %.2f s; exiting", step, self.drain_tier,
                        time.perf_counter() - t0)
        except TimeoutError:
            log.error("step %d was not durable on the %s tier within drain_deadline=%.0f s", step,
                      self.drain_tier, self.drain_deadline)
        except Exception as e:
            log.error("the preemption save of step %d failed: %s", step, e)
        self._guard.chain(signum)
        if self.on_preempt == "raise":
            raise Preempted(signum, step, durable)
        raise SystemExit(128 + signum)

    def interval_report(self) -> dict[str, float | None]:
        """With ``interval="auto"``: the current interval, measured cost, MTBF and expected fraction lost."""
        if not isinstance(self.interval, AutoInterval):
            raise ValueError("interval_report() needs Checkpointer(interval='auto', mtbf=...)")
        return self.interval.report()

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` as step ``step`` and persist it in the background.

        Returns once the copies are enqueued (phase 1 overlaps the caller's next
        forward/backward; the next ``optimizer.step()`` waits for it on the GPU).
        Raises :class:`~ckpt.errors.RefusedStateError` for a value that needs
        pickle and :class:`~ckpt.errors.HostMemoryError` past ``host_memory_limit``.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        plan = flatten(state, self.on_unsupported)
        records, data_bytes = layout(plan.entries, knobs.get("CKPT_ALIGN_BYTES"))
        stats = SnapshotStats(step, nbytes=data_bytes)
        handle = SaveHandle(step, self.tiers, stats)
        t_wait = time.perf_counter()
        wait = self.if_busy is IfBusy.WAIT
        if not wait and self.ranks is not None and self.ranks.max([int(not self.pool.has_free())])[0]:
            buf = None   # if_busy="skip" on several ranks: all skip when any is busy, so they commit the same steps
        else:
            buf = self.pool.acquire(data_bytes, block=wait, step=step)
        stats.wait_s = time.perf_counter() - t_wait
        if buf is None:
            self.skipped += 1
            log.warning("skipped the save of step %d: all %d host buffers are still persisting%s "
                        "(if_busy='skip'; raise max_in_flight or save less often)", step, self.pool.slots,
                        "" if self.ranks is None else " on this rank or another")
            handle._skip()
            stats.stall_s = time.perf_counter() - t0
            return handle
        shared = [i for i, e in enumerate(plan.entries)
                  if not e.sharded and e.key.split("/", 1)[0] in self.replicated] if self.replicated else []
        manifest = Manifest(step=step, rank=0, world_size=1, data_bytes=data_bytes,
                            chunk_bytes=knobs.get("CKPT_CHUNK_BYTES"), chunks=[], items=records, tree=plan.tree,
                            job=self._job, replicated=shared or None)
        snap = Snapshot(step, plan.entries, records, data_bytes, manifest, buf, stats)
        try:
            stage(snap, self._side_stream)
        except BaseException:
            snap._fence()
            self.pool.release(buf)
            raise
        self._pipeline.submit(snap, handle)
        self.interval.saved(step)
        stats.stall_s = time.perf_counter() - t0
        if isinstance(self.interval, AutoInterval):
            previous = self.history[-1] if self.history else None
            self.interval.record(stats.stall_s, previous.persist_s.get("local") if previous else None)
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]
        self.history.append(stats)
        return handle

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
        """
        self._check_open()
        with self._lock:
            handles = list(self._handles)
        for h in handles:       # snapshots still being copied become the memory tier first
            try:
                # with the peer tier, the persist thread's exchanges must be over: a restore may use
                # the same peer group to send a kept copy back. Failures stay for wait() / close().
                h._wait_quietly(None if self.peer is not None else "memory")
            except BaseException:
                pass
        if self.ranks is not None:
            info = self._restore_agreed(state, step, strict)
        else:
            info = _restore(state, self.memory, self.local, self.remote, step, strict, self._job)
        self.last_restore = info
        return None if info is None else info.step

    def _check_own_storage(self) -> None:
        """Refuse, on every rank, a ``local_dir`` or ``url`` that another rank of the job writes too
        (each rank's files and ``COMMIT`` would overwrite the others'). Collective. Sharing is found
        by marker files, so a directory shared across hosts (a network file system) is found too."""
        ranks = self.ranks
        nonce = ranks.gather([secrets.randbits(62)])[0][0]   # rank 0's: one name space for this job
        prefix = f".ckpt-job-{nonce:x}-rank-"
        marker = self.local.root / f"{prefix}{ranks.rank}"
        marker.touch()
        try:
            ranks.gather([])   # every marker exists before any rank looks
            mates = sorted(int(p.name[len(prefix):]) for p in self.local.root.glob(f"{prefix}*"))
            url = zlib.crc32(self.remote.url.encode()) if self.remote is not None else -1
            seen = ranks.gather([len(mates), url])   # also: every rank has looked before markers go
        finally:
            marker.unlink(missing_ok=True)
        urls = [u for _, u in seen]
        job_url = urls[0] != -1 and urls.count(urls[0]) == len(urls)   # one url for the whole job
        same_url = [] if job_url else [r for r, u in enumerate(urls) if u != -1 and urls.count(u) > 1]
        problems = [f"local_dir {str(self.local.root)!r} is shared by ranks {mates}"] if len(mates) > 1 else \
            ["another rank's local_dir is shared"] if any(n > 1 for n, _ in seen) else []
        if same_url:
            problems.append(f"ranks {same_url} were given the same url, other ranks another")
        if problems:
            raise ValueError(f"{'; '.join(problems)}: in a multi-process job give every rank its own local_dir "
                             "(e.g. f'{root}/rank-{rank}') and every rank the same url (a job tier) or each its own, "
                             "or pass collective=False if only one rank checkpoints")
        if job_url:   # decided from gathered facts, so every rank joins (a collective) or none does
            self.remote.join_job(Ranks(timeout_s=knobs.get("CKPT_COMMIT_TIMEOUT_S"), own_group=True))

    def _make_peer(self, peers: bool | int | None) -> PeerTier | None:
        """The peer tier when asked for (collective: it makes a gloo group of its own)."""
        if peers is None or peers is False:
            return None
        if self.ranks is None:
            raise ValueError("peers= keeps copies on other ranks of a multi-process job: it needs torch.distributed "
                             "with more than one rank (and collective=None or True)")
        world = self.ranks.world
        if peers is True:   # the same local rank on the next node (torchrun sets LOCAL_WORLD_SIZE)
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            jump = per_node if 0 < per_node < world else 1
        elif isinstance(peers, int) and not isinstance(peers, bool) and peers > 0 and peers % world:
            jump = peers
        else:
            raise ValueError(f"peers must be True (the next node's rank: LOCAL_WORLD_SIZE) or a rank distance "
                             f"that is not a multiple of the world size {world}, got {peers!r}")
        return PeerTier(self.local.root, Ranks(timeout_s=knobs.get("CKPT_COMMIT_TIMEOUT_S"), own_group=True), jump)

    def _near_steps(self) -> list[int]:
        """Steps this rank holds in memory or on its local tier."""
        steps = set(self.local.committed_steps())
        mem = self.memory.newest()
        if mem is not None:
            steps.add(mem[0])
        return sorted(steps, reverse=True)

    def _restore_agreed(self, state: dict, step: int | None, strict: bool) -> RestoreInfo | None:
        """:meth:`restore` when the ranks must agree: the newest step every rank holds and loads
        (in memory, locally, on the remote tier, or as the copy its peer keeps)."""
        ranks = self.ranks
        near = ranks.gather(self._near_steps())
        far = ranks.gather(self.remote.committed_steps() if self.remote is not None else [])
        kept = ranks.gather(self.peer.store.committed_steps()) if self.peer is not None else None
        held = [sorted(set(n) | set(f) | (set(kept[self.peer.holder_of(r)]) if kept else set()), reverse=True)
                for r, (n, f) in enumerate(zip(near, far))]
        common = sorted(set.intersection(*(set(h) for h in held)), reverse=True)
        if step is not None:
            common = [s for s in common if s == step]
        where = "; ".join(f"rank {r}: {h[:8] if h else 'none'}" for r, h in enumerate(held))
        if not common:
            if step is not None:
                raise FileNotFoundError(f"step {step} is not held by every rank ({where})")
            if not any(held):
                return None
            raise NoCheckpointError(
                f"no step is committed on every rank ({where}, newest first): pass step= to restore "
                "one anyway, or remove the ranks' checkpoint directories to start afresh")
        failed: list[str] = []
        for s in common:
            info, error, code = None, None, 1
            if kept is not None:   # ranks without a near copy of s get theirs back from the peer keeping it
                self._pull_from_peers(s, near, kept)
            try:
                info = _restore(state, self.memory, self.local, self.remote, s, strict, self._job)
            except (NoCheckpointError, FileNotFoundError) as e:   # this rank's copies of s are unusable or
                # gone (a peer's copy that failed verification was not committed): try an older step
                error, code = e, 0
            except Exception as e:           # does not fit the state (or worse): stop on every rank
                error, code = e, -1
            codes = [c[0] for c in ranks.gather([code])]
            if min(codes) == 1:
                if failed:
                    log.warning("ranks agreed on step %d after skipping: %s", s, "; ".join(failed))
                return info
            bad = [r for r, c in enumerate(codes) if c != 1]
            if -1 in codes:
                if error is not None and code == -1:
                    raise error
                raise CheckpointError(f"rank(s) {bad} could not load step {s} into the state (their logs say why); "
                                      "every rank stops")
            failed.append(f"step {s} unusable on rank(s) {bad}")
            log.warning("step %d is unusable on rank(s) %s; the ranks try an older common step", s, bad)
        raise NoCheckpointError("no step that every rank holds could be loaded on every rank: " + "; ".join(failed))

    def _pull_from_peers(self, step: int, near: list[list[int]], kept: list[list[int]]) -> None:
        """Collective: every rank that holds no near copy of ``step`` while its peer keeps one gets it back
        into its local tier (the same transfers are derived on every rank from the gathered lists)."""
        peer = self.peer
        needs = [r for r in range(peer.world) if step not in near[r] and step in kept[peer.holder_of(r)]]
        send_to = peer.src if peer.src in needs else None
        receive = peer.rank in needs
        if send_to is None and not receive:
            return
        try:
            if peer.serve(step, send_to, receive, self.local):
                log.info("rank %d got its copy of step %d back from rank %d (peer tier)", peer.rank, step,
                         peer.holder_of(peer.rank))
        except (CheckpointError, OSError) as e:   # this rank falls back to the remote tier, if any
            log.warning("rank %d could not get step %d back from its peer: %s", peer.rank, step, e)

    @property
    def tiers(self) -> list[str]:
        """The tiers a save goes to, nearest first."""
        return ["memory", "local"] + (["peer"] if self.peer is not None else []) + \
            (["remote"] if self.remote is not None else [])

    def promote(self, step: int, to: str) -> None:
        """Copy committed checkpoint ``step`` to tier ``to`` (``"remote"`` or ``"local"``), verifying every byte.

        ``to="remote"`` uploads it from the local tier; ``to="local"`` downloads it
        from the remote tier. Raises ``FileNotFoundError`` if the source tier does
        not hold ``step`` and :class:`~ckpt.errors.CorruptCheckpointError` if its
        bytes fail their checksums (nothing is committed at the destination then).
        """
        self._check_open()
        if to == "remote":
            if self.remote is None:
                raise ValueError("promote(to='remote') needs Checkpointer(url=...)")
            _, manifest = self.local.open(step)
            with self.local.mapped(step) as data:
                self.remote.write(step, manifest, data)   # checks the chunk checksums on the way
        elif to == "local":
            if self.remote is None:
                raise ValueError("promote(to='local') copies from the remote tier: pass Checkpointer(url=...)")
            _, manifest = self.remote.open(step)
            self.remote.load(step, manifest, None, refill=self.local)
        else:
            raise ValueError(f"to must be 'remote' or 'local', got {to!r}")

    def list(self) -> list[CheckpointInfo]:
        """Checkpoints visible on any tier, newest first."""
        found: dict[int, CheckpointInfo] = {}
        for s in self.local.committed_steps():
            d = self.local.step_dir(s)
            try:
                size = sum(f.stat().st_size for f in d.iterdir())
                created = (d / COMMIT_NAME).stat().st_mtime
            except OSError:
                size = created = None
            found[s] = CheckpointInfo(s, ["local"], str(d), size, created)
        if self.remote is not None:
            for s in self.remote.committed_steps():
                info = found.setdefault(s, CheckpointInfo(s, [], self.remote.step_dir(s), None, None))
                info.tiers.append("remote")
        mem = self.memory.newest()
        if mem is not None:
            s, m = mem
            info = found.setdefault(s, CheckpointInfo(s, [], None, m.data_bytes, m.created_unix))
            info.tiers.insert(0, "memory")
        return [found[s] for s in sorted(found, reverse=True)]

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self, raise_errors: bool = True) -> None:
        """Finish persisting every save, stop the background worker, and free the host staging
        buffers (the memory tier goes with them). Safe to drop the object afterwards.

        When ``raise_errors``, raises the first failure the user has not seen: one that neither
        ``handle.wait()`` nor :meth:`wait` raised already. ``__exit__`` calls it (without raising
        when the block itself raised).
        """
        if self._closed:
            return
        self._closed = True
        self._pipeline.close()   # also frees the host staging buffers (the memory tier goes with them)
        with self._lock:
            self._handles = []
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
        busy = self._pipeline.in_flight()
        for name in tiers:
            if name == "local":
                prune(self.local, self.keep.local, busy)
            elif name == "peer":
                prune(self.peer.store, self.keep.local, busy)   # the peer's copies, kept like this rank's own
            elif self.remote.job is None or self.remote.job.rank == 0:
                # a job tier is pruned by rank 0 alone, after it committed (every rank is past older steps)
                prune(self.remote, self.keep.remote, busy)


def promote(step: int, to: str, *, local_dir: str | os.PathLike, url: str,
            storage_options: dict[str, Any] | None = None, compression: str | None = None) -> None:
    """Copy committed checkpoint ``step`` between ``local_dir`` and ``url`` (see :meth:`Checkpointer.promote`).

    For scripts and the command line, outside a training process.
    """
    with Checkpointer(url, local_dir=local_dir, storage_options=storage_options, compression=compression,
                      collective=False) as ck:
        ck.promote(step, to)

"""Restore: the newest checkpoint that verifies, from the nearest tier that holds it.

Candidates are the checkpoints of the live branch (:func:`ckpt.policy.live_and_abandoned`: the
abandoned branch of a rollback is never restored unless asked for by step), ordered newest
``(timeline, step)`` first and, for one checkpoint, nearest tier first (by each tier's ``nearness``:
memory, then local, then remote). A step asked for by number comes from the newest timeline that holds it. A candidate whose files are missing, torn or
corrupt is skipped with a warning naming the file, and the next one is tried.
A checkpoint that is valid but does not fit the state (other keys, shapes or
world size) is not a storage fault: it raises at once.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LayoutMismatchError,
    NoCheckpointError,
)
from .loading import OtherRanksCopy
from .policy import Committed, Timeline, live_and_abandoned
from .pipeline import SaveHandle
from .stage import SnapshotStats
from .tiers.base import COPY_UNKNOWN, PersistingTier, Tier
from .tiers.peer import Background, ReceivedCopy

__all__ = [
    "RestoreInfo",
    "restore",
    "listing",
    "OtherRanksCopy",
    "AgreedRestore",
    "HandOver",
    "held_anywhere",
    "restore_state",
    "restore_alone",
    "resume_timeline",
    "state_gpu",
]

log = logging.getLogger(__name__)


@dataclass
class RestoreInfo:
    """What a restore did: the step, the tier it came from, bytes and seconds.

    ``seconds``: reading the tier into the state. ``phases``: where the whole call's wall time went, in
    seconds: ``load`` (the same read) and, in a collective restore, ``agree`` (the ranks exchanging what
    they hold and picking the step), ``peer`` (getting this rank's copy back from the RAM of the rank
    holding it and serving the copy this rank holds to its owner; absent when no rank needed one) and
    ``confirm`` (waiting until every rank has loaded: a rank that finished first waits for the slowest).
    """

    step: int
    tier: str
    nbytes: int
    seconds: float
    skipped: list[str]
    timeline: Timeline = Timeline()  # the restored checkpoint's
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Bytes loaded per second of :attr:`seconds`, GB/s (10^9 bytes)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds else float("inf")


def listing(tiers: Sequence[Tier]) -> list[tuple[Committed, Tier]]:
    """Every checkpoint committed on any of ``tiers``, with the tier holding it (unordered)."""
    return [(e, t) for t in tiers for e in t.committed()]


#: how many times a restore lists the tiers again when a checkpoint changed under it (a live writer's
#: retention or re-save), before such a change counts as a failure of that copy
_RELISTS = 8


def _stamp(tier: Tier, step: int) -> Any:
    """What identifies the copy of ``step`` on ``tier`` now (``None``: it is not committed there), or
    :data:`~ckpt.tiers.base.COPY_UNKNOWN` for a tier that cannot say (or when the question failed)."""
    try:
        return tier.copy_id(step)
    except OSError:
        return COPY_UNKNOWN


def _candidates(
    tiers: Sequence[Tier], listed: list[tuple[Committed, Tier]], step: int | None, timeline: int | None
) -> list[tuple[Committed, Tier]]:
    """The checkpoints a restore tries, in order: the live branch newest first (or ``step``, from the newest
    timeline holding it; ``FileNotFoundError`` when no tier holds it), nearest tier first."""
    if step is None:
        live = {e.key for e in live_and_abandoned(e for e, _ in listed)[0]}
        candidates = [c for c in listed if c[0].key in live]
    else:
        candidates = [c for c in listed if c[0].step == step and timeline in (None, c[0].timeline.number)]
        if not candidates:
            where = ", ".join(f"{t.name}: {t.location()}" for t in tiers)
            raise FileNotFoundError(
                f"step {step} is on no tier ({where}"
                f"{'' if timeline is None else f', timeline {timeline}'}); committed: "
                + "; ".join(f"{t.name} {t.committed_steps()[:10]}" for t in tiers)
            )
        newest = max(e.timeline.number for e, _ in candidates)
        candidates = [c for c in candidates if c[0].timeline.number == newest]
    return sorted(candidates, key=lambda c: (-c[0].timeline.number, -c[0].step, c[1].nearness))


def restore(
    state: dict,
    tiers: Sequence[Tier],
    step: int | None = None,
    strict: bool = True,
    job: list[int] | None = None,
    timeline: int | None = None,
    listed: list[tuple[Committed, Tier]] | None = None,
    refill: bool = True,
) -> RestoreInfo | None:
    """Load the newest verified checkpoint (or ``step``) on any of ``tiers`` into ``state`` in place.

    A checkpoint read from a tier farther than one that ``refills`` (the local tier) is written to that
    one on the way (verified chunk by chunk), so the next restore is near. ``job``: this process's
    ``[rank, world size]`` in a multi-process job; a rank's own copy saved at another place in the job
    is passed over. A tier that ``reshards`` (a job tier) loads a checkpoint saved in another layout.
    ``step`` comes from the newest timeline holding it (``timeline``: from that one); ``listed``:
    :func:`listing`, when the caller has it already. A candidate that failed because another process
    removed or replaced it while it was read (its tier's ``copy_id`` changed) is no fault of the copy:
    the tiers are listed again (into ``listed``, in place) and the search starts over from the newest.
    ``refill=False``: write no tier on the way (the caller may not write the local tier: another process
    owns it).
    """
    tiers = sorted(tiers, key=lambda t: t.nearness)
    if listed is None:
        listed = listing(tiers)
    skipped: list[str] = []
    for relist in range(_RELISTS + 1):
        candidates = _candidates(tiers, listed, step, timeline)
        if not candidates:
            return None
        changed = False
        for entry, tier in candidates:
            s = entry.step
            near = next((t for t in tiers if refill and t.refills and t.nearness < tier.nearness), None)
            before = _stamp(tier, s)
            t0 = time.perf_counter()
            try:
                if before is None:  # listed, and gone since: raise what a read of it would
                    raise IncompleteCheckpointError(
                        f"step {s} on the {tier.name} tier is no longer committed"
                    )
                nbytes = tier.restore_into(state, s, entry.timeline, strict, job, near)
            except LayoutMismatchError as e:
                if tier.reshards or not any(t.reshards and t.nearness > tier.nearness for t in tiers):
                    raise
                # this rank's own copy is in the old layout; a farther tier may hold the job's shards
                log.info(
                    "step %d on the %s tier is in another layout; trying a tier that reshards: %s",
                    s,
                    tier.name,
                    e,
                )
                skipped.append(f"{tier.name}:{s}: {e}")
                continue
            except (CorruptCheckpointError, IncompleteCheckpointError, OSError, LookupError) as e:
                after = (
                    COPY_UNKNOWN
                    if before is None or before is COPY_UNKNOWN or isinstance(e, LookupError)
                    else _stamp(tier, s)
                )
                # changed: gone since it was listed, or another copy now (a tier that cannot say now, its store
                # down or stalled, says nothing: the read's failure is the copy's)
                if (
                    not isinstance(e, LookupError)
                    and relist < _RELISTS
                    and before is not COPY_UNKNOWN
                    and (before is None or (after is not COPY_UNKNOWN and after != before))
                ):
                    # Not a fault of the copy: another process removed or replaced it while this one read it
                    # (retention or a re-save of a live writer of the directory). List the tiers again and
                    # start over from the newest, rather than fall back past checkpoints that are fine.
                    log.info(
                        "step %d on the %s tier was removed or replaced while it was read (%s); listing the "
                        "tiers again",
                        s,
                        tier.name,
                        e,
                    )
                    changed = True
                    break
                if not isinstance(e, LookupError):
                    tier.verified[s] = False  # known not to verify: retention never keeps it as the good copy
                msg = f"step {s} on the {tier.name} tier is unusable, trying the next tier or an older step: {e}"
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                log.warning(msg)
                skipped.append(f"{tier.name}:{s}: {e}")
                continue
            if tier.refills:
                tier.verified[s] = (
                    True  # every byte read and checked (a farther read refills and commits here)
                )
            took = time.perf_counter() - t0
            info = RestoreInfo(s, tier.name, nbytes, took, skipped, entry.timeline, {"load": took})
            tier.measured_read(nbytes, info.seconds)
            log.info(
                "restored step %d from the %s tier (%.3f GB in %.3f s)",
                s,
                tier.name,
                info.nbytes / 1e9,
                info.seconds,
            )
            return info
        if not changed:
            break
        listed[:] = listing(tiers)  # in place: the caller decides the next timeline from what is there now
    raise NoCheckpointError("no checkpoint could be verified and loaded; tried:\n  " + "\n  ".join(skipped))


def resume_timeline(restored: Committed | None, entries: list[Committed]) -> Timeline:
    """The timeline of the saves after a restore of ``restored``: its own when it is the newest of
    ``entries`` (every checkpoint on every tier, of every rank), else a new one (one more than the
    largest seen) that branches off at the restored step."""
    if restored is None or not entries:
        return Timeline()
    if restored.key == max(e.key for e in entries):
        return restored.timeline
    return restored.timeline.branch(restored.step, max(e.timeline.number for e in entries) + 1)


#: seconds a collective restore's agreement runs before a rank reads its own newest snapshot onto its GPU
#: (:meth:`ckpt.tiers.MemoryTier.read_ahead`): ranks arriving together agree in a few milliseconds
READ_AHEAD_AFTER_S = 0.02


def state_gpu(state: dict) -> torch.device | None:
    """The GPU of the first tensor of ``state`` found on one (``None``: none is), looking at tensors, modules'
    parameters and buffers and optimizers' parameters, never calling ``state_dict()`` (which an FSDP model
    may answer with collectives)."""
    stack: list[Any] = list(state.values())[::-1]
    seen = 0
    while stack and seen < 10_000:
        v = stack.pop()
        seen += 1
        if isinstance(v, torch.Tensor):
            t = v.to_local() if hasattr(v, "to_local") else v
            if t.device.type == "cuda":
                return t.device
        elif isinstance(v, torch.nn.Module):
            t = next(
                (x for x in itertools.chain(v.parameters(), v.buffers()) if x.device.type == "cuda"), None
            )
            if t is not None:
                return t.device
        elif isinstance(v, torch.optim.Optimizer):
            stack.extend(p for g in v.param_groups[::-1] for p in g["params"][::-1])
        elif isinstance(v, Mapping):
            stack.extend(list(v.values())[::-1])
        elif isinstance(v, (list, tuple)):
            stack.extend(v[::-1])
    return None


def _encode(entries: list[Committed]) -> list[int]:
    """``(timeline, step, forks)`` of each checkpoint as integers, for a gather between ranks."""
    out: list[int] = []
    for e in entries:
        out += [e.timeline.number, e.step, len(e.timeline.forks)] + [v for f in e.timeline.forks for v in f]
    return out


def _decode(values: list[int]) -> list[Committed]:
    out, i = [], 0
    while i < len(values):
        number, step, n = values[i : i + 3]
        forks = tuple((values[i + 3 + 2 * j], values[i + 4 + 2 * j]) for j in range(n))
        out.append(Committed(step, Timeline(number, forks)))
        i += 3 + 2 * n
    return out


def _labels(keys: list[tuple[int, int]]) -> str:
    """``[130 (timeline 1), 100]``: checkpoints by step, with their timeline when not 0."""
    return "[" + ", ".join(str(s) if n == 0 else f"{s} (timeline {n})" for n, s in keys) + "]"


class AgreedRestore:
    """A restore in a job of several ranks: the newest checkpoint of the live branch that every rank holds
    and loads (in its memory tier, locally, on the remote tier, or as the copy its peer keeps).

    Collective contract: :meth:`run` is called on every rank, in the same order as the job's other
    collectives. ``tiers``: this rank's tiers, nearest first; ``peer``: the peer tier (``None``: off);
    ``memory``: the memory tier, which reads ahead while the ranks agree; ``job``: ``[rank, world]``;
    ``use_timeline``: called with the timeline the saves after the restore take; ``unpersisted(info, held,
    everything)``: the durable tiers the restored snapshot must still be written to, and ``persist(info,
    tiers)`` hands it to them (a previous process's snapshot restored from RAM alone); ``job_tier``: the name of
    the tier that commits steps job-wide (every rank must be able to upload its part), ``None`` without one."""

    def __init__(
        self,
        ranks: Any,
        tiers: Sequence[Tier],
        peer: Any,
        memory: Any,
        job: Any,
        use_timeline: Callable[[Timeline], None],
        unpersisted: Callable[[RestoreInfo, Mapping[str, set[tuple[int, int]]], list[Committed]], list[str]],
        persist: Callable[[RestoreInfo, list[str]], None],
        job_tier: str | None,
    ) -> None:
        self.ranks, self.tiers, self.peer, self.memory, self.job = ranks, list(tiers), peer, memory, job
        self.use_timeline, self.unpersisted, self.persist, self.job_tier = (
            use_timeline,
            unpersisted,
            persist,
            job_tier,
        )

    def run(self, state: dict, step: int | None, strict: bool) -> RestoreInfo | None:
        """:meth:`ckpt.Checkpointer.restore` when the ranks must agree: the newest checkpoint of the live branch that every
        rank holds and loads (in memory, locally, on the remote tier, or as the copy its peer keeps).
        Every rank sees every rank's checkpoints and timelines, so all pick the same one, and branch
        off onto the same new timeline when it is not the newest."""
        # A rank that waits for the others to agree (a replaced node still coming up, a slower start) reads its
        # own newest snapshot onto its GPU meanwhile: begun only once the agreement has taken READ_AHEAD_AFTER_S,
        # so ranks that arrive together load as before, with no thread beside their agreement
        gpu = state_gpu(state)
        timer = (
            threading.Timer(READ_AHEAD_AFTER_S, self.memory.read_ahead, (gpu,)) if gpu is not None else None
        )
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            return self._agree_and_load(state, step, strict, timer.cancel if timer is not None else None)
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
            self.memory.end_read_ahead()

    def _agree_and_load(
        self, state: dict, step: int | None, strict: bool, agreed: Callable[[], None] | None = None
    ) -> RestoreInfo | None:
        """:meth:`run`'s agreement and loads; ``agreed`` is called once every rank's lists are in."""
        ranks = self.ranks
        t0 = time.perf_counter()
        mine = {t.name: t.committed() for t in self.tiers}  # this rank's checkpoints, per tier
        near = [
            _decode(v)
            for v in ranks.gather(_encode([e for t in self.tiers if t.on_node for e in mine[t.name]]))
        ]
        far = [
            _decode(v)
            for v in ranks.gather(_encode([e for t in self.tiers if not t.on_node for e in mine[t.name]]))
        ]
        kept = (
            [_decode(v) for v in ranks.gather(_encode(self.peer.committed()))]
            if self.peer is not None
            else None
        )
        if agreed is not None:
            agreed()
        held = [
            {e.key for e in n + f + (kept[self.peer.holder_of(r)] if kept else [])}
            for r, (n, f) in enumerate(zip(near, far))
        ]
        everything = [e for lists in (near, far, kept or []) for entries in lists for e in entries]
        timelines: dict[tuple[int, int], Timeline] = {}
        for e in everything:
            timelines.setdefault(e.key, e.timeline)
        common = set.intersection(*held)
        if step is None:
            live = {e.key for e in live_and_abandoned(everything)[0]}
            agreed = sorted((k for k in common if k in live), reverse=True)
        else:
            agreed = sorted((k for k in common if k[1] == step), reverse=True)[:1]  # the newest timeline's
        where = "; ".join(
            f"rank {r}: {_labels(sorted(h, reverse=True)[:8]) if h else 'none'}" for r, h in enumerate(held)
        )
        if not agreed:
            if step is not None:
                raise FileNotFoundError(f"step {step} is not held by every rank ({where})")
            if not any(held):
                self.use_timeline(Timeline())
                return None
            raise NoCheckpointError(
                f"no step is committed on every rank ({where}, newest first): pass step= to restore "
                "one anyway, or remove the ranks' checkpoint directories to start afresh"
            )
        failed: list[str] = []
        phases = {"agree": time.perf_counter() - t0}
        for n, s in agreed:
            info, error, code = None, None, 1
            received, serving = None, None
            unpersisted: list[str] = []
            if kept is not None:  # ranks without a near copy of s get theirs back from the peer holding it
                send_to, receive = self._peer_roles(
                    s,
                    timelines[(n, s)],
                    [{e.key for e in x} for x in near],
                    [{e.key for e in x} for x in kept],
                )
                if receive:  # this rank loads from what it receives: first receive (and serve, if it must)
                    received = self._pull_from_peers(s, timelines[(n, s)], send_to, receive, phases)
                elif (
                    send_to is not None
                ):  # serving only: its own load runs meanwhile (both read this node's RAM)
                    serving = Background(
                        functools.partial(
                            self._pull_from_peers, s, timelines[(n, s)], send_to, False, phases
                        ),
                        self.peer.wire.device,
                    )
            try:
                info = restore(
                    state,
                    self.tiers + ([received] if received is not None else []),
                    s,
                    strict,
                    self.job,
                    timeline=n,
                )
                unpersisted = self.unpersisted(
                    info, {k: {e.key for e in v} for k, v in mine.items()}, everything
                )
            except (NoCheckpointError, FileNotFoundError) as e:  # this rank's copies of s are unusable or
                # gone (a peer's copy that failed verification was not committed): try an older step
                error, code = e, 0
            except Exception as e:  # does not fit the state (or worse): stop on every rank
                error, code = e, -1
            finally:
                if serving is not None:
                    serving.result()  # the replica is served (or the failure logged) before the ranks go on
            t0 = time.perf_counter()
            # with each rank's word, whether the job tier lacks the step and this rank has it in its memory tier
            job = self.job_tier
            replies = ranks.gather([code, int(job is not None and job in unpersisted)])
            codes = [c[0] for c in replies]
            phases["confirm"] = phases.get("confirm", 0.0) + time.perf_counter() - t0
            if min(codes) == 1:
                info.phases = {**phases, **info.phases}
                if failed:
                    log.warning("ranks agreed on step %d after skipping: %s", s, "; ".join(failed))
                self.use_timeline(resume_timeline(Committed(s, timelines[(n, s)]), everything))
                if job is not None and job in unpersisted and not all(c[1] for c in replies):
                    # the job tier commits a step once every rank uploaded its part: only where every rank can
                    unpersisted.remove(job)
                    log.info(
                        "step %d is not written to the job tier at restore: rank(s) %s restored it from "
                        "another tier than their memory tier",
                        s,
                        [r for r, c in enumerate(replies) if not c[1]],
                    )
                self.persist(info, unpersisted)
                return info
            bad = [r for r, c in enumerate(codes) if c != 1]
            if -1 in codes:
                if error is not None and code == -1:
                    raise error
                raise CheckpointError(
                    f"rank(s) {bad} could not load step {s} into the state (their logs say why); "
                    "every rank stops"
                )
            failed.append(f"step {s} unusable on rank(s) {bad}")
            log.warning("step %d is unusable on rank(s) %s; the ranks try an older common step", s, bad)
        raise NoCheckpointError(
            "no step that every rank holds could be loaded on every rank: " + "; ".join(failed)
        )

    def _peer_roles(
        self,
        step: int,
        timeline: Timeline,
        near: list[set[tuple[int, int]]],
        kept: list[set[tuple[int, int]]],
    ) -> tuple[int | None, bool]:
        """Who gets ``step`` (on ``timeline``) back from a holder's RAM, from the gathered sets of
        ``(timeline, step)`` (the same on every rank): every rank with no near copy whose holder keeps a
        replica. Returns the rank this one must serve (``None``: none) and whether it receives its own."""
        peer = self.peer
        key = (timeline.number, step)
        needs = [r for r in range(peer.world) if key not in near[r] and key in kept[peer.holder_of(r)]]
        return (peer.src if peer.src in needs else None), peer.rank in needs

    def _pull_from_peers(
        self, step: int, timeline: Timeline, send_to: int | None, receive: bool, phases: dict[str, float]
    ) -> ReceivedCopy | None:
        """Collective with the ranks of :meth:`_peer_roles`: serve ``send_to`` the replica this rank holds and,
        with ``receive``, get this rank's own copy back from its holder; adds the seconds to ``phases["peer"]``.
        Returns this rank's copy, checked, or ``None``."""
        peer = self.peer
        t0 = time.perf_counter()
        try:
            got = peer.serve(step, timeline, send_to, receive)
            if got is not None:
                log.info(
                    "rank %d got its snapshot of step %d back from the RAM of rank %d (peer tier)",
                    peer.rank,
                    step,
                    peer.holder_of(peer.rank),
                )
            return got
        except (CheckpointError, OSError) as e:  # this rank falls back to the remote tier, if any
            log.warning("rank %d could not get step %d back from its peer: %s", peer.rank, step, e)
            return None
        finally:
            phases["peer"] = phases.get("peer", 0.0) + time.perf_counter() - t0


def restore_alone(
    state: dict,
    tiers: Sequence[Tier],
    step: int | None,
    strict: bool,
    job: Any,
    refill: Any,
    use_timeline: Callable[[Timeline], None],
    handover: "HandOver",
) -> RestoreInfo | None:
    """The restore of a process that decides alone (no agreement between ranks): :func:`restore` from
    ``tiers`` (nearest first), ``use_timeline`` for the saves that follow (:func:`resume_timeline`), and the
    hand-over of a snapshot a previous process left in RAM alone to the durable tiers (:class:`HandOver`)."""
    listed = listing(tiers)
    info = restore(state, tiers, step, strict, job, listed=listed, refill=refill)
    restored = None if info is None else Committed(info.step, info.timeline)
    use_timeline(resume_timeline(restored, [e for e, _ in listed]))
    if info is not None:
        held: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
        for e, tier in listed:
            held[tier.name].add(e.key)
        handover.persist(info, handover.unpersisted(info, held, [e for e, _ in listed]))
    return info


def restore_state(
    state: dict,
    step: int | None,
    strict: bool,
    tiers: Sequence[Tier],
    ranks: Any,
    peer: Any,
    job: Any,
    use_timeline: Callable[[Timeline], None],
    handover: "HandOver",
) -> RestoreInfo | None:
    """``Checkpointer.restore()`` from this rank's ``tiers`` (nearest first): agreed over ``ranks``
    (:class:`AgreedRestore`, a collective) or, with ``ranks=None``, alone (:func:`restore_alone`). ``peer``: the
    peer tier or ``None``; ``job``: ``[rank, world]`` or ``None``; ``use_timeline``: called with the timeline of
    the saves that follow; ``handover``: writes a snapshot restored from RAM alone to the durable tiers."""
    if ranks is None:
        refill = handover.node.may_refill()
        return restore_alone(state, tiers, step, strict, job, refill, use_timeline, handover)
    remote = handover.remote
    job_tier = remote.name if remote is not None and remote.job is not None else None
    agreed = AgreedRestore(
        ranks,
        tiers,
        peer,
        handover.memory,
        job,
        use_timeline,
        handover.unpersisted,
        handover.persist,
        job_tier,
    )
    return agreed.run(state, step, strict)


def held_anywhere(tiers: Sequence[Tier], peer: Any, ranks: Any) -> bool:
    """``Checkpointer.restorable()``: whether some rank holds a committed checkpoint on one of its ``tiers``,
    or its ``peer`` tier holds a replica for it (agreed over ``ranks``, one all-reduce, unless ``None``)."""
    held = any(t.committed() for t in tiers) or (peer is not None and bool(peer.committed()))
    if ranks is not None:
        held = bool(ranks.max([int(held)])[0])
    return held


class HandOver:
    """Persist at breakpoint: the snapshot a restore read from the memory tier, which a previous process took
    and did not get to write to a durable tier (it was killed while the local tier wrote it, say), goes to
    those tiers in the background right after the restore, so that a second failure (the node rebooting
    next, which wipes its RAM) does not lose it.

    ``memory``, ``tiers`` (this rank's, nearest first), ``pipeline``, ``node`` (:class:`~ckpt.ownership.Ownership`
    of ``local_dir``), ``names`` (the tiers a save goes to), ``remote`` (or ``None``) are the Checkpointer's;
    ``track(handle)``: the hand-over's :class:`~ckpt.pipeline.SaveHandle` joins the saves ``wait()`` and
    ``close()`` wait for."""

    def __init__(
        self,
        memory: Any,
        tiers: Sequence[Tier],
        pipeline: Any,
        node: Any,
        names: Sequence[str],
        remote: Any,
        track: Callable[[Any], None],
    ) -> None:
        self.memory, self.tiers, self.pipeline, self.node = memory, list(tiers), pipeline, node
        self.names, self.remote, self.track = list(names), remote, track

    def unpersisted(
        self, info: RestoreInfo, held: Mapping[str, set[tuple[int, int]]], everything: list[Committed]
    ) -> list[str]:
        """The durable tiers that a restore's snapshot must still be written to: where ``info`` came from the
        memory tier, a snapshot a previous process took (not this one), and is the newest checkpoint of all
        (``everything``: what every tier of every rank holds), each persisting tier of this rank's that does
        not hold it (``held``: tier name -> ``(timeline, step)`` keys). A previous process killed before its
        local (or remote) tier had it leaves it in RAM alone, which the node's next reboot wipes."""
        key = (info.timeline.number, info.step)
        if info.tier != self.memory.name or not everything or key != max(e.key for e in everything):
            return []
        try:
            if not self.memory.inherited(info.step, info.timeline):
                return []
        except OSError as e:  # the RAM file system could not be listed: the restore itself stands
            log.warning(
                "could not tell whether step %d, restored from the memory tier, is on a durable tier: %s",
                info.step,
                e,
            )
            return []
        return [
            t.name
            for t in self.tiers
            if t.durable
            and isinstance(t, PersistingTier)
            and t.name in self.pipeline.lanes
            and key not in held.get(t.name, ())
        ]

    def persist(self, info: RestoreInfo, tiers: list[str]) -> None:
        """Write the snapshot that a restore read from the memory tier to ``tiers`` in the background
        (see :meth:`~ckpt.pipeline.Pipeline.persist_restored`), as the owner of ``local_dir``: beside another live
        owner nothing is written (that process is the directory's one writer); where no live process owns it,
        this process takes it over, as its first save would. ``wait()`` and ``close()`` wait for it."""
        if not tiers:
            return
        try:
            self._hand(info, tiers)
        except Exception as e:  # noqa: BLE001 - the restore itself stands; the next saves persist as usual
            log.warning(
                "step %d, restored from the memory tier, is not written to the %s tier(s): %s (%s)",
                info.step,
                ", ".join(tiers),
                e,
                type(e).__name__,
            )

    def _hand(self, info: RestoreInfo, tiers: list[str]) -> None:
        step, timeline = info.step, info.timeline
        if not self.node.owned:
            if self.node.other_owner():
                log.info(
                    "step %d, restored from the memory tier, is not on the %s tier(s); not writing it there: "
                    "another live process owns %s",
                    step,
                    ", ".join(tiers),
                    self.node.local.root,
                )
                return
            self.node.own()  # LockedError: another process took it meanwhile
            self.node.by_restore = True
        failure: BaseException | None = None
        try:
            manifest = self.memory.manifest(step, timeline)
            if manifest is None:  # gone since the restore read it (not while this process owns local_dir)
                raise LookupError(
                    f"step {step} left the memory tier before it could be written to the durable tiers"
                )
        except (OSError, LookupError) as e:
            if self.remote is None or self.remote.name not in tiers or self.remote.job is None:
                raise
            manifest, failure = None, e  # the job tier's uploads of the other ranks wait for this rank's word
        handle = SaveHandle(
            step, self.names, SnapshotStats(step, nbytes=manifest.data_bytes if manifest else 0)
        )
        handle._finish(self.memory.name)
        durable = {
            t.name for t in self.tiers if t.durable
        }  # the others (the peer tier) get no copy at restore
        for name in self.names:
            if name != self.memory.name and name not in tiers:
                handle._skip_tier(name, "holds it" if name in durable else "not written at restore")
        self.node.pool.adopt_ahead()  # from this thread: the segments are registered in its CUDA device's context
        if manifest is not None:
            log.info(
                "step %d, restored from the memory tier, is on no durable tier of this rank: writing it to the "
                "%s tier(s) in the background (%.3f GB)",
                step,
                ", ".join(tiers),
                manifest.data_bytes / 1e9,
            )

        def obtain() -> Any:
            if failure is not None:
                raise failure
            self.node.pool.adopt()  # the previous process's segments are this pool's buffers (once)
            return self.memory.hold_image(step, timeline, manifest)

        self.pipeline.persist_restored(step, timeline, manifest, tiers, obtain, handle)
        self.track(handle)

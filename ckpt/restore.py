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

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import CorruptCheckpointError, IncompleteCheckpointError, LayoutMismatchError, NoCheckpointError
from .loading import OtherRanksCopy
from .policy import Committed, Timeline, live_and_abandoned
from .tiers.base import Tier

__all__ = ["RestoreInfo", "restore", "listing", "OtherRanksCopy"]

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
    timeline: Timeline = Timeline()   # the restored checkpoint's
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
_UNSTAMPED = object()   # a tier that cannot tell one copy of a step from another


def _stamp(tier: Tier, step: int) -> Any:
    """What identifies the copy of ``step`` on ``tier`` now (``None``: it is not committed there), or
    ``_UNSTAMPED`` for a tier that cannot say (no ``copy_id``, or the question failed)."""
    copy_id = getattr(tier, "copy_id", None)
    if copy_id is None:
        return _UNSTAMPED
    try:
        return copy_id(step)
    except OSError:
        return _UNSTAMPED


def _candidates(tiers: Sequence[Tier], listed: list[tuple[Committed, Tier]], step: int | None,
                timeline: int | None) -> list[tuple[Committed, Tier]]:
    """The checkpoints a restore tries, in order: the live branch newest first (or ``step``, from the newest
    timeline holding it; ``FileNotFoundError`` when no tier holds it), nearest tier first."""
    if step is None:
        live = {e.key for e in live_and_abandoned(e for e, _ in listed)[0]}
        candidates = [c for c in listed if c[0].key in live]
    else:
        candidates = [c for c in listed if c[0].step == step and timeline in (None, c[0].timeline.number)]
        if not candidates:
            where = ", ".join(f"{t.name}: {t.location()}" for t in tiers)
            raise FileNotFoundError(f"step {step} is on no tier ({where}"
                                    f"{'' if timeline is None else f', timeline {timeline}'}); committed: "
                                    + "; ".join(f"{t.name} {t.committed_steps()[:10]}" for t in tiers))
        newest = max(e.timeline.number for e, _ in candidates)
        candidates = [c for c in candidates if c[0].timeline.number == newest]
    return sorted(candidates, key=lambda c: (-c[0].timeline.number, -c[0].step, c[1].nearness))


def restore(state: dict, tiers: Sequence[Tier], step: int | None = None, strict: bool = True,
            job: list[int] | None = None, timeline: int | None = None,
            listed: list[tuple[Committed, Tier]] | None = None, refill: bool = True) -> RestoreInfo | None:
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
                if before is None:   # listed, and gone since: raise what a read of it would
                    raise IncompleteCheckpointError(f"step {s} on the {tier.name} tier is no longer committed")
                nbytes = tier.restore_into(state, s, entry.timeline, strict, job, near)
            except LayoutMismatchError as e:
                if tier.reshards or not any(t.reshards and t.nearness > tier.nearness for t in tiers):
                    raise
                # this rank's own copy is in the old layout; a farther tier may hold the job's shards
                log.info("step %d on the %s tier is in another layout; trying a tier that reshards: %s", s,
                         tier.name, e)
                skipped.append(f"{tier.name}:{s}: {e}")
                continue
            except (CorruptCheckpointError, IncompleteCheckpointError, OSError, LookupError) as e:
                after = _UNSTAMPED if before is None or before is _UNSTAMPED or isinstance(e, LookupError) \
                    else _stamp(tier, s)
                # changed: gone since it was listed, or another copy now (a tier that cannot say now, its store
                # down or stalled, says nothing: the read's failure is the copy's)
                if (not isinstance(e, LookupError) and relist < _RELISTS and before is not _UNSTAMPED
                        and (before is None or (after is not _UNSTAMPED and after != before))):
                    # Not a fault of the copy: another process removed or replaced it while this one read it
                    # (retention or a re-save of a live writer of the directory). List the tiers again and
                    # start over from the newest, rather than fall back past checkpoints that are fine.
                    log.info("step %d on the %s tier was removed or replaced while it was read (%s); listing the "
                             "tiers again", s, tier.name, e)
                    changed = True
                    break
                if not isinstance(e, LookupError):
                    tier.verified[s] = False   # known not to verify: retention never keeps it as the good copy
                msg = f"step {s} on the {tier.name} tier is unusable, trying the next tier or an older step: {e}"
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                log.warning(msg)
                skipped.append(f"{tier.name}:{s}: {e}")
                continue
            if tier.refills:
                tier.verified[s] = True   # every byte read and checked (a farther read refills and commits here)
            took = time.perf_counter() - t0
            info = RestoreInfo(s, tier.name, nbytes, took, skipped, entry.timeline, {"load": took})
            tier.measured_read(nbytes, info.seconds)
            log.info("restored step %d from the %s tier (%.3f GB in %.3f s)", s, tier.name,
                     info.nbytes / 1e9, info.seconds)
            return info
        if not changed:
            break
        listed[:] = listing(tiers)   # in place: the caller decides the next timeline from what is there now
    raise NoCheckpointError("no checkpoint could be verified and loaded; tried:\n  " + "\n  ".join(skipped))



"""Restore: the newest checkpoint that verifies, from the nearest tier that holds it.

Candidates are the checkpoints of the live branch (:func:`ckpt.policy.live_and_abandoned`: the
abandoned branch of a rollback is never restored unless asked for by step), ordered newest
``(timeline, step)`` first and, for one checkpoint, nearest tier first (memory, then local, then
remote). A step asked for by number comes from the newest timeline that holds it. A candidate whose files are missing, torn or
corrupt is skipped with a warning naming the file, and the next one is tried.
A checkpoint that is valid but does not fit the state (other keys, shapes or
world size) is not a storage fault: it raises at once.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .errors import (CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError,
                     IncompleteCheckpointError, LayoutMismatchError, NoCheckpointError)
from .format import ItemRecord, manifest_name
from .plan import Binding, bind
from .policy import Committed, Timeline, live_and_abandoned
from .reshard import load_resharded
from .tiers import LocalTier, MemoryTier, RemoteTier
from .tiers.remote import ABSENT

__all__ = ["RestoreInfo", "restore", "listing"]

log = logging.getLogger(__name__)


@dataclass
class RestoreInfo:
    """What a restore did: the step, the tier it came from, bytes and seconds."""

    step: int
    tier: str
    nbytes: int
    seconds: float
    skipped: list[str]
    timeline: Timeline = Timeline()   # the restored checkpoint's

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else float("inf")


def listing(memory: MemoryTier, local: LocalTier, remote: RemoteTier | None) -> list[tuple[Committed, Any]]:
    """Every checkpoint committed on any tier, with the tier holding it (unordered)."""
    out = [(e, memory) for e in memory.committed()] + [(e, local) for e in local.committed()]
    if remote is not None:
        out += [(e, remote) for e in remote.committed()]
    return out


def restore(state: dict, memory: MemoryTier, local: LocalTier, remote: RemoteTier | None,
            step: int | None = None, strict: bool = True, job: list[int] | None = None,
            timeline: int | None = None, listed: list[tuple[Committed, Any]] | None = None) -> RestoreInfo | None:
    """Load the newest verified checkpoint (or ``step``) into ``state`` in place.

    A checkpoint read from the remote tier is written to the local tier on the
    way (verified chunk by chunk), so the next restore is local. ``job``: this
    process's ``[rank, world size]`` in a multi-process job; a rank's own copy
    saved at another place in the job (the world size changed) is passed over.
    A checkpoint that several ranks saved into the remote tier (a job tier) is
    resharded (:mod:`ckpt.reshard`) when the world size or the sharding differs.
    ``step`` comes from the newest timeline holding it (``timeline``: from that one);
    ``listed``: :func:`listing`, when the caller has it already.
    """
    listed = listing(memory, local, remote) if listed is None else listed
    if step is None:
        live = {e.key for e in live_and_abandoned(e for e, _ in listed)[0]}
        candidates = [c for c in listed if c[0].key in live]
    else:
        candidates = [c for c in listed if c[0].step == step and timeline in (None, c[0].timeline.number)]
        if not candidates:
            raise FileNotFoundError(f"step {step} is on no tier (local_dir={local.root}"
                                    f"{', url=' + remote.url if remote is not None else ''}"
                                    f"{'' if timeline is None else f', timeline {timeline}'}); "
                                    f"committed locally: {local.committed_steps()}")
        newest = max(e.timeline.number for e, _ in candidates)
        candidates = [c for c in candidates if c[0].timeline.number == newest]
    order = {"memory": 0, "local": 1, "remote": 2}
    candidates.sort(key=lambda c: (-c[0].timeline.number, -c[0].step, order[c[1].name]))
    if not candidates:
        return None
    skipped: list[str] = []
    for entry, tier in candidates:
        s = entry.step
        t0 = time.perf_counter()
        try:
            if tier is remote:
                with local.copying(s, entry.timeline):   # the local copy keeps the checkpoint's timeline
                    nbytes = _load_remote(state, remote, s, strict, local, job)
            else:
                manifest = tier.open(s)[1] if tier is not memory else memory.manifest(s, entry.timeline)
                if manifest is None:
                    raise LookupError(f"step {s} is no longer in host memory")
                _check_job(manifest, job, tier.name, s)
                where = (f"step {s} in host memory" if tier is memory
                         else f"{tier.step_dir(s)}/{manifest_name(tier.rank)}")
                binding = _bind(state, manifest.tree, manifest.items, strict, where)
                tier.load(s, manifest, binding.dest)
                _finish(binding)
                nbytes = manifest.data_bytes
        except LayoutMismatchError as e:
            if tier is remote or remote is None:
                raise
            # this rank's own copy is in the old layout; the remote tier may hold the job's shards
            log.info("step %d on the %s tier is in another layout; trying the remote tier: %s", s, tier.name, e)
            skipped.append(f"{tier.name}:{s}: {e}")
            continue
        except (CorruptCheckpointError, IncompleteCheckpointError, OSError, LookupError) as e:
            if not isinstance(e, LookupError) and tier is not memory:
                tier.verified[s] = False   # known not to verify: retention never keeps it as the good copy
            msg = f"step {s} on the {tier.name} tier is unusable, trying the next tier or an older step: {e}"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
            skipped.append(f"{tier.name}:{s}: {e}")
            continue
        if tier is local:
            local.verified[s] = True   # every byte read and checked (a remote read refills and commits local)
        info = RestoreInfo(s, tier.name, nbytes, time.perf_counter() - t0, skipped, entry.timeline)
        log.info("restored step %d from the %s tier (%.3f GB in %.3f s)", s, tier.name,
                 info.nbytes / 1e9, info.seconds)
        return info
    raise NoCheckpointError("no checkpoint could be verified and loaded; tried:\n  " + "\n  ".join(skipped))


class OtherRanksCopy(LookupError):
    """A rank's own copy that another place in the job saved (the world size changed)."""


def _check_job(manifest: Any, job: list[int] | None, tier: str, step: int) -> None:
    saved = manifest.job
    if job is not None and saved is not None and list(saved) != list(job):
        raise OtherRanksCopy(
            f"this {tier} copy of step {step} was saved by rank {saved[0]} of {saved[1]}, this is rank {job[0]} "
            f"of {job[1]}: a rank's own copy cannot be resharded; a job tier (the same url on every rank) can")


def _load_remote(state: dict, remote: RemoteTier, step: int, strict: bool, local: LocalTier,
                 job: list[int] | None) -> int:
    """Load ``step`` from the remote tier: this rank's own file when it was saved in the live
    layout and holds all its tensors (also refilling the local tier), else through the loader
    that reads every saved rank's file (resharding, and replicated tensors from rank 0)."""
    rank, world = job if job is not None else (0, 1)
    commit = remote.read_commit(step)
    if commit.world_size == remote.world_size:   # laid out for this tier's place: this rank's own file
        commit, manifest = remote.open(step)
        _check_job(manifest, job, remote.name, step)
        try:
            # a rank whose replicated tensors rank 0 stored takes the loader that reads other ranks' files
            binding = None if ABSENT in manifest.codecs else _bind(
                state, manifest.tree, manifest.items, strict, f"{remote.step_dir(step)}/{manifest_name(manifest.rank)}")
        except LayoutMismatchError:
            if commit.world_size == 1:
                raise   # one rank's file: nothing to reshard from
            binding = None   # same world size, another mesh or placements
        if binding is not None:
            remote.load(step, manifest, binding.dest, refill=local)
            _finish(binding)
            return manifest.data_bytes
    manifests = remote.read_manifests(step, commit)
    own = rank if rank < commit.world_size else 0
    t0 = time.perf_counter()
    binding = _bind(state, manifests[own].tree, manifests[own].items, strict,
                    f"{remote.step_dir(step)}/{manifest_name(own)}", reshard=True)
    nbytes = load_resharded(manifests, own, binding.dest, binding.boxes,
                            lambda r, m, i: remote.fetch(step, r, m, i))
    _finish(binding)
    log.info("resharded step %d saved by %d rank(s) into rank %d of %d (%.3f GB fetched in %.2f s)", step,
             commit.world_size, rank, world, nbytes / 1e9, time.perf_counter() - t0)
    return nbytes


def _bind(state: dict, tree: Any, items: list[ItemRecord], strict: bool, where: str,
          reshard: bool = False) -> Binding:
    """:func:`~ckpt.plan.bind`, where any failure that is not a verdict of the library's own (the
    checkpoint does not fit the state) makes this candidate corrupt, naming its manifest, so that
    restore skips it for the next one instead of crashing."""
    try:
        return bind(state, tree, items, strict, reshard=reshard)
    except CheckpointError:
        raise
    except (TypeError, ValueError, RuntimeError, LookupError, AttributeError, ArithmeticError,
            RecursionError, MemoryError) as e:
        raise CorruptCheckpointError(f"{where}: cannot be bound to the state ({type(e).__name__}: {e})") from e


def _finish(binding: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    try:
        binding.finish()
    except CheckpointError:
        raise
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise IncompatibleCheckpointError(f"the checkpoint does not fit the state: {e}") from e

"""Restore: the newest checkpoint that verifies, from the nearest tier that holds it.

Candidates are ordered newest step first and, for one step, nearest tier
first (memory, then local, then remote). A candidate whose files are missing, torn or
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
                     IncompleteCheckpointError, NoCheckpointError)
from .plan import bind
from .tiers import LocalTier, MemoryTier, RemoteTier

__all__ = ["RestoreInfo", "restore"]

log = logging.getLogger(__name__)


@dataclass
class RestoreInfo:
    """What a restore did: the step, the tier it came from, bytes and seconds."""

    step: int
    tier: str
    nbytes: int
    seconds: float
    skipped: list[str]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else float("inf")


def restore(state: dict, memory: MemoryTier, local: LocalTier, remote: RemoteTier | None,
            step: int | None = None, strict: bool = True) -> RestoreInfo | None:
    """Load the newest verified checkpoint (or ``step``) into ``state`` in place.

    A checkpoint read from the remote tier is written to the local tier on the
    way (verified chunk by chunk), so the next restore is local.
    """
    candidates: list[tuple[int, Any]] = []
    mem = memory.newest()
    if mem is not None:
        candidates.append((mem[0], memory))
    candidates += [(s, local) for s in local.committed_steps()]
    if remote is not None:
        candidates += [(s, remote) for s in remote.committed_steps()]
    order = {"memory": 0, "local": 1, "remote": 2}
    candidates.sort(key=lambda c: (-c[0], order[c[1].name]))
    if step is not None:
        candidates = [c for c in candidates if c[0] == step]
        if not candidates:
            raise FileNotFoundError(f"step {step} is on no tier (local_dir={local.root}"
                                    f"{', url=' + remote.url if remote is not None else ''}); "
                                    f"committed locally: {local.committed_steps()}")
    if not candidates:
        return None
    skipped: list[str] = []
    for s, tier in candidates:
        t0 = time.perf_counter()
        try:
            manifest = mem[1] if tier is memory else tier.open(s)[1]
            binding = bind(state, manifest.tree, manifest.items, strict)
            if tier is remote:
                tier.load(s, manifest, binding.dest, refill=local)
            else:
                tier.load(s, manifest, binding.dest)
            _finish(binding)
        except (CorruptCheckpointError, IncompleteCheckpointError, OSError, LookupError) as e:
            msg = f"step {s} on the {tier.name} tier is unusable, trying an older one: {e}"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
            skipped.append(f"{tier.name}:{s}: {e}")
            continue
        info = RestoreInfo(s, tier.name, manifest.data_bytes, time.perf_counter() - t0, skipped)
        log.info("restored step %d from the %s tier (%.3f GB in %.3f s)", s, tier.name,
                 info.nbytes / 1e9, info.seconds)
        return info
    raise NoCheckpointError("no checkpoint could be verified and loaded; tried:\n  " + "\n  ".join(skipped))


def _finish(binding: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    try:
        binding.finish()
    except CheckpointError:
        raise
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise IncompatibleCheckpointError(f"the checkpoint does not fit the state: {e}") from e

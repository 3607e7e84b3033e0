"""What checkpoints there are: per checkpoint, the tiers that hold it, its size and where it lies
(``Checkpointer.list()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .policy import live_and_abandoned
from .restore import listing
from .tiers.base import Tier

__all__ = ["CheckpointInfo", "catalog"]


@dataclass
class CheckpointInfo:
    """A checkpoint visible on at least one tier."""

    step: int
    tiers: list[str]
    path: str | None
    nbytes: int | None
    created_unix: float | None
    timeline: int = 0  # its timeline (see ckpt.policy.Timeline)
    abandoned: bool = False  # on the branch a rollback left: restored only when asked for by step


def catalog(tiers: Sequence[Tier]) -> list[CheckpointInfo]:
    """The checkpoints committed on any of ``tiers``, newest first: the live branch by ``(timeline, step)``,
    then the abandoned branch of a rollback (``abandoned=True``), each newest first. Each lists the tiers
    holding it, nearest first; its size and time come from the nearest, its path from the nearest durable
    one."""
    listed = listing(tiers)
    live, abandoned = live_and_abandoned(e for e, _ in listed)
    gone = {e.key for e in abandoned}
    found: dict[tuple[int, int], CheckpointInfo] = {}
    for e, tier in sorted(listed, key=lambda c: c[1].nearness):
        info = found.get(e.key)
        if info is None:
            info = found[e.key] = CheckpointInfo(
                e.step, [], None, None, None, e.timeline.number, e.key in gone
            )
        info.tiers.append(tier.name)
        d = tier.describe(e.step, e.timeline)
        if info.nbytes is None:
            info.nbytes, info.created_unix = d.nbytes, d.created_unix
        if info.path is None and tier.durable:  # where it lies on disk or in storage
            info.path = d.path
    order = [e.key for e in live + abandoned]
    return [found[k] for k in dict.fromkeys(order)]

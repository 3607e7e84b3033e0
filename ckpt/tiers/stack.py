"""Which tiers a Checkpointer has: :class:`Tiers`, built from its :class:`~ckpt.Storage`.

The memory and local tiers are always there, the remote tier with a ``url``, the peer tier with ``peers``.
The settings that name tiers (``persist_every``, a per-tier ``mtbf``, a drain tier) are checked here against
the tiers that exist, so the rest of the library asks this object instead of spelling out tier names.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping

from .base import PersistingTier, Tier

__all__ = ["Tiers"]


class Tiers:
    """The tiers of one rank, nearest first (by :attr:`~ckpt.tiers.base.Tier.nearness`).

    ``memory``, ``local`` and (or ``None``) ``remote`` hold this rank's own checkpoints: what restore,
    listing and retention read. ``peer`` (or ``None``) holds another rank's replicas and writes this rank's
    to its holder: a tier a save goes to, read by a restore only for a rank whose own copies are gone."""

    #: the tiers a Checkpointer may have, nearest first, each with what makes it exist (``None``: always there)
    POSSIBLE = {"memory": None, "local": None, "peer": "peers=", "remote": "a url"}

    def __init__(self, memory: Tier, local: Tier, remote: Tier | None = None, peer_planned: bool = False) -> None:
        self.memory, self.local, self.remote = memory, local, remote
        self.peer: Tier | None = None
        self.peer_planned = peer_planned   # add_peer() will make one (it is collective: it comes later)

    @classmethod
    def build(cls, storage: Any, pool: Any, rank: int) -> "Tiers":
        """The memory, local and (with ``storage.url``) remote tiers of ``storage`` (a :class:`~ckpt.Storage`
        whose ``local_dir`` is set), the memory tier over ``pool`` (its host buffers) in the shared-memory
        space of ``rank`` on this node. An unreachable store does not stop a job from resuming from its nearer
        tiers (each save retries it); a store that answers "no such bucket" or "access denied" is a
        configuration error: raised. The peer tier comes later (:meth:`add_peer`: collective)."""
        from .local import LocalTier
        from .memory import MemoryTier, space_for
        from .remote import RemoteTier, refuse_overlap

        url, local_dir = storage.url, storage.local_dir
        local = local_dir if isinstance(local_dir, LocalTier) else LocalTier(local_dir)
        remote = None
        if url is not None:
            remote = url if isinstance(url, RemoteTier) else \
                RemoteTier(url, storage.storage_options, compression=storage.compression, on_unreachable="degrade")
            refuse_overlap(local.root, remote.url, remote.fs, remote.root)
        elif storage.compression is not None:
            raise ValueError("compression applies to the remote tier: pass a url too, or compression=None")
        peers = storage.peers
        return cls(MemoryTier(pool, space_for(local.root, rank)), local, remote,
                   peer_planned=peers is not None and peers is not False)

    def add_peer(self, job: Any, peers: bool | int | None) -> None:
        """The peer tier of ``peers`` (``None`` / ``False``: none) for this rank of ``job``
        (:meth:`~ckpt.tiers.PeerTier.for_job`). Collective: call on all ranks."""
        if peers is None or peers is False:
            return
        from .peer import PeerTier

        self.peer = PeerTier.for_job(self.local.root, job, peers)

    # -- which tiers ------------------------------------------------------------------------------------
    @property
    def own(self) -> list[Tier]:
        """This rank's checkpoints, nearest first: what restore, listing and the timelines iterate."""
        return sorted([t for t in (self.memory, self.local, self.remote) if t is not None], key=lambda t: t.nearness)

    @property
    def persisting(self) -> list[Tier]:
        """The tiers the persist pipeline writes to, nearest first (the peer tier among them)."""
        return sorted([t for t in self.own if isinstance(t, PersistingTier)] + ([self.peer] if self.peer else []),
                      key=lambda t: t.nearness)

    @property
    def names(self) -> list[str]:
        """The tiers a save goes to, nearest first: its handle's tiers."""
        return [self.memory.name] + [t.name for t in self.persisting]

    def __iter__(self) -> Iterator[Tier]:
        return iter(sorted(self.own + ([self.peer] if self.peer else []), key=lambda t: t.nearness))

    def __contains__(self, name: object) -> bool:
        return any(t.name == name for t in self)

    def get(self, name: str) -> Tier:
        """The tier called ``name``; ``KeyError`` naming the tiers there are."""
        for t in self:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r} here; the tiers are {self.names}")

    # -- settings that name tiers -------------------------------------------------------------------------
    @property
    def planned(self) -> list[str]:
        """The names of the tiers a save goes to, nearest first, the peer tier included from construction on
        (before :meth:`add_peer` made it): what settings naming a tier are checked against."""
        return [n for n in self.POSSIBLE if n in ("memory", "local") or (n == "peer" and self.peer_planned)
                or (n == "remote" and self.remote is not None)]

    def check_cadences(self, persist_every: Mapping[str, int]) -> dict[str, int]:
        """``persist_every`` (tier name -> steps) as a dict, naming only persisting tiers this Checkpointer
        has: ``ValueError`` naming the tier and what makes each exist otherwise."""
        have = [n for n in self.planned if n != self.memory.name]
        for name in persist_every:
            if name not in have:
                known = ", ".join(f"{n!r}" + (f" (with {why})" if why else "")
                                  for n, why in self.POSSIBLE.items() if n != self.memory.name)
                raise ValueError(f"persist_every names the tiers {known}, got {name!r}")
        return dict(persist_every)

    def per_tier(self, value: Any, what: str) -> dict[str, Any]:
        """A setting given once for all tiers or as a dict by tier name (``mtbf``), as a dict over the tiers
        a save goes to: a tier not named takes the memory tier's value, which is required. A name of a tier
        this Checkpointer may have but does not (``"remote"`` without a url) is accepted and unused; any other
        is a ``ValueError`` naming ``what`` and the tiers."""
        names = self.planned
        if not isinstance(value, Mapping):
            return dict.fromkeys(names, value)
        unknown = sorted(set(value) - set(self.POSSIBLE))
        if unknown or self.memory.name not in value:
            raise ValueError(f"{what}= as a dict names the tiers {list(self.POSSIBLE)!r} ({self.memory.name!r} "
                             f"required: the snapshots' failures), got {sorted(value)!r}")
        return {n: value.get(n, value[self.memory.name]) for n in names}


def default_local_dir(local_dir: str | os.PathLike | Any | None) -> Any:
    """``local_dir``, else ``$CKPT_LOCAL_DIR``; ``ValueError`` when neither is set."""
    local_dir = local_dir if local_dir is not None else os.environ.get("CKPT_LOCAL_DIR")
    if local_dir is None:
        raise ValueError("Checkpointer needs a local tier: pass local_dir=... or set $CKPT_LOCAL_DIR")
    return local_dir

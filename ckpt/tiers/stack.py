"""Which tiers a Checkpointer has: :class:`Tiers`, built from its :class:`~ckpt.Storage`.

The memory and local tiers are always there, the remote tier with a ``url``, the peer tier with ``peers``.
The settings that name tiers (``persist_every``, a per-tier ``mtbf``, a drain tier, a retention per tier) are
checked here against the tiers that exist, so the rest of the library asks this object instead of spelling out
tier names.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Iterator, Mapping

from ..policy import Retention
from .base import PersistingTier, Tier, nearness, registered

__all__ = ["Tiers", "persisting_kinds", "needs_text", "register_built_in"]

#: the modules of the built-in tiers (a tier of one's own registers when its module is imported)
_BUILT_IN = ("memory", "local", "peer", "remote")


def register_built_in() -> None:
    """Register the built-in tier classes (their modules are imported lazily elsewhere): for code that checks a
    tier name against :func:`~ckpt.tiers.base.registered` before it builds any tier (the DCP adapter)."""
    for module in _BUILT_IN:  # importing a tier's module registers it
        importlib.import_module(f"{__package__}.{module}")


def persisting_kinds() -> dict[str, str | None]:
    """The registered tiers the persist pipeline writes to (the built-in ones, and a tier of one's own once its
    module is imported), nearest first: name -> what makes a Checkpointer have it (its
    :attr:`~ckpt.tiers.Tier.needs`; ``None``: every Checkpointer has it). What a setting naming a tier a save is
    written to may name (``persist_every``, ``Signals(drain_tier=..., save_tier=...)``)."""
    register_built_in()
    return {c.name: c.needs for c in registered() if issubclass(c, PersistingTier)}


def needs_text(kinds: Mapping[str, str | None]) -> str:
    """``kinds`` (:func:`persisting_kinds`) for a message: ``'local', 'peer' (with peers=), ...``."""
    return ", ".join(f"{name!r}" + (f" (with {needs})" if needs else "") for name, needs in kinds.items())


class Tiers:
    """The tiers of one rank, nearest first (by :attr:`~ckpt.tiers.base.Tier.nearness`), made from the
    registry (:func:`~ckpt.tiers.register`): each registered tier class makes itself from the storage settings
    (:meth:`~ckpt.tiers.Tier.for_storage`) or stays out.

    :attr:`own` holds this rank's own checkpoints: what restore, listing and retention read. ``peer`` (or
    ``None``) holds another rank's replicas and writes this rank's to its holder: a tier a save goes to, read by
    a restore only for a rank whose own copies are gone. :attr:`memory`, :attr:`local` (always there) and
    :attr:`remote` (or ``None``) are the tiers the Checkpointer itself works with (ownership of ``local_dir``,
    the job tier)."""

    def __init__(self, tiers: Mapping[str, Tier], peer_planned: bool = False) -> None:
        self._by_name = dict(tiers)
        self.peer: Tier | None = None
        self.peer_planned = peer_planned  # add_peer() will make one (it is collective: it comes later)

    @property
    def memory(self) -> Tier:
        return self._by_name["memory"]

    @property
    def local(self) -> Any:
        return self._by_name["local"]

    @property
    def remote(self) -> Any:
        return self._by_name.get("remote")

    @classmethod
    def build(cls, storage: Any, pool: Any, rank: int) -> "Tiers":
        """Every registered tier that ``storage`` (a :class:`~ckpt.Storage` whose ``local_dir`` is set) asks for,
        the memory tier over ``pool`` (its host buffers) in the shared-memory space of ``rank`` on this node.
        A name in ``storage.extra_tiers`` that no registered tier has is a ``ValueError``. The peer tier comes
        later (:meth:`add_peer`: collective)."""
        register_built_in()

        built: dict[str, Tier] = {}
        waiting = list(registered())
        while waiting:
            ready = [c for c in waiting if all(n in built for n in c.built_after)]
            if not ready:
                raise TypeError(
                    f"tier classes {[c.__qualname__ for c in waiting]} wait for tiers that are never "
                    "made (their built_after)"
                )
            for c in ready:
                waiting.remove(c)
                tier = c.for_storage(storage, built, pool, rank)
                if tier is not None:
                    built[c.name] = tier
        unknown = sorted(set(storage.extra_tiers or {}) - set(built))
        if unknown:
            raise ValueError(
                f"Storage(extra_tiers=...) names {unknown}: no registered tier has that name (the "
                f"registered tiers: {[c.name for c in registered()]}; a tier class is registered with "
                "@ckpt.tiers.register when its module is imported)"
            )
        peers = storage.peers
        return cls(built, peer_planned=peers is not None and peers is not False)

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
        return sorted(self._by_name.values(), key=lambda t: t.nearness)

    @property
    def persisting(self) -> list[Tier]:
        """The tiers the persist pipeline writes to, nearest first (the peer tier among them)."""
        return sorted(
            [t for t in self.own if isinstance(t, PersistingTier)] + ([self.peer] if self.peer else []),
            key=lambda t: t.nearness,
        )

    @property
    def names(self) -> list[str]:
        """The tiers a save goes to, nearest first: its handle's tiers."""
        return [self.memory.name] + [t.name for t in self.persisting]

    def __iter__(self) -> Iterator[Tier]:
        return iter(sorted(self.own + ([self.peer] if self.peer else []), key=lambda t: t.nearness))

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
        near = {t.name: t.nearness for t in self.own}
        if self.peer_planned or self.peer is not None:
            near["peer"] = nearness("peer")
        return sorted(near, key=near.__getitem__)

    @property
    def planned_persisting(self) -> list[str]:
        """The names among :attr:`planned` of the tiers the persist pipeline writes to (all but the memory tier,
        whose snapshots the pipeline takes): what ``persist_every`` and a drain tier may name."""
        return [n for n in self.planned if n != self.memory.name]

    def check_cadences(self, persist_every: Mapping[str, int]) -> dict[str, int]:
        """``persist_every`` (tier name -> steps) as a dict, naming only persisting tiers this Checkpointer
        has: ``ValueError`` naming the tier and what makes each exist otherwise."""
        have = self.planned_persisting
        for name in persist_every:
            if name not in have:
                raise ValueError(
                    f"persist_every names the tiers {needs_text(persisting_kinds())}, got {name!r}"
                )
        return dict(persist_every)

    def check_retention(self, keep: Retention) -> Retention:
        """``keep`` when each tier it names (:attr:`~ckpt.policy.Retention.tiers`, beside ``local`` and ``remote``)
        is a durable tier this Checkpointer has, the tiers retention applies to; else a ``ValueError`` naming the
        tier and the durable tiers there are (and what makes each exist)."""
        have = {t.name for t in self.own if t.durable}
        for name in keep.tiers:
            if name not in have:
                kinds = {c.name: c.needs for c in registered() if c.durable}
                raise ValueError(
                    f"keep names the tier {name!r}, which is not a durable tier of this Checkpointer; "
                    f"retention applies to the tiers {needs_text(kinds)}"
                )
        return keep

    def per_tier(self, value: Any, what: str) -> dict[str, Any]:
        """A setting given once for all tiers or as a dict by tier name (``mtbf``), as a dict over the tiers
        a save goes to: a tier not named takes the memory tier's value, which is required. A name of a tier
        this Checkpointer may have but does not (``"remote"`` without a url) is accepted and unused; any other
        is a ``ValueError`` naming ``what`` and the tiers."""
        names = self.planned
        if not isinstance(value, Mapping):
            return dict.fromkeys(names, value)
        possible = [c.name for c in registered()]
        unknown = sorted(set(value) - set(possible))
        if unknown or self.memory.name not in value:
            raise ValueError(
                f"{what}= as a dict names the tiers {possible!r} ({self.memory.name!r} required: the "
                f"snapshots' failures), got {sorted(value)!r}"
            )
        return {n: value.get(n, value[self.memory.name]) for n in names}


def default_local_dir(local_dir: str | os.PathLike | Any | None) -> Any:
    """``local_dir``, else ``$CKPT_LOCAL_DIR``; ``ValueError`` when neither is set."""
    local_dir = local_dir if local_dir is not None else os.environ.get("CKPT_LOCAL_DIR")
    if local_dir is None:
        raise ValueError("Checkpointer needs a local tier: pass local_dir=... or set $CKPT_LOCAL_DIR")
    return local_dir

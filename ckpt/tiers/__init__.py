"""Storage tiers: where committed checkpoints live, nearest first.

Each tier implements the contract of :mod:`ckpt.tiers.base` (:class:`Tier`; :class:`PersistingTier`
for those the persist pipeline writes to) and is registered with :func:`register`.
"""

from .base import PersistingTier, StepInfo, Tier, TierFigures, register, registered
from .local import LocalTier
from .memory import MemoryTier
from .peer import PeerTier
from .remote import RemoteTier

__all__ = ["Tier", "PersistingTier", "StepInfo", "TierFigures", "register", "registered", "LocalTier",
           "MemoryTier", "PeerTier", "RemoteTier"]

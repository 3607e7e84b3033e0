"""Storage tiers: where committed checkpoints live, nearest first."""

from .local import LocalTier
from .memory import MemoryTier
from .peer import PeerTier
from .remote import RemoteTier

__all__ = ["LocalTier", "MemoryTier", "PeerTier", "RemoteTier"]

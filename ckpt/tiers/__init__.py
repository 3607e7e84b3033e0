"""Storage tiers: where committed checkpoints live, nearest first."""

from .local import LocalTier
from .memory import MemoryTier

__all__ = ["LocalTier", "MemoryTier"]

"""Storage tiers: where committed checkpoints live, nearest first.

Each tier implements the contract of :mod:`ckpt.tiers.base` (:class:`Tier`; :class:`PersistingTier`
for those the persist pipeline writes to) and is registered with :func:`register`.

The tier classes are imported on first use (``ckpt.tiers.LocalTier``...): the commands that only read
records (``ckpt ls``, ``inspect``, ``verify``, ``gc``) never import torch for the memory and peer tiers.
"""

from __future__ import annotations

from .._lazy import exports

__all__ = [
    "Tier",
    "PersistingTier",
    "StoredTier",
    "StepInfo",
    "TierFigures",
    "register",
    "registered",
    "LocalTier",
    "MemoryTier",
    "PeerTier",
    "RemoteTier",
    "Tiers",
]

_WHERE = {
    "Tier": "base",
    "PersistingTier": "base",
    "StoredTier": "base",
    "StepInfo": "base",
    "TierFigures": "base",
    "register": "base",
    "registered": "base",
    "LocalTier": "local",
    "MemoryTier": "memory",
    "PeerTier": "peer",
    "RemoteTier": "remote",
    "Tiers": "stack",
}


__getattr__, __dir__ = exports(__name__, _WHERE)

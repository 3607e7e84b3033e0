"""Preemption signals, for code that imports them from here: see :mod:`ckpt.preempt`.

The handling lives in the engine (``ckpt.preempt``); this module re-exports it so that
``from ckpt.integrations.signals import PreemptionGuard`` keeps working.
"""

from __future__ import annotations

from ..preempt import PreemptionGuard, Signals

__all__ = ["PreemptionGuard", "Signals"]

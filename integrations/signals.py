"""Preemption signals: a handler that only sets a flag, and the ranks' agreement on it.

The handler runs in the interpreter's signal context, so it does nothing but
record the signal. The work happens at the next step boundary
(``Checkpointer.maybe_save``): the ranks agree with one all-reduce (so every
rank saves the same step even if the signal reached only some of them), the
save is forced and made durable within the drain deadline, then the process
exits with the conventional status ``128 + signal`` (or raises
:class:`~ckpt.errors.Preempted`). Previous handlers are chained to before
exiting and reinstalled when the ``with`` block ends.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Sequence

import torch

__all__ = ["PreemptionGuard"]

log = logging.getLogger(__name__)


class PreemptionGuard:
    """Installs flag-only handlers for ``signals`` while active."""

    def __init__(self, signals: Sequence[int | signal.Signals]) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def active(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Checkpointer(signals=...) installs signal handlers, which Python allows only in "
                               "the main thread: enter the `with` block there, or pass signals=()")
        for s in self.signals:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handler)

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum   # nothing heavy in a signal handler: the step boundary does the work

    def agreed(self, ranks: Any = None) -> int | None:
        """The signal any rank received (``None`` if none). Collective when torch.distributed is
        initialised: over ``ranks`` (a :class:`ckpt.ranks.Ranks`, CPU only) when given, else one
        all-reduce on the default group."""
        local = self.received or 0
        if ranks is not None:
            local = ranks.max([local])[0]
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            backend = torch.distributed.get_backend()
            device = "cuda" if backend == "nccl" else "cpu"
            flag = torch.tensor([local], dtype=torch.int32, device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            local = int(flag.item())
        if local and self.received is None:
            self.received = local
        return local or None

    def chain(self, signum: int) -> None:
        """Call the handler that was installed before ours, if it was a Python callable."""
        prev = self._previous.get(signal.Signals(signum))
        if callable(prev):
            prev(signum, None)

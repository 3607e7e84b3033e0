"""The saves a Checkpointer still answers for: their handles, until each is done on every tier, and the
failures of its saves, until they are raised (``Checkpointer.wait()``, ``close()``)."""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["Handles"]

log = logging.getLogger(__name__)


class Handles:
    """The handles (:class:`~ckpt.pipeline.SaveHandle`) of the saves not yet done, and the failures the
    persisting tiers reported, oldest first. Thread-safe: the pipeline reports failures from its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._failures: list[tuple[Any, BaseException]] = []

    def track(self, handle: Any) -> None:
        """Keep ``handle`` among those waited for (the finished ones go)."""
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]

    def pending(self) -> list[Any]:
        """The handles kept, oldest first (some may have finished since)."""
        with self._lock:
            return list(self._handles)

    def clear(self) -> None:
        """Forget every handle (``close()``: every write is over)."""
        with self._lock:
            self._handles = []

    def wait_quietly(self, tier: str | None, swallow: bool = False) -> None:
        """Wait until each save kept finished ``tier`` (every tier when ``None``), its failure left for
        :meth:`raise_failures`; ``swallow``: also what the wait itself raises (a restore goes on)."""
        for h in self.pending():
            try:
                h._wait_quietly(tier)
            except BaseException:
                if not swallow:
                    raise

    def settle(self, step: int | None = None) -> None:
        """Wait until each save kept (those of ``step`` only, when given) finished every tier; a failure is
        raised by its handle (so ``close()`` counts it as seen) and swallowed here."""
        for h in self.pending():
            if step is not None and h.step != step:
                continue
            try:
                h.wait()
            except BaseException:
                pass

    def failed(self, handle: Any, error: BaseException) -> None:
        """Record that the save of ``handle`` failed with ``error`` (the pipeline's failure callback)."""
        with self._lock:
            self._failures.append((handle, error))

    def raise_failures(self, include_seen: bool = False) -> None:
        """Raise the first failure recorded since the last call (the others are logged). Those a
        ``handle.wait()`` raised to the user already count only when ``include_seen`` (``wait()``, which
        reports on every save, sets it; ``close()`` does not: it raises what the user never saw)."""
        with self._lock:
            failures, self._failures = self._failures, []
        if not include_seen:
            failures = [(h, e) for h, e in failures if not h._was_raised(e)]
        if failures:
            handle, err = failures[0]
            if len(failures) > 1:
                log.error("%d saves failed; raising the first (step %d)", len(failures), handle.step)
            raise err

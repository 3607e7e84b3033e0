"""When to save (interval policy) and what to keep (retention)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["Retention", "Interval"]


@dataclass(frozen=True)
class Retention:
    """How many committed checkpoints each tier keeps.

    ``local``: newest checkpoints kept in ``local_dir`` (``None`` keeps all).
    The newest committed checkpoint and any checkpoint still being written are
    never deleted, whatever the setting.
    """

    local: int | None = 2

    def __post_init__(self) -> None:
        if self.local is not None and (not isinstance(self.local, int) or self.local < 1):
            raise ValueError(f"Retention(local={self.local!r}): keep at least 1, since the newest committed "
                             "checkpoint is never deleted (or None to keep all)")


class Interval:
    """Decides whether ``maybe_save(step, ...)`` saves.

    ``every_steps``: save when ``step % every_steps == 0``. ``every_seconds``:
    save when that long passed since the last save (by ``clock``, seconds).
    Both may be given; either triggers. Neither: ``maybe_save`` never saves.
    """

    def __init__(self, every_steps: int | None = None, every_seconds: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be a positive integer, got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be positive, got {every_seconds!r}")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.clock = clock
        self._last_time = clock()

    def due(self, step: int) -> bool:
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and self.clock() - self._last_time >= self.every_seconds

    def saved(self, step: int) -> None:
        self._last_time = self.clock()

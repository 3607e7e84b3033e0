"""When to save (interval policy) and what to keep (retention)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection

__all__ = ["Retention", "Interval", "AutoInterval", "daly_interval", "prune"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """How many committed checkpoints each tier keeps.

    ``local``: newest checkpoints kept in ``local_dir``; ``remote``: at the
    URL (``None`` keeps all).
    The newest committed checkpoint and any checkpoint still being written are
    never deleted, whatever the setting.
    """

    local: int | None = 2
    remote: int | None = 10

    def __post_init__(self) -> None:
        for tier in ("local", "remote"):
            n = getattr(self, tier)
            if n is not None and (not isinstance(n, int) or n < 1):
                raise ValueError(f"Retention({tier}={n!r}): keep at least 1, since the newest committed "
                                 "checkpoint is never deleted (or None to keep all)")


def prune(tier: Any, keep: int | None, busy: Collection[int] = (), dry_run: bool = False,
          verified: Callable[[int], bool] | None = None) -> list[int]:
    """Apply retention to one tier: returns the steps deleted (or that would be, with ``dry_run``).

    Keeps the newest ``keep`` committed steps that the tier owns (all with ``None``); also removes
    uncommitted leftovers older than the newest commit (crashed or failed writes). Never deletes the
    newest committed step nor a step in ``busy``. A linked step (its directory or ``COMMIT`` a
    symbolic link: :func:`ckpt.tiers.local.linked`) is not the tier's own: it is neither counted
    nor deleted, and nothing inside it is touched. A step that cannot be deleted is logged and
    skipped.

    ``verified(step)`` says whether a step is known to verify. When given, the newest owned step
    for which it returns ``True`` is kept too, asked newest first and only while steps would be
    deleted (so it may read the step: ``ckpt gc`` verifies each one it asks about); when it is
    ``True`` for none, no committed step is deleted, so retention never leaves only checkpoints
    that are not known to verify.
    """
    steps = tier.committed_steps()
    if not steps:
        return []
    owns = getattr(tier, "owns", lambda s: True)
    newest = steps[0]
    owned = [s for s in steps if owns(s)]
    kept = set(owned if keep is None else owned[:keep])
    if verified is not None and len(kept) < len(owned):
        keeper = next((s for s in owned if verified(s)), None)
        kept = set(owned) if keeper is None else kept | {keeper}
    doomed = [s for s in owned if s not in kept]
    stale = [s for s in tier.all_step_dirs() if s < newest and s not in steps and owns(s)]
    gone = [s for s in doomed + stale if s != newest and s not in busy]
    if dry_run:
        return gone
    deleted = []
    for s in gone:
        try:
            tier.delete(s)
            deleted.append(s)
        except OSError as e:
            log.warning("retention could not delete step %d: %s", s, e)
    return deleted


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


class AutoInterval:
    """The Young/Daly optimum checkpoint interval, from measured save costs and a given MTBF.

    With ``cost`` the time the training loop loses per checkpoint and ``mtbf``
    the mean time between failures (seconds), Young's first-order optimum is
    ``sqrt(2 * cost * mtbf)``; Daly's higher-order refinement, used here, is
    ``sqrt(2 c M) * (1 + sqrt(c / 2M) / 3 + (c / 2M) / 9) - c`` for ``c < 2M``
    and ``M`` otherwise (J. T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", FGCS 2006).

    ``cost`` is the median of the last ``window`` measured stalls (what
    ``save()`` blocked the loop, back-pressure waits included), so the interval
    follows the real price of a save. The interval is also never shorter than
    the last save's persist time, since saving faster than the disk drains only
    turns into waiting. Before the first measurement the next ``maybe_save``
    saves at once, to measure.

    The expected fraction of time lost is ``cost / tau + (tau / 2 + restart) / mtbf``
    (checkpoint overhead plus the expected rework and restart per failure).
    """

    def __init__(self, mtbf: float, restart: float = 0.0, window: int = 5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not mtbf or mtbf <= 0:
            raise ValueError(f"interval='auto' needs mtbf=<mean time between failures, seconds> > 0, got {mtbf!r}")
        if restart < 0:
            raise ValueError(f"restart cost must be >= 0 seconds, got {restart!r}")
        self.mtbf = float(mtbf)
        self.restart = float(restart)
        self.window = window
        self.clock = clock
        self._costs: list[float] = []
        self._persist = 0.0
        self._last_time: float | None = None

    @property
    def cost(self) -> float | None:
        if not self._costs:
            return None
        s = sorted(self._costs)
        return s[len(s) // 2]

    @property
    def seconds(self) -> float | None:
        """The current interval (seconds), or ``None`` before the first measurement."""
        c = self.cost
        if c is None:
            return None
        return max(daly_interval(c, self.mtbf), self._persist)

    def expected_loss(self) -> float | None:
        """Expected fraction of wall time lost to checkpoints, rework and restarts at the current interval."""
        c, tau = self.cost, self.seconds
        if c is None or tau is None or tau <= 0:
            return None
        return c / tau + (tau / 2 + self.restart) / self.mtbf

    def due(self, step: int) -> bool:
        if self._last_time is None or self.seconds is None:
            return True
        return self.clock() - self._last_time >= self.seconds

    def saved(self, step: int) -> None:
        self._last_time = self.clock()

    def record(self, stall_s: float, persist_s: float | None = None) -> None:
        """Feed one save's measured stall (and its persist time, once known)."""
        self._costs = (self._costs + [max(stall_s, 1e-6)])[-self.window:]
        if persist_s is not None:
            self._persist = persist_s

    def report(self) -> dict[str, float | None]:
        return {"interval_s": self.seconds, "cost_s": self.cost, "mtbf_s": self.mtbf,
                "expected_loss_fraction": self.expected_loss()}


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum checkpoint interval (seconds of work between checkpoints)."""
    if cost >= 2 * mtbf:
        return mtbf
    r = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - cost

"""When to save (interval policy), what to keep (retention), and which checkpoint is newest (timelines).

Timelines order checkpoints the way PostgreSQL orders its WAL after a point-in-time recovery. A
run that was never rolled back is timeline 0. Restoring a step older than the newest committed one
(``restore(state, step=100)`` with 300 committed, or a fallback past a corrupt newest step) starts a
new timeline, one more than the largest seen on any tier, for the saves that follow; its ``COMMIT``
records which ancestors it came from and where it left them (``forks``). "Newest" then means largest
``(timeline, step)`` among the checkpoints of the *live branch*: the newest checkpoint's timeline and,
of each ancestor timeline, the steps up to where it was left. The rest is the *abandoned branch*:
never restored unless asked for by step, and the first that retention removes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping

from . import knobs

__all__ = [
    "Retention",
    "Interval",
    "plain_interval",
    "AutoInterval",
    "TierCadence",
    "tier_cadences",
    "Schedule",
    "EVERY_TIER",
    "daly_interval",
    "prune",
    "Timeline",
    "TimelineCopies",
    "Committed",
    "live_and_abandoned",
    "newest_timeline",
    "switch_timeline",
    "retain",
]

log = logging.getLogger(__name__)


def _check_count(tier: str, n: Any) -> None:
    """A count of :class:`Retention` for ``tier``: an int >= 1 or ``None`` (all); else a ``ValueError``."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
        raise ValueError(
            f"Retention({tier}={n!r}): the number of checkpoints to keep must be an int (or None to keep all)"
        )
    if n is not None and n < 1:
        raise ValueError(
            f"Retention({tier}={n!r}): keep at least 1, since the newest committed "
            "checkpoint is never deleted (or None to keep all)"
        )


@dataclass(frozen=True, init=False, repr=False)
class Retention:
    """How many committed checkpoints each tier keeps.

    ``local``: newest checkpoints kept in ``local_dir`` (and of the copies kept for a peer rank);
    ``remote``: at the URL (``None`` keeps all). Any other durable tier by its name, as a keyword:
    ``Retention(local=2, remote=10, disk2=5)`` for a tier registered as ``"disk2"``
    (``Storage(extra_tiers=...)``); the same counts may be given as a mapping, ``keep={"local": 2,
    "disk2": 5}`` (:class:`~ckpt.Policy`). A tier not named keeps what its class takes from ``local`` /
    ``remote`` (a subclass of the local tier: ``local``), else ``others``: ``None`` (all) unless the
    retention is :meth:`every_tier`'s (what ``keep=N`` makes). The Checkpointer checks the names against its
    tiers: a name that is not one of its durable tiers is a ``ValueError`` naming the tiers it has.
    ``tiers``: the counts given by name (beside ``local`` and ``remote``).

    Newest means the live branch newest ``(timeline, step)`` first, then the abandoned branch of a
    rollback (see :class:`Timeline`), so the abandoned branch goes first. The newest committed
    checkpoint, any checkpoint still being written, linked checkpoints (a symbolic link into the
    directory) and the newest checkpoint this process knows to verify (one it committed itself or read
    back in full) are never deleted, whatever the setting; see :func:`prune`.
    """

    local: int | None
    remote: int | None
    tiers: Mapping[str, int | None]
    others: int | None

    def __init__(self, local: int | None = 2, remote: int | None = 10, **tiers: int | None) -> None:
        for tier, n in {"local": local, "remote": remote, **tiers}.items():
            _check_count(tier, n)
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "remote", remote)
        object.__setattr__(self, "tiers", types.MappingProxyType(dict(tiers)))
        object.__setattr__(self, "others", None)

    @classmethod
    def of(cls, counts: Mapping[str, int | None], others: int | None = None) -> "Retention":
        """The retention of ``counts`` (tier name -> checkpoints kept); the tiers not named keep the defaults
        (``others``: the count of a durable tier neither named nor of the local or remote kind)."""
        for name in counts:
            if not isinstance(name, str):
                raise TypeError(
                    f"keep= as a dict is keyed by tier name ('local', 'remote', ...), got {name!r}"
                )
        out = cls(**counts)
        _check_count("others", others)
        object.__setattr__(out, "others", others)
        return out

    @classmethod
    def every_tier(cls, n: int | None) -> "Retention":
        """``n`` checkpoints on every durable tier: ``local_dir``, the url and any other durable tier
        (``Storage(extra_tiers=...)``), what ``keep=n`` means (``None``: all everywhere)."""
        return cls.of({"local": n, "remote": n}, others=n)

    def count(self, tier: Any) -> int | None:
        """How many steps ``tier`` keeps: its count by name, else what the tier takes from ``local`` /
        ``remote`` (:meth:`~ckpt.tiers.base.Tier.keep_of`; ``None``: all)."""
        if tier.name in self.tiers:
            return self.tiers[tier.name]
        return tier.keep_of(self)

    def __hash__(self) -> int:
        return hash((self.local, self.remote, tuple(sorted(self.tiers.items())), self.others))

    def __reduce__(self) -> tuple:  # copies and pickles (a Lightning callback's settings) by its counts
        return Retention.of, ({"local": self.local, "remote": self.remote, **self.tiers}, self.others)

    def __repr__(self) -> str:
        if self.others is not None and self.local == self.remote == self.others and not self.tiers:
            return f"Retention.every_tier({self.others!r})"
        if self.others is not None:
            counts = {"local": self.local, "remote": self.remote, **self.tiers}
            return f"Retention.of({counts!r}, others={self.others!r})"
        more = "".join(f", {name}={n!r}" for name, n in self.tiers.items())
        return f"Retention(local={self.local!r}, remote={self.remote!r}{more})"


@dataclass(frozen=True)
class Timeline:
    """The branch of history a checkpoint is on (see the module docstring).

    ``number``: 0 for a run never rolled back (and for checkpoints older than timelines);
    ``forks``: ``(timeline, step)`` for each ancestor, oldest first: the branch left
    ``timeline`` after ``step``.
    """

    number: int = 0
    forks: tuple[tuple[int, int], ...] = ()

    def holds(self, number: int, step: int) -> bool:
        """Whether checkpoint ``step`` of timeline ``number`` is part of this branch's history."""
        return number == self.number or any(n == number and step <= at for n, at in self.forks)

    def branch(self, step: int, number: int) -> "Timeline":
        """Timeline ``number``, which leaves this one after ``step``."""
        return Timeline(number, self.forks + ((self.number, step),))

    @classmethod
    def of(cls, commit: Any) -> "Timeline":
        """The timeline a :class:`~ckpt.format.Commit` records."""
        return cls(commit.timeline, tuple((int(n), int(s)) for n, s in commit.forks))

    def record(self) -> dict[str, Any]:
        """The :class:`~ckpt.format.Commit` fields recording this timeline."""
        return {"timeline": self.number, "forks": [[n, s] for n, s in self.forks]}


class TimelineCopies:
    """For a tier: writes of a step made inside :meth:`copying` record the given timeline in their
    ``COMMIT`` (a copy of a checkpoint keeps its timeline) instead of the tier's current one."""

    _copying: dict[int, Timeline]

    @contextlib.contextmanager
    def copying(self, step: int, timeline: Timeline) -> Iterator[None]:
        self._copying[step] = timeline
        try:
            yield
        finally:
            self._copying.pop(step, None)


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint as a tier lists it: its step, its timeline, and whether it is linked in
    (its directory or ``COMMIT`` a symbolic link: listed and restorable, never deleted). ``known``:
    whether its timeline was read (``False``: the store failed to give its ``COMMIT``; the timeline
    shown is a guess, so retention deletes nothing on that tier, see :func:`prune`)."""

    step: int
    timeline: Timeline = Timeline()
    linked: bool = False
    known: bool = True

    @property
    def key(self) -> tuple[int, int]:
        """``(timeline, step)``: larger is newer."""
        return self.timeline.number, self.step


def live_and_abandoned(entries: Iterable[Committed]) -> tuple[list[Committed], list[Committed]]:
    """Split checkpoints (of one tier or several) into the live branch and the abandoned one, each
    newest first by ``(timeline, step)``. The live branch is that of the newest checkpoint."""
    entries = list(entries)
    if not entries:
        return [], []
    head = max(entries, key=lambda e: (e.key, e.timeline.forks))
    live = [e for e in entries if head.timeline.holds(*e.key)]
    abandoned = [e for e in entries if not head.timeline.holds(*e.key)]
    order = lambda e: e.key  # noqa: E731
    return sorted(live, key=order, reverse=True), sorted(abandoned, key=order, reverse=True)


def newest_timeline(tiers: Iterable[Any]) -> Timeline:
    """The newest checkpoint's timeline, on any of ``tiers`` (0 when there is none). A tier that cannot be
    listed now (a remote tier whose store is down) is left out (logged): a save must not fail on it before
    its upload even starts."""
    entries = []
    for tier in tiers:
        try:
            entries += tier.committed()
        except OSError as e:
            log.warning(
                "could not list the %s tier to find the newest checkpoint's timeline (%s); using the "
                "other tiers'",
                tier.name,
                e,
            )
    live = live_and_abandoned(entries)[0]
    return live[0].timeline if live else Timeline()


def switch_timeline(
    current: Timeline | None,
    timeline: Timeline,
    settle: Callable[[], None],
    pipeline: Any,
    pool: Any,
    tiers: Iterable[Any],
) -> Timeline:
    """Make ``timeline`` the one the next saves record, instead of ``current`` (``None``: none yet), on each of
    ``tiers`` (the peer tier sends it with each replica) and in ``pool`` (a snapshot a rollback abandoned is the
    first whose buffer is taken again); returns it. On a change, the saves still persisting were taken on
    ``current`` and commit on it first (``settle()`` waits for them), and ``pipeline`` is told the branch left
    (:meth:`~ckpt.pipeline.Pipeline.branch_left`)."""
    if current is not None and timeline != current:
        settle()
        pipeline.branch_left(current, timeline)
    with pool._cv:
        pool.live = timeline
    for tier in tiers:
        tier.timeline = timeline
    return timeline


def _listing(tier: Any) -> list[Committed]:
    if hasattr(tier, "committed"):
        return list(tier.committed())
    owns = getattr(tier, "owns", lambda s: True)
    return [Committed(s, linked=not owns(s)) for s in tier.committed_steps()]


def prune(
    tier: Any,
    keep: int | None,
    busy: Collection[int] = (),
    dry_run: bool = False,
    verified: Callable[[int], bool] | None = None,
) -> list[int]:
    """Apply retention to one tier: returns the steps deleted (or that would be, with ``dry_run``).

    Keeps the newest ``keep`` committed steps that the tier owns (all with ``None``), newest in the
    order of :func:`live_and_abandoned`: the live branch newest first, then the abandoned branch, so
    that the abandoned branch goes first. Also removes uncommitted leftovers older than the newest
    commit (crashed or failed writes): older than the live branch's newest, not than the largest step
    listed, since after a rollback the new branch's next save, numbered below the abandoned steps, may
    be in flight in another process (a job's upload beside ``ckpt gc URL``, another rank's part).
    Never deletes the newest committed step nor a step in ``busy``. A linked step (its directory or
    ``COMMIT`` a symbolic link: :func:`ckpt.tiers.local.linked`) is not the tier's own: it is neither
    counted nor deleted, and nothing inside it is touched. A step that cannot be deleted is logged and
    skipped.

    ``verified(step)`` says whether a step is known to verify. When given, the newest owned step
    for which it returns ``True`` is kept too, asked in the order above and only while steps would
    be deleted (so it may read the step: ``ckpt gc`` verifies each one it asks about); when it is
    ``True`` for none, no committed step is deleted, so retention never leaves only checkpoints
    that are not known to verify.

    A listing with a step whose ``COMMIT`` the store failed to give (:attr:`Committed.known` false)
    deletes nothing: without its timeline the live branch is a guess, and a newer good step could
    pass for an abandoned one. The next retention, once the store answers, prunes.
    """
    entries = _listing(tier)
    if not entries:
        return []
    unknown = [e.step for e in entries if not e.known]
    if unknown:
        log.warning(
            "retention of the %s tier deletes nothing this time: the commit records of steps %s could "
            "not be read, so which steps are live is not known",
            getattr(tier, "name", "?"),
            unknown,
        )
        return []
    live, abandoned = live_and_abandoned(entries)
    owns = getattr(tier, "owns", lambda s: True)
    newest = live[0].step
    owned = [e.step for e in live + abandoned if not e.linked]
    kept = set(owned if keep is None else owned[:keep])
    if verified is not None and len(kept) < len(owned):
        keeper = next((s for s in owned if verified(s)), None)
        kept = set(owned) if keeper is None else kept | {keeper}
    doomed = [s for s in owned if s not in kept]
    steps = {e.step for e in entries}
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


def retain(tiers: Iterable[Any], keep: Retention, busy: Collection[int]) -> None:
    """Retention after a commit, on each of ``tiers`` that prunes from this process (:func:`prune`, with each
    tier's count of ``keep``, :meth:`Retention.count`; ``busy``: steps still being written). What counts as verified here (the newest
    such step is always kept, and with none nothing committed is deleted): a step this process committed to
    that tier itself (checksums computed from its own host buffer, or, for a copy, every chunk checked
    against the sender's), or read back in full from it; never a step it saw fail verification."""
    for tier in tiers:
        if not tier.prunes_here():
            continue
        prune(tier, keep.count(tier), busy, verified=lambda s, record=tier.verified: record.get(s) is True)


def elapsed(now: float, last: float, seconds: float) -> bool:
    """Whether ``seconds`` passed since ``last`` on a clock that reads ``now``. A clock that went back past
    ``last`` (a wall clock stepped back by NTP, an injected ``clock=``) makes it due at once, rather than
    wait for the clock to catch up again, which would stop the saves for as long as the step back."""
    return now - last >= seconds or now < last


class Interval:
    """Decides whether ``maybe_save(step, ...)`` saves.

    ``every_steps``: save when ``step % every_steps == 0``. ``every_seconds``:
    save when that long passed since the last save (by ``clock``, seconds).
    Both may be given; either triggers. Neither: ``maybe_save`` never saves.
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
        return self.every_seconds is not None and elapsed(self.clock(), self._last_time, self.every_seconds)

    def saved(self, step: int) -> None:
        self._last_time = self.clock()


def plain_interval(
    every_steps: int | None, every_seconds: float | None, interval: str | None, clock: Callable[[], float]
) -> Interval | None:
    """The snapshot cadence of ``every_steps`` / ``every_seconds``, or ``None`` for ``interval="auto"`` (an
    :class:`AutoInterval`, made once the tiers' MTBFs are known); ``ValueError`` when both are given."""
    if interval is None:
        return Interval(every_steps, every_seconds, clock)
    if every_steps is not None or every_seconds is not None:
        raise ValueError("interval='auto' picks the interval itself: drop every_steps / every_seconds")
    return None


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

    def __init__(
        self, mtbf: float, restart: float = 0.0, window: int = 5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not mtbf or mtbf <= 0:
            raise ValueError(
                f"interval='auto' needs mtbf=<mean time between failures, seconds> > 0, got {mtbf!r}"
            )
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
        """Seconds a save costs the loop: the median of the last ``window`` stalls (``None`` before one)."""
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
        """Whether a save is due at ``step``: the interval has passed since the last (or none measured yet)."""
        if self._last_time is None or self.seconds is None:
            return True
        return elapsed(self.clock(), self._last_time, self.seconds)

    def saved(self, step: int) -> None:
        """Note that a save was taken at ``step`` now: the interval counts from here."""
        self._last_time = self.clock()

    def record(self, stall_s: float, persist_s: float | None = None) -> None:
        """Feed one save's measured stall (and its persist time, once known)."""
        self._costs = (self._costs + [max(stall_s, 1e-6)])[-self.window :]
        if persist_s is not None:
            self._persist = persist_s

    def report(self) -> dict[str, float | None]:
        """``interval_s``, ``cost_s``, ``mtbf_s`` (seconds) and ``expected_loss_fraction`` (of wall time)."""
        return {
            "interval_s": self.seconds,
            "cost_s": self.cost,
            "mtbf_s": self.mtbf,
            "expected_loss_fraction": self.expected_loss(),
        }


class TierCadence:
    """``interval="auto"`` for one persisting tier: how often it writes the newest snapshot.

    A tier writes in the background, so what a copy costs the training loop is the slowdown of the steps
    that run while it writes: ``cost = (median step while it writes - median step while it does not)
    * (write seconds / median step while it writes)``, from the last ``window`` steps of each kind
    (:meth:`step`) and its last write (:meth:`wrote`). The interval is Daly's optimum for that cost and the
    MTBF of the failures the tier is there for (:func:`daly_interval`), and never shorter than a write takes
    (a tier cannot write more often; newest wins meanwhile). With no measurable cost that is as often as
    it keeps up. Before its first write and before enough steps were seen, the tier writes as soon as it
    can, to measure.
    """

    def __init__(self, name: str, mtbf: float, window: int = 20) -> None:
        if not mtbf or mtbf <= 0:
            raise ValueError(f"interval='auto' needs an mtbf > 0 seconds for the {name} tier, got {mtbf!r}")
        self.name = name
        self.mtbf = float(mtbf)
        self.window = window
        self._busy: list[float] = []
        self._idle: list[float] = []
        self._write: float | None = None

    def step(self, seconds: float, writing: bool) -> None:
        """One training step of ``seconds``; ``writing``: this tier was writing during it."""
        if writing:
            self._busy = (self._busy + [seconds])[-self.window :]
        else:
            self._idle = (self._idle + [seconds])[-self.window :]

    def wrote(self, seconds: float) -> None:
        """A write to the tier took ``seconds`` (wall time, as the training loop lives it)."""
        self._write = seconds

    @property
    def cost(self) -> float | None:
        """Seconds of training lost per write (``None`` until measured)."""
        if self._write is None or len(self._busy) < 3 or len(self._idle) < 3:
            return None
        busy, idle = _median(self._busy), _median(self._idle)
        return max(0.0, busy - idle) * (self._write / busy) if busy > 0 else 0.0

    @property
    def seconds(self) -> float | None:
        """Seconds between copies on this tier (``None``: write as soon as possible, to measure)."""
        c = self.cost
        if c is None:
            return None
        return max(self._write, daly_interval(c, self.mtbf) if c > 0 else 0.0)

    def report(self) -> dict[str, float | None]:
        return {"interval_s": self.seconds, "cost_s": self.cost, "mtbf_s": self.mtbf, "write_s": self._write}


#: ``Schedule.takes(force=...)``: every tier writes the snapshot, due or busy (``maybe_save(final=True)``)
EVERY_TIER = "*"


def tier_cadences(
    persisting: Iterable[Any], mtbf: dict[str, float], given: Collection[str]
) -> dict[str, TierCadence]:
    """``interval="auto"``: a :class:`TierCadence` for each persisting tier not ``given`` a ``persist_every``
    cadence, from its ``mtbf`` (seconds, per tier name)."""
    return {t.name: TierCadence(t.name, mtbf[t.name]) for t in persisting if t.name not in given}


class Schedule:
    """When a Checkpointer's snapshots are due, and on which tiers.

    ``interval``: the snapshot cadence (:class:`Interval` or :class:`AutoInterval`); ``pipeline``: the
    persisting tiers and their own cadences; ``pool``: the host buffers; ``ranks``: the job's ranks
    (``None``: this process decides alone); ``auto_tiers``: some tier has an ``interval="auto"`` cadence
    of its own (:class:`TierCadence`). A decision taken by each rank's clock or costs is agreed over the
    ranks (due on all when due on any), so every rank saves the same steps.
    """

    def __init__(
        self,
        interval: Interval | AutoInterval,
        pipeline: Any,
        pool: Any,
        ranks: Any,
        clock: Callable[[], float],
        auto_tiers: bool,
    ) -> None:
        self.interval, self.pipeline, self.pool, self.ranks = interval, pipeline, pool, ranks
        self.clock, self.auto_tiers = clock, auto_tiers
        # a time-based policy decides by each rank's clock: those decisions are agreed in maybe_save
        self.agree_due = ranks is not None and (
            isinstance(interval, AutoInterval) or interval.every_seconds is not None
        )
        self._last_step_at: float | None = None

    def due(self, step: int) -> bool:
        """Whether the snapshot interval makes ``step`` a save (collective when agreed over the ranks)."""
        if self.auto_tiers:  # a step's time, for the tiers' interval="auto" costs
            now = self.clock()
            if self._last_step_at is not None:
                self.pipeline.note_step(now - self._last_step_at)
            self._last_step_at = now
        due = self.interval.due(step)
        if (
            due
            and isinstance(self.interval, AutoInterval)
            and self.interval.seconds is None
            and self.pool.allocation_outlasts(knobs.get("CKPT_BUSY_WAIT_MS") / 1e3)
        ):
            due = False  # "as soon as it can" means once a buffer can be there: no skip per step meanwhile
        if self.agree_due:
            due = bool(self.ranks.max([int(due)])[0])  # clocks differ between ranks: save if any says so
        return due

    def require_policy(self, signals: Any) -> None:
        """``maybe_save()``'s check: with no interval (no ``every_steps``, ``every_seconds`` or ``interval``)
        and no ``signals`` to act on it would never save, a ``ValueError``."""
        iv = self.interval
        if (
            isinstance(iv, Interval)
            and iv.every_steps is None
            and iv.every_seconds is None
            and not (signals.preempt or signals.save)
        ):
            raise ValueError(
                "maybe_save() has no policy to follow, so it would never save: pass every_steps=, "
                "every_seconds= or interval='auto' (with mtbf=) to ckpt.Checkpointer (or in "
                "ckpt.Policy), or call save() where the loop should save"
            )

    def takes(self, step: int, busy: dict[str, int], force: str | None) -> dict[str, str | None]:
        """Per persisting tier, whether it writes the snapshot of ``step`` (``None``) or why not (``"not due"``
        by its cadence, ``"busy"`` with an older one: ``busy``). ``force``: a tier that writes it anyway (a
        drain), or :data:`EVERY_TIER`. A tier whose waiting snapshot lost its buffer to this one writes it."""
        pipe = self.pipeline
        due = pipe.due(step)
        if (
            self.ranks is not None and self.auto_tiers
        ):  # each rank's clock and costs: due on all if due on any
            due = dict(zip(pipe.tiers, (bool(v) for v in self.ranks.max([int(due[t]) for t in pipe.tiers]))))
        orphaned = pipe.take_orphaned()  # tiers whose waiting snapshot this buffer held: they get this one
        return {
            t: None
            if force in (t, EVERY_TIER) or t in orphaned or (due[t] and not busy[t])
            else ("not due" if not due[t] else "busy")
            for t in pipe.tiers
        }

    def report(self) -> dict[str, Any]:
        """``Checkpointer.interval_report()``: the :class:`AutoInterval`'s report, and per tier with a cadence
        of its own, its :class:`TierCadence`'s under ``"tiers"``."""
        if not isinstance(self.interval, AutoInterval):
            raise ValueError("interval_report() needs Checkpointer(interval='auto', mtbf=...)")
        return {
            **self.interval.report(),
            "tiers": {n: c.report() for n, c in self.pipeline.cadences().items()},
        }

    def record(self, stats: Any, allocations: int, local_s: float | None) -> None:
        """After a save (``stats``: its :class:`~ckpt.stage.SnapshotStats`; ``allocations``: the pool's
        allocations before it; ``local_s``: the previous save's local write, when saves wait for the
        tiers), what an ``interval="auto"`` learns of the snapshot's cost."""
        if isinstance(self.interval, AutoInterval):
            # saves that wait for the tiers (if_busy="wait") cannot come faster than the local tier writes;
            # with newest wins the snapshot cadence is the memory tier's alone (each tier has its own)
            # a save that allocated its buffer paid a one-time cost (seconds for GB of pinned memory), not the
            # snapshot's: the interval is set from what every snapshot costs the loop
            once = stats.wait_s if self.pool.allocations > allocations else 0.0
            self.interval.record(stats.stall_s - once, local_s)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum checkpoint interval (seconds of work between checkpoints)."""
    if cost >= 2 * mtbf:
        return mtbf
    r = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - cost

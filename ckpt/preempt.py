"""Signals: a preemption that saves and exits, and a requested save that keeps training.

Two kinds of signal reach a training process from outside:

* a **preemption** (SIGTERM before a node drains, a scheduler's time limit): save the step that
  just ended, wait until it is durable, exit (status ``128 + signal``) or raise
  :class:`~ckpt.errors.Preempted`;
* a **save request** (SIGUSR1 from an operator before planned maintenance, from
  ``kubectl exec`` or ``scancel --signal``): save the step that just ended, wait until it is
  durable, log it and *go on training*.

:class:`Signals` holds both configurations (the ``signals=`` argument of
:class:`~ckpt.Checkpointer`). :class:`PreemptionGuard` installs handlers that do nothing but
record the signal (the interpreter runs them between two bytecodes of the main thread, where
no real work is safe). The work happens at the next step boundary,
``Checkpointer.maybe_save``: the ranks of a multi-process job agree with one small integer
collective on the CPU group (so every rank saves the same step even when the signal reached
one of them), then :func:`drain` or :func:`save_on_request` runs. A preemption wins over a save
request that arrives with it. Previous handlers are reinstalled when the ``with`` block ends;
a preemption calls the previous handler of its signal (a Python callable) before exiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Collection, Iterable, NoReturn, Sequence

import torch

from .errors import CheckpointError, Preempted

__all__ = [
    "Signals",
    "PreemptionGuard",
    "Listening",
    "WorkerSignals",
    "drain",
    "drain_outside",
    "save_on_request",
]

log = logging.getLogger(__name__)

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def _signal_tuple(values: Iterable[int | signal.Signals], argument: str) -> tuple[signal.Signals, ...]:
    if isinstance(values, (int, str)):
        raise TypeError(f"{argument} must be a tuple of signals, e.g. (signal.SIGTERM,); got {values!r}")
    out = []
    for v in values:
        try:
            s = signal.Signals(v)
        except (ValueError, TypeError):
            raise ValueError(f"{argument}: {v!r} is not a signal number of this platform") from None
        if s in _UNCATCHABLE:
            raise ValueError(f"{argument}: {s.name} cannot be caught by any process; pick another signal")
        if s not in out:
            out.append(s)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Signals:
    """What the signals a training process receives do (``Checkpointer(signals=ckpt.Signals(...))``).

    Inside the Checkpointer's ``with`` block each listed signal only sets a flag; the next
    :meth:`~ckpt.Checkpointer.maybe_save` acts on it (on every rank of a multi-process job, when
    any rank received it: ``maybe_save`` is then collective at every step).

    Args:
        preempt: signals that mean "this process is about to be stopped": the next ``maybe_save``
            saves its step whatever the policy, waits until it is durable on ``drain_tier`` (at
            most ``deadline`` seconds) and exits with status ``128 + signal`` (``on_preempt="exit"``)
            or raises :class:`~ckpt.errors.Preempted` (``on_preempt="raise"``). Default: SIGTERM.
        save: signals that mean "save now and keep training" (``(signal.SIGUSR1,)``, say): the next
            ``maybe_save`` saves its step whatever the policy, waits until it is durable on
            ``save_tier`` (at most ``save_deadline`` seconds), logs it and returns the save's handle;
            training goes on. Signals that arrive before the save is taken make one save; one that
            arrives later (during the wait, say) asks for another at the next step. Default: none.
        drain_tier: where a preemption save must land: a tier the persist pipeline writes to, among those
            the Checkpointer has: ``"local"``, ``"remote"`` (needs the Checkpointer's ``url``), ``"peer"``
            (needs ``peers=``: the peer rank on another node has committed this rank's copy) or a
            registered tier of one's own (``Storage(extra_tiers=...)``).
        deadline: seconds a preemption waits for its save to become durable before it exits anyway
            (logged; the step may then not be durable). Budget it inside the scheduler's grace period.
        on_preempt: ``"exit"`` or ``"raise"``.
        save_tier: where a requested save must land (the same choices as ``drain_tier``).
        save_deadline: seconds a requested save may hold the training loop (default: ``deadline``).
            When it passes, the loop goes on and the save keeps persisting in the background (logged).
        outside_loop_after: seconds a preemption waits for a ``maybe_save`` (default 5): when none comes
            by then (the process is evaluating, waiting for data, or in a step longer than that), a
            background thread makes the newest snapshot already in RAM durable on ``drain_tier`` (no new
            copy from the GPU; it may be some steps old), within what is left of ``deadline``, then exits
            the process with ``128 + signal`` at once (``os._exit``: no ``finally`` blocks or exit hooks
            run, and the memory tier's RAM stays for the next process); with ``on_preempt="raise"`` the
            next ``maybe_save`` raises :class:`~ckpt.errors.Preempted` instead. ``None``: only
            ``maybe_save`` acts on a preemption.

    A signal may be listed in ``preempt`` or in ``save``, not both. SIGKILL and SIGSTOP cannot be
    caught. Python installs handlers only in the main thread: enter the ``with`` block there.
    """

    preempt: tuple[int | signal.Signals, ...] = (signal.SIGTERM,)
    save: tuple[int | signal.Signals, ...] = ()
    drain_tier: str = "local"
    deadline: float = 30.0
    on_preempt: str = "exit"
    save_tier: str = "local"
    save_deadline: float | None = None
    outside_loop_after: float | None = 5.0

    def __post_init__(self) -> None:
        preempt = _signal_tuple(self.preempt, "Signals(preempt=...)")
        save = _signal_tuple(self.save, "Signals(save=...)")
        both = [s.name for s in preempt if s in save]
        if both:
            raise ValueError(
                f"{both} listed in both Signals(preempt=...) and Signals(save=...): a signal either "
                "stops the run or saves and goes on; list it in one of them"
            )
        object.__setattr__(self, "preempt", preempt)
        object.__setattr__(self, "save", save)
        from .tiers.stack import needs_text, persisting_kinds

        kinds = persisting_kinds()
        for name in ("drain_tier", "save_tier"):
            if getattr(self, name) not in kinds:
                raise ValueError(
                    f"{name} must name a tier saves are written to: {needs_text(kinds)} (a tier of "
                    f"one's own once registered); got {getattr(self, name)!r}"
                )
        if self.on_preempt not in ("exit", "raise"):
            raise ValueError(f"on_preempt must be 'exit' or 'raise', got {self.on_preempt!r}")
        if self.save_deadline is None:
            object.__setattr__(self, "save_deadline", self.deadline)
        for name in ("deadline", "save_deadline", "outside_loop_after"):
            value = getattr(self, name)
            if name == "outside_loop_after" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"{name} must be a positive number of seconds, got {value!r}"
                    + (
                        " (None: only maybe_save acts on a preemption)"
                        if name == "outside_loop_after"
                        else ""
                    )
                )

    @classmethod
    def from_arguments(
        cls, signals: "Signals | Sequence[int]", drain_deadline: float, drain_tier: str, on_preempt: str
    ) -> "Signals":
        """The configuration from ``Checkpointer``'s arguments: a :class:`Signals`, or the keyword form
        (``signals=(signal.SIGTERM,), drain_deadline=..., drain_tier=..., on_preempt=...``), whose
        signals are preemption signals. Given a :class:`Signals`, the keyword options must keep their
        defaults (each is a field of it)."""
        if isinstance(signals, Signals):
            given = [
                n
                for n, v, default in (
                    ("drain_deadline", drain_deadline, 30.0),
                    ("drain_tier", drain_tier, "local"),
                    ("on_preempt", on_preempt, "exit"),
                )
                if v != default
            ]
            if given:
                raise ValueError(
                    f"{given} given beside signals=ckpt.Signals(...): set them inside it "
                    "(ckpt.Signals(deadline=..., drain_tier=..., on_preempt=...))"
                )
            return signals
        preempt = _signal_tuple(signals, "signals")
        if not preempt:
            # nothing to drain: the deadline is never used, so (as always) it is not checked either
            try:
                usable = not isinstance(drain_deadline, bool) and drain_deadline > 0
            except TypeError:
                usable = False
            drain_deadline = drain_deadline if usable else 30.0
        return cls(preempt=preempt, drain_tier=drain_tier, deadline=drain_deadline, on_preempt=on_preempt)

    def check_tiers(self, planned: Collection[str]) -> None:
        """Refuse a tier the Checkpointer does not have (``planned``: the names of the tiers it writes saves to,
        :attr:`ckpt.tiers.Tiers.planned_persisting`; ``ValueError`` naming the argument and what makes the
        tier exist)."""
        from .tiers.stack import persisting_kinds

        for name, tier in (("drain_tier", self.drain_tier), ("save_tier", self.save_tier)):
            if tier not in planned:
                needs = persisting_kinds().get(tier)
                raise ValueError(
                    f"{name}={tier!r}: this Checkpointer writes saves to {list(planned)}"
                    + (f"; the {tier!r} tier needs {needs}" if needs else "")
                )

    @property
    def handled(self) -> tuple[signal.Signals, ...]:
        """Every signal handled."""
        return self.preempt + self.save


class PreemptionGuard:
    """Installs flag-only handlers while active: ``signals`` (preemption) set :attr:`received`,
    ``save`` set :attr:`save_requested`."""

    def __init__(
        self, signals: Sequence[int | signal.Signals], save: Sequence[int | signal.Signals] = ()
    ) -> None:
        self.signals = _signal_tuple(signals, "signals")
        self.save = _signal_tuple(save, "save signals")
        self.received: int | None = None  # the first preemption signal
        self.received_at: float | None = None  # when it arrived (time.monotonic())
        self.save_requested: int | None = None  # a save request not yet served
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def active(self) -> bool:
        """Whether the handlers are installed (between :meth:`install` and :meth:`uninstall`)."""
        return bool(self._previous)

    def install(self) -> None:
        """Install the flag-only handlers, remembering the previous ones (main thread only: ``RuntimeError``)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Checkpointer(signals=...) installs signal handlers, which Python allows only in "
                "the main thread: enter the `with` block there, or pass signals=()"
            )
        try:
            for s in self.signals + self.save:
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handler)
        except BaseException:
            self.uninstall()
            raise
        _installed.append(self)  # what a data-loader worker forked from now on leaves to its parent

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        if self in _installed:
            _installed.remove(self)
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # nothing heavy in a signal handler: the step boundary does the work
        if signum in self.save:
            if self.save_requested is None:
                self.save_requested = signum
        elif self.received is None:
            self.received_at = time.monotonic()
            self.received = signum

    def poll(self, ranks: Any = None) -> tuple[int | None, int | None]:
        """``(preemption signal, save request)`` that any rank received, ``None`` for neither. Over
        ``ranks`` (a :class:`ckpt.ranks.Ranks`: one all-reduce of two integers on the CPU group) when
        given, collective then; else this process's own."""
        preempt, save = self.received or 0, self.save_requested or 0
        if ranks is not None:
            preempt, save = ranks.max([preempt, save])
        if preempt and self.received is None:
            self.received = preempt
        return preempt or None, save or None

    def agreed(self, ranks: Any = None) -> int | None:
        """The preemption signal any rank received (``None`` if none). Collective when torch.distributed
        is initialised: over ``ranks`` (a :class:`ckpt.ranks.Ranks`, CPU only) when given, else one
        all-reduce on the default group."""
        if ranks is not None:
            return self.poll(ranks)[0]
        local = self.received or 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
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


#: the guards installed in this process, in order (a forked child has its parent's list)
_installed: list[PreemptionGuard] = []


def _leave_to_parent(signum: int, frame: FrameType | None) -> None:
    """A data-loader worker's handler of its parent's signals: nothing (the parent saves, then ends)."""


class WorkerSignals:
    """A ``worker_init_fn`` for :class:`torch.utils.data.DataLoader` that keeps its worker processes alive
    through the signals a scheduler sends to every process of a job, so that the training process can take
    its preemption (or requested) save at the next step boundary:
    ``DataLoader(..., worker_init_fn=ckpt.WorkerSignals())`` (``WorkerSignals(my_init_fn)`` calls yours
    after it).

    Why: SLURM (``--signal``, ``scancel``) signals every process of a job step, the data-loader workers too.
    PyTorch's workers end on a SIGTERM (their own handler), and a SIGUSR1 ends a process that does not
    handle it; the training process then fails at its next batch ("DataLoader worker ... exited
    unexpectedly"), before its save. In a worker this sets a handler that does nothing for the signals the
    training process's :class:`~ckpt.Checkpointer` listens for (those of its active ``with`` block when the
    worker was forked; ``signals`` to name them, e.g. for workers started with ``spawn`` before the block),
    default SIGTERM and SIGUSR1. A worker still ends when its DataLoader is done with it or its parent is
    gone (PyTorch's own checks), and on SIGKILL; programs it runs get the default handlers back.

    Args:
        fn: the ``worker_init_fn`` to call after (``fn(worker_id)``), or ``None``.
        signals: the signals to leave to the parent; ``None``: as above.

    Picklable when ``fn`` is (workers started with ``spawn`` or ``forkserver``).
    """

    def __init__(
        self, fn: Callable[[int], Any] | None = None, signals: Iterable[int | signal.Signals] | None = None
    ) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(
                f"WorkerSignals(fn=...) takes a worker_init_fn (a callable of the worker id), "
                f"got {type(fn).__name__}"
            )
        self.fn = fn
        self.signals = None if signals is None else _signal_tuple(signals, "WorkerSignals(signals=...)")

    def __call__(self, worker_id: int) -> None:
        wanted = self.signals
        if wanted is None:
            wanted = tuple(dict.fromkeys(s for g in _installed for s in g.signals + g.save)) or (
                signal.SIGTERM,
                signal.SIGUSR1,
            )
        for s in wanted:
            signal.signal(s, _leave_to_parent)
        if self.fn is not None:
            self.fn(worker_id)

    def __repr__(self) -> str:
        return f"WorkerSignals(fn={self.fn!r}, signals={self.signals!r})"


def _durable(handle: Any, tier: str, deadline: float, t0: float) -> tuple[bool, BaseException | None]:
    """Wait (until ``t0 + deadline``) for ``handle`` to finish ``tier``: (finished in time, its error).
    The error stays unseen, so ``Checkpointer.wait()`` / ``close()`` still raise it."""
    try:
        error = handle._wait_quietly(tier, timeout=max(0.0, deadline - (time.perf_counter() - t0)))
    except TimeoutError:
        return False, None
    if error is None and handle.status == "skipped":  # forced saves wait for a buffer; never count a skip
        error = CheckpointError(f"the save of step {handle.step} was skipped")
    return True, error


def drain(
    save: Callable[[], Any], step: int, signum: int, config: Signals, guard: PreemptionGuard
) -> NoReturn:
    """The preemption: ``save()`` (which saves ``step``), wait until it is durable on
    ``config.drain_tier`` within ``config.deadline``, call the signal's previous handler, then exit
    with ``128 + signum`` or raise :class:`~ckpt.errors.Preempted`."""
    name = signal.Signals(signum).name
    t0 = time.perf_counter()
    log.warning(
        "%s received: saving step %d and making it durable on the %s tier within %.0f s",
        name,
        step,
        config.drain_tier,
        config.deadline,
    )
    durable = False
    try:
        done, error = _durable(save(), config.drain_tier, config.deadline, t0)
        if not done:
            log.error(
                "step %d was not durable on the %s tier within the drain deadline of %.0f s",
                step,
                config.drain_tier,
                config.deadline,
            )
        elif error is not None:
            log.error("the preemption save of step %d failed: %s", step, error)
        else:
            durable = True
            log.warning(
                "step %d is durable on the %s tier after %.2f s; exiting",
                step,
                config.drain_tier,
                time.perf_counter() - t0,
            )
    except Exception as e:
        log.error("the preemption save of step %d failed: %s", step, e)
    guard.chain(signum)
    if config.on_preempt == "raise":
        raise Preempted(signum, step, durable)
    raise SystemExit(128 + signum)


def drain_outside(
    flush: Callable[[str], Any], signum: int, config: Signals, since: float
) -> tuple[int | None, bool]:
    """A preemption no ``maybe_save`` came to act on (see ``Signals.outside_loop_after``): hand the newest
    snapshot in RAM to ``config.drain_tier`` (``flush(tier)`` returns its save handle, ``None`` when there is
    none) and wait until it is durable there, at most until ``since + config.deadline`` (``since``: when the
    signal arrived, ``time.monotonic()``). Returns ``(the step drained or None, durable)``."""
    name = signal.Signals(signum).name
    left = lambda: config.deadline - (time.monotonic() - since)  # noqa: E731
    handle = flush(config.drain_tier)
    if handle is None:
        log.error(
            "%s received outside the training loop and no snapshot is in RAM to drain: nothing was made "
            "durable",
            name,
        )
        return None, False
    log.warning(
        "%s received and no maybe_save() came within %.1f s (evaluating, waiting for data?): making the "
        "newest snapshot in RAM, step %d, durable on the %s tier within %.0f s",
        name,
        time.monotonic() - since,
        handle.step,
        config.drain_tier,
        max(0.0, left()),
    )
    t0 = time.perf_counter()
    done, error = _durable(handle, config.drain_tier, max(0.0, left()), t0)
    if not done:
        log.error(
            "step %d was not durable on the %s tier within the drain deadline of %.0f s",
            handle.step,
            config.drain_tier,
            config.deadline,
        )
    elif error is not None:
        log.error("the preemption drain of step %d failed: %s", handle.step, error)
    else:
        log.warning(
            "step %d is durable on the %s tier %.2f s after %s",
            handle.step,
            config.drain_tier,
            time.monotonic() - since,
            name,
        )
    return handle.step, done and error is None


def save_on_request(save: Callable[[], Any], step: int, signum: int, config: Signals) -> Any:
    """A requested save: ``save()`` (which saves ``step``), wait until it is durable on
    ``config.save_tier`` within ``config.save_deadline``, log the outcome and return the handle.
    A failure is logged (and stays on the handle for ``Checkpointer.wait()`` / ``close()``), never
    raised here: the signal came from outside the program, which goes on training."""
    name = signal.Signals(signum).name
    t0 = time.perf_counter()
    log.info(
        "%s received: saving step %d and waiting until it is durable on the %s tier (at most %.0f s)",
        name,
        step,
        config.save_tier,
        config.save_deadline,
    )
    handle = save()
    done, error = _durable(handle, config.save_tier, config.save_deadline, t0)
    if not done:
        log.warning(
            "the save of step %d requested by %s is not durable on the %s tier after %.0f s; training "
            "goes on while it persists",
            step,
            name,
            config.save_tier,
            config.save_deadline,
        )
    elif error is not None:
        log.error(
            "the save of step %d requested by %s failed on the %s tier: %s; training goes on",
            step,
            name,
            config.save_tier,
            error,
        )
    else:
        log.info(
            "step %d (requested by %s) is durable on the %s tier after %.2f s; training goes on",
            step,
            name,
            config.save_tier,
            time.perf_counter() - t0,
        )
    return handle


class Listening:
    """The signals of a Checkpointer's ``with`` block: the flag-only handlers (:class:`PreemptionGuard`),
    the thread that drains a preemption no ``maybe_save()`` acted on within ``signals.outside_loop_after``
    seconds (:func:`drain_outside`), and which of the two drains it.

    ``flush(tier)`` hands the newest snapshot in RAM to ``tier`` and returns its handle (``None``: there is
    none); ``closing()`` says whether the Checkpointer is closing (then ``close()`` makes every snapshot
    durable, and the watcher leaves it alone).
    """

    def __init__(self, signals: Signals, flush: Callable[[str], Any], closing: Callable[[], bool]) -> None:
        self.signals = signals
        self.guard: PreemptionGuard | None = None
        self.outside: Preempted | None = None  # a drain outside the loop, for the next maybe_save to raise
        self._flush, self._closing = flush, closing
        self._watch: tuple[threading.Thread, threading.Event] | None = None
        self._drain_lock = threading.Lock()
        self._draining: str | None = None  # "loop" or "outside": who drains a preemption

    @property
    def received(self) -> int | None:
        """The preemption signal received (``None`` if none, or outside the ``with`` block)."""
        return None if self.guard is None else self.guard.received

    @property
    def save_requested(self) -> int | None:
        """The save signal received and not yet served by a save (``None`` if none)."""
        return None if self.guard is None else self.guard.save_requested

    def listen(self, preempt: bool = True) -> None:
        """Install the handlers of ``signals`` (main thread only); ``preempt=False``: the save requests
        only (for a framework that handles preemption itself, as Lightning does)."""
        wanted = (self.signals.preempt if preempt else ()), self.signals.save
        if self.guard is None and any(wanted):
            self.guard = PreemptionGuard(*wanted)
            self.guard.install()
            if wanted[0] and self.signals.outside_loop_after is not None:
                stop = threading.Event()
                watcher = threading.Thread(
                    target=self._watch_preemption,
                    args=(self.guard, stop),
                    name="ckpt-preempt-watch",
                    daemon=True,
                )
                self._watch = (watcher, stop)
                watcher.start()

    def unlisten(self) -> None:
        """Put the previous handlers back and stop the watcher."""
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.uninstall()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch[1].set()

    def _watch_preemption(self, guard: PreemptionGuard, stop: threading.Event) -> None:
        """A preemption that no maybe_save() acted on within ``signals.outside_loop_after`` seconds: drain
        the newest snapshot in RAM from this thread, then exit (or leave :class:`Preempted` for the next
        maybe_save to raise). See :class:`Signals`."""
        while not stop.wait(0.1):
            signum, since = guard.received, guard.received_at
            if signum is None or since is None or time.monotonic() - since < self.signals.outside_loop_after:
                continue
            if self._closing():  # close() is making every snapshot durable already; the block's end follows
                return
            with self._drain_lock:
                if self._draining is not None:
                    return
                self._draining = "outside"
            step, durable = drain_outside(self._flush, signum, self.signals, since)
            if self.signals.on_preempt == "exit":
                for h in logging.getLogger().handlers + logging.getLogger("ckpt").handlers:
                    with contextlib.suppress(Exception):
                        h.flush()
                for f in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        f.flush()
                os._exit(128 + signum)  # the main thread is elsewhere: no unwinding, the RAM stays
            self.outside = Preempted(signum, step if step is not None else -1, durable)
            return

    def act(self, step: int, save: Callable[[str], Any], ranks: Any = None) -> Any:
        """At the step boundary of ``step`` (``maybe_save``): raise the :class:`Preempted` a drain outside
        the loop left; on a preemption any rank received (collective over ``ranks``), :func:`drain` with
        ``save(tier)`` (it exits or raises); on a save request, :func:`save_on_request` and return its
        handle. ``None``: no signal to act on."""
        if self.outside is not None:  # drained outside the loop, on_preempt="raise"
            raise self.outside
        if self.guard is not None and self.guard.active:
            preempt, requested = self.guard.poll(ranks)  # collective over the ranks' CPU group
            if preempt:  # wins over a save request
                with self._drain_lock:
                    outside = self._draining == "outside"
                    self._draining = self._draining or "loop"
                if outside:  # the watcher drains the newest snapshot in RAM: it exits or leaves Preempted
                    watch = self._watch
                    if watch is not None:
                        watch[0].join()
                    if self.outside is not None:
                        raise self.outside
                drain(lambda: save(self.signals.drain_tier), step, preempt, self.signals, self.guard)
            if requested:
                self.guard.save_requested = None  # a request arriving from here on asks for another save
                return save_on_request(lambda: save(self.signals.save_tier), step, requested, self.signals)
        return None

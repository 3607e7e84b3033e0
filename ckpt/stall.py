"""A deadline on the progress of the remote tier's requests (``CKPT_REMOTE_STALL_S``).

A request to a store that stops moving must not hold a save, a restore, ``wait()`` or ``close()`` for
hours: a connection the store accepted and then stopped reading from, a proxy that stopped forwarding,
a peer that vanished without a reset. Client timeouts do not cover all of these (botocore's
``read_timeout`` bounds the wait for an answer, not a request body the peer stopped reading; other
clients have none), so every request of the remote tier runs under a watchdog of its own, whatever the
fsspec backend (:class:`Watched`):

* Progress is counted in requests. fsspec reports no bytes of a request in flight, and every request of
  the remote tier is small and bounded: one part (at most ``CKPT_CHUNK_BYTES``, 16 MiB), one record, one
  listing or removal of a step. A request that has not finished ``CKPT_REMOTE_STALL_S`` seconds after
  it was sent has stalled (with the defaults, a part moving slower than 140 kB/s).
* A stalled request is aborted and sent again after a backoff: the coroutine of an asynchronous file
  system (s3fs, gcsfs, adlfs) is cancelled, which closes its connection; a blocking call is left to
  its daemon thread (nothing can stop a thread) and never waited for again.
* After :data:`ATTEMPTS` stalled attempts the call raises :class:`StallError`, a ``TimeoutError``
  naming the request's URL: a stalled save fails within about ``ATTEMPTS * CKPT_REMOTE_STALL_S``
  seconds plus the backoffs, and so does a read.

``CKPT_REMOTE_STALL_S=0`` turns the watchdog off (each request then runs on the caller's thread, bounded
only by the client's own timeouts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import inspect
import logging
import random
import threading
import time
from typing import Any

from . import knobs

__all__ = ["StallError", "Watched", "ATTEMPTS", "call"]

log = logging.getLogger(__name__)

#: attempts of a request before it fails (the first and two more, each after a backoff)
ATTEMPTS = 3

#: the fsspec methods that send requests: every one of them goes through :func:`call`
REQUESTS = frozenset(
    {
        "cat_file",
        "cat",
        "pipe_file",
        "pipe",
        "exists",
        "info",
        "size",
        "ls",
        "glob",
        "find",
        "rm",
        "rm_file",
        "makedirs",
        "mkdir",
        "put_file",
        "get_file",
    }
)


class StallError(TimeoutError):
    """A remote request made no progress for ``CKPT_REMOTE_STALL_S`` seconds in each of its attempts.
    ``filename``: the URL it was for; ``errno``: ``ETIMEDOUT``."""


class Watched:
    """An fsspec file system whose requests (:data:`REQUESTS`) each run under the watchdog (:func:`call`);
    anything else (``protocol``, ``invalidate_cache``, ``unstrip_protocol`` ...) is the file system's own.
    An attribute set on it stays on it (a test's hook of ``pipe_file`` wraps the watched request)."""

    def __init__(self, fs: Any) -> None:
        self._inner = fs

    @property
    def inner(self) -> Any:
        """The file system itself."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (a copy being made): never look it up through itself
            raise AttributeError(name)
        attr = getattr(self._inner, name)
        if name in REQUESTS:
            return functools.partial(call, self._inner, name)
        return attr

    def __repr__(self) -> str:
        return f"Watched({self._inner!r})"


def call(fs: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``fs.<name>(*args, **kwargs)`` under the watchdog: aborted and sent again when it has not finished
    within ``CKPT_REMOTE_STALL_S`` seconds, :class:`StallError` after :data:`ATTEMPTS` such attempts.
    Whatever the request raises itself is raised as it is (the client retries what it retries)."""
    stall = knobs.get("CKPT_REMOTE_STALL_S")
    if stall <= 0:
        return getattr(fs, name)(*args, **kwargs)
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(min(stall, 2.0 ** (attempt - 1)) * (0.5 + random.random() / 2))
        try:
            finished, value = _once(fs, name, args, kwargs, stall)
        except FileNotFoundError:
            if attempt and name in ("rm", "rm_file"):
                return None  # the stalled attempt removed it after all
            raise
        if finished:
            return value
        log.warning(
            "%s of %s made no progress for %d s (CKPT_REMOTE_STALL_S): aborted (attempt %d of %d)",
            name,
            _url(fs, args, kwargs),
            stall,
            attempt + 1,
            ATTEMPTS,
        )
    raise StallError(
        errno.ETIMEDOUT,
        f"no progress for {stall} s (CKPT_REMOTE_STALL_S) in each of {ATTEMPTS} "
        f"attempts of a {name} request (each aborted and sent again after a backoff): the store or the "
        "network stalled",
        _url(fs, args, kwargs),
    )


def _once(fs: Any, name: str, args: tuple, kwargs: dict, limit: float) -> tuple[bool, Any]:
    """One attempt: ``(True, result)``, or ``(False, None)`` when it did not finish within ``limit``
    seconds (it was cancelled, or left to its thread)."""
    method = getattr(fs, name)
    # an asynchronous file system's blocking method runs a coroutine on the file system's loop (fsspec's
    # sync wrapper, which says which): that coroutine is run here, so that it can be cancelled
    coro = getattr(method, "__wrapped__", None) if getattr(fs, "async_impl", False) else None
    if coro is not None and inspect.iscoroutinefunction(coro):
        if not inspect.ismethod(coro):  # the class's wrapper wraps the plain function
            coro = functools.partial(coro, fs)
        future = asyncio.run_coroutine_threadsafe(coro(*args, **kwargs), fs.loop)
        done, _ = concurrent.futures.wait([future], timeout=limit)
        if not done:
            future.cancel()  # cancels the task on the file system's loop: its connection is closed
            return False, None
        return True, future.result()
    outcome: list[tuple[Any, BaseException | None]] = []
    finished = threading.Event()

    def run() -> None:
        try:
            outcome.append((method(*args, **kwargs), None))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome.append((None, e))
        finally:
            finished.set()

    # a daemon: a call that never returns must not hold the interpreter's exit
    threading.Thread(target=run, name=f"ckpt-remote-{name}", daemon=True).start()
    if not finished.wait(limit):
        return False, None
    value, error = outcome[0]
    if error is not None:
        raise error
    return True, value


def _url(fs: Any, args: tuple, kwargs: dict) -> str:
    """The URL a request is for (its first path; a list of paths by its first one and how many)."""
    path = args[0] if args else kwargs.get("path", kwargs.get("rpath"))
    more = ""
    if isinstance(path, (list, tuple)):
        more = f" (and {len(path) - 1} more)" if len(path) > 1 else ""
        path = path[0] if path else ""
    try:
        return fs.unstrip_protocol(path) + more
    except Exception:  # noqa: BLE001 - a name for a message only
        return f"{path}{more}"

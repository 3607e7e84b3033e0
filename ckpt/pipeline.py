"""Phase 2: persist snapshots in the background, tier by tier, with bounded memory.

One worker thread takes staged snapshots in order. For each it waits for the
device-to-host copy (on the host, in the background), publishes it as the
memory tier, writes it to every durable tier configured, applies retention and
hands the host buffer back to the pool. At most ``max_in_flight`` snapshots
exist at once (one host buffer each); what happens to a save that arrives
while all buffers are busy is the caller's documented choice (``if_busy``).

A failure cleans up the partial files, is logged, is recorded on the save's
handle (``handle.wait()`` raises it) and on the checkpointer
(``Checkpointer.wait()`` raises it); training goes on and older checkpoints
stay untouched.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from . import knobs
from .errors import CheckpointError
from .stage import HostPool, Snapshot, SnapshotStats
from .tiers import LocalTier, MemoryTier, RemoteTier

__all__ = ["SaveHandle", "Pipeline"]

log = logging.getLogger(__name__)

_live: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


def _finish_at_exit() -> None:
    """At interpreter exit, let every pipeline that was not closed finish its queued saves.

    Runs before the interpreter finalizes. Its worker is a daemon thread (it must not keep a
    process alive by itself), and a daemon thread still working when the interpreter
    finalizes is killed where it stands: inside torch code that releases the GIL (freeing a
    tensor, say) that aborts the whole process ("terminate called without an active
    exception", seen after a SIGTERM-ed Lightning run had made its save durable). Saves in
    flight are completed rather than lost; a process that must not wait calls ``os._exit``.
    Registered with ``threading``'s exit hooks where available: those run before the
    interpreter joins threads and before ``concurrent.futures`` stops accepting work, which
    the local and remote writers need.
    """
    limit = knobs.get("CKPT_EXIT_WAIT_S")
    deadline = time.monotonic() + limit if limit > 0 else None
    for pipe in list(_live):
        busy = pipe.in_flight()
        if busy:
            log.info("finishing checkpoint(s) of step(s) %s before the process exits%s", sorted(busy),
                     f" (at most {limit} s, CKPT_EXIT_WAIT_S)" if deadline is not None else "")
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not pipe.close(timeout=left):
            log.error("exiting before checkpoint(s) of step(s) %s finished persisting (CKPT_EXIT_WAIT_S=%d s "
                      "passed); they are not committed, older checkpoints are intact. Raise CKPT_EXIT_WAIT_S "
                      "(0: no limit) or wait() for saves before exiting", sorted(pipe.in_flight()), limit)


getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)


def _drop_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback (and those of its
    causes). The error lives on in the save handle and the Checkpointer until raised; its frames
    would otherwise keep views of the host buffer, and so the whole staging memory, alive after
    close(). File names and line numbers stay, so the traceback still prints."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


class SaveHandle:
    """The progress of one save, tier by tier.

    Tiers: ``"memory"`` (the snapshot is complete in host memory),
    ``"local"`` and, with a URL, ``"remote"``. ``status`` is ``"pending"``, ``"done"``, ``"failed"`` or
    ``"skipped"`` (``if_busy="skip"`` and every buffer was busy).
    """

    def __init__(self, step: int, tiers: list[str], stats: SnapshotStats) -> None:
        self.step = step
        self.tiers = list(tiers)
        self.stats = stats
        self.errors: dict[str, BaseException] = {}
        self._events = {t: threading.Event() for t in tiers}
        self._skipped = False
        self._all = threading.Event()
        self._raised: list[BaseException] = []   # errors wait() raised to its caller
        self._lock = threading.Lock()

    @property
    def status(self) -> str:
        if self._skipped:
            return "skipped"
        if self.errors:
            return "failed"
        return "done" if self._all.is_set() else "pending"

    @property
    def error(self) -> BaseException | None:
        return next(iter(self.errors.values()), None)

    def done(self, tier: str | None = None) -> bool:
        """Whether ``tier`` (every tier when ``None``) finished, successfully or not."""
        if tier is None:
            return self._all.is_set()
        return self._event(tier).is_set()

    def wait(self, tier: str | None = None, timeout: float | None = None) -> "SaveHandle":
        """Block until ``tier`` (every tier when ``None``) finished; raise its error if it failed.

        Raises ``TimeoutError`` after ``timeout`` seconds. An error raised here is not raised
        again by ``Checkpointer.wait()`` or ``close()`` (those raise the failures not yet seen).
        """
        err = self._wait_quietly(tier, timeout)
        if err is not None:
            with self._lock:
                if not any(err is e for e in self._raised):
                    self._raised.append(err)
            raise err
        return self

    def _wait_quietly(self, tier: str | None = None, timeout: float | None = None) -> BaseException | None:
        """:meth:`wait` for the library's own use: returns the error instead of raising it, and does not
        count it as shown to the user."""
        ev = self._all if tier is None else self._event(tier)
        if not ev.wait(timeout):
            raise TimeoutError(f"step {self.step}: tier {tier or 'all'} not done after {timeout} s")
        return self.errors.get(tier) if tier is not None else self.error

    def _was_raised(self, error: BaseException) -> bool:
        """Whether :meth:`wait` raised ``error`` to its caller already."""
        with self._lock:
            return any(error is e for e in self._raised)

    def _event(self, tier: str) -> threading.Event:
        if tier not in self._events:
            raise ValueError(f"unknown tier {tier!r}; this save goes to {self.tiers}")
        return self._events[tier]

    def _finish(self, tier: str, error: BaseException | None = None) -> None:
        if error is not None:
            self.errors[tier] = error
        self._events[tier].set()
        if all(e.is_set() for e in self._events.values()):
            self._all.set()

    def _fail_rest(self, error: BaseException) -> None:
        for t, ev in self._events.items():
            if not ev.is_set():
                self._finish(t, error)

    def _skip(self) -> None:
        self._skipped = True
        for t in self._events:
            self._finish(t)

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, status={self.status!r})"


class Pipeline:
    """The background persister: one worker thread; the local write and the remote upload run side by side."""

    def __init__(self, pool: HostPool, memory: MemoryTier, local: LocalTier, remote: RemoteTier | None,
                 retention: Callable[[list[str]], None],
                 on_error: Callable[[SaveHandle, BaseException], None], peer: Any = None) -> None:
        self.pool = pool
        self.memory = memory
        self.local = local
        self.remote = remote
        self.peer = peer
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="ckpt-remote") if remote is not None else None
        self._retention = retention
        self._on_error = on_error
        self._queue: queue.Queue = queue.Queue()
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-persist", daemon=True)
        self._thread.start()
        _live.add(self)

    def in_flight(self) -> set[int]:
        with self._lock:
            return set(self._in_flight)

    def submit(self, snap: Snapshot, handle: SaveHandle) -> None:
        with self._lock:
            self._in_flight.add(snap.step)
        # The memory tier does not queue behind earlier persists: a watcher publishes it as soon as
        # the copy has landed, while the worker may still be writing an older snapshot.
        staged = threading.Event()
        # Not a daemon: interpreter shutdown joins it before finalizing. It signals `staged`
        # before its frame lets go of the snapshot's tensors, and a daemon freeing the last
        # reference to a tensor while the interpreter finalizes aborts the process (see
        # _finish_at_exit: what happened to the persist worker). It ends once the copy has landed.
        threading.Thread(target=self._watch, args=(snap, handle, staged), name=f"ckpt-staged-{snap.step}",
                         daemon=False).start()
        self._queue.put((snap, handle, staged))

    def _watch(self, snap: Snapshot, handle: SaveHandle, staged: threading.Event) -> None:
        try:
            snap.wait_copied()
            if snap.error is None:
                self.memory.commit(snap.step, snap.manifest, snap.buffer)
                handle._finish("memory")
        except BaseException as e:
            snap.error = snap.error or e
        finally:
            staged.set()

    def close(self, timeout: float | None = None) -> bool:
        """Persist everything queued, then stop the worker (idempotent).

        ``timeout`` (seconds, ``None``: no limit) bounds the wait; returns False when the worker
        was still persisting when it ran out (the worker is then left to the interpreter).
        """
        if not self._closed:
            self._closed = True
            _live.discard(self)
            self._queue.put(None)
        self._thread.join(timeout)
        # the host buffers go now; one still held by a persist that outlived `timeout`, once it is released
        self.pool.close()
        if self._thread.is_alive():
            return False
        if self._uploader is not None:
            self._uploader.shutdown()
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            snap, handle, staged = job
            try:
                staged.wait()
                self._persist(snap, handle)
            finally:
                with self._lock:
                    self._in_flight.discard(snap.step)

    def _exchange(self, step: int, manifest: Any, data: Any, handle: SaveHandle) -> tuple[Any, BaseException | None]:
        """The peer tier's collective exchange for ``step`` (``manifest`` None: this rank has nothing to
        send, but still takes its part). Returns (what keeps the received copy, or None; the error)."""
        t0 = time.perf_counter()
        try:
            keep = self.peer.exchange(step, manifest, data)
        except BaseException as e:
            log.error("the peer copy exchange of step %d failed on this rank: %s", step, e)
            self._on_error(handle, e)
            return None, e
        handle.stats.persist_s["peer"] = handle.stats.persist_s["peer_transfer"] = time.perf_counter() - t0
        return keep, None

    def _confirm(self, step: int, kept: bool) -> bool:
        try:
            return self.peer.confirm(step, kept)
        except Exception as e:   # noqa: BLE001 - the group failed: this rank's copy is not known to be kept
            log.error("the peer confirmation of step %d failed: %s", step, e)
            return False

    def _keep_peer_copy(self, step: int, keep: Any, handle: SaveHandle) -> BaseException | None:
        """Verify, write and commit the copy received from the peer source (after the buffer is free)."""
        t0 = time.perf_counter()
        try:
            keep()
        except BaseException as e:
            log.error("the copy of step %d received from the peer source is not kept: %s", step, e)
            self._on_error(handle, e)
            return e
        handle.stats.persist_s["peer"] = handle.stats.persist_s.get("peer", 0.0) + time.perf_counter() - t0
        try:
            self._retention(["peer"])
        except OSError as e:
            log.warning("retention of peer copies after step %d failed: %s", step, e)
        return None

    def _persist(self, snap: Snapshot, handle: SaveHandle) -> None:
        def run(tier: str, write: Callable[[], float]) -> BaseException | None:
            try:
                handle.stats.persist_s[tier] = write()
                return None
            except BaseException as e:
                log.error("checkpoint of step %d failed on the %s tier: %s", snap.step, tier, e)
                _drop_locals(e)
                self._on_error(handle, e)
                return e

        if snap.error is not None:    # the snapshot itself is bad (torn, or the copy failed)
            snap.buffer.image_step = None
            log.error("checkpoint of step %d failed: %s", snap.step, snap.error)
            if self.remote is not None:
                self.remote.abstain(snap.step)   # on a job tier the other ranks wait for this rank's report
            if self.peer is not None:   # the peers wait for this rank's header
                keep, _ = self._exchange(snap.step, None, None, handle)
                kept = keep is not None and self._keep_peer_copy(snap.step, keep, handle) is None
                self._confirm(snap.step, kept)
            self._on_error(handle, snap.error)
            self.pool.release(snap.buffer)
            handle._fail_rest(snap.error)
            return
        data = snap.buffer.memoryview(snap.data_bytes)
        upload = None
        if self.remote is not None:   # straight from host memory, beside the local write: no second copy
            remote = self.remote
            upload = self._uploader.submit(run, "remote", lambda: remote.write(snap.step, snap.manifest, data))
        local_error = run("local", lambda: self.local.write(snap.step, snap.manifest, data))
        if upload is not None or self.peer is not None:
            handle._finish("local", local_error)   # the buffer stays busy until the upload / peer has read it
        peer_error, keep = None, None
        if self.peer is not None:   # the committed image to the peer rank, straight from the host buffer
            keep, peer_error = self._exchange(snap.step, snap.manifest if local_error is None else None, data,
                                              handle)
            peer_error = peer_error or local_error   # no local copy: none went to the peer either
        remote_error = upload.result() if upload is not None else None
        committed = [t for t, e in (("local", local_error), ("remote", remote_error))
                     if e is None and (t == "local" or upload is not None)]
        if committed:
            try:
                self._retention(committed)
            except OSError as e:   # retention trouble never fails a committed save
                log.warning("retention after step %d failed: %s", snap.step, e)
        # Drop this thread's view of the buffer before anyone can be told the save is done: a
        # waiter may exit the process at once, and the view must not be the last reference then.
        del data
        # Release before reporting the last tier: a save issued right after handle.wait() finds the buffer free.
        self.pool.release(snap.buffer)
        if upload is not None:
            handle._finish("remote", remote_error)
        if self.peer is not None:
            # the received copy is written after the buffer is free for the next save; then each rank
            # hears from its peer whether its own copy is committed there ("peer" done = durable there)
            kept = keep is not None and self._keep_peer_copy(snap.step, keep, handle) is None
            acked = self._confirm(snap.step, kept)
            if peer_error is None and not acked:
                peer_error = CheckpointError(f"step {snap.step}: rank {self.peer.dst} did not keep this rank's copy "
                                             "(its log says why)")
                self._on_error(handle, peer_error)   # raised by Checkpointer.wait() / close() like any failure
            handle._finish("peer", peer_error)
        if upload is None and self.peer is None:
            handle._finish("local", local_error)

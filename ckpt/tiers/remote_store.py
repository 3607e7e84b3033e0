"""The remote tier's side of its store: every failure of the store client as an ``OSError`` that names
what was being done and where (``ConnectionError`` for an outage, naming the endpoint; ``PermissionError``
for refused credentials; ``FileNotFoundError``), the bounded probe of reachability, what it found last
(:class:`RemoteStatus`), a request bounded like a probe, and the requests every user of a store shares:
records and ranges read with their bounds (on a mounted ``file://`` store by the operating system,
:class:`OnHost`, regular files only), fresh listings, removals (a directory ``COMMIT`` first).

The file system itself comes from :func:`ckpt.fs.resolve` (the client chosen by the URL's scheme and
``storage_options["backend"]``), each request under the watchdog of :mod:`ckpt.stall`:
:meth:`StoreClient.__init__` sets both up, for :class:`~ckpt.tiers.remote.RemoteTier` and for a client on
its own alike.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import knobs, stall
from ..commit import FsSink
from ..errors import CheckpointError
from ..format import COMMIT_NAME, fsync_dir, fsync_file, open_regular, read_record, read_record_fs
from ..fs import Store, is_local_fs
from ..stall import StallError, Watched
from .base import TierStatus
from .local import _read_range, remove_step_dir
from .remote_errors import errno_of, failure_type, unavailable

__all__ = ["RemoteStatus", "StoreClient", "OnHost", "read_file_range"]


#: what the remote tier found the last time it used its store (the tier contract's :class:`~ckpt.tiers.base.TierStatus`)
RemoteStatus = TierStatus


def read_file_range(path: str, start: int, end: int) -> bytearray:
    """Bytes ``[start, end)`` of a regular file of this host (:func:`ckpt.format.open_regular`: a FIFO or a
    device is refused, never read), fewer when it is short, into a writable buffer (a tensor can be built
    over it without another copy). Nothing beyond the file's size is allocated, whatever ``end`` says."""
    fd, st = open_regular(path)
    try:
        end = min(end, st.st_size)
        buf = bytearray(max(0, end - start))
        _read_range(fd, False, Path(path), memoryview(buf), start, len(buf))
    finally:
        os.close(fd)
    return buf


class OnHost:
    """The requests of a mounted (``file://``) store that go through the operating system rather than
    fsspec: reads with the regular-file checks of :func:`ckpt.format.open_regular` (a FIFO swapped in never
    blocks) and positioned writes. Shaped as :func:`ckpt.stall.call` runs a file system's requests (the
    path first; ``protocol`` and ``unstrip_protocol`` for its messages), so a network mount that stops
    answering fails them after ``CKPT_REMOTE_STALL_S`` seconds in each of three attempts rather than
    holding a save or a load. Every write is positioned (``pwrite`` at its offset): an attempt sent again
    writes the same bytes at the same place."""

    protocol = "file"

    @staticmethod
    def unstrip_protocol(path: str) -> str:
        return f"file://{path}"

    @staticmethod
    def create(path: str) -> None:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644))

    @staticmethod
    def write_at(path: str, data: Any, offset: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        finally:
            os.close(fd)

    @staticmethod
    def publish(path: str, final: str) -> None:
        """Flush ``path`` to stable storage, rename it to ``final`` and flush the name: a ``COMMIT`` written
        after it never reaches the disk first."""
        fsync_file(path)
        os.replace(path, final)
        fsync_dir(Path(final).parent)

    @staticmethod
    def read_range(path: str, start: int, end: int) -> bytearray:
        return read_file_range(path, start, end)

    @staticmethod
    def read_record(path: str) -> bytes:
        return read_record(path)


class StoreClient:
    """A client of one store: its requests (each under the watchdog of ``CKPT_REMOTE_STALL_S``), their
    failures as ``OSError`` s, the bounded probe and what it found (:attr:`status`). The base of
    :class:`~ckpt.tiers.remote.RemoteTier`, and on its own the client of code that writes a layout of its
    own to a store (the DCP adapter, :mod:`ckpt.integrations.dcp`): both are built by :meth:`__init__`."""

    url: str
    on_unreachable: str
    store: Store
    fs: Any  # the store's file system, every request under the watchdog (ckpt.stall.Watched)
    root: str
    status: RemoteStatus
    _probe_fs: Any  # the file system the probe uses (on S3 a client of few retries and short timeouts)
    _local_fs: bool  # a local or mounted file system (file://)

    def __init__(self, url: str, store: Store, on_unreachable: str = "raise") -> None:
        """The client of ``store``, which :func:`ckpt.fs.resolve` opened for ``url``: every request of
        ``store.fs`` under the watchdog (:class:`ckpt.stall.Watched`; the probe has its own bound).
        Nothing is sent here. ``on_unreachable``: what the owner does when the store cannot be reached,
        ``"raise"`` or ``"degrade"`` (see :class:`~ckpt.tiers.remote.RemoteTier`)."""
        if on_unreachable not in ("raise", "degrade"):
            raise ValueError(f"on_unreachable must be 'raise' or 'degrade', got {on_unreachable!r}")
        self.url, self.on_unreachable, self.store = url, on_unreachable, store
        self.fs, self.root, self._probe_fs = Watched(store.fs), store.root, store.probe_fs
        self._local_fs = is_local_fs(self.fs)
        self.status = RemoteStatus()

    def _endpoint(self) -> str:
        return self.store.endpoint

    def _url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _failure(self, e: BaseException, doing: str) -> OSError:
        """The ``OSError`` to raise for a failure ``e`` of the store client while ``doing`` something."""
        what = f"{type(e).__name__}: {e}"
        if isinstance(e, StallError):  # a request that stopped moving: it names its URL itself
            return StallError(e.errno, f"{doing}: {e.strerror}", e.filename)
        kind = failure_type(e)
        if kind is FileNotFoundError:
            return FileNotFoundError(errno.ENOENT, f"{doing}: not found ({what})")
        if kind is PermissionError:
            return PermissionError(
                errno.EACCES,
                f"{doing}: access denied ({what}); check the credentials in "
                "storage_options (key / secret / profile) and the bucket's policy",
            )
        if kind is ConnectionError:
            return ConnectionError(
                errno_of(e) or errno.EIO,
                f"{doing}: the store at {self._endpoint()} cannot be reached or is not answering "
                f"({what}); {self.store.hint}",
            )
        return OSError(errno_of(e) or errno.EIO, f"{doing}: {what}")

    @contextlib.contextmanager
    def _store(self, doing: str) -> Iterator[None]:
        """Store calls inside become ``OSError`` s naming ``doing`` (and an outage is noted in ``status``)."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            e = self.store.translate(e)  # a client failure whose type says nothing: our own check (ckpt.fs)
            failure = self._failure(e, doing)
            if unavailable(e):
                self._note(failure)
            raise failure from e

    def _note(self, failure: OSError | None) -> None:
        now, prev = time.time(), self.status
        if failure is None:
            self.status = RemoteStatus(True, None, None, now)
        else:
            since = prev.since_unix if prev.available is False and prev.since_unix is not None else now
            self.status = RemoteStatus(False, failure, since, now)

    def probe(self) -> OSError | None:
        """Check that the store answers, within ``CKPT_REMOTE_PROBE_S`` seconds (on S3 with a client of
        its own: 2 attempts, short timeouts, whatever ``storage_options`` sets for uploads).

        Returns ``None`` when it does and the failure (a ``ConnectionError`` naming the endpoint) when it
        cannot be reached or does not answer; both are recorded in :attr:`status`. Raises
        ``FileNotFoundError`` when the store answers that the bucket does not exist (a bucket is never
        created: a typo must not be), ``PermissionError`` when it refuses the credentials, and an
        ``OSError`` for any other answer that the tier cannot work with.
        """
        limit = knobs.get("CKPT_REMOTE_PROBE_S")
        outcome: list[tuple[OSError | None, BaseException | None]] = []

        def run() -> None:
            try:
                outcome.append((self._probe_once(), None))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                outcome.append(
                    (None, self.store.translate(e, probing=True) if isinstance(e, Exception) else e)
                )

        # a thread, so that a store that accepts connections and never answers cannot hold the caller
        t = threading.Thread(target=run, name="ckpt-remote-probe", daemon=True)
        t.start()
        t.join(limit)
        doing = f"the remote tier {self.url}"
        if not outcome:
            failure: OSError | None = ConnectionError(
                errno.ETIMEDOUT,
                f"{doing}: no answer within {limit} s (CKPT_REMOTE_PROBE_S) from the store at "
                f"{self._endpoint()}; {self.store.hint}",
            )
        else:
            answer, e = outcome[0]
            if answer is not None:
                raise answer
            failure = None if e is None else self._failure(e, doing)
            if e is not None and not unavailable(e):
                raise failure from e
        self._note(failure)
        return failure

    def _probe_once(self) -> OSError | None:
        """One look at the store; returns the error to raise when its answers rule this tier out."""
        fs = self._probe_fs
        if self._local_fs or "memory" in fs.protocol:
            fs.makedirs(self.root, exist_ok=True)  # directories are real here
            return None
        fs.invalidate_cache()  # ask the store, not a listing cached by the last probe
        bucket = self.root.split("/", 1)[0]
        try:
            if bucket:
                fs.info(bucket)
        except FileNotFoundError:
            return FileNotFoundError(
                errno.ENOENT,
                f"the remote tier {self.url}: bucket {bucket!r} does not exist (the store at "
                f"{self._endpoint()} says so); check the bucket name in the URL and the endpoint in storage_options "
                "(a bucket is never created: a typo must not be)",
            )
        try:
            fs.ls(self.root, detail=False)
        except FileNotFoundError:
            pass  # the bucket exists (checked above): nothing under the prefix yet, a new run
        return None

    def _still_down(self) -> OSError | None:
        """While the store is known to be down, probe it again (bounded) rather than send a request
        through the upload retry policy: the failure when it is still down, else None."""
        if self.status.available is not False:
            return None
        return self.probe()

    def _answered(self, call: Callable[[], Any]) -> Any:
        """``call()``, a request through the upload retry policy, bounded like a probe: it runs on a thread
        of its own, and while it has not returned, the store is probed every ``CKPT_REMOTE_PROBE_S``
        seconds; an outage the probe finds is raised at once (a ``ConnectionError``, recorded in
        :attr:`status`) instead of waiting out the retries, which may take minutes. A store that answers
        the probe is waited for (a long listing is not an outage). The abandoned call ends on its own."""
        limit = knobs.get("CKPT_REMOTE_PROBE_S")
        outcome: list[tuple[Any, BaseException | None]] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((call(), None))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                outcome.append((None, e))
            finally:
                done.set()

        threading.Thread(target=run, name="ckpt-remote-list", daemon=True).start()
        while not done.wait(limit):
            failure = self.probe()
            if failure is not None:
                raise failure
        value, error = outcome[0]
        if error is not None:
            raise error
        return value

    # -- requests: the remote tier's and those of code writing its own layout (the DCP adapter) -------
    def read_record(self, path: str) -> bytes:
        """The record (``COMMIT``, a manifest, metadata) at ``path``, of at most ``MAX_RECORD_BYTES``, refused
        unread otherwise (:class:`~ckpt.errors.CorruptCheckpointError`); ``FileNotFoundError`` when it is
        missing. On a mounted file system a regular file read by the operating system under the watchdog
        (:class:`OnHost`: a FIFO never blocks, a stalled mount fails in bounded time); on an object store
        :func:`ckpt.format.read_record_fs`. The store client's own failures are raised as they are (inside
        :meth:`_store`, they become ``OSError`` s naming what was being done)."""
        if self._local_fs:
            return stall.call(OnHost, "read_record", self.fs._strip_protocol(path))
        return read_record_fs(self.fs, path)

    def read_range(self, path: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of the file at ``path``, fewer when it is shorter (an object store answers a
        range with what the object holds; a mounted file system's file is read by the operating system,
        a regular file only, nothing beyond its size allocated: :func:`read_file_range`); one request under
        the watchdog. Failures as :meth:`read_record`'s."""
        if self._local_fs:
            return stall.call(OnHost, "read_range", self.fs._strip_protocol(path), start, end)
        return self.fs.cat_file(path, start=start, end=end)

    def listing(
        self, doing: str, how: str, path: str, missing: Any, fresh: str | None = None, **kw: Any
    ) -> Any:
        """``fs.<how>(path, **kw)`` (a listing: ``ls``, ``glob``, ``find``) as the store holds it now: the
        listing cached of ``fresh`` (default ``path``) is dropped first (other processes write here too);
        ``missing`` when nothing is at ``path``; a failure is an ``OSError`` naming ``doing``."""
        with self._store(doing):
            self.fs.invalidate_cache(fresh or path)
            try:
                return getattr(self.fs, how)(path, **kw)
            except FileNotFoundError:
                return missing

    def sink(self, base: str) -> FsSink:
        """Where the records of the checkpoint under ``base`` go (:mod:`ckpt.commit`): one put each, and on a
        mounted file system written atomically with their names synced (a page cache reaches the disk out of
        order)."""
        return FsSink(self.fs, base, self._local_fs)

    def remove(self, path: str) -> None:
        """Remove the file at ``path``, if there is one."""
        try:
            self.fs.rm_file(path)
        except (FileNotFoundError, NotADirectoryError):
            pass  # nothing there

    def remove_dir(self, name: str) -> bool:
        """Remove directory ``name`` (``/``-separated) of the root, its ``COMMIT`` first, so that a removal cut
        short leaves it uncommitted, never committed with files missing; whether it was there. On a mounted
        file system never through a symbolic link (:func:`~ckpt.tiers.local.remove_step_dir`: a linked
        directory raises ``OSError(ELOOP)``). The store client's failures are raised as they are."""
        if self._local_fs:
            return remove_step_dir(self.root, name)
        d = f"{self.root}/{name}"
        commit = f"{d}/{COMMIT_NAME}"
        if self.fs.exists(commit):
            self.fs.rm(commit)
        if not self.fs.exists(d):
            return False
        self.fs.rm(d, recursive=True)
        return True

    def _put(self, path: str, data: Any, sync_dir: bool = False) -> None:
        """Write one file. On a local or mounted file system (``file://``) it is also fsynced (and,
        with ``sync_dir``, its directory), so that a ``COMMIT`` never reaches the disk before the files
        it vouches for: an object store's upload is durable when it returns, a page cache's is not."""
        self.fs.pipe_file(path, data)
        if self._local_fs:
            fsync_file(path, and_dir=sync_dir)

    def _rm(self, path: str, recursive: bool = False) -> None:
        self.fs.rm(path, recursive=recursive)

"""The remote tier's side of its store: every failure of the store client as an ``OSError`` that names
what was being done and where (``ConnectionError`` for an outage, naming the endpoint; ``PermissionError``
for refused credentials; ``FileNotFoundError``), the bounded probe of reachability, what it found last
(:class:`RemoteStatus`), and a request bounded like a probe.

The file system itself comes from :func:`ckpt.fs.resolve` (the client chosen by the URL's scheme and
``storage_options["backend"]``), each request under the watchdog of :mod:`ckpt.stall`:
:class:`~ckpt.tiers.remote.RemoteTier` sets both up at construction.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from typing import Any, Callable, Iterator

from .. import knobs
from ..errors import CheckpointError
from ..format import fsync_file
from ..fs import Store, is_local_fs
from ..stall import StallError
from .base import TierStatus
from .remote_errors import errno_of, failure_type, unavailable

__all__ = ["RemoteStatus", "StoreClient"]


#: what the remote tier found the last time it used its store (the tier contract's :class:`~ckpt.tiers.base.TierStatus`)
RemoteStatus = TierStatus


class StoreClient:
    """Reaching the store, mixed into :class:`~ckpt.tiers.remote.RemoteTier`, which sets the attributes
    annotated here at construction."""

    url: str
    on_unreachable: str
    store: Store
    fs: Any  # the store's file system, every request under the watchdog (ckpt.stall.Watched)
    root: str
    status: RemoteStatus
    _probe_fs: Any  # the file system the probe uses (on S3 a client of few retries and short timeouts)
    _local_fs: bool  # a local or mounted file system (file://)

    @classmethod
    def of_store(cls, url: str, store: Store, fs: Any) -> StoreClient:
        """A client of ``store`` on its own, outside a tier (``fs``: the store's file system, under the
        watchdog): the store-side requests and their failures exactly as the remote tier has them, for
        code that writes its own layout to a store (the DCP adapter, :mod:`ckpt.integrations.dcp`).
        Nothing is probed here; ``on_unreachable`` is ``"raise"``."""
        client = cls.__new__(cls)
        client.url, client.on_unreachable, client.store = url, "raise", store
        client.fs, client.root, client._probe_fs = fs, store.root, store.probe_fs
        client._local_fs = is_local_fs(fs)
        client.status = RemoteStatus()
        return client

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

    def _put(self, path: str, data: Any, sync_dir: bool = False) -> None:
        """Write one file. On a local or mounted file system (``file://``) it is also fsynced (and,
        with ``sync_dir``, its directory), so that a ``COMMIT`` never reaches the disk before the files
        it vouches for: an object store's upload is durable when it returns, a page cache's is not."""
        self.fs.pipe_file(path, data)
        if self._local_fs:
            fsync_file(path, and_dir=sync_dir)

    def _rm(self, path: str, recursive: bool = False) -> None:
        self.fs.rm(path, recursive=recursive)

"""The remote tier: any fsspec URL (``s3://``, ``gs://``, ``hdfs://``, ``file://``, ``memory://`` ...).

Layout under the URL: the local tier's, except that a rank's data is stored as
one object per chunk (``rank-00000/part-000000`` ...), each raw or
zstd-compressed, so that uploads and downloads run as parallel independent
requests of 16 MiB with no multipart bookkeeping, any fsspec backend works
the same way, and a chunk can be verified and used as soon as it arrives.
The manifest records each part's codec and stored size; checksums are of the
decoded bytes, identical to the local tier's. ``COMMIT`` is put last, then
``latest``: a reader never sees a step without ``COMMIT``, and a failed upload
leaves the previous remote checkpoint untouched. A write that replaces a
committed copy of its step puts the new manifest and parts under a fresh
subdirectory of the step (``step-.../<generation>/``) and then a ``COMMIT``
naming it (object stores have no atomic rename: putting ``COMMIT`` is the
switch); the old copy's files are deleted only once the new ``COMMIT`` is
durable, so the step is readable, old or new, at every instant.

The filesystem is resolved once (:func:`ckpt.fs.resolve`: an fsspec file system,
pyarrow's through fsspec's ``ArrowFSWrapper`` included, chosen by the URL's
scheme and ``storage_options["backend"]``), never per file; chained URLs
(``simplecache::s3://...``) pass through. Transient failures are retried by the
backend's own machinery: for S3 the default here is the AWS "standard" retry
mode with 10 attempts (5xx answers, throttling, dropped connections, timeouts);
``storage_options={"config_kwargs": {"retries": ...}}`` overrides it. A request that stops moving
(a store or a proxy that accepted the connection and stopped reading or answering) is the library's
own to bound, whatever the backend: every request runs under a watchdog (:mod:`ckpt.stall`) that
aborts it after ``CKPT_REMOTE_STALL_S`` seconds without finishing, sends it again after a backoff,
and after three stalled attempts fails the save's (or the read's) remote copy with a ``TimeoutError``
naming the URL, the rank and the part.

Reachability is a separate, bounded question (:meth:`RemoteTier.probe`): at
construction, and before each upload or listing while the store is known to be
down, one probe of few retries and short timeouts, cut off after
``CKPT_REMOTE_PROBE_S`` seconds. A store that answers that the bucket does not
exist or that the credentials are refused is a configuration error; one that
cannot be reached is an outage, recorded in :attr:`RemoteTier.status`. Every
failure of the store client becomes an ``OSError`` that names what was being
done and where: ``ConnectionError`` for an unreachable or unavailable store
(naming the endpoint), ``PermissionError`` for refused credentials,
``FileNotFoundError`` for a missing bucket; the decision is made on exception
types and errno, never on message text.

Everything a remote manifest states about a part is checked against the part
itself before it is used: its codec must be one this library writes, its
stored size must be what the object holds (read with a bounded request), and
its decoded size must be one those bytes can decode to (:mod:`ckpt.codec`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import socket
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

from .. import knobs
from ..codec import RAW, check_codec, decode, encode, max_decoded
from ..commit import FsSink, publish, rank_record, record as record_of_job
from ..errors import (CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, IncompleteCheckpointError,
                      LayoutMismatchError)
from ..format import (COMMIT_NAME, LATEST_NAME, Commit, ItemRecord, Manifest, data_name, fsync_dir, fsync_file,
                      manifest_name, new_generation, parse_step_dir, read_record_fs, read_records, step_dir_name)
from ..fs import Store, is_local_fs, resolve
from ..integrity import checksum
from ..policy import Committed, Retention, Timeline, TimelineCopies
from ..reshard import check_layouts
from ..scatter import Scatter
from ..stall import StallError, Watched
from .base import PersistingTier, StepInfo, register
from .local import LOCK_NAME, linked, remove_step_dir

__all__ = ["RemoteTier", "RemoteStatus"]

log = logging.getLogger(__name__)

#: the codec of a part a rank did not upload: its bytes are replicated tensors that rank 0 stores
ABSENT = "absent"

# what rank 0 tells every rank of a job tier's commit (the largest wins): not committed, a COMMIT put that
# failed but may still land, committed
_NOT_COMMITTED, _MAYBE_COMMITTED, _COMMITTED = 0, 1, 2


def refuse_local_tier_dir(url: str, root: str) -> None:
    """Raise ``ValueError`` where the remote tier's directory ``root`` (of ``url``, on the local file system)
    is a local tier's: the two tiers lay out a step differently, so a remote tier there would find none of
    the local steps valid, and would write and prune its own steps beside a live owner's without its lock."""
    if os.path.lexists(os.path.join(root, LOCK_NAME)):
        raise ValueError(
            f"{url} is a local tier's directory (it holds {LOCK_NAME}, made by a Checkpointer with local_dir "
            f"{root}), whose layout is not the remote tier's: pass it as local_dir=, or to the ckpt commands as "
            "a path rather than a URL; a remote tier needs a directory of its own")


def refuse_overlap(local_dir: str | os.PathLike, url: str, fs: Any, root: str) -> None:
    """Raise ``ValueError`` where the remote tier of ``url`` (its file system ``fs`` and path ``root``: fsspec's
    ``url_to_fs``), a ``file://`` URL, and the local tier of ``local_dir`` would share
    their checkpoints: the URL is ``local_dir`` itself (through any path to it), or a step directory (or
    ``latest``) of it, or the other way round. Both tiers would then write and prune one place: the remote
    tier's ``COMMIT`` and manifest over the local ones (a good local checkpoint that no longer verifies once
    they differ, e.g. by compression), a promote writing into ``local_dir`` without its owner lock. A URL
    elsewhere in ``local_dir`` (``file://DIR/remote``) or around it (a job tier over ``ROOT/rank-N``) shares
    nothing."""
    if not is_local_fs(fs):
        return
    a, b = os.path.realpath(os.fspath(local_dir)), os.path.realpath(root)

    def part_of(inner: str, outer: str) -> bool:
        first = os.path.relpath(inner, outer).split(os.sep)[0]
        return first != ".." and (first == "." or parse_step_dir(first) is not None or first == LATEST_NAME)

    if part_of(a, b) or part_of(b, a):
        raise ValueError(f"the remote tier's url {url} is local_dir {os.fspath(local_dir)} or one of its "
                         "checkpoints (or holds it in one of its own): the two tiers would write one place; give "
                         "the remote tier a directory of its own (a url of another directory)")


# errno values of a store that cannot be reached or does not answer now (s3fs: 503 / SlowDown is EBUSY,
# 500 InternalError EREMOTEIO); a stale NFS handle on a mounted file:// URL too
_UNAVAILABLE_ERRNOS = frozenset(getattr(errno, n) for n in (
    "ECONNREFUSED", "ECONNRESET", "ECONNABORTED", "EPIPE", "ETIMEDOUT", "EHOSTUNREACH", "EHOSTDOWN",
    "ENETUNREACH", "ENETDOWN", "ENETRESET", "EBUSY", "EAGAIN", "EREMOTEIO", "ESTALE") if hasattr(errno, n))


def _client_types(*names: tuple[str, str]) -> tuple[type, ...]:
    """Exception classes of store clients that are loaded (none is imported here)."""
    found = []
    for module, name in names:
        t = getattr(sys.modules.get(module), name, None)
        if isinstance(t, type):
            found.append(t)
    return tuple(found)


def _unavailable(e: BaseException) -> bool:
    """Whether ``e`` says the store could not be reached or did not answer (an outage), rather than
    answering (missing bucket, refused credentials, a bad request)."""
    if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError, socket.gaierror, socket.herror)):
        return True
    if _http_status(e) >= 500:   # the service failing (a gateway's 502 / 504 has no S3 error code)
        return True
    if isinstance(e, OSError):
        return e.errno in _UNAVAILABLE_ERRNOS
    return isinstance(e, _client_types(
        ("botocore.exceptions", "ConnectionError"),    # EndpointConnectionError, ConnectTimeoutError ...
        ("botocore.exceptions", "HTTPClientError"),    # ConnectionClosedError, ReadTimeoutError ...
        ("aiohttp", "ClientConnectionError"), ("aiohttp", "ServerTimeoutError"),
        ("fsspec.exceptions", "FSTimeoutError")))


def _http_status(e: BaseException | None) -> int:
    """The HTTP status of the store's answer under ``e`` (0: none), from the client error's own fields:
    botocore's ``response`` (s3fs raises an ``OSError`` caused by it), aiohttp's ``status``."""
    answered = _client_types(("botocore.exceptions", "ClientError"), ("aiohttp", "ClientResponseError"))
    for _ in range(8):
        if e is None:
            break
        if answered and isinstance(e, answered):
            response = getattr(e, "response", None)
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") if isinstance(response, dict) \
                else getattr(e, "status", None)
            return status if isinstance(status, int) else 0
        e = e.__cause__ or e.__context__
    return 0


def _denied(e: BaseException) -> bool:
    return isinstance(e, PermissionError) or isinstance(e, _client_types(
        ("botocore.exceptions", "NoCredentialsError"), ("botocore.exceptions", "PartialCredentialsError")))


def _errno_of(e: BaseException) -> int | None:
    """The errno of ``e`` or of the OS error under it (a client error wrapping a refused connection)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and isinstance(e.errno, int) and e.errno > 0:
            return e.errno
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _caused_by(e: BaseException, origin: BaseException) -> bool:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if e is origin:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@dataclasses.dataclass(frozen=True)
class RemoteStatus:
    """What the remote tier found the last time it used its store.

    ``available``: ``True`` when the store last answered, ``False`` when it could not be reached or
    did not answer (connections refused or dropped, timeouts, 5xx answers), ``None`` before any check.
    ``error``: that failure, an ``OSError`` naming the endpoint. ``since_unix``: when the store was
    first found unavailable in this outage; ``checked_unix``: the last check.
    """

    available: bool | None = None
    error: OSError | None = None
    since_unix: float | None = None
    checked_unix: float | None = None


@register
class RemoteTier(PersistingTier, TimelineCopies):
    """Committed checkpoints under an fsspec URL.

    ``on_unreachable``: what construction does when the store cannot be reached (the bounded probe,
    :meth:`probe`, fails with an outage rather than an answer). ``"raise"`` (default: command-line
    tools) raises the ``ConnectionError``; ``"degrade"`` (what :class:`~ckpt.Checkpointer` uses, so a
    job resumes from its nearer tiers) logs a warning and starts with ``status.available`` False:
    while the store stays down, listings are empty (logged), and each write probes first and fails at
    once with a ``ConnectionError`` naming the endpoint; once a probe succeeds, writes upload again.
    A missing bucket or refused credentials raise at construction in either mode.
    """

    name = "remote"
    nearness = 30
    on_node = False
    reshards = True   # a job tier's checkpoint loads into another world size, mesh or placements

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, rank: int = 0,
                 world_size: int = 1, compression: str | None = None, on_unreachable: str = "raise") -> None:
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        if on_unreachable not in ("raise", "degrade"):
            raise ValueError(f"on_unreachable must be 'raise' or 'degrade', got {on_unreachable!r}")
        self.url = url
        self.rank = rank
        self.world_size = world_size
        self.compression = compression
        self.on_unreachable = on_unreachable
        self.job: Any = None   # a Ranks over a group of its own once every rank writes here (join_job)
        # steps this process committed here itself (True) or saw fail verification (False): see LocalTier
        self.verified: dict[int, bool] = {}
        self.timeline = Timeline()   # what a fresh upload's COMMIT records (the Checkpointer sets it)
        self._copying: dict[int, Timeline] = {}
        self._options = dict(storage_options or {})
        self.store: Store = resolve(url, self._options)   # the client (backend) serving the URL: ckpt.fs
        # every request under the watchdog of CKPT_REMOTE_STALL_S (ckpt.stall); the probe has its own bound
        self.fs, self.root, self._probe_fs = Watched(self.store.fs), self.store.root, self.store.probe_fs
        self._local_fs = is_local_fs(self.fs)
        if self._local_fs:
            refuse_local_tier_dir(url, self.root)
        self.status = RemoteStatus()
        failure = self.probe()   # raises when the store answers that this tier cannot work
        if failure is not None:
            if on_unreachable == "raise":
                raise failure
            log.warning("%s. Going on without the remote tier for now: restore uses the nearer tiers, and every "
                        "save still tries to upload (handle.wait('remote') raises while the store is down; "
                        "RemoteTier.status says what was found)", failure)

    # -- reaching the store -----------------------------------------------------------------------
    def _endpoint(self) -> str:
        return self.store.endpoint

    def _url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _failure(self, e: BaseException, doing: str) -> OSError:
        """The ``OSError`` to raise for a failure ``e`` of the store client while ``doing`` something."""
        what = f"{type(e).__name__}: {e}"
        if isinstance(e, StallError):   # a request that stopped moving: it names its URL itself
            return StallError(e.errno, f"{doing}: {e.strerror}", e.filename)
        if isinstance(e, FileNotFoundError):
            return FileNotFoundError(errno.ENOENT, f"{doing}: not found ({what})")
        if _denied(e):
            return PermissionError(errno.EACCES, f"{doing}: access denied ({what}); check the credentials in "
                                   "storage_options (key / secret / profile) and the bucket's policy")
        if _unavailable(e):
            return ConnectionError(_errno_of(e) or errno.EIO,
                                   f"{doing}: the store at {self._endpoint()} cannot be reached or is not answering "
                                   f"({what}); {self.store.hint}")
        return OSError(_errno_of(e) or errno.EIO, f"{doing}: {what}")

    @contextlib.contextmanager
    def _store(self, doing: str) -> Iterator[None]:
        """Store calls inside become ``OSError`` s naming ``doing`` (and an outage is noted in ``status``)."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            e = self.store.translate(e)   # a client failure whose type says nothing: our own check (ckpt.fs)
            failure = self._failure(e, doing)
            if _unavailable(e):
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
            except BaseException as e:   # noqa: BLE001 - handed to the caller's thread
                outcome.append((None, self.store.translate(e, probing=True) if isinstance(e, Exception) else e))

        # a thread, so that a store that accepts connections and never answers cannot hold the caller
        t = threading.Thread(target=run, name="ckpt-remote-probe", daemon=True)
        t.start()
        t.join(limit)
        doing = f"the remote tier {self.url}"
        if not outcome:
            failure: OSError | None = ConnectionError(
                errno.ETIMEDOUT, f"{doing}: no answer within {limit} s (CKPT_REMOTE_PROBE_S) from the store at "
                f"{self._endpoint()}; {self.store.hint}")
        else:
            answer, e = outcome[0]
            if answer is not None:
                raise answer
            failure = None if e is None else self._failure(e, doing)
            if e is not None and not _unavailable(e):
                raise failure from e
        self._note(failure)
        return failure

    def _probe_once(self) -> OSError | None:
        """One look at the store; returns the error to raise when its answers rule this tier out."""
        fs = self._probe_fs
        if self._local_fs or "memory" in fs.protocol:
            fs.makedirs(self.root, exist_ok=True)   # directories are real here
            return None
        fs.invalidate_cache()                       # ask the store, not a listing cached by the last probe
        bucket = self.root.split("/", 1)[0]
        try:
            if bucket:
                fs.info(bucket)
        except FileNotFoundError:
            return FileNotFoundError(
                errno.ENOENT, f"the remote tier {self.url}: bucket {bucket!r} does not exist (the store at "
                f"{self._endpoint()} says so); check the bucket name in the URL and the endpoint in storage_options "
                "(a bucket is never created: a typo must not be)")
        try:
            fs.ls(self.root, detail=False)
        except FileNotFoundError:
            pass   # the bucket exists (checked above): nothing under the prefix yet, a new run
        return None

    def _still_down(self) -> OSError | None:
        """While the store is known to be down, probe it again (bounded) rather than send a request
        through the upload retry policy: the failure when it is still down, else None."""
        if self.status.available is not False:
            return None
        return self.probe()

    def _put(self, path: str, data: Any, sync_dir: bool = False) -> None:
        """Write one file. On a local or mounted file system (``file://``) it is also fsynced (and,
        with ``sync_dir``, its directory), so that a ``COMMIT`` never reaches the disk before the files
        it vouches for: an object store's upload is durable when it returns, a page cache's is not."""
        self.fs.pipe_file(path, data)
        if self._local_fs:
            fsync_file(path, and_dir=sync_dir)

    def join_job(self, ranks: Any) -> None:
        """Make this the job tier: every rank of the job writes its files into one step directory
        here and rank 0 commits the step once all have. ``ranks``: a :class:`~ckpt.ranks.Ranks` over a
        gloo group used only by this tier's uploads (they run on the upload thread)."""
        self.job = ranks
        self.rank, self.world_size = ranks.rank, ranks.world

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_dir(self, step: int) -> str:
        return self._path(step_dir_name(step))

    def _part(self, step: int, i: int, rank: int | None = None, generation: str | None = None) -> str:
        base = self.step_dir(step) if generation is None else f"{self.step_dir(step)}/{generation}"
        return f"{base}/rank-{self.rank if rank is None else rank:05d}/part-{i:06d}"

    # -- listing ----------------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps with a ``COMMIT`` here, newest first (not yet verified).

        When the store cannot be reached: with ``on_unreachable="degrade"`` none (logged; ``status``
        says why), so that a restore goes on with the nearer tiers; else the ``ConnectionError``. That is
        known within a bounded probe, also when the store went down since it last answered
        (:meth:`_answered`): the first ``save()`` lists every tier on the training thread.
        """
        doing = f"listing the checkpoints of the remote tier {self.url}"
        failure = self._still_down()
        if failure is None:
            try:
                found = self._answered(lambda: self._commit_paths(doing))
            except ConnectionError as e:
                failure = e
            else:
                self._note(None)
                steps = {parse_step_dir(p.rstrip("/").split("/")[-2]) for p in found}
                return sorted((s for s in steps if s is not None), reverse=True)
        if self.on_unreachable == "raise":
            raise failure
        log.warning("%s; its checkpoints are left out until it answers again", failure)
        return []

    def _commit_paths(self, doing: str) -> list[str]:
        """The paths of the step directories' ``COMMIT`` files (a key prefix named ``COMMIT`` commits nothing)."""
        with self._store(doing):
            self.fs.invalidate_cache(self.root)   # other processes write here too: never trust a cached listing
            try:
                found = self.fs.glob(self._path("step-*", COMMIT_NAME), detail=True)
            except FileNotFoundError:
                return []
        return [p for p, info in found.items() if info.get("type") != "directory"]

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
            except BaseException as e:   # noqa: BLE001 - handed to the caller's thread
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

    def committed(self) -> list[Committed]:
        """Every committed step here with its timeline (its ``COMMIT``s are read in parallel) and whether
        it is linked in. A ``COMMIT`` gone since the listing (retention elsewhere) leaves its step out; one
        that fails its checks lists timeline 0 (a restore then finds it broken); one the store fails to
        give lists timeline 0 with ``known=False``, so that retention deletes nothing meanwhile."""
        def one(step: int) -> Committed | None:
            where = f"{self.step_dir(step)}/{COMMIT_NAME}"
            try:
                tl = Timeline.of(Commit.from_bytes(self._get(step, COMMIT_NAME), where))
            except FileNotFoundError:
                return None
            except CheckpointError:
                tl = Timeline()
            except OSError as e:
                log.warning("%s could not be read (%s: %s): its timeline is not known", where, type(e).__name__, e)
                return Committed(step, Timeline(), not self.owns(step), known=False)
            return Committed(step, tl, not self.owns(step))

        steps = self.committed_steps()
        if len(steps) <= 1:
            found = [one(s) for s in steps]
        else:
            with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix="ckpt-list") as ex:
                found = list(ex.map(one, steps))
        return [c for c in found if c is not None]

    def owns(self, step: int) -> bool:
        """Whether this tier may delete ``step``: on a ``file://`` URL, not a linked step
        (:func:`~ckpt.tiers.local.linked`); an object store has no links."""
        return not (self._local_fs and linked(self.root, step_dir_name(step)))

    def describe(self, step: int, timeline: Timeline | None = None) -> StepInfo:
        """The step's URL and, from its ``COMMIT`` (one read), the bytes of every rank's data, the commit
        time and the world size."""
        url = self._url(self.step_dir(step))
        try:
            c = self.read_commit(step)
        except (CheckpointError, OSError):
            return StepInfo(url)
        return StepInfo(url, sum(c.data.values()), c.created_unix, c.world_size)

    def location(self) -> str:
        return self.url

    def keep_of(self, keep: Retention) -> int | None:
        return keep.remote

    def prunes_here(self) -> bool:
        """A job tier is pruned by rank 0 alone, after it committed (every rank is past older steps)."""
        return self.job is None or self.job.rank == 0

    def manifest_of(self, step: int, timeline: Timeline | None = None) -> Manifest:
        """This rank's validated manifest of ``step`` (:meth:`open`)."""
        return self.open(step)[1]

    def check(self, step: int, timeline: Timeline | None = None) -> None:
        """The commit record and every saved rank's manifest, validated and agreeing."""
        self.read_manifests(step, self.read_commit(step))

    def restore_into(self, state: dict, step: int, timeline: Timeline | None, strict: bool,
                     job: list[int] | None, refill: Any = None) -> int:
        """Load ``step`` into ``state``: this rank's own file when it was saved in the live layout and
        holds all its tensors (writing it to ``refill``, the local tier, on the way, so that the next
        restore is local), else through the loader that reads every saved rank's file (resharding, and
        replicated tensors from rank 0's files). See :meth:`Tier.restore_into`."""
        from ..loading import bind_checked, check_job, finish
        from ..reshard import load_resharded

        rank, world = job if job is not None else (0, 1)
        commit = self.read_commit(step)
        if commit.world_size == self.world_size:   # laid out for this tier's place: this rank's own file
            commit, manifest = self.open(step)
            check_job(manifest, job, self.name, step)
            try:
                # a rank whose replicated tensors rank 0 stored takes the loader that reads other ranks' files
                binding = None if ABSENT in manifest.codecs else bind_checked(
                    state, manifest.tree, manifest.items, strict, f"{self.step_dir(step)}/{manifest_name(manifest.rank)}")
            except LayoutMismatchError:
                if commit.world_size == 1:
                    raise   # one rank's file: nothing to reshard from
                binding = None   # same world size, another mesh or placements
            if binding is not None:
                if refill is not None:
                    with refill.copying(step, Timeline.of(commit)):   # the local copy keeps the checkpoint's timeline
                        self.load(step, manifest, binding.dest, refill=refill)
                else:
                    self.load(step, manifest, binding.dest)
                finish(binding)
                return manifest.data_bytes
        manifests = self.read_manifests(step, commit)
        own = rank if rank < commit.world_size else 0
        t0 = time.perf_counter()
        binding = bind_checked(state, manifests[own].tree, manifests[own].items, strict,
                               f"{self.step_dir(step)}/{manifest_name(own)}", reshard=True)
        nbytes = load_resharded(manifests, own, binding.dest, binding.boxes,
                                lambda r, m, i: self.fetch(step, r, m, i))
        finish(binding)
        log.info("resharded step %d saved by %d rank(s) into rank %d of %d (%.3f GB fetched in %.2f s)", step,
                 commit.world_size, rank, world, nbytes / 1e9, time.perf_counter() - t0)
        return nbytes

    def all_step_dirs(self) -> list[int]:
        with self._store(f"listing the remote tier {self.url}"):
            self.fs.invalidate_cache(self.root)
            try:
                names = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return [s for s in (parse_step_dir(n.rstrip("/").split("/")[-1]) for n in names) if s is not None]

    # -- write ------------------------------------------------------------------------------------
    def write(self, step: int, manifest: Manifest, data: memoryview,
              elem_size: Callable[[int], int] | None = None, *, source: str | None = None,
              move_latest: bool = True) -> float:
        """Upload ``data`` chunk by chunk (in parallel), then the manifest, then ``COMMIT``; seconds spent.

        A committed copy of ``step`` already here is replaced only by a complete new one (see the module
        docstring); a failure leaves it as it was. ``source``: the file ``data`` was read from, whose
        checksums ``manifest.chunks`` are: every chunk is checked against them before it is uploaded,
        and a mismatch raises :class:`~ckpt.errors.CorruptCheckpointError` naming that file.
        ``move_latest=False`` leaves ``latest`` where it is.

        On a job tier (:meth:`join_job`) this is collective over the job's ranks, on the upload
        thread: each rank uploads its own files, then all report (a gather of manifest checksums)
        and rank 0 writes ``COMMIT`` for the step when every rank's upload succeeded.
        """
        t0 = time.perf_counter()
        if self.job is None:
            self._write_files(step, manifest, data, elem_size, commit=True, source=source, move_latest=move_latest)
            return time.perf_counter() - t0
        try:
            # Every rank reads the same COMMIT before any rank reports (rank 0 changes it only after all
            # have), so every rank derives the same generation for a replacement without talking.
            replaced = self._replaced(step)
            gen = _generation_after(replaced) if replaced is not None else None
            raw = self._write_files(step, manifest, data, elem_size, commit=False, source=source, generation=gen)
        except BaseException:
            self.abstain(step)   # the other ranks still wait for this rank's report
            raise
        self._commit_job(step, raw, manifest.data_bytes, gen, replaced)
        return time.perf_counter() - t0

    def abstain(self, step: int) -> None:
        """On a job tier: report that this rank has nothing to upload for ``step`` (its snapshot failed),
        so the other ranks' uploads of it are not committed and no rank waits for this one."""
        if self.job is not None:
            try:
                self._commit_job(step, None)
            except CheckpointError:
                pass   # expected: the step is not committed, and this rank's own error is the one reported
            except Exception as e:   # noqa: BLE001 - the group failed (a rank died): keep the original error
                log.error("rank %d could not report step %d to the job tier's commit: %s", self.rank, step, e)

    def _commit_job(self, step: int, raw: bytes | None, data_bytes: int = 0, gen: str | None = None,
                    replaced: Commit | None = None) -> None:
        """The job tier's commit: every rank reports (ok, manifest checksum, data size, step, generation);
        rank 0 writes ``COMMIT`` listing every rank's files if all are ok and agree on the step and the
        generation (a replacement's subdirectory), then tells the others whether it did. Raises
        :class:`~ckpt.errors.CheckpointError` when the step is not committed: the copy committed before,
        if any, is then untouched."""
        job = self.job
        ok = raw is not None
        committed = _NOT_COMMITTED
        mine = [int(ok), Commit.manifest_checksum(raw) if ok else 0, data_bytes, step,
                zlib.crc32(gen.encode()) if gen is not None else 0]
        try:
            reports = job.gather(mine)
        except RuntimeError as e:   # gloo: a rank died or timed out (CKPT_COMMIT_TIMEOUT_S)
            if raw is not None:
                self._discard_own(step, gen)
            raise CheckpointError(
                f"step {step} is not committed to the job tier {self.url}: not every rank reported its upload "
                f"(a rank may have died; gloo says: {e}); the previous checkpoint there is untouched") from e
        failed = [r for r, rep in enumerate(reports) if rep[0] != 1]
        why = ""
        steps = sorted({rep[3] for rep in reports})
        if len(steps) > 1:   # saves paired up across ranks in order: a rank saved steps the others did not
            failed, why = [], (f"the ranks uploaded different steps ({steps}): with one url for all ranks every "
                                "rank must save the same steps (call save / maybe_save on every rank)")
            log.error("%s", why)
        elif not failed and len({rep[4] for rep in reports}) > 1:
            why = (f"the ranks disagree whether step {step} was committed there before (it changed while they "
                   "uploaded: retention or another writer)")
            log.error("%s", why)
        if job.rank == 0 and not failed and not why:
            d = self.step_dir(step)
            sent: list[bool] = []
            try:
                commit = record_of_job(step, job.world,
                                       {manifest_name(r): rep[1] for r, rep in enumerate(reports)},
                                       {data_name(r): rep[2] for r, rep in enumerate(reports)},
                                       self._copying.get(step, self.timeline), gen)
                sink = FsSink(self.fs, d, self._local_fs)
                # every rank's manifest is durable already (each put it before reporting): COMMIT alone
                publish(sink, [], commit.to_bytes(), put_commit=self._commit_put(sink, step, commit, gen, sent))
                self.verified[step] = True   # every rank uploaded its parts from its own bytes
                committed = _COMMITTED
            except Exception as e:   # noqa: BLE001 - reported to every rank below
                # a COMMIT put that was sent may still land (see _undo): no rank may remove its files then
                committed = _MAYBE_COMMITTED if sent else _NOT_COMMITTED
                why = f"rank 0 could not write {d}/{COMMIT_NAME} ({type(e).__name__}: {e})"
                log.error("%s", why)
        committed = job.max([committed])[0]
        if committed == _COMMITTED:
            if job.rank == 0:
                self._after_commit(step, replaced, move_latest=True)
            return
        if committed == _MAYBE_COMMITTED:
            log.warning("step %d may still commit to the job tier %s (rank 0's COMMIT put failed, and such a put "
                        "can land later): rank %d keeps its files", step, self.url, self.rank)
            raise CheckpointError(f"step {step} is not known to be committed to the job tier {self.url}: rank 0's "
                                  "COMMIT put failed (its log says why) and may still land; the files of every rank "
                                  "are kept for it, and the previous checkpoint there is untouched until it does")
        if raw is not None:
            self._discard_own(step, gen)
        if failed:
            why = f"rank(s) {failed} could not upload their files (their logs say why)"
        elif not why:
            why = "rank 0 could not write COMMIT (its log says why)"
        raise CheckpointError(f"step {step} is not committed to the job tier {self.url}: {why}; "
                              "the previous checkpoint there is untouched")

    def _discard_own(self, step: int, gen: str | None) -> None:
        """Remove this rank's files of a job-tier write that was not committed: its files in the
        replacement's subdirectory, or (no copy was committed before) its files of the step."""
        if gen is None:
            self._remove_own(step)
            return
        base = f"{self.step_dir(step)}/{gen}"
        try:
            for path, recursive in ((f"{base}/{manifest_name(self.rank)}", False), (f"{base}/rank-{self.rank:05d}", True)):
                if self.fs.exists(path):
                    self._rm(path, recursive=recursive)
        except Exception as e:   # noqa: BLE001 - leftovers go with the step
            log.warning("could not remove rank %d's files of step %d from %s: %s", self.rank, step, self.url, e)

    def _held_by_rank0(self, manifest: Manifest) -> set[int]:
        """On a job tier, rank > 0: the chunks holding no byte of a tensor that is not replicated
        (``Manifest.replicated``); rank 0 uploads those tensors for every rank."""
        if self.job is None or self.rank == 0 or not manifest.replicated:
            return set()
        c, n = manifest.chunk_bytes, -(-manifest.data_bytes // manifest.chunk_bytes)
        shared = set(manifest.replicated)
        needed: set[int] = set()
        for i, it in enumerate(manifest.items):
            if i not in shared and it.alias_of is None and it.nbytes:
                needed.update(range(it.offset // c, (it.offset + it.nbytes - 1) // c + 1))
        return set(range(n)) - needed

    def _remove_own(self, step: int) -> None:
        """Remove this rank's files of ``step`` (and, on rank 0, its ``COMMIT`` first)."""
        d = self.step_dir(step)
        if not self.owns(step):   # a linked step: nothing in it is this rank's to remove
            log.warning("%s is a symbolic link; rank %d's files of step %d there are left alone", d, self.rank, step)
            return
        self.verified.pop(step, None)
        try:
            if self.rank == 0 and self.fs.exists(f"{d}/{COMMIT_NAME}"):
                self.fs.rm(f"{d}/{COMMIT_NAME}")
            for path, recursive in ((f"{d}/{manifest_name(self.rank)}", False), (f"{d}/rank-{self.rank:05d}", True)):
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=recursive)
        except Exception as e:   # noqa: BLE001 - retention removes leftovers later
            log.warning("could not remove rank %d's files of step %d from %s: %s", self.rank, step, self.url, e)

    def _write_files(self, step: int, manifest: Manifest, data: memoryview,
                     elem_size: Callable[[int], int] | None, commit: bool, source: str | None = None,
                     move_latest: bool = True, generation: str | None = None) -> bytes:
        """Upload this rank's parts and manifest (and with ``commit``, ``COMMIT`` and ``latest``);
        returns the manifest's bytes. A failure removes what this write uploaded (unless the store cannot
        be reached, or its ``COMMIT`` put was sent and may still land, see :meth:`_undo`: retention removes
        the leftovers once a newer step commits) and raises an ``OSError``;
        a committed copy it was to replace stays as it was. On a job tier the caller passes the
        ``generation`` that every rank writes into when the step is committed there already."""
        doing = f"uploading step {step} to {self.url}"
        down = self._still_down()
        if down is not None:   # the store is still down: fail this save now, the next one tries again
            raise ConnectionError(down.errno, f"{doing}: not attempted, {down.strerror}; the previous remote "
                                  "checkpoint is untouched")
        if not self.owns(step):
            raise OSError(errno.ELOOP, "the step directory is a symbolic link (a checkpoint kept elsewhere, "
                          "read-only): a save never writes through it", self.step_dir(step))
        try:
            with self._store(doing):
                raw = self._upload(step, manifest, data, elem_size, commit, source, move_latest, generation)
        except BaseException as e:
            if isinstance(e, (ConnectionError, StallError)):
                log.warning("step %d: a partial upload may stay in %s while the store cannot be reached or stalls; "
                            "retention removes it once a newer step is committed there", step, self.url)
            if isinstance(e, OSError):
                raise type(e)(e.errno, f"{e.strerror}; the previous remote checkpoint is untouched",
                              e.filename) from e
            raise
        self._note(None)
        return raw

    def _upload(self, step: int, manifest: Manifest, data: memoryview, elem_size: Callable[[int], int] | None,
                commit: bool, source: str | None, move_latest: bool, generation: str | None) -> bytes:
        c, n = manifest.chunk_bytes, -(-manifest.data_bytes // manifest.chunk_bytes)
        sizer = elem_size or _dominant_elem_size(manifest.items, c)
        d = self.step_dir(step)
        replaced = self._replaced(step) if self.job is None else None
        gen = generation if self.job is not None else new_generation() if replaced is not None else None
        base = d if gen is None else f"{d}/{gen}"   # a committed copy is here: write beside it
        sent: list[bool] = []   # the COMMIT put was sent: from then on it may land, whatever the put says
        try:
            if self.job is not None and gen is None:
                self._remove_own(step)               # the other ranks' files of this step are theirs
            self.fs.makedirs(f"{base}/rank-{self.rank:05d}", exist_ok=True)   # file:// needs it

            absent = self._held_by_rank0(manifest)

            def put(i: int) -> tuple[int, str, int]:
                view = data[i * c:(i + 1) * c]
                crc = checksum(view)
                if source is not None and crc != manifest.chunks[i]:
                    raise CorruptCheckpointError(
                        f"{source}: bytes [{i * c}, {i * c + len(view)}) fail their {manifest.checksum_algorithm} "
                        f"checksum; nothing of step {step} at {self.url} was replaced")
                if i in absent:   # only replicated bytes: rank 0 uploads them
                    return crc, ABSENT, 0
                stored, codec = encode(view, self.compression, sizer(i))
                path = self._part(step, i, generation=gen)
                try:
                    # Object-store clients want bytes; local and mounted file systems take the view as it is.
                    self._put(path, stored if self._local_fs else bytes(stored))
                except StallError as e:
                    raise StallError(e.errno, f"rank {self.rank}'s part {i} of step {step} ({self._url(path)}): "
                                     f"{e.strerror}", e.filename) from None
                return crc, codec, len(stored)

            parts = _map_all(put, n, "ckpt-upload")
            remote = dataclasses.replace(manifest, rank=self.rank, world_size=self.world_size,
                                         chunks=[p[0] for p in parts], codecs=[p[1] for p in parts],
                                         stored_sizes=[p[2] for p in parts], generation=gen)
            if manifest.chunks and manifest.chunks != remote.chunks:
                raise CorruptCheckpointError(f"step {step}: bytes changed while uploading (checksums differ)")
            raw = remote.to_bytes()
            if self._local_fs:
                fsync_dir(f"{base}/rank-{self.rank:05d}")   # the parts' names, before anything vouches for them
            record = rank_record(step, self.rank, self.world_size, raw, manifest.data_bytes,
                                 self._copying.get(step, self.timeline), gen) if commit else None
            sink = FsSink(self.fs, base, self._local_fs)
            # the checkpoint exists from the COMMIT put on (a replacement: from the switch to its generation)
            publish(sink, [(manifest_name(self.rank), raw)], record.to_bytes() if record is not None else None,
                    put_commit=self._commit_put(sink, step, record, gen, sent))
            if commit:
                self.verified[step] = True
        except BaseException as e:
            if isinstance(e, StallError):   # removing the files would stall the same way: retention does it later
                log.warning("the partial upload of step %d stays in %s (the store stalled): retention removes it "
                            "once a newer step is committed there", step, self.url)
            else:
                self._undo(step, gen, maybe_committed=bool(sent))
            raise
        if commit:
            self._after_commit(step, replaced, move_latest)
        return raw

    def _commit_put(self, sink: FsSink, step: int, record: Commit | None, gen: str | None,
                    sent: list[bool]) -> Callable[[bytes], None]:
        """What puts a step's ``COMMIT`` (``record``'s bytes): straight into the step directory, or, for a
        replacement (``gen``), the switch to its generation. ``sent`` gets an entry before the request
        goes out: from then on the put may land even if it fails here, and no file it names may go."""
        def put(raw_commit: bytes) -> None:
            sent.append(True)
            if gen is None:
                sink.put(COMMIT_NAME, raw_commit)
            else:
                self._switch(step, record)
        return put

    def _replaced(self, step: int) -> Commit | None:
        """The record of the committed copy of ``step`` a write would replace (``None``: none is here).
        Outside a job tier, refuses to replace a step that a job committed (the other ranks' files)."""
        where = f"{self.step_dir(step)}/{COMMIT_NAME}"
        try:
            raw = read_record_fs(self.fs, where)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:   # not a file, or too large to be a record: write beside it
            raw = b""
        except OSError as e:
            raise OSError(e.errno, f"uploading step {step} to {self.url} failed: its COMMIT could not be read ({e}); "
                          "the previous remote checkpoint is untouched; check storage_options and the store") from e
        try:
            old = Commit.from_bytes(raw, where)
        except CorruptCheckpointError:   # unreadable: not a usable copy, but write beside it all the same
            return Commit(step=step, world_size=self.world_size, manifests={}, data={}, created_unix=0.0,
                          generation=None)
        if self.job is None and old.world_size != self.world_size:
            raise IncompatibleCheckpointError(
                f"{where}: step {step} there was saved by {old.world_size} rank(s) (world size {old.world_size}); "
                f"replacing it with a copy of world size {self.world_size} would drop the other ranks' files: "
                "write to another url, or delete that step there first")
        return old

    def _switch(self, step: int, record: Commit) -> None:
        """Put ``COMMIT`` over the committed one, atomically (an object store's put; on a file system a
        rename of a synced temporary file). A put that raised but landed all the same (a timeout after
        the store took it) counts as done."""
        d = self.step_dir(step)
        path = f"{d}/{COMMIT_NAME}"
        try:
            if self._local_fs:
                tmp = f"{d}/.{COMMIT_NAME}.{record.generation}"
                self._put(tmp, record.to_bytes())
                fsync_dir(d)   # the new copy's directory name, before the record that names it
                os.replace(tmp, path)
                fsync_dir(d)
            else:
                self.fs.pipe_file(path, record.to_bytes())
        except Exception:
            if not self._names(step, record.generation):
                raise

    def _names(self, step: int, generation: str | None) -> bool:
        """Whether the step's ``COMMIT`` can be read and names ``generation``."""
        where = f"{self.step_dir(step)}/{COMMIT_NAME}"
        try:
            return Commit.from_bytes(read_record_fs(self.fs, where), where).generation == generation
        except Exception:   # noqa: BLE001 - missing, torn or unreachable: it does not (as far as we know)
            return False

    def _undo(self, step: int, gen: str | None, maybe_committed: bool) -> None:
        """Remove what a failed write uploaded, never a committed copy. With ``maybe_committed`` (the
        ``COMMIT`` put was sent and failed) nothing is removed: a put that its client gave up on may still
        land (an object store can apply a request after the client's timeout, and a retry may be
        answered after the first attempt landed), and a ``COMMIT`` read now that does not name this
        write's files says nothing about one that lands later, which would vouch for deleted files (a
        replacement's: switch a committed step to them). Its files stay: retention removes them once a
        newer step commits if no ``COMMIT`` came to name them (a replacement's: when the step goes)."""
        d = self.step_dir(step)
        commit = f"{d}/{COMMIT_NAME}"
        if maybe_committed:
            log.warning("the failed write of step %d to %s may still commit (its COMMIT put failed, and such a put "
                        "can land later): its files are kept", step, self.url)
            return
        try:
            if self.job is not None:
                self._discard_own(step, gen)
            elif gen is not None:
                self._rm(f"{d}/{gen}", recursive=True)   # this write's files only: the committed copy stays
            elif not self.fs.exists(commit):
                self._rm(d, recursive=True)              # a fresh step: nothing was committed there
        except Exception as cleanup:   # noqa: BLE001 - the upload error is the one to report
            log.warning("could not remove the partial upload of step %d from %s: %s", step, self.url, cleanup)

    def _after_commit(self, step: int, replaced: Commit | None, move_latest: bool) -> None:
        """After a commit: move ``latest``, and delete the files of the copy it replaced. Failures here are
        logged: the new copy is committed, and leftovers go with the step when it is deleted."""
        d = self.step_dir(step)
        try:
            if move_latest:
                self._put(self._path(LATEST_NAME), (step_dir_name(step) + "\n").encode(), sync_dir=True)
        except Exception as e:   # noqa: BLE001
            log.warning("step %d is committed to %s, but %s could not be updated: %s", step, self.url, LATEST_NAME, e)
        if replaced is None:
            return
        if replaced.generation is not None:
            old = [(f"{d}/{replaced.generation}", True)]
        else:
            old = [(f"{d}/{manifest_name(r)}", False) for r in range(replaced.world_size)] + \
                  [(f"{d}/rank-{r:05d}", True) for r in range(replaced.world_size)]
        for path, recursive in old:
            try:
                if self.fs.exists(path):
                    self._rm(path, recursive=recursive)
            except Exception as e:   # noqa: BLE001
                log.warning("could not delete %s (the copy of step %d that a new one replaced): %s", path, step, e)

    def _rm(self, path: str, recursive: bool = False) -> None:
        self.fs.rm(path, recursive=recursive)

    def delete(self, step: int, missing_ok: bool = False) -> None:
        """Remove a checkpoint, ``COMMIT`` first. On a ``file://`` URL never through a symbolic link
        (:func:`~ckpt.tiers.local.remove_step_dir`: a linked step raises ``OSError(ELOOP)``)."""
        with self._store(f"removing step {step} from {self.url}"):
            found = self._delete(step)
        if not found and not missing_ok:
            raise FileNotFoundError(errno.ENOENT, f"step {step} is not on the remote tier",
                                    self._url(self.step_dir(step)))

    def _delete(self, step: int) -> bool:
        """Remove ``step`` (``COMMIT`` first); whether it was there."""
        d = self.step_dir(step)
        self.verified.pop(step, None)
        if self._local_fs:
            return remove_step_dir(self.root, step_dir_name(step))
        commit = f"{d}/{COMMIT_NAME}"
        if self.fs.exists(commit):
            self.fs.rm(commit)
        if not self.fs.exists(d):
            return False
        self.fs.rm(d, recursive=True)
        return True

    # -- read -------------------------------------------------------------------------------------
    def _get(self, step: int, name: str) -> bytes:
        where = f"{self.step_dir(step)}/{name}"
        doing = f"reading {self._url(where)}"
        down = self._still_down()
        if down is not None:
            raise ConnectionError(down.errno, f"{doing}: not attempted, {down.strerror}")
        try:
            with self._store(doing):
                return read_record_fs(self.fs, where)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{where}: missing") from None

    def copy_id(self, step: int) -> str | None:
        """What tells this copy of ``step`` from another (a digest of its ``COMMIT``, which names its
        generation and every manifest's checksum), or ``None`` when the step is not committed here now.
        A restore compares it before and after a failed read: a copy that another process's retention
        removed or a re-save replaced meanwhile (a consumer job reading a training job's store) is
        listed again, not taken for a corrupt one. Raises ``OSError`` when the store does not answer."""
        try:
            return hashlib.sha256(self._get(step, COMMIT_NAME)).hexdigest()
        except IncompleteCheckpointError:
            return None

    def open(self, step: int) -> tuple[Commit, Manifest]:
        """Read and validate the commit record and this rank's manifest of ``step``
        (:class:`~ckpt.errors.IncompatibleCheckpointError` when another world size saved it)."""
        d = self.step_dir(step)
        commit, manifest = read_records(lambda name: self._get(step, name), step, self.rank, self.world_size, d)
        if manifest.codecs is None:
            raise CorruptCheckpointError(f"{d}/{manifest_name(self.rank)}: remote manifest lacks part codecs")
        self._check_parts(step, manifest)
        return commit, manifest

    def _check_parts(self, step: int, m: Manifest) -> None:
        """Each part's codec must be one this library writes and its recorded stored size one that can
        hold its chunk (raw: the chunk itself; zstd: see :func:`~ckpt.codec.max_decoded`), so that no
        size the manifest states is used unless the stored bytes can back it. A part may be left out
        (``"absent"``, nothing stored) only where the writer leaves one out (:func:`_may_be_left_out`):
        else a manifest could vouch for data that no object holds, and verify without reading a byte."""
        c = m.chunk_bytes
        left_out = _may_be_left_out(m)
        for i, (codec, stored) in enumerate(zip(m.codecs, m.stored_sizes)):
            size = min(c, m.data_bytes - i * c)
            if codec == ABSENT:
                if stored == 0 and left_out(i):
                    continue
                if stored == 0:   # the manifest says that rank 0 holds bytes it does not
                    raise CorruptCheckpointError(
                        f"{self._url(self._part(step, i, m.rank, m.generation))}: not stored ({ABSENT!r}), but only a "
                        "job's rank above 0 leaves out a chunk, and only one holding nothing but replicated "
                        "tensors (which rank 0 stores)")
            else:
                check_codec(codec, self._url(self._part(step, i, m.rank, m.generation)))
                if (stored == size) if codec == RAW else (0 < stored <= size <= max_decoded(codec, stored)):
                    continue
            raise CorruptCheckpointError(f"{self._url(self._part(step, i, m.rank, m.generation))}: a {codec!r} part of {stored} "
                                         f"stored bytes cannot hold its {size}-byte chunk")

    def check_stored(self, step: int, m: Manifest) -> None:
        """Every part of saved rank ``m.rank`` is there with the size its manifest records: one listing,
        before any part is downloaded or room for the data is allocated."""
        base = self.step_dir(step) if m.generation is None else f"{self.step_dir(step)}/{m.generation}"
        d = f"{base}/rank-{m.rank:05d}"
        with self._store(f"listing {self._url(d)}"):
            self.fs.invalidate_cache(d)
            try:
                entries = self.fs.ls(d, detail=True)
            except FileNotFoundError:
                entries = []
        # a key prefix that shares a part's name (``part-000001/x``: S3 lists both) is not the part
        held = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries
                if e.get("type") != "directory"}
        for i, (codec, stored) in enumerate(zip(m.codecs, m.stored_sizes)):
            name = f"part-{i:06d}"
            if codec != ABSENT and held.get(name) != stored:
                where = self._url(self._part(step, i, m.rank, m.generation))
                raise IncompleteCheckpointError(f"{where}: missing" if name not in held else
                                                f"{where}: {held[name]} bytes, {stored} committed")

    def read_commit(self, step: int) -> Commit:
        """The validated commit record of ``step``, whatever world size wrote it."""
        where = f"{self.step_dir(step)}/{COMMIT_NAME}"
        commit = Commit.from_bytes(self._get(step, COMMIT_NAME), where)
        if commit.step != step:
            raise CorruptCheckpointError(f"{where}: records step {commit.step}, directory says {step}")
        return commit

    def read_manifests(self, step: int, commit: Commit) -> list[Manifest]:
        """Every saved rank's manifest of ``step`` (fetched in parallel), each checked against ``commit``."""
        d = self.step_dir(step)

        def one(rank: int) -> Manifest:
            name = manifest_name(rank)
            if name not in commit.manifests:
                raise CorruptCheckpointError(f"{d}/{COMMIT_NAME}: does not list {name}")
            path = name if commit.generation is None else f"{commit.generation}/{name}"
            raw = self._get(step, path)
            if Commit.manifest_checksum(raw) != commit.manifests[name]:
                raise CorruptCheckpointError(f"{d}/{path}: checksum does not match the one recorded in {COMMIT_NAME}")
            m = Manifest.from_bytes(raw, f"{d}/{path}")
            if m.rank != rank or m.codecs is None or commit.data.get(data_name(rank)) != m.data_bytes \
                    or m.generation != commit.generation:
                raise CorruptCheckpointError(f"{d}/{path}: rank, part codecs, data size or generation disagree with "
                                             f"{COMMIT_NAME}")
            self._check_parts(step, m)
            return m

        with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix="ckpt-manifest") as ex:
            manifests = list(ex.map(one, range(commit.world_size)))
        check_layouts(manifests, d)   # before a resharding restore or an export allocates a global tensor
        return manifests

    def verify(self, step: int) -> list[Manifest]:
        """Fetch every stored part of every rank of ``step`` and check it against its checksum (in parallel);
        returns the manifests. Raises :class:`~ckpt.errors.CheckpointError` naming the first bad part."""
        commit = self.read_commit(step)
        manifests = self.read_manifests(step, commit)
        for m in manifests:
            self.check_stored(step, m)
        parts = [(m, i) for m in manifests for i, codec in enumerate(m.codecs) if codec != ABSENT]
        with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix="ckpt-verify") as ex:
            for f in [ex.submit(self.fetch, step, m.rank, m, i) for m, i in parts]:
                f.result()
        return manifests

    def fetch(self, step: int, rank: int, manifest: Manifest, i: int) -> bytes | bytearray:
        """Part ``i`` of saved rank ``rank``'s data, decoded and checked against its checksum.

        A store failure is an ``OSError`` naming the part's URL; the read asks for no more than the
        stored size the manifest records (and one byte, to see a longer object)."""
        path = self._part(step, i, rank, manifest.generation)
        where = self._url(path)
        if manifest.codecs[i] == ABSENT:
            raise IncompleteCheckpointError(f"{where}: not stored (only replicated tensors, which rank 0 holds)")
        expect = manifest.stored_sizes[i]
        status = self.status   # one record: another thread may replace it
        down = status.error if status.available is False else None
        if down is not None:   # another part of this load met the outage: the load fails anyway, fail fast
            raise ConnectionError(down.errno, f"reading {where}: not attempted, {down.strerror}")
        try:
            with self._store(f"reading rank {rank}'s part {i} of step {step} ({where})"):
                if self._local_fs:   # a local file's reader allocates what it is asked for: ask what the file holds
                    held = self.fs.size(path)
                    if held != expect:
                        raise IncompleteCheckpointError(f"{where}: {held} bytes, {expect} committed")
                    stored = self.fs.cat_file(path)
                else:                # an object store answers a range with what the object holds
                    stored = self.fs.cat_file(path, start=0, end=expect + 1)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{where}: missing") from None
        if len(stored) != expect:
            raise IncompleteCheckpointError(f"{where}: {len(stored)}{'+' if len(stored) > expect else ''} bytes, "
                                            f"{expect} committed")
        size = min(manifest.chunk_bytes, manifest.data_bytes - i * manifest.chunk_bytes)
        raw = decode(stored, manifest.codecs[i], size, where)
        if len(raw) != size or checksum(raw) != manifest.chunks[i]:
            raise CorruptCheckpointError(f"{where}: fails its {manifest.checksum_algorithm} checksum")
        return raw

    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None] | None,
             refill: Any = None) -> None:
        """Download, decode and verify every part in parallel; scatter into ``dest`` (if given) and write
        the local tier ``refill`` (if given) on the way, so that the next restore is local."""
        import torch

        self.check_stored(step, manifest)   # before the refill allocates room for data_bytes
        sc = Scatter(manifest.items, dest) if dest is not None else None
        if sc is not None:
            sc.open_streams()   # here, on the caller's thread: after what it queued on the GPU
        c, n = manifest.chunk_bytes, len(manifest.chunks)

        def fetch(i: int) -> bytes:
            try:
                raw = self.fetch(step, manifest.rank, manifest, i)
            except OSError as e:   # the store, not the local disk the bytes were going to
                error = StallError if isinstance(e, StallError) else OSError
                path = self._part(step, i, manifest.rank, manifest.generation)
                raise error(e.errno, f"downloading {path} from {self.url} failed ({e.strerror or e}); check "
                            "storage_options and the store", e.filename or self._url(path)) from e
            size = len(raw)
            if sc is not None:
                chunk = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if size
                         else torch.empty(0, dtype=torch.uint8, device="cpu"))
                sc.copy(chunk, i * c)
                if sc.to_device:
                    sc.synchronize()   # the pageable source must outlive the copy
            return raw

        if refill is not None:
            # The local writer pulls each part through fetch(): downloads stream straight to disk,
            # with only the parts in flight held in memory. It reports any OSError as its own write
            # failure ("check the local_dir path"): a failed download is raised as what it is.
            fetch_errors: list[BaseException] = []

            def source(i: int) -> bytes:
                try:
                    return fetch(i)
                except BaseException as e:
                    fetch_errors.append(e)
                    raise

            try:
                refill.write_chunks(step, manifest, source, compute_checksums=False)
            except BaseException as e:
                origin = next((f for f in fetch_errors if _caused_by(e, f)), None)
                if origin is None or origin is e:
                    raise
                raise origin from None
            return
        _map_all(fetch, n, "ckpt-download")


def _may_be_left_out(m: Manifest) -> Callable[[int], bool]:
    """Whether the writer of ``m`` may have left chunk ``i`` out (:meth:`RemoteTier._held_by_rank0`): only
    a job tier's rank above 0 does, and only a chunk that holds no byte of a tensor it stores alone (not
    in ``m.replicated``). Built from merged chunk spans, so a manifest claiming vast sizes costs no more
    than its items."""
    if m.rank == 0 or m.world_size < 2 or not m.replicated:
        return lambda i: False
    c, shared = m.chunk_bytes, set(m.replicated)
    spans: list[list[int]] = []
    for a, b in sorted((it.offset // c, (it.offset + it.nbytes - 1) // c) for k, it in enumerate(m.items)
                       if k not in shared and it.alias_of is None and it.nbytes):
        if spans and a <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    starts = [a for a, _ in spans]

    def left_out(i: int) -> bool:
        j = bisect.bisect_right(starts, i) - 1
        return j < 0 or spans[j][1] < i

    return left_out


def _generation_after(old: Commit) -> str:
    """The generation a replacement of the copy committed as ``old`` is written to on a job tier: the
    same on every rank (derived from the record they all read), another one after every commit."""
    return "g" + hashlib.sha256(old.to_bytes()).hexdigest()[:16]


def _map_all(fn: Callable[[int], Any], n: int, name: str) -> list[Any]:
    """``[fn(i) for i in range(n)]`` on the remote tier's thread pool; the first failure cancels the
    calls not yet started (an outage fails one request, not every remaining one after its retries)."""
    with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix=name) as ex:
        futures = [ex.submit(fn, i) for i in range(n)]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _dominant_elem_size(items: list[ItemRecord], chunk: int) -> Callable[[int], int]:
    """Element size of the tensor covering most of chunk ``i`` (for the byte shuffle)."""
    import torch

    spans = sorted((it.offset, it.offset + it.nbytes, getattr(torch, it.dtype).itemsize)
                   for it in items if it.alias_of is None and it.nbytes)
    starts = [s[0] for s in spans]

    def size(i: int) -> int:
        lo, hi = i * chunk, (i + 1) * chunk
        best, best_len = 1, 0
        j = max(0, bisect.bisect_right(starts, lo) - 1)
        while j < len(spans) and spans[j][0] < hi:
            cover = min(hi, spans[j][1]) - max(lo, spans[j][0])
            if cover > best_len:
                best, best_len = spans[j][2], cover
            j += 1
        return best

    return size

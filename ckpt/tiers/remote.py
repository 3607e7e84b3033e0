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

The tier's parts, a module each: :mod:`ckpt.tiers.remote_store` (the store client: failures as
``OSError`` s, the probe, :class:`RemoteStatus`), :mod:`ckpt.tiers.remote_errors` (what a client's failure
means), :mod:`ckpt.tiers.remote_parts` (a rank's data as parts: upload, checks, bounded reads, download),
:mod:`ckpt.tiers.remote_upload` (writing and replacing a step), :mod:`ckpt.tiers.remote_job` (the job
tier's commit across ranks), :mod:`ckpt.tiers.remote_place` (where a remote tier may not live),
:mod:`ckpt.tiers.remote_file` (a file of a caller's own layout on the same store: the DCP adapter's). This module
is the tier itself: construction, layout, listing, reading records, restoring, deleting.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import knobs
from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, LayoutMismatchError
from ..format import (
    COMMIT_NAME,
    Commit,
    Manifest,
    data_name,
    manifest_name,
    parse_step_dir,
    read_records,
    step_dir_name,
)
from ..fs import resolve
from ..policy import Committed, Retention, Timeline, TimelineCopies
from ..reshard import check_layouts
from .base import PersistingTier, StepInfo, StoredTier, register
from .local import linked
from .remote_job import JobCommit
from .remote_parts import ABSENT, Parts, dominant_elem_size as _dominant_elem_size
from .remote_place import refuse_local_tier_dir, refuse_overlap
from .remote_store import RemoteStatus, StoreClient
from .remote_upload import Uploads

__all__ = [
    "RemoteTier",
    "RemoteStatus",
    # what other modules import from here (ckpt.api, ckpt.cli, ckpt.promotion, benchmarks/bench_remote.py)
    "ABSENT",
    "refuse_overlap",
    "_dominant_elem_size",
]

log = logging.getLogger(__name__)


@register
class RemoteTier(StoreClient, Parts, Uploads, JobCommit, PersistingTier, StoredTier, TimelineCopies):
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
    built_after = ("local",)  # it must not overlap local_dir
    on_node = False
    reshards = True  # a job tier's checkpoint loads into another world size, mesh or placements

    needs = "a url"

    @classmethod
    def for_storage(cls, storage: Any, built: dict[str, Any], pool: Any, rank: int) -> "RemoteTier | None":
        """The remote tier of ``storage.url`` (or the :class:`RemoteTier` given as it), never overlapping the
        local tier's directory. An unreachable store does not stop a job from resuming from its nearer tiers
        (``on_unreachable="degrade"``: each save retries it); a store that answers "no such bucket" or
        "access denied" is a configuration error: raised."""
        if cls.name != RemoteTier.name:
            return super().for_storage(storage, built, pool, rank)
        url = storage.url
        if url is None:
            if storage.compression is not None:
                raise ValueError(
                    "compression applies to the remote tier: pass a url too, or compression=None"
                )
            return None
        tier = (
            url
            if isinstance(url, RemoteTier)
            else cls(url, storage.storage_options, compression=storage.compression, on_unreachable="degrade")
        )
        refuse_overlap(built["local"].root, tier.url, tier.fs, tier.root)
        return tier

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        compression: str | None = None,
        on_unreachable: str = "raise",
    ) -> None:
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        # the client (backend) serving the URL (ckpt.fs), every request under the watchdog of
        # CKPT_REMOTE_STALL_S (ckpt.stall); the probe has its own bound
        StoreClient.__init__(self, url, resolve(url, storage_options), on_unreachable)
        self.rank = rank
        self.world_size = world_size
        self.compression = compression
        self.job: Any = None  # a Ranks over a group of its own once every rank writes here (join_job)
        # steps this process committed here itself (True) or saw fail verification (False): see LocalTier
        self.verified: dict[int, bool] = {}
        self.timeline = Timeline()  # what a fresh upload's COMMIT records (the Checkpointer sets it)
        self._copying: dict[int, Timeline] = {}
        if self._local_fs:
            refuse_local_tier_dir(url, self.root)
        failure = self.probe()  # raises when the store answers that this tier cannot work
        if failure is not None:
            if on_unreachable == "raise":
                raise failure
            log.warning(
                "%s. Going on without the remote tier for now: restore uses the nearer tiers, and every "
                "save still tries to upload (handle.wait('remote') raises while the store is down; "
                "RemoteTier.status says what was found)",
                failure,
            )

    # -- where its files are ----------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_dir(self, step: int) -> str:
        return self._path(step_dir_name(step))

    def step_location(self, step: int) -> str:
        """The URL of ``step``'s prefix on the store."""
        return self._url(self.step_dir(step))

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
        found = self.listing(
            doing, "glob", self._path("step-*", COMMIT_NAME), {}, fresh=self.root, detail=True
        )
        return [p for p, info in found.items() if info.get("type") != "directory"]

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
                log.warning(
                    "%s could not be read (%s: %s): its timeline is not known", where, type(e).__name__, e
                )
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
        url = self.step_location(step)
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

    def restore_into(
        self,
        state: dict,
        step: int,
        timeline: Timeline | None,
        strict: bool,
        job: list[int] | None,
        refill: Any = None,
    ) -> int:
        """Load ``step`` into ``state``: this rank's own file when it was saved in the live layout and
        holds all its tensors (writing it to ``refill``, the local tier, on the way, so that the next
        restore is local), else through the loader that reads every saved rank's file (resharding, and
        replicated tensors from rank 0's files). See :meth:`Tier.restore_into`."""
        from ..loading import bind_checked, check_job, finish
        from ..reshard import load_resharded

        rank, world = job if job is not None else (0, 1)
        commit = self.read_commit(step)
        if commit.world_size == self.world_size:  # laid out for this tier's place: this rank's own file
            commit, manifest = self.open(step)
            check_job(manifest, job, self.name, step)
            try:
                # a rank whose replicated tensors rank 0 stored takes the loader that reads other ranks' files
                binding = (
                    None
                    if ABSENT in manifest.codecs
                    else bind_checked(
                        state,
                        manifest.tree,
                        manifest.items,
                        strict,
                        f"{self.step_dir(step)}/{manifest_name(manifest.rank)}",
                    )
                )
            except LayoutMismatchError:
                if commit.world_size == 1:
                    raise  # one rank's file: nothing to reshard from
                binding = None  # same world size, another mesh or placements
            if binding is not None:
                if refill is not None:
                    with refill.copying(
                        step, Timeline.of(commit)
                    ):  # the local copy keeps the checkpoint's timeline
                        self.load(step, manifest, binding.dest, refill=refill)
                else:
                    self.load(step, manifest, binding.dest)
                finish(binding)
                return manifest.data_bytes
        manifests = self.read_manifests(step, commit)
        own = rank if rank < commit.world_size else 0
        t0 = time.perf_counter()
        binding = bind_checked(
            state,
            manifests[own].tree,
            manifests[own].items,
            strict,
            f"{self.step_dir(step)}/{manifest_name(own)}",
            reshard=True,
        )
        nbytes = load_resharded(
            manifests, own, binding.dest, binding.boxes, lambda r, m, i: self.fetch(step, r, m, i)
        )
        finish(binding)
        log.info(
            "resharded step %d saved by %d rank(s) into rank %d of %d (%.3f GB fetched in %.2f s)",
            step,
            commit.world_size,
            rank,
            world,
            nbytes / 1e9,
            time.perf_counter() - t0,
        )
        return nbytes

    def all_step_dirs(self) -> list[int]:
        names = self.listing(f"listing the remote tier {self.url}", "ls", self.root, [], detail=False)
        return [s for s in (parse_step_dir(n.rstrip("/").split("/")[-1]) for n in names) if s is not None]

    # -- delete -----------------------------------------------------------------------------------
    def delete(self, step: int, missing_ok: bool = False) -> None:
        """Remove a checkpoint, ``COMMIT`` first. On a ``file://`` URL never through a symbolic link
        (:func:`~ckpt.tiers.local.remove_step_dir`: a linked step raises ``OSError(ELOOP)``)."""
        with self._store(f"removing step {step} from {self.url}"):
            found = self._delete(step)
        if not found and not missing_ok:
            raise FileNotFoundError(
                errno.ENOENT, f"step {step} is not on the remote tier", self._url(self.step_dir(step))
            )

    def _delete(self, step: int) -> bool:
        """Remove ``step`` (``COMMIT`` first); whether it was there."""
        self.verified.pop(step, None)
        return self.remove_dir(step_dir_name(step))

    # -- read -------------------------------------------------------------------------------------
    def _get(self, step: int, name: str) -> bytes:
        where = f"{self.step_dir(step)}/{name}"
        doing = f"reading {self._url(where)}"
        down = self._still_down()
        if down is not None:
            raise ConnectionError(down.errno, f"{doing}: not attempted, {down.strerror}")
        try:
            with self._store(doing):
                return self.read_record(where)
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
        commit, manifest = read_records(
            lambda name: self._get(step, name), step, self.rank, self.world_size, d
        )
        if manifest.codecs is None:
            raise CorruptCheckpointError(f"{d}/{manifest_name(self.rank)}: remote manifest lacks part codecs")
        self._check_parts(step, manifest)
        return commit, manifest

    def records(self, step: int) -> tuple[Commit, list[Manifest]]:
        """The commit record of ``step`` and every saved rank's manifest (a job tier holds every rank's
        files), each checked against it."""
        commit = self.read_commit(step)
        return commit, self.read_manifests(step, commit)

    def stored_bytes(self, step: int) -> int:
        """The bytes of every stored part of every rank (a part left to rank 0, ``ABSENT``, is not stored)."""
        total = 0
        for m in self.records(step)[1]:
            c = m.chunk_bytes
            total += sum(min(c, m.data_bytes - i * c) for i, codec in enumerate(m.codecs) if codec != ABSENT)
        return total

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
                raise CorruptCheckpointError(
                    f"{d}/{path}: checksum does not match the one recorded in {COMMIT_NAME}"
                )
            m = Manifest.from_bytes(raw, f"{d}/{path}")
            if (
                m.rank != rank
                or m.codecs is None
                or commit.data.get(data_name(rank)) != m.data_bytes
                or m.generation != commit.generation
            ):
                raise CorruptCheckpointError(
                    f"{d}/{path}: rank, part codecs, data size or generation disagree with {COMMIT_NAME}"
                )
            self._check_parts(step, m)
            return m

        with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix="ckpt-manifest") as ex:
            manifests = list(ex.map(one, range(commit.world_size)))
        check_layouts(manifests, d)  # before a resharding restore or an export allocates a global tensor
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

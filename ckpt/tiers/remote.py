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

The filesystem is resolved once (``fsspec.core.url_to_fs``), never per file;
chained URLs (``simplecache::s3://...``) pass through. Transient failures are
retried by the backend's own machinery: for S3 the default here is botocore's
"standard" retry mode with 10 attempts (5xx answers, throttling, dropped
connections, timeouts); ``storage_options={"config_kwargs": {"retries": ...}}``
overrides it.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import logging
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import fsspec
import torch

from .. import knobs
from ..codec import decode, encode
from ..errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, IncompleteCheckpointError
from ..format import (COMMIT_NAME, LATEST_NAME, Commit, ItemRecord, Manifest, data_name, fsync_dir, fsync_file,
                      manifest_name, new_generation, parse_step_dir, read_records, step_dir_name)
from ..integrity import checksum
from ..scatter import Scatter

__all__ = ["RemoteTier"]

log = logging.getLogger(__name__)

#: the codec of a part a rank did not upload: its bytes are replicated tensors that rank 0 stores
ABSENT = "absent"


def is_local_fs(fs: Any) -> bool:
    """Whether an fsspec file system is the local one (a ``file://`` URL: real directories, and a
    page cache between a write and the disk)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in ("file", "local") for p in protocols)


def _with_retry_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    protocols = fsspec.utils.get_protocol(url).split("::")
    opts = dict(options)
    if any(p in ("s3", "s3a") for p in protocols):
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("retries", {"max_attempts": 10, "mode": "standard"})
        opts["config_kwargs"] = cfg
    return opts


class RemoteTier:
    """Committed checkpoints under an fsspec URL."""

    name = "remote"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, rank: int = 0,
                 world_size: int = 1, compression: str | None = None) -> None:
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        self.url = url
        self.rank = rank
        self.world_size = world_size
        self.compression = compression
        self.job: Any = None   # a Ranks over a group of its own once every rank writes here (join_job)
        self.fs, self.root = fsspec.core.url_to_fs(url, **_with_retry_defaults(url, storage_options or {}))
        self.root = self.root.rstrip("/")
        self._local_fs = is_local_fs(self.fs)
        self._check_reachable()

    def _check_reachable(self) -> None:
        """Fail at construction, not at the first save, when the store cannot be used."""
        try:
            if self._local_fs or "memory" in self.fs.protocol:
                self.fs.makedirs(self.root, exist_ok=True)   # directories are real here
            else:
                bucket = self.root.split("/", 1)[0]          # never create a bucket: a typo must not
                if not self.fs.exists(bucket):
                    raise FileNotFoundError(f"bucket {bucket!r} does not exist or is not visible")
            self.fs.ls(self.root, detail=False)
        except FileNotFoundError as e:
            if "bucket" in str(e):
                raise OSError(2, f"the remote tier {self.url} is not usable ({e}); check the URL, that the bucket "
                              "exists, and the credentials / endpoint in storage_options") from e
            # an empty prefix of an existing bucket lists as missing on some stores
        except Exception as e:   # noqa: BLE001 - re-raised as an OSError naming what to change
            raise OSError(getattr(e, "errno", None) or 5,
                          f"the remote tier {self.url} is not usable ({type(e).__name__}: {e}); check the URL, "
                          "that the bucket exists, and the credentials / endpoint in storage_options") from e

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
        self.fs.invalidate_cache(self.root)   # other processes write here too: never trust a cached listing
        try:
            found = self.fs.glob(self._path("step-*", COMMIT_NAME))
        except FileNotFoundError:
            return []
        steps = {parse_step_dir(p.rstrip("/").split("/")[-2]) for p in found}
        return sorted((s for s in steps if s is not None), reverse=True)

    def all_step_dirs(self) -> list[int]:
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
        committed, why = 0, ""
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
            try:
                commit = Commit(step=step, world_size=job.world,
                                manifests={manifest_name(r): rep[1] for r, rep in enumerate(reports)},
                                data={data_name(r): rep[2] for r, rep in enumerate(reports)}, generation=gen)
                if gen is None:
                    self._put(f"{d}/{COMMIT_NAME}", commit.to_bytes(), sync_dir=True)   # the checkpoint exists from here on
                else:
                    self._switch(step, commit)   # the new copy replaces the old one from here on
                committed = 1
            except Exception as e:   # noqa: BLE001 - reported to every rank below
                why = f"rank 0 could not write {d}/{COMMIT_NAME} ({type(e).__name__}: {e})"
                log.error("%s", why)
        committed = job.max([committed])[0]
        if committed:
            if job.rank == 0:
                self._after_commit(step, replaced, move_latest=True)
            return
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
        returns the manifest's bytes. A failure removes what this write uploaded and raises; a committed
        copy it was to replace stays as it was. On a job tier the caller passes the ``generation`` that
        every rank writes into when the step is committed there already."""
        c, n = manifest.chunk_bytes, -(-manifest.data_bytes // manifest.chunk_bytes)
        sizer = elem_size or _dominant_elem_size(manifest.items, c)
        d = self.step_dir(step)
        replaced = self._replaced(step) if self.job is None else None
        gen = generation if self.job is not None else new_generation() if replaced is not None else None
        base = d if gen is None else f"{d}/{gen}"   # a committed copy is here: write beside it
        maybe_committed = False
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
                # Object-store clients want bytes; local and mounted file systems take the view as it is.
                self._put(self._part(step, i, generation=gen), stored if self._local_fs else bytes(stored))
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
            self._put(f"{base}/{manifest_name(self.rank)}", raw, sync_dir=True)
            if commit:
                record = Commit(step=step, world_size=self.world_size,
                                manifests={manifest_name(self.rank): Commit.manifest_checksum(raw)},
                                data={data_name(self.rank): manifest.data_bytes}, generation=gen)
                maybe_committed = True
                if gen is None:
                    self._put(f"{d}/{COMMIT_NAME}", record.to_bytes(), sync_dir=True)   # the checkpoint exists from here on
                else:
                    self._switch(step, record)   # the new copy replaces the old one from here on
                maybe_committed = False
        except BaseException as e:
            self._undo(step, gen, maybe_committed)
            if isinstance(e, OSError):
                raise OSError(e.errno, f"uploading step {step} to {self.url} failed ({e}); the previous remote "
                              "checkpoint is untouched; check storage_options and the store") from e
            raise
        if commit:
            self._after_commit(step, replaced, move_latest)
        return raw

    def _replaced(self, step: int) -> Commit | None:
        """The record of the committed copy of ``step`` a write would replace (``None``: none is here).
        Outside a job tier, refuses to replace a step that a job committed (the other ranks' files)."""
        where = f"{self.step_dir(step)}/{COMMIT_NAME}"
        try:
            raw = self.fs.cat_file(where)
        except FileNotFoundError:
            return None
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
            return Commit.from_bytes(self.fs.cat_file(where), where).generation == generation
        except Exception:   # noqa: BLE001 - missing, torn or unreachable: it does not (as far as we know)
            return False

    def _undo(self, step: int, gen: str | None, maybe_committed: bool) -> None:
        """Remove what a failed write uploaded, never a committed copy: with ``maybe_committed`` (the
        ``COMMIT`` put failed) nothing is removed unless the step's ``COMMIT`` is read and does not name
        this write's files."""
        d = self.step_dir(step)
        commit = f"{d}/{COMMIT_NAME}"
        try:
            if maybe_committed:
                try:
                    named = Commit.from_bytes(self.fs.cat_file(commit), commit).generation == gen
                except FileNotFoundError:
                    named = False
                if named:
                    log.warning("the failed write of step %d to %s may have committed; its files are kept",
                                step, self.url)
                    return
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
        """Remove a checkpoint, ``COMMIT`` first."""
        d = self.step_dir(step)
        commit = f"{d}/{COMMIT_NAME}"
        if self.fs.exists(commit):
            self.fs.rm(commit)
        if self.fs.exists(d):
            self.fs.rm(d, recursive=True)
        elif not missing_ok:
            raise FileNotFoundError(d)

    # -- read -------------------------------------------------------------------------------------
    def _get(self, step: int, name: str) -> bytes:
        where = f"{self.step_dir(step)}/{name}"
        try:
            return self.fs.cat_file(where)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{where}: missing") from None

    def open(self, step: int) -> tuple[Commit, Manifest]:
        """Read and validate the commit record and this rank's manifest of ``step``
        (:class:`~ckpt.errors.IncompatibleCheckpointError` when another world size saved it)."""
        d = self.step_dir(step)
        commit, manifest = read_records(lambda name: self._get(step, name), step, self.rank, self.world_size, d)
        if manifest.codecs is None:
            raise CorruptCheckpointError(f"{d}/{manifest_name(self.rank)}: remote manifest lacks part codecs")
        return commit, manifest

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
            return m

        with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix="ckpt-manifest") as ex:
            return list(ex.map(one, range(commit.world_size)))

    def verify(self, step: int) -> list[Manifest]:
        """Fetch every stored part of every rank of ``step`` and check it against its checksum (in parallel);
        returns the manifests. Raises :class:`~ckpt.errors.CheckpointError` naming the first bad part."""
        commit = self.read_commit(step)
        manifests = self.read_manifests(step, commit)
        parts = [(m, i) for m in manifests for i, codec in enumerate(m.codecs) if codec != ABSENT]
        with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix="ckpt-verify") as ex:
            for f in [ex.submit(self.fetch, step, m.rank, m, i) for m, i in parts]:
                f.result()
        return manifests

    def fetch(self, step: int, rank: int, manifest: Manifest, i: int) -> bytes:
        """Part ``i`` of saved rank ``rank``'s data, decoded and checked against its checksum."""
        where = self._part(step, i, rank, manifest.generation)
        if manifest.codecs[i] == ABSENT:
            raise IncompleteCheckpointError(f"{where}: not stored (only replicated tensors, which rank 0 holds)")
        try:
            stored = self.fs.cat_file(where)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{where}: missing") from None
        if len(stored) != manifest.stored_sizes[i]:
            raise IncompleteCheckpointError(f"{where}: {len(stored)} bytes, {manifest.stored_sizes[i]} committed")
        size = min(manifest.chunk_bytes, manifest.data_bytes - i * manifest.chunk_bytes)
        raw = decode(stored, manifest.codecs[i], size, where)
        if len(raw) != size or checksum(raw) != manifest.chunks[i]:
            raise CorruptCheckpointError(f"{where}: fails its {manifest.checksum_algorithm} checksum")
        return raw

    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None] | None,
             refill: Any = None) -> None:
        """Download, decode and verify every part in parallel; scatter into ``dest`` (if given) and write
        the local tier ``refill`` (if given) on the way, so that the next restore is local."""
        sc = Scatter(manifest.items, dest) if dest is not None else None
        c, n = manifest.chunk_bytes, len(manifest.chunks)

        def fetch(i: int) -> bytes:
            try:
                raw = self.fetch(step, manifest.rank, manifest, i)
            except OSError as e:   # the store, not the local disk the bytes were going to
                raise OSError(e.errno, f"downloading {self._part(step, i, manifest.rank, manifest.generation)} "
                              f"from {self.url} failed ({e}); check storage_options and the store") from e
            size = len(raw)
            if sc is not None:
                chunk = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
                sc.copy(chunk, i * c)
                if sc.to_device:
                    torch.cuda.current_stream().synchronize()   # the pageable source must outlive the copy
            return raw

        if refill is not None:
            # The local writer pulls each part through fetch(): downloads stream straight to disk,
            # with only the parts in flight held in memory.
            refill.write_chunks(step, manifest, fetch, compute_checksums=False)
            return
        _map_all(fetch, n, "ckpt-download")


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
    spans = sorted((it.offset, it.offset + it.nbytes, torch.empty(0, dtype=getattr(torch, it.dtype)).element_size())
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

"""Writing a step to the remote tier: this rank's parts (:mod:`ckpt.tiers.remote_parts`), then its
manifest, then ``COMMIT`` (put last: a reader never sees a step without it), then ``latest``. A write that
replaces a committed copy of its step puts the new files under a fresh generation subdirectory of the step
and then a ``COMMIT`` naming it (putting ``COMMIT`` is the switch); the old copy's files go only once the
new ``COMMIT`` is durable. A failed write removes what it uploaded, unless its ``COMMIT`` put was sent
(such a put may still land) or the store stalled."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from typing import Callable

from ..commit import FsSink, publish, rank_record
from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from ..format import (
    COMMIT_NAME,
    LATEST_NAME,
    Commit,
    Manifest,
    fsync_dir,
    manifest_name,
    new_generation,
    step_dir_name,
)
from ..stall import StallError
from .remote_job import generation_after
from .remote_parts import dominant_elem_size

__all__ = ["Uploads"]

log = logging.getLogger("ckpt.tiers.remote")  # the remote tier's logger, whichever of its modules logs


class Uploads:
    """The write path of :class:`~ckpt.tiers.remote.RemoteTier` (on a job tier with
    :class:`~ckpt.tiers.remote_job.JobCommit`'s commit)."""

    def write(
        self,
        step: int,
        manifest: Manifest,
        data: memoryview,
        elem_size: Callable[[int], int] | None = None,
        *,
        source: str | None = None,
        move_latest: bool = True,
    ) -> float:
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
            self._write_files(
                step, manifest, data, elem_size, commit=True, source=source, move_latest=move_latest
            )
            return time.perf_counter() - t0
        try:
            # Every rank reads the same COMMIT before any rank reports (rank 0 changes it only after all
            # have), so every rank derives the same generation for a replacement without talking.
            replaced = self._replaced(step)
            gen = generation_after(replaced) if replaced is not None else None
            raw = self._write_files(
                step, manifest, data, elem_size, commit=False, source=source, generation=gen
            )
        except BaseException:
            self.abstain(step)  # the other ranks still wait for this rank's report
            raise
        self._commit_job(step, raw, manifest.data_bytes, gen, replaced)
        return time.perf_counter() - t0

    def _write_files(
        self,
        step: int,
        manifest: Manifest,
        data: memoryview,
        elem_size: Callable[[int], int] | None,
        commit: bool,
        source: str | None = None,
        move_latest: bool = True,
        generation: str | None = None,
    ) -> bytes:
        """Upload this rank's parts and manifest (and with ``commit``, ``COMMIT`` and ``latest``);
        returns the manifest's bytes. A failure removes what this write uploaded (unless the store cannot
        be reached, or its ``COMMIT`` put was sent and may still land, see :meth:`_undo`: retention removes
        the leftovers once a newer step commits) and raises an ``OSError``;
        a committed copy it was to replace stays as it was. On a job tier the caller passes the
        ``generation`` that every rank writes into when the step is committed there already."""
        doing = f"uploading step {step} to {self.url}"
        down = self._still_down()
        if down is not None:  # the store is still down: fail this save now, the next one tries again
            raise ConnectionError(
                down.errno,
                f"{doing}: not attempted, {down.strerror}; the previous remote checkpoint is untouched",
            )
        if not self.owns(step):
            raise OSError(
                errno.ELOOP,
                "the step directory is a symbolic link (a checkpoint kept elsewhere, "
                "read-only): a save never writes through it",
                self.step_dir(step),
            )
        try:
            with self._store(doing):
                raw = self._upload(step, manifest, data, elem_size, commit, source, move_latest, generation)
        except BaseException as e:
            if isinstance(e, (ConnectionError, StallError)):
                log.warning(
                    "step %d: a partial upload may stay in %s while the store cannot be reached or stalls; "
                    "retention removes it once a newer step is committed there",
                    step,
                    self.url,
                )
            if isinstance(e, OSError):
                raise type(e)(
                    e.errno, f"{e.strerror}; the previous remote checkpoint is untouched", e.filename
                ) from e
            raise
        self._note(None)
        return raw

    def _upload(
        self,
        step: int,
        manifest: Manifest,
        data: memoryview,
        elem_size: Callable[[int], int] | None,
        commit: bool,
        source: str | None,
        move_latest: bool,
        generation: str | None,
    ) -> bytes:
        sizer = elem_size or dominant_elem_size(manifest.items, manifest.chunk_bytes)
        d = self.step_dir(step)
        replaced = self._replaced(step) if self.job is None else None
        gen = generation if self.job is not None else new_generation() if replaced is not None else None
        base = d if gen is None else f"{d}/{gen}"  # a committed copy is here: write beside it
        sent: list[bool] = []  # the COMMIT put was sent: from then on it may land, whatever the put says
        try:
            if self.job is not None and gen is None:
                self._remove_own(step)  # the other ranks' files of this step are theirs
            self.fs.makedirs(f"{base}/rank-{self.rank:05d}", exist_ok=True)  # file:// needs it

            absent = self._held_by_rank0(manifest)
            parts = self._put_parts(step, manifest, data, sizer, source, gen, absent)
            remote = dataclasses.replace(
                manifest,
                rank=self.rank,
                world_size=self.world_size,
                chunks=[p[0] for p in parts],
                codecs=[p[1] for p in parts],
                stored_sizes=[p[2] for p in parts],
                generation=gen,
            )
            if manifest.chunks and manifest.chunks != remote.chunks:
                raise CorruptCheckpointError(f"step {step}: bytes changed while uploading (checksums differ)")
            raw = remote.to_bytes()
            if self._local_fs:
                fsync_dir(
                    f"{base}/rank-{self.rank:05d}"
                )  # the parts' names, before anything vouches for them
            record = (
                rank_record(
                    step,
                    self.rank,
                    self.world_size,
                    raw,
                    manifest.data_bytes,
                    self._copying.get(step, self.timeline),
                    gen,
                )
                if commit
                else None
            )
            sink = self.sink(base)
            # the checkpoint exists from the COMMIT put on (a replacement: from the switch to its generation)
            publish(
                sink,
                [(manifest_name(self.rank), raw)],
                record.to_bytes() if record is not None else None,
                put_commit=self._commit_put(sink, step, record, gen, sent),
            )
            if commit:
                self.verified[step] = True
        except BaseException as e:
            if isinstance(
                e, StallError
            ):  # removing the files would stall the same way: retention does it later
                log.warning(
                    "the partial upload of step %d stays in %s (the store stalled): retention removes it "
                    "once a newer step is committed there",
                    step,
                    self.url,
                )
            else:
                self._undo(step, gen, maybe_committed=bool(sent))
            raise
        if commit:
            self._after_commit(step, replaced, move_latest)
        return raw

    def _commit_put(
        self, sink: FsSink, step: int, record: Commit | None, gen: str | None, sent: list[bool]
    ) -> Callable[[bytes], None]:
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
            raw = self.read_record(where)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:  # not a file, or too large to be a record: write beside it
            raw = b""
        except OSError as e:
            raise OSError(
                e.errno,
                f"uploading step {step} to {self.url} failed: its COMMIT could not be read ({e}); "
                "the previous remote checkpoint is untouched; check storage_options and the store",
            ) from e
        try:
            old = Commit.from_bytes(raw, where)
        except CorruptCheckpointError:  # unreadable: not a usable copy, but write beside it all the same
            return Commit(
                step=step,
                world_size=self.world_size,
                manifests={},
                data={},
                created_unix=0.0,
                generation=None,
            )
        if self.job is None and old.world_size != self.world_size:
            raise IncompatibleCheckpointError(
                f"{where}: step {step} there was saved by {old.world_size} rank(s) (world size {old.world_size}); "
                f"replacing it with a copy of world size {self.world_size} would drop the other ranks' files: "
                "write to another url, or delete that step there first"
            )
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
                fsync_dir(d)  # the new copy's directory name, before the record that names it
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
            return Commit.from_bytes(self.read_record(where), where).generation == generation
        except Exception:  # noqa: BLE001 - missing, torn or unreachable: it does not (as far as we know)
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
            log.warning(
                "the failed write of step %d to %s may still commit (its COMMIT put failed, and such a put "
                "can land later): its files are kept",
                step,
                self.url,
            )
            return
        try:
            if self.job is not None:
                self._discard_own(step, gen)
            elif gen is not None:
                self._rm(f"{d}/{gen}", recursive=True)  # this write's files only: the committed copy stays
            elif not self.fs.exists(commit):
                self._rm(d, recursive=True)  # a fresh step: nothing was committed there
        except Exception as cleanup:  # noqa: BLE001 - the upload error is the one to report
            log.warning("could not remove the partial upload of step %d from %s: %s", step, self.url, cleanup)

    def _after_commit(self, step: int, replaced: Commit | None, move_latest: bool) -> None:
        """After a commit: move ``latest``, and delete the files of the copy it replaced. Failures here are
        logged: the new copy is committed, and leftovers go with the step when it is deleted."""
        d = self.step_dir(step)
        try:
            if move_latest:
                self._put(self._path(LATEST_NAME), (step_dir_name(step) + "\n").encode(), sync_dir=True)
        except Exception as e:  # noqa: BLE001
            log.warning(
                "step %d is committed to %s, but %s could not be updated: %s", step, self.url, LATEST_NAME, e
            )
        if replaced is None:
            return
        if replaced.generation is not None:
            old = [(f"{d}/{replaced.generation}", True)]
        else:
            old = [(f"{d}/{manifest_name(r)}", False) for r in range(replaced.world_size)] + [
                (f"{d}/rank-{r:05d}", True) for r in range(replaced.world_size)
            ]
        for path, recursive in old:
            try:
                if self.fs.exists(path):
                    self._rm(path, recursive=recursive)
            except Exception as e:  # noqa: BLE001
                log.warning(
                    "could not delete %s (the copy of step %d that a new one replaced): %s", path, step, e
                )

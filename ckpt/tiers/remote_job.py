"""The job tier: one URL for every rank of a job (:meth:`JobCommit.join_job`). Each rank uploads its own
files of a step into one step directory, then every rank reports (a gather over a gloo group of the tier's
own) and rank 0 writes ``COMMIT`` once every rank's upload succeeded and all agree on the step and on the
generation a replacement goes to; a step that is not committed leaves the copy committed before untouched.
A rank above 0 leaves out the chunks that hold only replicated tensors: rank 0 stores those."""

from __future__ import annotations

import hashlib
import logging
import zlib
from typing import Any

from ..commit import publish, record as record_of_job
from ..errors import CheckpointError
from ..format import COMMIT_NAME, Commit, Manifest, data_name, manifest_name

__all__ = ["JobCommit", "generation_after"]

log = logging.getLogger("ckpt.tiers.remote")  # the remote tier's logger, whichever of its modules logs

# what rank 0 tells every rank of a job tier's commit (the largest wins): not committed, a COMMIT put that
# failed but may still land, committed
_NOT_COMMITTED, _MAYBE_COMMITTED, _COMMITTED = 0, 1, 2


class JobCommit:
    """The job tier's side of :class:`~ckpt.tiers.remote.RemoteTier`: joining a job, each rank's report
    and rank 0's commit, and removing a rank's own files of a step that was not committed."""

    job: Any  # a Ranks over a group of the tier's own once every rank writes here; None before

    def join_job(self, ranks: Any) -> None:
        """Make this the job tier: every rank of the job writes its files into one step directory
        here and rank 0 commits the step once all have. ``ranks``: a :class:`~ckpt.ranks.Ranks` over a
        gloo group used only by this tier's uploads (they run on the upload thread)."""
        self.job = ranks
        self.rank, self.world_size = ranks.rank, ranks.world

    def abstain(self, step: int) -> None:
        """On a job tier: report that this rank has nothing to upload for ``step`` (its snapshot failed),
        so the other ranks' uploads of it are not committed and no rank waits for this one."""
        if self.job is not None:
            try:
                self._commit_job(step, None)
            except CheckpointError:
                pass  # expected: the step is not committed, and this rank's own error is the one reported
            except Exception as e:  # noqa: BLE001 - the group failed (a rank died): keep the original error
                log.error("rank %d could not report step %d to the job tier's commit: %s", self.rank, step, e)

    def _commit_job(
        self,
        step: int,
        raw: bytes | None,
        data_bytes: int = 0,
        gen: str | None = None,
        replaced: Commit | None = None,
    ) -> None:
        """The job tier's commit: every rank reports (ok, manifest checksum, data size, step, generation);
        rank 0 writes ``COMMIT`` listing every rank's files if all are ok and agree on the step and the
        generation (a replacement's subdirectory), then tells the others whether it did. Raises
        :class:`~ckpt.errors.CheckpointError` when the step is not committed: the copy committed before,
        if any, is then untouched."""
        job = self.job
        ok = raw is not None
        committed = _NOT_COMMITTED
        mine = [
            int(ok),
            Commit.manifest_checksum(raw) if ok else 0,
            data_bytes,
            step,
            zlib.crc32(gen.encode()) if gen is not None else 0,
        ]
        try:
            reports = job.gather(mine)
        except RuntimeError as e:  # gloo: a rank died or timed out (CKPT_COMMIT_TIMEOUT_S)
            if raw is not None:
                self._discard_own(step, gen)
            raise CheckpointError(
                f"step {step} is not committed to the job tier {self.url}: not every rank reported its upload "
                f"(a rank may have died; gloo says: {e}); the previous checkpoint there is untouched"
            ) from e
        failed = [r for r, rep in enumerate(reports) if rep[0] != 1]
        why = ""
        steps = sorted({rep[3] for rep in reports})
        if len(steps) > 1:  # saves paired up across ranks in order: a rank saved steps the others did not
            failed, why = (
                [],
                (
                    f"the ranks uploaded different steps ({steps}): with one url for all ranks every "
                    "rank must save the same steps (call save / maybe_save on every rank)"
                ),
            )
            log.error("%s", why)
        elif not failed and len({rep[4] for rep in reports}) > 1:
            why = (
                f"the ranks disagree whether step {step} was committed there before (it changed while they "
                "uploaded: retention or another writer)"
            )
            log.error("%s", why)
        if job.rank == 0 and not failed and not why:
            d = self.step_dir(step)
            sent: list[bool] = []
            try:
                commit = record_of_job(
                    step,
                    job.world,
                    {manifest_name(r): rep[1] for r, rep in enumerate(reports)},
                    {data_name(r): rep[2] for r, rep in enumerate(reports)},
                    self._copying.get(step, self.timeline),
                    gen,
                )
                sink = self.sink(d)
                # every rank's manifest is durable already (each put it before reporting): COMMIT alone
                publish(
                    sink, [], commit.to_bytes(), put_commit=self._commit_put(sink, step, commit, gen, sent)
                )
                self.verified[step] = True  # every rank uploaded its parts from its own bytes
                committed = _COMMITTED
            except Exception as e:  # noqa: BLE001 - reported to every rank below
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
            log.warning(
                "step %d may still commit to the job tier %s (rank 0's COMMIT put failed, and such a put "
                "can land later): rank %d keeps its files",
                step,
                self.url,
                self.rank,
            )
            raise CheckpointError(
                f"step {step} is not known to be committed to the job tier {self.url}: rank 0's "
                "COMMIT put failed (its log says why) and may still land; the files of every rank "
                "are kept for it, and the previous checkpoint there is untouched until it does"
            )
        if raw is not None:
            self._discard_own(step, gen)
        if failed:
            why = f"rank(s) {failed} could not upload their files (their logs say why)"
        elif not why:
            why = "rank 0 could not write COMMIT (its log says why)"
        raise CheckpointError(
            f"step {step} is not committed to the job tier {self.url}: {why}; "
            "the previous checkpoint there is untouched"
        )

    def _discard_own(self, step: int, gen: str | None) -> None:
        """Remove this rank's files of a job-tier write that was not committed: its files in the
        replacement's subdirectory, or (no copy was committed before) its files of the step."""
        if gen is None:
            self._remove_own(step)
            return
        base = f"{self.step_dir(step)}/{gen}"
        try:
            for path, recursive in (
                (f"{base}/{manifest_name(self.rank)}", False),
                (f"{base}/rank-{self.rank:05d}", True),
            ):
                if self.fs.exists(path):
                    self._rm(path, recursive=recursive)
        except Exception as e:  # noqa: BLE001 - leftovers go with the step
            log.warning(
                "could not remove rank %d's files of step %d from %s: %s", self.rank, step, self.url, e
            )

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
        if not self.owns(step):  # a linked step: nothing in it is this rank's to remove
            log.warning(
                "%s is a symbolic link; rank %d's files of step %d there are left alone", d, self.rank, step
            )
            return
        self.verified.pop(step, None)
        try:
            if self.rank == 0 and self.fs.exists(f"{d}/{COMMIT_NAME}"):
                self.fs.rm(f"{d}/{COMMIT_NAME}")
            for path, recursive in (
                (f"{d}/{manifest_name(self.rank)}", False),
                (f"{d}/rank-{self.rank:05d}", True),
            ):
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=recursive)
        except Exception as e:  # noqa: BLE001 - retention removes leftovers later
            log.warning(
                "could not remove rank %d's files of step %d from %s: %s", self.rank, step, self.url, e
            )


def generation_after(old: Commit) -> str:
    """The generation a replacement of the copy committed as ``old`` is written to on a job tier: the
    same on every rank (derived from the record they all read), another one after every commit."""
    return "g" + hashlib.sha256(old.to_bytes()).hexdigest()[:16]

"""Copying a committed checkpoint between the local and the remote tier, verifying every byte (``ckpt
promote``, :func:`promote`, ``Checkpointer.promote``): the destination's copy is replaced only by a complete,
verified new one."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
)
from .format import Manifest, data_name
from .policy import Timeline
from .tiers import LocalTier, RemoteTier
from .tiers.remote import refuse_overlap

__all__ = ["promote", "copy_between", "check_target"]

log = logging.getLogger(__name__)


def promote(
    step: int,
    to: str,
    *,
    local_dir: str | os.PathLike,
    url: str,
    storage_options: dict[str, Any] | None = None,
    compression: str | None = None,
) -> bool:
    """Copy committed checkpoint ``step`` between ``local_dir`` and ``url`` (see :meth:`ckpt.Checkpointer.promote`:
    the same guarantees); returns ``False`` when the destination already held it.

    For scripts and the command line, outside a training process. ``to="remote"`` only reads
    ``local_dir``, so it may run beside the job that owns it; ``to="local"`` writes there and raises
    :class:`~ckpt.errors.LockedError` while a live Checkpointer owns ``local_dir`` (that one can
    call ``ck.promote(step, "local")`` itself).
    """
    if to not in ("remote", "local"):
        raise ValueError(f"to must be 'remote' or 'local', got {to!r}")
    remote = RemoteTier(url, storage_options, compression=compression)
    refuse_overlap(local_dir, url, remote.fs, remote.root)
    local = LocalTier(local_dir)
    owner = local.acquire_owner() if to == "local" else None
    try:
        return copy_between(local, remote, step, to)
    finally:
        if owner is not None:
            owner.release()


def check_target(to: str, remote: RemoteTier | None) -> None:
    """``Checkpointer.promote(step, to)``'s ``to``: ``"remote"`` or ``"local"``, with a remote tier (``remote``) to
    copy to or from; else a ``ValueError`` naming the argument to change."""
    if to not in ("remote", "local"):
        raise ValueError(f"to must be 'remote' or 'local', got {to!r}")
    if remote is None:
        raise ValueError(
            "promote(to='remote') needs Checkpointer(url=...)"
            if to == "remote"
            else "promote(to='local') copies from the remote tier: pass Checkpointer(url=...)"
        )


def copy_between(local: LocalTier, remote: RemoteTier, step: int, to: str) -> bool:
    """The work of :func:`promote` (``to``: ``"remote"`` or ``"local"``), between tiers the caller made and
    owns: verify the source as it is copied, write the destination beside its
    committed copy and switch on success (the tiers' writes do that). ``False``: nothing to do."""
    if to == "remote":
        src, dst = local, remote
        where = str(local.step_dir(step))
    else:
        src, dst = remote, local
        where = remote.step_dir(step)
    if step not in src.committed_steps():
        status = src.status  # a remote tier lists nothing while its store is down
        if status.available is False and status.error is not None:
            raise ConnectionError(
                status.error.errno,
                f"promoting step {step}: {status.error.strerror}; nothing was copied",
                where,
            ) from status.error
        raise FileNotFoundError(
            errno.ENOENT,
            f"step {step} is not committed on the {src.name} tier "
            f"(committed there: {src.committed_steps()[:10]}); nothing was copied",
            where,
        )
    commit, manifest = src.open(step)  # the records, validated (CorruptCheckpointError names the file)
    if _holds(dst, step, manifest):
        log.info(
            "step %d is already on the %s tier, the same checkpoint, and verifies: nothing to copy", step, to
        )
        return False
    if to == "remote":
        committed = remote.committed_steps()
        if remote.job is not None and step in committed:
            raise CheckpointError(
                f"step {step} is committed on the job tier {remote.url} with other content than "
                f"rank {remote.rank}'s local copy: promote does not replace a job-tier checkpoint "
                "(every rank's files would have to switch at once); delete it there first"
            )
        # each chunk is checked against the manifest before it goes up; the copy keeps the checkpoint's timeline
        with local.mapped(step) as data, remote.copying(step, Timeline.of(commit)):
            remote.write(
                step,
                manifest,
                data,
                source=str(local.step_dir(step) / data_name(local.rank)),
                move_latest=step >= max(committed, default=-1),
            )
    else:
        with local.copying(step, Timeline.of(commit)):  # the copy keeps the checkpoint's timeline
            remote.load(step, manifest, None, refill=local)  # every part verified before the local switch
    log.info("step %d copied to the %s tier", step, to)
    return True


def _holds(tier: Any, step: int, manifest: Manifest) -> bool:
    """Whether ``tier`` holds a committed copy of ``step`` with the same contents as ``manifest`` that
    verifies (every byte read). A copy that differs or fails is replaced by the promote."""
    try:
        if step not in tier.committed_steps():
            return False
        there = tier.open(step)[1]
    except (CorruptCheckpointError, IncompleteCheckpointError, IncompatibleCheckpointError, OSError):
        return False  # not a usable copy of this process's checkpoint: the write decides (or refuses)

    def content(m: Manifest) -> tuple:
        return (
            m.data_bytes,
            m.chunk_bytes,
            m.chunks,
            m.items,
            m.tree,
            m.job,
            m.replicated,
            m.checksum_algorithm,
        )

    if content(there) != content(manifest):
        return False
    try:
        tier.verify(step)
    except (CheckpointError, OSError) as e:
        log.warning(
            "step %d on the %s tier is the same checkpoint but fails verification (%s): replacing it",
            step,
            tier.name,
            e,
        )
        return False
    return True

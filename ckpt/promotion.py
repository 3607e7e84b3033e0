"""Copying a committed checkpoint from one tier to another, verifying every byte (``ckpt promote``,
:func:`promote`, ``Checkpointer.promote``): the destination's copy is replaced only by a complete, verified new
one. Between the local and the remote tier from the command line; between any stored tier and any durable tier
of a Checkpointer (a tier of one's own included) from ``Checkpointer.promote``."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
from typing import Any, Iterator, Sequence

from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
)
from .format import Manifest, data_name
from .policy import Timeline, TimelineCopies
from .tiers import LocalTier, RemoteTier
from .tiers.base import PersistingTier, StoredTier, Tier, registered
from .tiers.remote import refuse_overlap
from .tiers.stack import needs_text

__all__ = ["promote", "copy_between", "copy_step", "endpoints"]

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


def endpoints(tiers: Sequence[Tier], step: int, to: str) -> tuple[Tier, PersistingTier]:
    """``Checkpointer.promote(step, to)``'s source and destination among ``tiers`` (this rank's, nearest first).

    The destination is the durable tier called ``to`` that the persist pipeline writes to (``"local"``,
    ``"remote"``, a registered tier of one's own); any other name is a ``ValueError`` naming the tiers there
    are. The source is the nearest other stored tier (:class:`~ckpt.tiers.base.StoredTier`) that holds
    ``step`` committed, else the farthest (never listed here: a store that does not answer is asked once, by
    the copy, which then raises ``ConnectionError``; ``FileNotFoundError`` when it does not hold ``step``)."""
    durable = [t for t in tiers if t.durable and isinstance(t, PersistingTier)]
    dst = next((t for t in durable if t.name == to), None)
    if dst is None:
        kinds = {c.name: c.needs for c in registered() if c.durable and issubclass(c, PersistingTier)}
        raise ValueError(
            f"to must be a durable tier of this Checkpointer, one of {[t.name for t in durable]}, got {to!r} "
            f"(the durable tiers: {needs_text(kinds)})"
        )
    sources = [t for t in tiers if t is not dst and isinstance(t, StoredTier)]
    if not sources:
        raise ValueError(f"promote(to={to!r}): this Checkpointer has no other stored tier to copy from")
    return next((t for t in sources[:-1] if _committed_here(t, step)), sources[-1]), dst


def _committed_here(tier: Tier, step: int) -> bool:
    try:
        return step in tier.committed_steps()
    except OSError:  # a store that does not answer holds nothing now
        return False


def copy_between(local: LocalTier, remote: RemoteTier, step: int, to: str) -> bool:
    """:func:`promote`'s copy (``to``: ``"remote"`` or ``"local"``) between tiers the caller made and owns
    (:func:`copy_step`)."""
    return copy_step(local, remote, step) if to == "remote" else copy_step(remote, local, step)


def copy_step(src: Tier, dst: PersistingTier, step: int) -> bool:
    """Copy committed ``step`` from ``src`` (a stored tier) to ``dst`` (a durable tier), the work of
    :func:`promote` and ``Checkpointer.promote``: every chunk is checked against the source's checksums before
    the destination commits it, the copy keeps the checkpoint's timeline, and the destination's copy of
    ``step``, if any, is replaced only by the complete new one (each tier's write stages beside its committed
    copy and switches on success). ``False``: ``dst`` already held the same checkpoint, and it verifies."""
    if step not in src.committed_steps():
        status = src.status  # a remote tier lists nothing while its store is down
        where = _location(src, step)
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
    commit, manifests = src.records(step)  # validated (CorruptCheckpointError names the file)
    manifest = src.manifest_of(step) if len(manifests) != 1 else manifests[0]  # this rank's
    if _holds(dst, step, manifest):
        log.info(
            "step %d is already on the %s tier, the same checkpoint, and verifies: nothing to copy",
            step,
            dst.name,
        )
        return False
    committed = dst.committed_steps()
    if getattr(dst, "job", None) is not None and step in committed:
        raise CheckpointError(
            f"step {step} is committed on the job tier {dst.location()} with other content than "
            f"rank {dst.rank}'s copy on the {src.name} tier: promote does not replace a job-tier checkpoint "
            "(every rank's files would have to switch at once); delete it there first"
        )
    with _copying(dst, step, Timeline.of(commit)):  # the copy keeps the checkpoint's timeline
        _transfer(src, dst, step, manifest, latest=step >= max(committed, default=-1))
    log.info("step %d copied from the %s tier to the %s tier", step, src.name, dst.name)
    return True


def _transfer(src: Tier, dst: PersistingTier, step: int, manifest: Manifest, latest: bool) -> None:
    """Write ``src``'s copy of ``step`` to ``dst``, every chunk checked against ``manifest`` before it is
    committed there."""
    chunk = functools.partial(src.fetch, step, manifest.rank, manifest)  # decoded and checked
    if isinstance(dst, LocalTier):  # streamed to disk, each chunk checked again as it is written
        if isinstance(src, RemoteTier):
            src.load(step, manifest, None, refill=dst)  # parts downloaded in parallel, failures named by URL
        else:
            dst.write_chunks(step, manifest, chunk, compute_checksums=False)
    elif isinstance(dst, RemoteTier):  # uploaded from one image, each part checked before it goes up
        with _image(src, step, manifest, chunk) as (data, source):
            dst.write(step, manifest, data, source=source, move_latest=latest)
    else:  # a tier of one's own: its write commits a verified image
        with _image(src, step, manifest, chunk) as (data, _):
            dst.write(
                step, dataclasses.replace(manifest, codecs=None, stored_sizes=None, generation=None), data
            )


@contextlib.contextmanager
def _image(src: Tier, step: int, manifest: Manifest, chunk: Any) -> Iterator[tuple[memoryview, str | None]]:
    """This rank's data file image of ``step`` on ``src``, and the file it was mapped from (``None``: each
    chunk was checked as it was read). A local tier's file is mapped, not read: the writer checks it."""
    if isinstance(src, LocalTier):
        with src.mapped(step) as data:
            yield data, str(src.step_dir(step) / data_name(src.rank))
        return
    c = manifest.chunk_bytes
    data = bytearray(manifest.data_bytes)
    for i in range(len(manifest.chunks)):
        data[i * c : (i + 1) * c] = chunk(i)
    yield memoryview(data), None


@contextlib.contextmanager
def _copying(dst: Tier, step: int, timeline: Timeline) -> Iterator[None]:
    """``dst``'s write of ``step`` records ``timeline`` (:class:`~ckpt.policy.TimelineCopies`), where it can."""
    if isinstance(dst, TimelineCopies):
        with dst.copying(step, timeline):
            yield
    else:
        saved = dst.timeline
        dst.timeline = timeline
        try:
            yield
        finally:
            dst.timeline = saved


def _location(tier: Tier, step: int) -> str:
    return tier.step_location(step) if isinstance(tier, StoredTier) else tier.location()


def _holds(tier: Any, step: int, manifest: Manifest) -> bool:
    """Whether ``tier`` holds a committed copy of ``step`` with the same contents as ``manifest`` that
    verifies (every byte read). A copy that differs or fails is replaced by the promote."""
    try:
        if step not in tier.committed_steps():
            return False
        there = tier.manifest_of(step)
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

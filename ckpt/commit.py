"""The commit protocol every persisting tier follows: what ``COMMIT`` records, and the order in which a
checkpoint's files become durable.

A checkpoint exists on a tier iff its ``COMMIT`` exists there, so ``COMMIT`` is made durable last:

1. the data files, each flushed to stable storage (``fsync``; an object store's put is durable when it
   returns);
2. the manifests, each written atomically (a temporary name, ``fsync``, rename; a put);
3. the names of all of them, durable before anything vouches for them (``fsync`` of the directory);
4. ``COMMIT``, atomically, listing every manifest's checksum and every data file's size;
5. then, advisory and never undoing the commit, ``latest``.

Steps 2-4 run through a :class:`Sink`: the small seam between the protocol and a store (a directory
of this node, or an fsspec file system). The local tier commits into a staging directory that it then
renames into place; the remote tier commits in place (a replacement goes to a generation subdirectory
and the ``COMMIT`` put is the switch), and a job tier's ``COMMIT`` (rank 0, once every rank reported)
lists every rank's files. All of them build their record here (:func:`record`) and publish through
:func:`publish`, and so does the DCP adapter for its own record format.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from .format import COMMIT_NAME, Commit, data_name, fsync_dir, manifest_name, write_atomic
from .policy import Timeline

__all__ = ["Sink", "DirSink", "FsSink", "record", "rank_record", "publish"]


class Sink(Protocol):
    """Where one checkpoint's records go (the storage seam of the commit protocol)."""

    def put(self, name: str, data: bytes) -> None:
        """Write record ``name`` durably, whole or not at all (a reader never sees part of it)."""

    def sync(self) -> None:
        """Make the names of the files written so far durable (before ``COMMIT`` vouches for them)."""


class DirSink:
    """Records in a directory of this node: each written to a unique temporary name, fsynced and
    renamed over its final name (:func:`ckpt.format.write_atomic`), and the directory fsynced."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def put(self, name: str, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path / name, data)

    def sync(self) -> None:
        fsync_dir(self.path)


class FsSink:
    """Records under ``base`` on an fsspec file system: one put each (atomic on an object store). On a
    local or mounted file system (``file://``, ``mounted=True``), where ``base`` is a path of this host,
    each is written under a temporary name, fsynced, renamed into place and its directory fsynced: a
    page cache, unlike an object store, may reach the disk out of order, and a process killed while it
    writes a file in place leaves it torn (a ``COMMIT`` half written)."""

    def __init__(self, fs: Any, base: str, mounted: bool) -> None:
        self.fs, self.base, self.mounted = fs, base.rstrip("/"), mounted

    def put(self, name: str, data: bytes) -> None:
        path = f"{self.base}/{name}"
        if not self.mounted:
            self.fs.pipe_file(path, data)
            return
        self.fs.makedirs(self.base, exist_ok=True)  # real directories here (an object store has none)
        write_atomic(Path(path), data)

    def sync(self) -> None:
        if self.mounted:
            fsync_dir(self.base)


def record(
    step: int,
    world_size: int,
    manifests: dict[str, int],
    data: dict[str, int],
    timeline: Timeline,
    generation: str | None = None,
) -> Commit:
    """The ``COMMIT`` of ``step``: every manifest's checksum by name, every data file's size by name, the
    timeline the checkpoint is on, and (remote tier) the generation subdirectory holding its files."""
    return Commit(
        step=step,
        world_size=world_size,
        manifests=dict(manifests),
        data=dict(data),
        generation=generation,
        **timeline.record(),
    )


def rank_record(
    step: int,
    rank: int,
    world_size: int,
    manifest_raw: bytes,
    data_bytes: int,
    timeline: Timeline,
    generation: str | None = None,
) -> Commit:
    """The ``COMMIT`` of one rank's copy (a tier that one rank writes alone)."""
    return record(
        step,
        world_size,
        {manifest_name(rank): Commit.manifest_checksum(manifest_raw)},
        {data_name(rank): data_bytes},
        timeline,
        generation,
    )


def publish(
    sink: Sink,
    records: Iterable[tuple[str, bytes]],
    commit: bytes | None,
    put_commit: Callable[[bytes], None] | None = None,
) -> None:
    """Steps 2-4 of the protocol: each of ``records`` (the manifests), their names made durable, then
    ``commit`` last (``None``: not this writer's to commit, e.g. a job tier's rank waiting for rank 0).
    ``put_commit`` replaces the plain put of ``COMMIT`` (a switch over a committed copy)."""
    for name, data in records:
        sink.put(name, data)
    sink.sync()
    if commit is None:
        return
    if put_commit is not None:
        put_commit(commit)
    else:
        sink.put(COMMIT_NAME, commit)

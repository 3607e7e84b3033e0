"""``torch.distributed.checkpoint`` (DCP) storage over the tiers, without pickle.

For code that already calls ``dcp.save`` / ``dcp.load`` (torchtitan-style loops, FSDP2 and TP
states, DCP's own resharding planners)::

    from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter

    dcp.save(state, storage_writer=TierStorageWriter(local_dir="/nvme/ckpt", url="s3://bucket/run"),
             checkpoint_id="step-1200")                                   # call on all ranks
    dcp.load(state, storage_reader=TierStorageReader(local_dir="/nvme/ckpt", url="s3://bucket/run"),
             checkpoint_id="step-1200")                                   # call on all ranks

or with the Checkpointer's description of the tiers, a tier of one's own included::

    storage = ckpt.Storage(local_dir="/nvme/ckpt", url="s3://bucket/run",
                           extra_tiers={"disk2": "/mnt/hdd/ckpt"})        # a tier registered as "disk2"
    dcp.save(state, storage_writer=TierStorageWriter(storage=storage, keep=Retention(local=2, disk2=5)),
             checkpoint_id="step-1200")

The tiers: ``local_dir`` (a directory of this node), ``url`` (any fsspec URL) and each tier of
``Storage(extra_tiers=...)``, made by its registered class as a Checkpointer makes it
(:meth:`ckpt.tiers.Tier.for_storage`); ``local_dir=`` / ``url=`` / ``storage_options=`` and ``storage=`` may
be mixed, each field given once. A tier takes its role from its class, never from its name: a
:class:`~ckpt.tiers.LocalTier` subclass is a directory as ``local_dir`` is, a :class:`~ckpt.tiers.RemoteTier`
subclass a URL as ``url`` is; ``on_node`` says whether each node has its own (read inline, its own ranks'
files pruned by each node), ``nearness`` the order tiers are written, committed and read in,
:meth:`ckpt.Retention.count` what each keeps. What the adapter has no counterpart for is a ``ValueError``
naming it: ``peers``, ``compression``, ``replicated``, ``max_in_flight`` and ``host_memory_limit`` (the peer
and host-memory tiers need the Checkpointer's snapshots), a tier of another kind, two tiers over one
directory, several URLs with no directory to send the file from.

Layout, the same on each tier::

    <root>/<checkpoint_id>/
        rank-00000.dcp.bin   this rank's items back to back: raw tensor bytes (contiguous, in their
                             dtype) and non-tensor values as JSON text
        metadata.json        DCP's Metadata as JSON, plus where every item lies and its CRC-32C
        COMMIT               written last, by the coordinator: format, world size, metadata checksum

Each rank writes its own file to every tier, nearest first: as it is produced to the nearest directory
(fsynced and renamed into place), then from that file a copy to each farther directory (written the same way)
and an upload to each URL; without a directory the file goes to the URL as it is produced. The storage is the
engine's: a URL is opened by :func:`ckpt.fs.resolve` and used through the remote tier's store client
(:class:`ckpt.tiers.remote_store.StoreClient`, built as the tier builds it: its requests, records, range
reads, listings, removals and failures), and a data file goes up and is read back through
:mod:`ckpt.tiers.remote_file`, in parts of ``CKPT_CHUNK_BYTES``, each part one request: from the local file in
parallel on the remote tier's pool (``CKPT_REMOTE_THREADS`` parts in flight), as it is produced one part in
flight while the next fills (host memory holds about two parts). On S3 through s3fs the file is one object by
a multipart upload (parts of at least 5 MiB, and at most ``default_block_size``), through any other
object-store client one object per part (``rank-RRRRR.dcp.bin.parts/000000``, ...; the items' ``part_bytes``
in the metadata say so), on a ``file://`` URL one file. A failed upload is aborted or removed, never
published. Every remote request (parts, records, listings, removals, reads) runs under the watchdog of
``CKPT_REMOTE_STALL_S`` (:mod:`ckpt.stall`): one that makes no progress is aborted and sent again, and after
three attempts the save (or the load) fails with a ``TimeoutError`` naming the URL, the part and the rank (a
stalled part is named as the remote tier names its own, :func:`ckpt.tiers.remote_parts.stall_names`). The
coordinator writes ``metadata.json`` and then ``COMMIT`` to every tier once DCP has gathered all ranks'
results, so a checkpoint exists on a tier iff its ``COMMIT`` does. When a farther tier cannot take a rank's
file after the nearest one did, that is reported (a warning) and that tier gets no ``COMMIT`` for this
checkpoint; a failed write to the nearest tier (a full disk, say) fails the save with the path, and a
checkpoint committed on no tier fails it too. Saving under a ``checkpoint_id`` that exists replaces that
checkpoint (its ``COMMIT`` is removed first); other checkpoint ids are never touched.

Reading takes the metadata from the nearest tier with a valid ``COMMIT`` and every item from the nearest tier
(tier by tier, item by item) whose bytes match the item's checksum (committed or not: on a multi-node job a
node's local tier holds its own ranks' files, while only the coordinator's node has the ``COMMIT``), so a node
that lost its disk, a torn local file or another node's rank falls back to the next tier's copy item by item;
bytes that fail their checksum are reported (a warning).

**No pickle.** DCP's own file storage pickles its metadata and every non-tensor value; loading
one runs ``torch.load(weights_only=False)`` on bytes from the checkpoint. Here the metadata is
JSON, validated field by field on load (a hostile or torn file gives a
:class:`~ckpt.errors.CorruptCheckpointError` naming the file), and a non-tensor value is stored as
JSON in the engine's encoding (:mod:`ckpt.values`): ``None``, bools, ints, floats (NaN and infinities
included), strings, ``bytes`` and ``io.BytesIO`` (as base64 text; read back as themselves), and lists,
tuples and dicts of those, which covers optimizer ``param_groups`` and scalar training state. Anything
else is refused at save time with a :class:`~ckpt.errors.RefusedStateError` naming the key. Values of
checkpoints written before the encoding was shared (tags ``$float`` and ``$dict``) are still read. A
save planner that overrides ``resolve_data`` or ``transform_object`` is honoured: its ``torch.save``
bytes, made in this process, are read back with the ``weights_only`` unpickler and stored as JSON.
DCP's load planner takes non-tensor values as ``torch.save`` bytes: the reader makes those itself from
the decoded JSON value, so the bytes it unpickles were never read from storage.

``dcp.save(use_collectives=False)`` on several processes: each rank commits a checkpoint of one rank
at ``<checkpoint_id>/rank-RRRRR/`` (and removes ``<checkpoint_id>/COMMIT``); ``dcp.load`` falls back to
it per rank (``read_metadata(rank=...)``). Retention is not applied to such saves.

``dcp.async_save`` works with these classes (tested). Retention: ``TierStorageWriter(keep=
Retention(local=2, remote=10))`` prunes after each save (the coordinator deletes whole committed
checkpoints, ``COMMIT`` first, by the engine's retention, :func:`ckpt.policy.prune`, over the
checkpoints in commit order; every other node deletes its own ranks' files beyond each of its directory
tiers' count). Operations on one tier (a directory, a URL, or the engine's tier object such as a registered
tier's): :func:`list_checkpoints`, :func:`verify` and :func:`prune` (keep the newest N by commit time;
``ckpt ls/verify/gc --dcp``). Not done here: the host-memory and peer tiers (they
need the Checkpointer's snapshot and rank groups); for saves that overlap training use
:class:`ckpt.Checkpointer`.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import os
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, StorageReader, StorageWriter
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from .. import knobs, values
from ..commit import DirSink, Sink, publish
from ..errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NoCheckpointError,
    RefusedStateError,
)
from ..format import (
    COMMIT_NAME,
    _is_nonneg_int,
    _is_number,
    check_shape,
    dtype_to_str,
    empty_tensor,
    fsync_dir,
    fsync_file,
    parse_record,
    read_record,
    str_to_dtype,
)
from ..integrity import ALGORITHM, checksum
from .. import policy
from ..policy import Committed, Retention
from ..scatter import writing_state
from ..stall import StallError
from ..values import Encoder
from ..tiers.base import Tier, registered
from ..tiers.local import LocalTier, linked, remove_step_dir
from ..tiers.remote import RemoteTier
from ..tiers.remote_errors import failure_type
from ..tiers.remote_file import MIN_PART_BYTES, PARTS, FileUpload, form_of, read_file
from ..tiers.remote_store import StoreClient, read_file_range
from ..tiers.stack import register_built_in
from ..config import Storage, merge
from ..fs import is_url, resolve

__all__ = ["TierStorageWriter", "TierStorageReader", "FORMAT", "list_checkpoints", "verify", "prune"]

FORMAT = "ckpt.dcp"
"""The ``format`` field of the ``COMMIT`` and ``metadata.json`` records :class:`TierStorageWriter` writes
(readers refuse a record without it)."""
_VERSION = 1
METADATA_NAME = "metadata.json"
_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve": torch.preserve_format,
}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}


def _data_name(rank: int) -> str:
    return f"rank-{rank:05d}.dcp.bin"


def _part_bytes() -> int:
    """Bytes per part of a data file uploaded to a remote tier: ``CKPT_CHUNK_BYTES`` (16 MiB; at least
    4 KiB), small enough that one request finishes well within ``CKPT_REMOTE_STALL_S``."""
    return max(MIN_PART_BYTES, knobs.get("CKPT_CHUNK_BYTES"))


class _Tier:
    """One place a checkpoint id can live: a directory of this host (``local_dir``, or a registered tier of
    the local kind: fsync'd, renamed into place) or an fsspec URL, holding checkpoints in the DCP layout.
    ``kind``: the engine's tier class for that storage (:class:`~ckpt.tiers.LocalTier` or a subclass for a
    directory, :class:`~ckpt.tiers.RemoteTier` or a subclass for a URL; ``engine``: the engine's tier it was
    made from, when there is one); what the adapter does with a tier follows from what that class declares
    (``on_node``: read inline, its other nodes' files pruned by each node; ``nearness``: the order tiers are
    written, committed and read in; ``keep_of``: its count of a :class:`~ckpt.Retention`), and its ``name`` is
    for messages, :class:`~ckpt.Retention` and the record of tiers a rank's file missed only.

    Why not the engine's tier objects themselves: a DCP checkpoint is named by an id, not a step, and is one
    data file per rank whose checksums are per DCP item in ``metadata.json``, with no manifest of the
    engine's; the tier contract's reads (``manifest_of``, ``load``, ``verify`` by chunk) have nothing to
    read here. So this is the layout (paths) over the engine's storage: a URL's requests are the remote
    tier's store client's (:class:`~ckpt.tiers.remote_store.StoreClient`, built as the tier builds it:
    every request under the watchdog of ``CKPT_REMOTE_STALL_S``, failures as ``OSError`` s, records read
    with its bounds, directories removed ``COMMIT`` first), a data file goes up and is read back by range
    through :mod:`ckpt.tiers.remote_file`, and records are published by :mod:`ckpt.commit`."""

    def __init__(
        self, kind: type[Tier], root: str, client: StoreClient | None, where: str, engine: Tier | None = None
    ) -> None:
        self.kind, self.name, self.on_node = kind, kind.name, kind.on_node
        self.nearness, self.durable = kind.nearness, kind.durable
        self.engine = engine  # the engine's tier this one was made from (a registered tier's), if any
        self.root = root
        # the engine's client of the store; None: root is a directory of this host, used through os
        self.client = client
        self.mounted = client is not None and client._local_fs  # a file:// URL: a page cache to flush
        # an object store whose data files are one object per part (the items' part_bytes say so)
        self.parted = client is not None and form_of(client) == "parts"
        self.on_host = client is None or self.mounted  # its checkpoints are directories of this host
        self.where = where

    @classmethod
    def directory(cls, root: str | os.PathLike) -> _Tier:
        """The tier of a directory of this node (``local_dir``), with the engine's local tier's capabilities."""
        return cls(LocalTier, str(Path(root).expanduser()), None, os.fspath(root))

    @classmethod
    def of(cls, tier: Tier) -> _Tier:
        """The DCP layout over the storage of the engine's tier ``tier``, with its class's capabilities: a
        directory of this host for a :class:`~ckpt.tiers.LocalTier` (a registered subclass too), a client of
        its store for a :class:`~ckpt.tiers.RemoteTier`; any other kind of tier is a ``ValueError``."""
        if isinstance(tier, LocalTier):
            return cls(type(tier), str(tier.root), None, os.fspath(tier.root), tier)
        if isinstance(tier, RemoteTier):
            client = StoreClient(tier.url, tier.store)  # the store as the tier opened it, no request sent
            return cls(type(tier), client.root.rstrip("/"), client, tier.url, tier)
        raise ValueError(
            f"the {tier.name!r} tier ({type(tier).__qualname__}) keeps its checkpoints neither in a "
            "directory of this host (a LocalTier) nor at a URL (a RemoteTier): the DCP adapter writes its "
            "layout to those only; use ckpt.Checkpointer for that tier"
        )

    @classmethod
    def at_url(cls, url: str, storage_options: dict[str, Any] | None) -> _Tier:
        """The tier at an fsspec URL, with the engine's remote tier's capabilities; opened by
        :func:`ckpt.fs.resolve`, the library's one way to open a URL (its backend choice too)."""
        client = StoreClient(url, resolve(url, storage_options))
        return cls(RemoteTier, client.root.rstrip("/"), client, url)

    def keep_of(self, keep: Retention) -> int | None:
        """How many checkpoints ``keep`` keeps here (through :meth:`ckpt.Retention.count`): what it keeps on
        the engine's tier of this kind."""
        if self.engine is not None:
            return self.engine.keep_of(keep)
        return self.kind.keep_of(self, keep)  # type: ignore[arg-type]

    def path(self, ckpt_id: str, name: str) -> str:
        return f"{self.root}/{ckpt_id}/{name}"

    def url(self, path: str) -> str:
        """``path`` of this tier as a URL, for messages."""
        return self.client._url(path) if self.client is not None else path

    def refuse_linked(self, ckpt_id: str) -> None:
        """Refuse to write checkpoint ``ckpt_id`` on a file system where its directory (or its ``COMMIT``)
        is a symbolic link: a checkpoint kept elsewhere is read-only (``OSError(ELOOP)``), as for the
        Checkpointer's tiers (:func:`ckpt.tiers.local.linked`)."""
        if self.on_host and linked(self.root, ckpt_id):
            raise OSError(
                errno.ELOOP,
                f"TierStorageWriter: checkpoint {ckpt_id!r} under {self.where} is a symbolic "
                "link (a checkpoint kept elsewhere, read-only): a save never writes through it; save "
                "under another checkpoint_id",
                f"{self.root}/{ckpt_id}",
            )

    def sink(self, ckpt_id: str) -> Sink:
        """Where checkpoint ``ckpt_id``'s records go (:mod:`ckpt.commit`)."""
        if self.client is None:
            return DirSink(f"{self.root}/{ckpt_id}")
        self.client.fs.makedirs(f"{self.root}/{ckpt_id}", exist_ok=True)
        return self.client.sink(f"{self.root}/{ckpt_id}")

    def upload(self, ckpt_id: str, name: str, rank: int, part_bytes: int) -> FileUpload:
        """Data file ``name`` of ``ckpt_id`` going to this (remote) tier, in the form its store takes
        (:class:`ckpt.tiers.remote_file.FileUpload`); a stall names the rank, the file and the part."""
        assert self.client is not None
        who = f"rank {rank}'s {name} of {ckpt_id!r}"
        return FileUpload(self.client, self.path(ckpt_id, name), who, part_bytes)

    def get_record(self, ckpt_id: str, name: str) -> bytes:
        """A record (``COMMIT``, ``metadata.json``) through :func:`ckpt.format.read_record`'s bounds: a regular
        file of at most ``MAX_RECORD_BYTES``, refused unread otherwise (a FIFO never blocks); on a URL by the
        store client (:meth:`~ckpt.tiers.remote_store.StoreClient.read_record`), its failures as ``OSError`` s
        so that a reader falls back to the next tier instead of crashing."""
        p = self.path(ckpt_id, name)
        if self.client is None:
            return read_record(p)
        with self.client._store(f"reading {self.url(p)}"):
            return self.client.read_record(p)

    def get_bytes(
        self, ckpt_id: str, name: str, start: int, end: int, part_bytes: int | None = None
    ) -> bytes | bytearray:
        """Bytes ``[start, end)`` of a data file (fewer when it is short): a file of this host by
        :func:`ckpt.tiers.remote_store.read_file_range` (a regular file only, into a writable buffer, so a
        tensor can be built over it without another copy), a URL's by :func:`ckpt.tiers.remote_file.read_file`
        (``part_bytes``: the items' record of the parts the file was uploaded in; failures as ``OSError`` s)."""
        p = self.path(ckpt_id, name)
        if self.client is None:
            return read_file_range(p, start, end)
        with self.client._store(f"reading {self.url(p)}"):
            return read_file(self.client, p, start, end, part_bytes)

    def item(self, ckpt_id: str, rec: dict[str, Any]) -> tuple[bytes | bytearray, bool]:
        """The stored bytes of item ``rec`` (its record in ``metadata.json``: its rank's file, byte range and
        part size) and whether they are whole and match its CRC-32C: the one check of an item's bytes, the
        reader's and :func:`verify`'s. A DCP checkpoint's checksums are per item, over the items DCP's planner
        made, so the engine's checks by chunk (:meth:`ckpt.tiers.base.StoredTier.fetch`) have nothing to
        check here; the bytes are read as the engine reads a range (:meth:`get_bytes`)."""
        a = rec["offset_bytes"]
        data = self.get_bytes(ckpt_id, _data_name(rec["rank"]), a, a + rec["length"], rec.get("part_bytes"))
        return data, len(data) == rec["length"] and checksum(data) == rec["crc"]

    def delete(self, ckpt_id: str) -> None:
        """Remove checkpoint ``ckpt_id``, its ``COMMIT`` first (a deletion cut short leaves it uncommitted,
        never committed with files missing); on this host never through a symbolic link, even one swapped
        in meanwhile (:func:`ckpt.tiers.local.remove_step_dir`: ``OSError(ELOOP)``). A URL's directory is
        removed as the remote tier removes a step's (:meth:`~ckpt.tiers.remote_store.StoreClient.remove_dir`)."""
        if self.client is None:
            remove_step_dir(self.root, ckpt_id)
            return
        with self.client._store(f"removing {self.url(f'{self.root}/{ckpt_id}')}"):
            self.client.remove_dir(ckpt_id)

    def remove(self, ckpt_id: str, name: str) -> None:
        p = self.path(ckpt_id, name)
        if self.client is not None:
            self.client.remove(p)
            return
        try:
            os.unlink(p)
        except (FileNotFoundError, NotADirectoryError):
            pass  # nothing there


def _gave_up(up: FileUpload, rank: int, name: str, ckpt_id: str, tier: _Tier) -> None:
    """Abort ``up`` (:meth:`~ckpt.tiers.remote_file.FileUpload.abort`: nothing is published) and warn when
    something stays on the store."""
    left = up.abort()
    if left is not None:
        warnings.warn(
            f"TierStorageWriter: rank {rank} gave up {name} of {ckpt_id!r} on {tier.where}: {left}; it is "
            "uncommitted, so no load reads it",
            stacklevel=3,
        )


def _upload_file(tier: _Tier, ckpt_id: str, name: str, rank: int, src: str, part_bytes: int) -> None:
    """Upload a finished local data file to a remote tier, its parts in parallel
    (:meth:`ckpt.tiers.remote_file.FileUpload.send_file`)."""
    up = tier.upload(ckpt_id, name, rank, part_bytes)
    try:
        up.send_file(src)
    except BaseException:
        _gave_up(up, rank, name, ckpt_id, tier)
        raise


def _copy_file(tier: _Tier, ckpt_id: str, name: str, src: str) -> None:
    """Copy a finished data file to another directory of this host (a farther tier of the local kind) as the
    first was written: into a temporary name beside its place, fsynced, renamed into place, the directory
    flushed; a failure leaves nothing under the file's name."""
    final = Path(tier.path(ckpt_id, name))
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    try:
        shutil.copyfile(src, tmp)
        fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def _write_error(rank: int, name: str, ckpt_id: str, tier: _Tier, e: BaseException) -> OSError:
    """The failure of a rank's data file on ``tier`` as an ``OSError`` of the same kind (a stall stays a
    :class:`~ckpt.stall.StallError`, a refusal a ``PermissionError`` ...; a store client's own ``OSError``
    subclass as :func:`ckpt.tiers.remote_errors.failure_type` classifies it) that says what it means."""
    msg = (
        f"TierStorageWriter: rank {rank} could not write {name} of {ckpt_id!r} to {tier.where} "
        f"({type(e).__name__}: {e}); nothing of this save is committed there and earlier "
        "checkpoints are untouched (check url= and storage_options=, or add local_dir=)"
    )
    code = getattr(e, "errno", None) or errno.EIO
    cls = (
        type(e)
        if isinstance(e, OSError) and type(e).__module__ in ("builtins", StallError.__module__)
        else failure_type(e)
    )
    return cls(code, msg, getattr(e, "filename", None))


#: the fields of :class:`ckpt.Storage` for what the DCP adapter does not have, and why
_NOT_HERE = {
    "peers": "the DCP adapter has no peer tier (it needs the Checkpointer's snapshots and rank groups)",
    "compression": "the DCP adapter stores each item's own bytes, uncompressed",
    "replicated": "DCP's save planner de-duplicates replicated state itself",
    "max_in_flight": "the DCP adapter has no host-memory tier (dcp.save writes from the state itself)",
    "host_memory_limit": "the DCP adapter has no host-memory tier (dcp.save writes from the state itself)",
}


def _tiers(
    who: str,
    storage: Storage | None,
    local_dir: str | os.PathLike | None,
    url: str | None,
    storage_options: dict[str, Any] | None,
) -> list[_Tier]:
    """The tiers of ``storage`` (a :class:`ckpt.Storage`, with ``local_dir`` / ``url`` / ``storage_options``
    given as keywords merged in, each field given once), nearest first: ``local_dir``, ``url`` and each of
    ``extra_tiers``, made by its registered class (:meth:`ckpt.tiers.Tier.for_storage`) as a Checkpointer
    makes it. A field for what the adapter does not have (peers, compression, the host-memory tier), a
    name no registered tier has, a tier of another kind than a directory or a URL, and two tiers over one
    directory are each a ``ValueError``."""
    storage = merge(
        storage, Storage, {"local_dir": local_dir, "url": url, "storage_options": storage_options}, {}
    )
    for field, why in _NOT_HERE.items():
        value = getattr(storage, field)
        if value is not None and value is not False and not (isinstance(value, (tuple, list)) and not value):
            raise ValueError(
                f"{who}: Storage({field}={value!r}): {why}; leave it out, or use ckpt.Checkpointer"
            )
    extra = dict(storage.extra_tiers or {})
    if storage.local_dir is None and storage.url is None and not extra:
        raise ValueError(
            "give local_dir (this node's disk), url (an fsspec URL), or both (or storage=ckpt.Storage(...) "
            "with them or extra_tiers)"
        )
    tiers = []
    if storage.local_dir is not None:
        d = storage.local_dir
        tiers.append(_Tier.of(d) if isinstance(d, Tier) else _Tier.directory(d))
    if storage.url is not None:
        u = storage.url
        so = None if storage.storage_options is None else dict(storage.storage_options)
        tiers.append(_Tier.of(u) if isinstance(u, Tier) else _Tier.at_url(u, so))
    if extra:
        register_built_in()
        kinds = {c.name: c for c in registered()}
        rank = torch.distributed.get_rank() if _distributed() else 0
        for name in extra:
            cls = kinds.get(name)
            if cls is None:
                raise ValueError(
                    f"{who}: Storage(extra_tiers=...) names {name!r}: no registered tier has that name (the "
                    f"registered tiers: {list(kinds)}; a tier class is registered with @ckpt.tiers.register "
                    "when its module is imported)"
                )
            if cls in (LocalTier, RemoteTier):
                raise ValueError(
                    f"{who}: Storage(extra_tiers=...) names the {name!r} tier, which Storage's own "
                    f"{'local_dir' if cls is LocalTier else 'url'}= sets: give it there"
                )
            if not cls.durable:
                raise ValueError(
                    f"{who}: Storage(extra_tiers=...) names the {name!r} tier, which keeps its copies in "
                    "memory: the DCP adapter writes to durable tiers only"
                )
            made = cls.for_storage(storage, {t.name: t.engine for t in tiers if t.engine}, None, rank)
            if made is not None:
                tiers.append(_Tier.of(made))
    tiers.sort(key=lambda t: t.nearness)  # written, committed and read in this order
    names, dirs = set(), {}
    for t in tiers:
        if t.name in names:
            raise ValueError(f"{who}: two tiers named {t.name!r} ({', '.join(x.where for x in tiers)})")
        names.add(t.name)
        if t.client is None:
            other = dirs.setdefault(os.path.realpath(t.root), t)
            if other is not t:
                raise ValueError(
                    f"{who}: the {other.name} and {t.name} tiers are one directory ({t.root}): give each "
                    "tier a directory of its own"
                )
    return tiers


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_local_id(checkpoint_id: str, rank: int) -> str:
    """Where rank ``rank``'s own checkpoint of a ``dcp.save(use_collectives=False)`` lies: a checkpoint
    of one rank (its ``COMMIT``, metadata and data file) inside checkpoint ``checkpoint_id``."""
    return f"{checkpoint_id}/rank-{rank:05d}"


def _checkpoint_name(checkpoint_id: str | os.PathLike | None, default: str | None) -> str:
    name = os.fspath(checkpoint_id) if checkpoint_id is not None else default
    if name is None:
        raise ValueError(
            "no checkpoint_id: pass checkpoint_id= to dcp.save / dcp.load (a name such as "
            "'step-1200') or to the storage writer / reader"
        )
    name = str(name).strip("/")
    if not name or any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"checkpoint_id must be a relative name like 'step-1200', got {checkpoint_id!r}")
    return name


# -- non-tensor values as JSON ------------------------------------------------------------------------
class _ValueEncoder(Encoder):
    """The one encoding of :mod:`ckpt.values`, with ``bytes`` and ``io.BytesIO`` (DCP's planners treat them
    as plain values like ``str``: torchtitan keeps a data loader's state as bytes, a loss history as a
    BytesIO), stored as base64 text and read back as the same type (a BytesIO at the same position)."""

    bytes_ok = True
    remedy = (
        "Non-tensor values must be None, bool, int, float, str, bytes, io.BytesIO, or lists / tuples / dicts "
        "of those; convert it (e.g. to a tensor or a string) or leave it out of the state given to dcp.save."
    )
    leave_out = ", or leave it out of the state given to dcp.save"


_ENCODER = _ValueEncoder()


def _to_json(value: Any, where: str) -> Any:
    """The JSON node of a non-tensor value (:mod:`ckpt.values`); a value that would need pickle, or nests
    too deep for the reader, is a :class:`~ckpt.errors.RefusedStateError` naming ``where`` (its key)."""
    return _ENCODER.encode(value, where)


def _from_json(obj: Any, where: str) -> Any:
    """The value of JSON node ``obj`` (:func:`ckpt.values.decode`, old checkpoints' tags included); a
    malformed node is a :class:`~ckpt.errors.CorruptCheckpointError` naming ``where``."""
    return values.decode(obj, where, legacy=True)


def _plain_lookup(planner: SavePlanner) -> bool:
    """Whether ``planner`` resolves a value item the way DCP's ``DefaultSavePlanner`` does
    (``torch.save`` of ``lookup_object``), so the value can be looked up instead of unpickled."""

    def own(name: str) -> bool:
        return getattr(getattr(planner, name, None), "__func__", None) is getattr(DefaultSavePlanner, name)

    return hasattr(planner, "lookup_object") and own("resolve_data") and own("transform_object")


_SAFE_GLOBALS_LOCK = threading.Lock()


def _planner_value(data: Any, where: str) -> Any:
    """The value in a save planner's ``resolve_data`` result for a value item: ``torch.save`` output
    made in this process, read by torch's ``weights_only`` unpickler (plain data only, and
    ``io.BytesIO``, which DCP's planners treat as a value). Other bytes (a planner's own format) are
    refused with the key's name: this storage keeps values as JSON, never as opaque bytes."""
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    try:
        with _SAFE_GLOBALS_LOCK:
            extra = [] if io.BytesIO in torch.serialization.get_safe_globals() else [io.BytesIO]
            with torch.serialization.safe_globals(extra):
                return torch.load(io.BytesIO(bytes(raw)), weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors have many types
        raise ValueError(
            f"state value {where!r}: the save planner's resolve_data gave {type(data).__name__} that "
            f"is not torch.save output of plain data ({type(e).__name__}); TierStorageWriter stores "
            "non-tensor values as JSON, never opaque bytes"
        ) from None


# -- metadata <-> JSON --------------------------------------------------------------------------------
def _index_to_json(ix: MetadataIndex) -> dict[str, Any]:
    return {"fqn": ix.fqn, "offset": list(ix.offset) if ix.offset is not None else None}


def _metadata_to_json(md: Metadata) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes"}
        elif isinstance(m, TensorStorageMetadata):
            p = m.properties
            if p.layout != torch.strided:
                raise ValueError(
                    f"tensor {fqn!r} has layout {p.layout}; TierStorageWriter stores strided tensors only"
                )
            entries[fqn] = {
                "kind": "tensor",
                "dtype": dtype_to_str(p.dtype),
                "size": list(m.size),
                "requires_grad": bool(p.requires_grad),
                "pin_memory": bool(p.pin_memory),
                "memory_format": _MEMORY_FORMAT_NAMES.get(p.memory_format, "contiguous"),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
            }
        else:
            raise ValueError(
                f"state entry {fqn!r} has DCP metadata of type {type(m).__name__}, which this "
                "storage does not know"
            )
    try:
        planner_data = _to_json(md.planner_data, "planner_data")
    except RefusedStateError as e:
        raise RefusedStateError(
            f"{e} (the save planner's planner_data; use DCP's DefaultSavePlanner or one whose "
            "planner_data is plain data)",
            path=e.path,
        ) from None
    items = [{"index": _index_to_json(ix), **rec} for ix, rec in (md.storage_data or {}).items()]
    sm = md.storage_meta
    return {
        "format": FORMAT,
        "version": _VERSION,
        "dcp_version": md.version,
        "state": entries,
        "planner_data": planner_data,
        "items": items,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        },
    }


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"{where}: {what}")


def _opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _metadata_from_json(raw: bytes, where: str) -> tuple[Metadata, dict[MetadataIndex, dict[str, Any]]]:
    """DCP's Metadata and our item records from ``metadata.json``, every field checked: sizes and
    shapes bounded (:func:`ckpt.format.check_shape`), every tensor item exactly one saved chunk of its
    entry (same dtype and shape), the items of a rank file disjoint. Anything else is a
    :class:`CorruptCheckpointError` naming the file."""
    obj = parse_record(raw, where)
    _need(obj.get("format") == FORMAT, where, f"not a {FORMAT} metadata record")
    _need(
        obj.get("version") == _VERSION,
        where,
        f"format version {obj.get('version')!r}; this reader knows {_VERSION}",
    )
    state = obj.get("state")
    _need(isinstance(state, dict), where, "'state' is not an object")
    sdm: dict[str, Any] = {}
    for fqn, e in state.items():
        w = f"{where}: state[{fqn!r}]"
        _need(
            isinstance(e, dict) and e.get("kind") in ("bytes", "tensor"),
            w,
            "kind must be 'bytes' or 'tensor'",
        )
        if e["kind"] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        _need(isinstance(e.get("dtype"), str), w, "dtype must be a string")
        itemsize = str_to_dtype(e["dtype"], w).itemsize
        _need(check_shape(e.get("size"), itemsize), w, "size must be a list of bounded non-negative ints")
        _need(isinstance(e.get("chunks"), list), w, "chunks must be a list")
        chunks = []
        for c in e["chunks"]:
            _need(
                isinstance(c, dict)
                and check_shape(c.get("offsets"))
                and check_shape(c.get("sizes"), itemsize)
                and len(c["offsets"]) == len(c["sizes"]) == len(e["size"]),
                w,
                f"malformed chunk {c!r}",
            )
            _need(
                all(o + s <= n for o, s, n in zip(c["offsets"], c["sizes"], e["size"])),
                w,
                f"chunk {c!r} lies outside the tensor's size {e['size']}",
            )
            chunks.append(
                ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
            )
        # the global size is what a planner that builds the state from the metadata allocates: it must be
        # exactly what the chunks hold, each chunk once (one saved item each, checked below)
        _need(len({tuple(c.offsets) for c in chunks}) == len(chunks), w, "two chunks at one offset")
        _need(
            sum(math.prod(c.sizes) for c in chunks) == math.prod(e["size"]),
            w,
            f"its chunks hold {sum(math.prod(c.sizes) for c in chunks)} elements, its size {e['size']} "
            f"{math.prod(e['size'])}",
        )
        _need(e.get("memory_format", "contiguous") in _MEMORY_FORMATS, w, "unknown memory_format")
        props = TensorProperties(
            dtype=str_to_dtype(e["dtype"], w),
            layout=torch.strided,
            requires_grad=bool(e.get("requires_grad", False)),
            memory_format=_MEMORY_FORMATS[e.get("memory_format", "contiguous")],
            pin_memory=bool(e.get("pin_memory", False)),
        )
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(e["size"]), chunks=chunks)
    items = obj.get("items")
    _need(isinstance(items, list), where, "'items' is not a list")
    storage: dict[MetadataIndex, dict[str, Any]] = {}
    spans: dict[int, list[tuple[int, int, str]]] = {}
    part_sizes: dict[int, int | None] = {}
    for it in items:
        w = f"{where}: item {it.get('index') if isinstance(it, dict) else it!r}"
        _need(isinstance(it, dict) and isinstance(it.get("index"), dict), w, "malformed item")
        ix = it["index"]
        _need(isinstance(ix.get("fqn"), str) and ix["fqn"] in sdm, w, "names no entry of 'state'")
        _need(
            ix.get("offset") is None or check_shape(ix["offset"]), w, "offset must be null or a list of ints"
        )
        for key in ("rank", "offset_bytes", "length", "crc"):
            _need(_is_nonneg_int(it.get(key)) and it[key] < 1 << 62, w, f"{key} must be a non-negative int")
        _need(it.get("kind") in ("tensor", "bytes"), w, "kind must be 'tensor' or 'bytes'")
        part = it.get("part_bytes")  # the rank's file is parts of this size on an object store
        _need(
            part is None or (_is_nonneg_int(part) and MIN_PART_BYTES <= part < 1 << 62),
            w,
            f"part_bytes must be an int of at least {MIN_PART_BYTES}",
        )
        _need(
            part_sizes.setdefault(it["rank"], part) == part,
            w,
            f"part_bytes differs from that of the other items of {_data_name(it['rank'])}",
        )
        entry = sdm[ix["fqn"]]
        if it["kind"] == "tensor":
            _need(
                isinstance(entry, TensorStorageMetadata) and ix.get("offset") is not None,
                w,
                "a tensor item must name a chunk of a tensor entry of 'state'",
            )
            _need(isinstance(it.get("dtype"), str), w, "tensor item needs a dtype")
            dt = str_to_dtype(it["dtype"], w)
            _need(
                dt == entry.properties.dtype and check_shape(it.get("shape"), dt.itemsize),
                w,
                "tensor item needs its entry's dtype and a bounded shape",
            )
            chunk = next((c for c in entry.chunks if list(c.offsets) == ix["offset"]), None)
            _need(
                chunk is not None and list(chunk.sizes) == it["shape"],
                w,
                f"shape {it['shape']} at offset {ix['offset']} is no chunk of the entry's chunks",
            )
            n = math.prod(it["shape"])
            _need(
                n * dt.itemsize == it["length"],
                w,
                f"length {it['length']} does not match shape {it['shape']} of {it['dtype']}",
            )
        else:
            _need(
                isinstance(entry, BytesStorageMetadata) and ix.get("offset") is None,
                w,
                "a value item must name a value entry of 'state'",
            )
        if it["length"]:
            spans.setdefault(it["rank"], []).append((it["offset_bytes"], it["length"], ix["fqn"]))
        offset = torch.Size(ix["offset"]) if ix.get("offset") is not None else None
        storage[MetadataIndex(fqn=ix["fqn"], offset=offset)] = it
    for fqn, entry in sdm.items():
        if isinstance(entry, TensorStorageMetadata):
            for c in entry.chunks:
                _need(
                    MetadataIndex(fqn=fqn, offset=c.offsets) in storage,
                    f"{where}: state[{fqn!r}]",
                    f"no saved item holds its chunk at {list(c.offsets)}",
                )
    for rank, ranges in spans.items():
        ranges.sort()
        for (a, n, k), (b, _, k2) in zip(ranges, ranges[1:]):
            _need(b >= a + n, where, f"items {k!r} and {k2!r} overlap in {_data_name(rank)}")
    sm = obj.get("storage_meta")
    storage_meta = None
    if sm is not None:
        _need(
            isinstance(sm, dict)
            and all(_opt_str(sm.get(k)) for k in ("checkpoint_id", "save_id", "load_id"))
            and isinstance(sm.get("modules") or [], list)
            and all(isinstance(m, str) for m in sm.get("modules") or []),
            where,
            "malformed storage_meta",
        )
        storage_meta = StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"),
            save_id=sm.get("save_id"),
            load_id=sm.get("load_id"),
            modules=list(sm.get("modules") or []),
        )
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=_from_json(obj.get("planner_data"), f"{where}: planner_data"),
        storage_data=storage,
        storage_meta=storage_meta,
    )
    if isinstance(obj.get("dcp_version"), str):
        md.version = obj["dcp_version"]
    return md, storage


def _commit_record(world_size: int, metadata: bytes) -> bytes:
    return json.dumps(
        {
            "format": FORMAT,
            "version": _VERSION,
            "world_size": world_size,
            "metadata_bytes": len(metadata),
            "metadata_checksum": checksum(metadata),
            "algorithm": ALGORITHM,
            "created_unix": time.time(),
        }
    ).encode()


def _check_commit(raw: bytes, where: str) -> dict[str, Any]:
    obj = parse_record(raw, where)
    _need(
        obj.get("format") == FORMAT and obj.get("version") == _VERSION,
        where,
        f"not a {FORMAT} commit record of version {_VERSION}",
    )
    for key in ("world_size", "metadata_bytes", "metadata_checksum"):
        _need(_is_nonneg_int(obj.get(key)), where, f"{key} must be a non-negative int")
    _need(obj.get("algorithm") == ALGORITHM, where, f"checksum algorithm {obj.get('algorithm')!r}")
    _need(
        obj.get("created_unix") is None or _is_number(obj["created_unix"]),
        where,
        "created_unix must be a number",
    )
    return obj


def _committed_metadata(tier: _Tier, ckpt_id: str) -> tuple[dict[str, Any], bytes, str]:
    """The checked ``COMMIT`` of ``ckpt_id`` on ``tier``, the ``metadata.json`` it vouches for (its size and
    checksum as the ``COMMIT`` records) and where that is: ``FileNotFoundError`` when either is missing,
    :class:`~ckpt.errors.CorruptCheckpointError` naming the file that fails its checks."""
    commit = _check_commit(tier.get_record(ckpt_id, COMMIT_NAME), tier.path(ckpt_id, COMMIT_NAME))
    raw = tier.get_record(ckpt_id, METADATA_NAME)
    where = tier.path(ckpt_id, METADATA_NAME)
    _need(
        len(raw) == commit["metadata_bytes"] and checksum(raw) == commit["metadata_checksum"],
        where,
        "does not match the checksum its COMMIT records",
    )
    return commit, raw, where


def _parse_metadata(
    commit: dict[str, Any], raw: bytes, where: str
) -> tuple[Metadata, dict[MetadataIndex, dict[str, Any]]]:
    """DCP's Metadata and the item records of a committed ``metadata.json`` (:func:`_metadata_from_json`),
    whose items name only ranks its ``COMMIT`` says saved."""
    md, storage = _metadata_from_json(raw, where)
    ranks = {rec["rank"] for rec in storage.values()}
    _need(
        all(r < commit["world_size"] for r in ranks),
        where,
        f"items name ranks {sorted(ranks)} but its COMMIT says {commit['world_size']} ranks saved",
    )
    return md, storage


# -- writer -------------------------------------------------------------------------------------------
class TierStorageWriter(StorageWriter):
    """``dcp.save`` into ``local_dir``, ``url`` and the tiers of ``storage`` (see the module docstring).

    Args:
        local_dir: this node's checkpoint directory (fast disk); each rank writes its own file here.
        url: an fsspec URL (``s3://bucket/run``, ``gs://...``, ``file:///shared/...``) every rank writes
            to; the coordinator writes the metadata and ``COMMIT`` there too.
        storage_options: passed to fsspec for ``url`` (credentials, endpoint, ...).
        checkpoint_id: default name of the checkpoint when ``dcp.save`` gets none.
        keep: retention applied after each save (:class:`ckpt.Retention`: the newest ``local``
            checkpoints in ``local_dir``, ``remote`` at ``url``, and on another tier its count by name or what
            its class takes (:meth:`ckpt.Retention.count`); ``None`` keeps all). Default: none, every
            checkpoint stays. The checkpoint just saved is never deleted; see :func:`prune` for the order
            of deletion. A name none of the tiers has is a ``ValueError``.
        storage: the tiers as a :class:`ckpt.Storage` describes them for a Checkpointer (``local_dir``,
            ``url``, ``storage_options``, ``extra_tiers``); a field given here and as a keyword above is a
            ``ValueError``, and so is a field for what the adapter does not have (``peers``, ...).

    Collective: used through ``dcp.save``, which calls it on every rank.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike | None = None,
        url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        checkpoint_id: str | None = None,
        keep: Retention | None = None,
        *,
        storage: Storage | None = None,
    ) -> None:
        super().__init__()
        self.tiers = _tiers("TierStorageWriter", storage, local_dir, url, storage_options)
        if keep is not None and not isinstance(keep, Retention):
            raise TypeError(
                f"keep must be a ckpt.Retention (e.g. Retention(local=2, remote=10)), got {keep!r}"
            )
        if len(self.tiers) > 1 and all(t.client is not None for t in self.tiers):
            raise ValueError(
                f"TierStorageWriter: the tiers {', '.join(t.where for t in self.tiers)} are all URLs: "
                "a rank's file goes to each farther tier from a directory of this host, so add "
                "local_dir= (or give one URL)"
            )
        for name in keep.tiers if keep is not None else ():
            if name not in [t.name for t in self.tiers]:
                raise ValueError(
                    f"keep names the tier {name!r}, which is not one of this writer's tiers "
                    f"({', '.join(repr(t.name) for t in self.tiers)})"
                )
        self.keep = keep
        self._default_id = checkpoint_id
        self.checkpoint_id = checkpoint_id
        self.save_id = uuid.uuid4().hex  # StorageMeta.save_id of the next save (new at each reset)
        self.is_coordinator = False
        self._collective = True
        self._where = checkpoint_id  # the checkpoint this rank writes (set up by set_up_storage_writer)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.checkpoint_id = _checkpoint_name(checkpoint_id, self._default_id)
        self._where = self.checkpoint_id
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.checkpoint_id is None:
            self.checkpoint_id = _checkpoint_name(None, self._default_id)
        # dcp.save(use_collectives=False) on a job of several processes: every rank saves on its own
        # (no plans exchanged, each rank runs finish() on its own results), so each one commits a
        # checkpoint of its own, of one rank, inside this one; dcp.load reads it back (read_metadata
        # with rank=) when the checkpoint has no COMMIT of its own
        rank = kwargs.get("rank")
        self._collective = (
            kwargs.get("use_collectives", True) is not False
            or not _is_nonneg_int(rank)
            or not (
                torch.distributed.is_available()
                and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1
            )
        )
        self._where = self.checkpoint_id if self._collective else _rank_local_id(self.checkpoint_id, rank)
        self._no_commit: set[str] = set()
        for tier in self.tiers:  # every rank writes its file into the checkpoint's directory
            tier.refuse_linked(self.checkpoint_id)
            tier.refuse_linked(self._where)
        if is_coordinator or not self._collective:
            # a COMMIT left by an earlier save under this name would vouch for a mix of old and new
            # files while this save runs: take it away first (the files it covered go with the save);
            # a rank-local save also takes away the checkpoint's own COMMIT, which dcp.load prefers
            for tier in self.tiers:
                for name in dict.fromkeys((self._where, self.checkpoint_id)):
                    try:
                        tier.remove(name, COMMIT_NAME)
                    except Exception as e:  # noqa: BLE001 - that tier then gets no COMMIT from this save
                        self._no_commit.add(tier.name)
                        warnings.warn(
                            f"TierStorageWriter: could not clear {tier.where}/{name} "
                            f"({type(e).__name__}: {e}); this save will not be committed there",
                            stacklevel=2,
                        )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data={"rank": i}) for i, p in enumerate(plans)]

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked by DCP's storage auto-detection: pass it explicitly

    def _value_bytes(self, item: WriteItem, planner: SavePlanner) -> bytes:
        where = item.index.fqn
        if _plain_lookup(planner):
            value = planner.lookup_object(item.index)  # what DefaultSavePlanner would torch.save
        else:
            # a planner with its own resolve_data / transform_object (a hook that converts or redacts
            # values): its result is what gets stored, torch.save output made in this process
            value = _planner_value(planner.resolve_data(item), where)
        return json.dumps(_to_json(value, where), allow_nan=False).encode()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = plan.storage_data["rank"] if isinstance(plan.storage_data, dict) else 0
        name = _data_name(rank)
        results: list[WriteResult] = []
        # the rank's file is written once as it is produced: on the nearest tier that is a directory of this
        # host when there is one (then copied or uploaded from that file to each farther tier, in order),
        # else straight to the nearest tier (a URL), part by part
        local = next((t for t in self.tiers if t.client is None), None)
        part_bytes = _part_bytes()
        if local is not None:
            final = Path(local.path(self._where, name))
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
            sink: Any = open(tmp, "wb")
        else:
            remote = self.tiers[0]
            try:
                sink = remote.upload(self._where, name, rank, part_bytes)
            except OSError as e:
                raise _write_error(rank, name, self._where, remote, e) from e
        offset = 0
        # the caller's current stream per GPU: the helper thread copies on it, so the copies are
        # ordered after whatever produced the state there (a thread starts on the default stream)
        streams = (
            {i: torch.cuda.current_stream(i) for i in range(torch.cuda.device_count())}
            if torch.cuda.is_initialized()
            else {}
        )

        def prepare(item: WriteItem) -> tuple[Any, dict[str, Any], int]:
            # on a helper thread, one item ahead of the writes: the device-to-host copy and the
            # checksum of the next item overlap the write of this one (both release the GIL)
            if item.type == WriteItemType.BYTE_IO:
                data: Any = self._value_bytes(item, planner)
                rec: dict[str, Any] = {"kind": "bytes"}
            else:
                t = planner.resolve_data(item).detach()
                if t.is_cuda:
                    with torch.cuda.stream(streams[t.device.index]):
                        t = t.to("cpu")
                t = t.contiguous()
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
                rec = {"kind": "tensor", "dtype": dtype_to_str(t.dtype), "shape": list(t.shape)}
            return data, rec, checksum(data)

        # an object store holds the file as parts: the reader maps an item's bytes onto them
        parted = {"part_bytes": part_bytes} if any(t.parted for t in self.tiers) else {}
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="ckpt-dcp-stage") as stage:
                items = list(plan.items)
                ahead = stage.submit(prepare, items[0]) if items else None
                for i, item in enumerate(items):
                    data, rec, crc = ahead.result()
                    if i + 1 < len(items):
                        ahead = stage.submit(prepare, items[i + 1])
                    sink.write(data)
                    rec.update(rank=rank, offset_bytes=offset, length=len(data), crc=crc, **parted)
                    offset += len(data)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=rec))
            if local is not None:
                sink.flush()
                os.fsync(sink.fileno())
                sink.close()
                os.replace(tmp, final)
                fsync_dir(final.parent)
            else:
                sink.close()  # the last part goes up here (a mounted tier's file is flushed and renamed)
        except BaseException as e:
            if local is not None:
                sink.close()
                tmp.unlink(missing_ok=True)
                raise
            _gave_up(sink, rank, name, self._where, remote)
            if isinstance(e, OSError):  # the storage's failure: say where, keeping its kind (a stall ...)
                raise _write_error(rank, name, self._where, remote, e) from e
            raise
        if local is not None:
            self._prune_own(local, rank)
        took, failed = [self.tiers[0] if local is None else local], []
        for tier in self.tiers:
            if tier is local or local is None:
                continue
            try:
                if (
                    tier.client is None
                ):  # another directory of this host (a registered tier of the local kind)
                    _copy_file(tier, self._where, name, str(final))
                    self._prune_own(tier, rank)
                else:
                    _upload_file(tier, self._where, name, rank, str(final), part_bytes)
                took.append(tier)
            except Exception as e:  # noqa: BLE001 - reported; the save fails only if no tier took the file
                failed.append((tier, e))
                for r in results:
                    r.storage_data["missing"] = sorted(set(r.storage_data.get("missing", [])) | {tier.name})
        for tier, e in failed:
            warnings.warn(
                f"TierStorageWriter: rank {rank} could not write {name} of {self._where!r} "
                f"to {tier.where} ({type(e).__name__}: {e}); the checkpoint stays on the "
                f"{', '.join(t.name for t in took)} tier{'s' if len(took) > 1 else ''} only",
                stacklevel=2,
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _prune_own(self, tier: _Tier, rank: int) -> None:
        """Retention of this rank's own files on ``tier`` when it is a directory of this node
        (:func:`_prune_own_files`: what a node whose tier gets no ``COMMIT`` deletes itself)."""
        n = None if self.keep is None else self.keep.count(tier)
        if n is not None and self._collective and tier.on_node and tier.client is None:
            _prune_own_files(tier, rank, n, spare=self._where)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {}
        missing: set[str] = set(getattr(self, "_no_commit", ()))
        for per_rank in results:
            for r in per_rank:
                rec = dict(r.storage_data)
                missing.update(rec.pop("missing", []))
                storage[r.index] = rec
        metadata.storage_data = storage
        # DCP's planners leave storage_meta to the storage (FileSystemWriter sets it here too): the
        # checkpoint id and this save's id, recorded in metadata.json
        metadata.storage_meta = self.storage_meta()
        raw = json.dumps(_metadata_to_json(metadata), allow_nan=False).encode()
        commit = _commit_record(len(results), raw)
        committed = []
        for tier in self.tiers:
            if tier.name in missing:
                continue  # some rank's file did not reach this tier: no COMMIT may vouch for it
            try:  # the metadata, then COMMIT last (ckpt.commit: the protocol every tier follows)
                publish(tier.sink(self._where), [(METADATA_NAME, raw)], commit)
                committed.append(tier.name)
            except Exception as e:  # noqa: BLE001 - reported below
                warnings.warn(
                    f"TierStorageWriter: could not commit {self._where!r} on {tier.where} "
                    f"({type(e).__name__}: {e})",
                    stacklevel=2,
                )
        if not committed:
            raise OSError(
                5,
                f"TierStorageWriter: checkpoint {self._where!r} was committed on no tier "
                f"({', '.join(t.where for t in self.tiers)}); earlier checkpoints are untouched",
            )
        for tier in self.tiers:
            n = None if self.keep is None else self.keep.count(tier)
            if n is None or tier.name not in committed or not self._collective:  # rank-local: no retention
                continue
            try:
                _prune_tier(tier, n, spare=self._where)
            except Exception as e:  # noqa: BLE001 - the save itself succeeded
                warnings.warn(
                    f"TierStorageWriter: retention on {tier.where} failed ({type(e).__name__}: {e}); "
                    "older checkpoints stay until the next save or `ckpt gc --dcp`",
                    stacklevel=2,
                )


# -- reader -------------------------------------------------------------------------------------------
class TierStorageReader(StorageReader):
    """``dcp.load`` from the nearest tier holding a valid copy, item by item (see the module docstring).

    Args:
        local_dir: as :class:`TierStorageWriter`; the local tier is tried first.
        url: as :class:`TierStorageWriter`.
        storage_options: as :class:`TierStorageWriter`.
        checkpoint_id: default name when ``dcp.load`` gets none.
        threads: parallel range reads per rank (remote reads are latency-bound).
        storage: as :class:`TierStorageWriter`; the tiers are tried nearest first.

    Collective: used through ``dcp.load``, which calls it on every rank.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike | None = None,
        url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        checkpoint_id: str | None = None,
        threads: int = 8,
        *,
        storage: Storage | None = None,
    ) -> None:
        super().__init__()
        self.tiers = _tiers("TierStorageReader", storage, local_dir, url, storage_options)
        self._default_id = checkpoint_id
        self.checkpoint_id = checkpoint_id
        self.threads = max(1, int(threads))
        self.storage: dict[MetadataIndex, dict[str, Any]] = {}
        self.committed: list[str] = []  # tiers (their paths) holding a valid COMMIT, after read_metadata
        self.source: str | None = None  # the tier the metadata came from
        self.load_id = uuid.uuid4().hex  # StorageMeta.load_id given to the planner (new at each reset)
        self._where = checkpoint_id  # the checkpoint read: checkpoint_id, or a rank's own inside it

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.checkpoint_id = _checkpoint_name(checkpoint_id, self._default_id)
        self._where = self.checkpoint_id
        self.storage = {}
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata; with ``rank=`` (what ``dcp.load`` asks when the checkpoint has
        no ``COMMIT`` of its own: a ``dcp.save(use_collectives=False)``), that rank's own checkpoint
        inside it, else the checkpoint's."""
        self.checkpoint_id = _checkpoint_name(self.checkpoint_id, self._default_id)
        rank = kwargs.get("rank")
        names = (
            [self.checkpoint_id]
            if not _is_nonneg_int(rank)
            else [_rank_local_id(self.checkpoint_id, rank), self.checkpoint_id]
        )
        problems: list[str] = []
        for ckpt_id in names:
            md = self._read_metadata_of(ckpt_id, problems)
            if md is not None:
                return md
        raise IncompleteCheckpointError(
            f"no tier holds a valid committed checkpoint {names[0]!r}: " + "; ".join(problems)
        )

    def _read_metadata_of(self, ckpt_id: str, problems: list[str]) -> Metadata | None:
        self.committed = []
        found: tuple[Metadata, dict, str] | None = None
        for tier in self.tiers:
            try:
                commit, raw, mwhere = _committed_metadata(tier, ckpt_id)
                if found is None:
                    found = (*_parse_metadata(commit, raw, mwhere), tier.where)
                self.committed.append(tier.where)
            except FileNotFoundError:
                problems.append(f"{tier.where}: no committed checkpoint {ckpt_id!r}")
            except CorruptCheckpointError as e:
                problems.append(str(e))
                warnings.warn(f"TierStorageReader: skipping {tier.where} ({e})", stacklevel=3)
            except OSError as e:
                problems.append(f"{tier.where}: {type(e).__name__}: {e}")
        if found is None:
            return None
        md, self.storage, self.source = found
        self._where = ckpt_id
        if md.storage_meta is None:  # saved by a writer that recorded none
            md.storage_meta = StorageMeta(checkpoint_id=ckpt_id)
        md.storage_meta.load_id = self.load_id
        # the item records of the metadata's storage_data stay ours; DCP needs only the index keys
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not self.storage and isinstance(metadata.storage_data, dict):
            self.storage = metadata.storage_data  # metadata read by another reader instance

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _fetch(
        self, req: ReadItem, tiers: list[_Tier], tried: list[str], final: bool
    ) -> tuple[ReadItem, bytes | bytearray, dict[str, Any]] | None:
        """The item's bytes from the first of ``tiers`` whose copy matches its checksum; ``None`` when
        none does and ``final`` is false (``tried`` then says why), else CorruptCheckpointError."""
        rec = self.storage.get(req.storage_index)
        if rec is None:
            raise CorruptCheckpointError(
                f"checkpoint {self._where!r} has no stored item for "
                f"{req.storage_index.fqn!r} at offset {req.storage_index.offset}"
            )
        name = _data_name(rec["rank"])
        start, end = rec["offset_bytes"], rec["offset_bytes"] + rec["length"]
        stalled: StallError | None = None
        for tier in tiers:  # nearest first; every copy is checked against the committed checksum
            try:
                data, ok = tier.item(self._where, rec)
            except (OSError, IncompleteCheckpointError, CorruptCheckpointError) as e:
                # missing, cut short, not a regular file, or the store stalled: that tier lacks it
                tried.append(f"{tier.where}: {type(e).__name__}: {e}")
                if isinstance(e, StallError):
                    stalled = e
                continue
            if ok:
                return req, data, rec
            tried.append(f"{tier.where}: {name} bytes {start}..{end} do not match their checksum")
            if final and tier is tiers[-1]:
                break  # no tier left to try: the error below says it all
            warnings.warn(
                f"TierStorageReader: the copy of {req.storage_index.fqn!r} of {self._where!r} on "
                f"{tier.where} fails its checksum ({name} bytes {start}..{end}); trying the next tier",
                stacklevel=3,
            )
        if not final:
            return None
        if (
            stalled is not None
        ):  # not known to be corrupt: the store stopped answering (a later load may work)
            raise StallError(
                errno.ETIMEDOUT,
                f"no tier gave a valid copy of {req.storage_index.fqn!r} (in {name} of "
                f"{self._where!r}) and a store stalled (CKPT_REMOTE_STALL_S): {'; '.join(tried)}",
                stalled.filename,
            )
        raise CorruptCheckpointError(
            f"no tier holds a valid copy of {req.storage_index.fqn!r} "
            f"(in {name} of {self._where!r}): {'; '.join(tried)}"
        )

    def _serve(
        self, req: ReadItem, data: bytes | bytearray, rec: dict[str, Any], planner: LoadPlanner
    ) -> None:
        where = f"{req.storage_index.fqn!r} of {self._where!r}"
        if req.type == LoadItemType.BYTE_IO:
            _need(rec["kind"] == "bytes", where, "stored as a tensor, read as a value")
            value = _from_json(
                parse_record(data, where, expect=None), where
            )  # depth-bounded: no RecursionError
            buf = io.BytesIO()
            torch.save(value, buf)  # made here from plain data, for DCP's load planner
            buf.seek(0)
            planner.load_bytes(req, buf)
            return
        _need(rec["kind"] == "tensor", where, "stored as a value, read as a tensor")
        dtype = str_to_dtype(rec["dtype"], where)
        if not isinstance(data, bytearray):
            data = bytearray(data)  # torch.frombuffer wants a writable buffer
        stored = torch.frombuffer(data, dtype=dtype) if data else empty_tensor((0,), dtype)
        try:  # the metadata was checked; this guards against a load plan that does not fit it
            stored = stored.reshape(rec["shape"])
            for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                stored = stored.narrow(dim, off, length)
        except (RuntimeError, ValueError, IndexError) as e:
            raise CorruptCheckpointError(
                f"{where}: the stored chunk {rec['shape']} does not hold the requested "
                f"offsets {list(req.storage_offsets)} / lengths {list(req.lengths)} "
                f"({type(e).__name__}: {e})"
            ) from None
        target = planner.resolve_tensor(req).detach()
        if target.shape != stored.shape:
            raise CorruptCheckpointError(
                f"{where}: stored chunk gives shape {tuple(stored.shape)}, the load "
                f"plan wants {tuple(target.shape)}"
            )
        with writing_state():
            target.copy_(stored)
        planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # The local tier is read inline, item after item (page-cache or NVMe reads, no latency to
        # hide; reader threads would only compete with the copies for the cores). Items it cannot
        # serve go to the farther tiers through a thread pool (object-store reads are latency-bound).
        local = [t for t in self.tiers if t.on_node]
        farther = [t for t in self.tiers if not t.on_node]
        pending: list[tuple[ReadItem, list[str]]] = []
        for req in plan.items:
            tried: list[str] = []
            got = self._fetch(req, local, tried, final=not farther) if local else None
            if got is None:
                pending.append((req, tried))
            else:
                self._serve(*got, planner)
        if pending:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-dcp-read") as pool:
                for got in pool.map(lambda p: self._fetch(p[0], farther, p[1], final=True), pending):
                    self._serve(*got, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


# -- operations -------------------------------------------------------------------------------------
def _one_tier(where: str | os.PathLike | Tier, storage_options: dict[str, Any] | None) -> _Tier:
    if isinstance(where, Tier):  # the engine's tier (a registered one, say): its storage, its class's roles
        return _Tier.of(where)
    w = os.fspath(where)
    return _Tier.at_url(w, storage_options) if is_url(w) else _Tier.directory(w)


def list_checkpoints(
    where: str | os.PathLike | Tier, storage_options: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The checkpoint ids under ``where`` (a local directory, an fsspec URL, or the engine's tier object of
    either kind, such as a registered tier's) whose ``COMMIT`` is a valid record of this format, sorted by
    name: dicts ``{"id", "world_size", "bytes"}`` (``bytes``: the ranks' data files, as listed)."""
    return _list_tier(_one_tier(where, storage_options))


def _list_tier(tier: _Tier) -> list[dict[str, Any]]:
    """The rows of :func:`list_checkpoints` for one tier. A URL is listed by one fresh listing of the store
    client (:meth:`~ckpt.tiers.remote_store.StoreClient.listing`, as the remote tier lists its steps) and
    each ``COMMIT`` read with its bounds; what is read from the listing is the adapter's own, since a
    checkpoint id is any relative name (nested too), not the engine's ``step-N`` directory."""
    out = []
    if tier.client is None:
        root = Path(tier.root)
        names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        sizes = {n: sum(f.stat().st_size for f in (root / n).glob("rank-*.dcp.bin")) for n in names}
    else:
        listing = tier.client.listing(f"listing {tier.where}", "find", tier.root, {}, detail=True)
        names, sizes = set(), {}
        for path, info in listing.items():
            rel = path[len(tier.root) :].strip("/").split("/") if path.startswith(tier.root) else []
            if len(rel) < 2:
                continue
            data = rel[-1]
            if len(rel) >= 3 and _is_data_name(rel[-2], PARTS):  # a part of a data file
                data, rel = rel[-2], rel[:-1]
            ckpt_id = "/".join(rel[:-1])
            names.add(ckpt_id)
            if _is_data_name(data, PARTS) or _is_data_name(data):
                sizes[ckpt_id] = sizes.get(ckpt_id, 0) + int(info.get("size") or 0)
        names = sorted(names)
    for name in names:
        try:
            commit = _check_commit(tier.get_record(name, COMMIT_NAME), tier.path(name, COMMIT_NAME))
        except (OSError, CorruptCheckpointError):
            continue
        created = commit.get("created_unix")
        out.append(
            {
                "id": name,
                "world_size": commit["world_size"],
                "bytes": sizes.get(name, 0),
                "created_unix": created if isinstance(created, (int, float)) else None,
                "linked": _linked(tier, name),
            }
        )
    return out


def _is_data_name(name: str, suffix: str = "") -> bool:
    """Whether ``name`` is a rank's data file (``rank-RRRRR.dcp.bin``), with ``suffix`` (its parts' folder)."""
    return name.startswith("rank-") and name.endswith(".dcp.bin" + suffix)


def _linked(tier: _Tier, ckpt_id: str) -> bool:
    """Whether a checkpoint directory on a local or mounted (``file://``) tier is, or sits under, a
    symbolic link, or holds a ``COMMIT`` that is one: listed and loadable, never deleted."""
    if not tier.on_host:
        return False
    parts = ckpt_id.split("/")
    return any(linked(tier.root, "/".join(parts[:i])) for i in range(1, len(parts) + 1))


def prune(
    where: str | os.PathLike | Tier,
    keep: int,
    storage_options: dict[str, Any] | None = None,
    dry_run: bool = False,
    verify: bool = False,
) -> list[str]:
    """Delete all but the ``keep`` (at least 1) newest committed checkpoints under ``where`` (one tier, as
    for :func:`list_checkpoints`), newest by the time their ``COMMIT`` records; returns the ids removed (or,
    with ``dry_run``, that would be). Each goes ``COMMIT`` first,
    so a deletion cut short leaves an uncommitted directory, never a committed checkpoint with files missing.
    Uncommitted directories (a save in progress, or one that failed) are left alone, and so are linked
    checkpoints (a directory or ``COMMIT`` that is a symbolic link: listed and loadable, but neither counted
    nor deleted, nor anything inside them).

    ``verify=True`` (what ``ckpt gc --dcp`` does) also keeps the newest checkpoint that verifies
    (:func:`verify`, newest first, only while some would be deleted; each failure is a warning);
    when none does, nothing is deleted and :class:`~ckpt.errors.NoCheckpointError` is raised."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    tier = _one_tier(where, storage_options)
    check = (lambda ckpt_id: _verifies(where, ckpt_id, storage_options)) if verify else None
    return _prune_tier(tier, keep, dry_run=dry_run, verify=check)


def _verifies(where: str | os.PathLike | Tier, ckpt_id: str, storage_options: dict[str, Any] | None) -> bool:
    try:
        verify(where, ckpt_id, storage_options)
        return True
    except (CorruptCheckpointError, IncompleteCheckpointError, OSError) as e:
        warnings.warn(
            f"{ckpt_id!r} does not verify, so it does not count as the checkpoint to keep: {e}", stacklevel=4
        )
        return False


class _Listed:
    """One listing of a tier's committed checkpoints as the engine's retention takes a tier
    (:func:`ckpt.policy.prune`): a checkpoint id is no step, so each is numbered by its place in commit
    order (the time its ``COMMIT`` records, then its id; 1 the oldest), all on one timeline. Uncommitted
    directories are not listed, so retention leaves them alone; linked ones are listed, not owned."""

    def __init__(self, tier: _Tier) -> None:
        self.tier, self.name = tier, tier.name
        rows = sorted(_list_tier(tier), key=lambda r: (r["created_unix"] or 0.0, r["id"]))
        self.ids = [r["id"] for r in rows]
        self.linked = [r["linked"] for r in rows]

    def step(self, ckpt_id: str) -> int | None:
        return self.ids.index(ckpt_id) + 1 if ckpt_id in self.ids else None

    def committed(self) -> list[Committed]:
        return [Committed(i, linked=ln) for i, ln in enumerate(self.linked, 1)]

    def owns(self, step: int) -> bool:
        return not self.linked[step - 1]

    def all_step_dirs(self) -> list[int]:
        return list(range(1, len(self.ids) + 1))

    def delete(self, step: int) -> None:
        self.tier.delete(self.ids[step - 1])


def _prune_tier(
    tier: _Tier, keep: int | None, dry_run: bool = False, spare: str | None = None, verify: Any = None
) -> list[str]:
    """Retention of one tier by the engine's rule (:func:`ckpt.policy.prune`; ``spare``: the checkpoint
    just saved, never deleted); with ``verify`` (checkpoint id -> whether it verifies) and none that
    does, nothing is deleted and :class:`~ckpt.errors.NoCheckpointError` says so."""
    listed = _Listed(tier)
    asked: list[bool] = []

    def verified(step: int) -> bool:
        asked.append(bool(verify(listed.ids[step - 1])))
        return asked[-1]

    busy = [s for s in (listed.step(spare),) if s is not None] if spare is not None else []
    gone = policy.prune(listed, keep, busy, dry_run, verified if verify is not None else None)
    if asked and not any(asked):
        raise NoCheckpointError(f"no checkpoint under {tier.where} verifies, so none was deleted")
    return [listed.ids[s - 1] for s in gone]


def _prune_own_files(tier: _Tier, rank: int, keep: int, spare: str) -> None:
    """Retention for a node whose local tier never gets a ``COMMIT`` (every node but the
    coordinator's): this rank's own files in uncommitted checkpoint directories, all but the newest
    ``keep`` by modification time (``spare``, the one just written, always stays), are deleted, and
    a directory left with no rank files is removed. Committed directories are the coordinator's
    to prune (:func:`_prune_tier`), so none ever loses a file while its ``COMMIT`` vouches for it.
    Linked directories (symbolic links) are never entered."""
    root = Path(tier.root)
    name = _data_name(rank)
    mine = []
    for d in root.iterdir() if root.is_dir() else ():
        f = d / name
        if d.name != spare and not d.is_symlink() and f.is_file() and not (d / COMMIT_NAME).exists():
            mine.append((f.stat().st_mtime, d))
    mine.sort(reverse=True)
    for _, d in mine[max(0, keep - 1) :]:  # the spared checkpoint counts as one of the kept
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # a link swapped in: ELOOP
            try:
                os.unlink(name, dir_fd=fd)
                left = [
                    e
                    for e in os.listdir(fd)
                    if e.startswith("rank-") and e.endswith(".dcp.bin") or e == COMMIT_NAME
                ]
            finally:
                os.close(fd)
            if not left:
                remove_step_dir(root, d.name)
        except OSError as e:
            warnings.warn(f"TierStorageWriter: retention could not delete {d / name} ({e})", stacklevel=3)


def verify(
    where: str | os.PathLike | Tier, checkpoint_id: str, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Read every byte of checkpoint ``checkpoint_id`` under ``where`` (one tier, as for
    :func:`list_checkpoints`) and check the ``COMMIT``, the metadata and every item's checksum
    (:meth:`_Tier.item`, the reader's check; not the tier contract's ``verify``, whose checksums are the
    engine's per-chunk ones).

    Returns ``{"id", "items", "bytes"}``; raises :class:`~ckpt.errors.CorruptCheckpointError` or
    :class:`~ckpt.errors.IncompleteCheckpointError` naming the first file or item that fails."""
    tier = _one_tier(where, storage_options)
    name = _checkpoint_name(checkpoint_id, None)
    try:
        commit, raw, mwhere = _committed_metadata(tier, name)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(
            f"{tier.path(name, COMMIT_NAME)}: no committed checkpoint ({e})"
        ) from None
    _, storage = _parse_metadata(commit, raw, mwhere)
    by_rank: dict[int, list[tuple[MetadataIndex, dict[str, Any]]]] = {}
    for ix, rec in storage.items():
        by_rank.setdefault(rec["rank"], []).append((ix, rec))
    total = 0
    for rank, recs in sorted(by_rank.items()):
        fname = _data_name(rank)
        for ix, rec in sorted(recs, key=lambda r: r[1]["offset_bytes"]):  # item by item: one in memory
            a, b = rec["offset_bytes"], rec["offset_bytes"] + rec["length"]
            try:
                data, ok = tier.item(name, rec)
            except FileNotFoundError:
                raise IncompleteCheckpointError(f"{tier.path(name, fname)}: missing") from None
            if not ok:
                raise CorruptCheckpointError(
                    f"{tier.path(name, fname)}: item {ix.fqn!r} (bytes {a}..{b}) "
                    "fails its checksum" + (" (file too short)" if len(data) < b - a else "")
                )
            total += len(data)
    return {"id": name, "items": len(storage), "bytes": total}

"""On-disk format: names, manifest and commit records, atomic writes.

::

    <root>/step-000001200/
        rank-00000.bin              one data file per rank, tensors 4 KiB aligned
        rank-00000.manifest.json    per-rank index: items, chunk checksums, state tree
        COMMIT                      written last, atomically: step, world size, manifest checksums
    <root>/latest                   names the newest committed step; moved only after COMMIT

A checkpoint exists on a tier iff its ``COMMIT`` exists there. Everything is
JSON or raw tensor bytes: loading never executes code. Records read from disk
are validated field by field, so a hostile or torn file gives a
:class:`~ckpt.errors.CorruptCheckpointError` naming the file, never a crash
deeper in.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import CorruptCheckpointError
from .integrity import ALGORITHM, checksum

__all__ = [
    "FORMAT_VERSION",
    "COMMIT_NAME",
    "LATEST_NAME",
    "ItemRecord",
    "Manifest",
    "Commit",
    "step_dir_name",
    "parse_step_dir",
    "data_name",
    "manifest_name",
    "dtype_to_str",
    "str_to_dtype",
    "write_atomic",
    "fsync_dir",
    "read_records",
    "new_generation",
]

FORMAT_VERSION = 1
COMMIT_NAME = "COMMIT"
LATEST_NAME = "latest"
MAX_RECORD_BYTES = 1 << 30  # a manifest larger than this is refused, not parsed

_STEP_RE = re.compile(r"^step-(\d{9,})$")
_GENERATION_RE = re.compile(r"^g[0-9a-f]{16}$")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def new_generation() -> str:
    """A fresh name for the subdirectory that holds a replacement copy of a step (see ``Commit.generation``)."""
    return "g" + secrets.token_hex(8)


def _valid_generation(g: Any) -> bool:
    return g is None or (isinstance(g, str) and _GENERATION_RE.match(g) is not None)


def _without_unset_generation(d: dict) -> dict:
    # written only when set, so that every other record keeps the bytes (and readers) it always had
    if d.get("generation") is None:
        d.pop("generation", None)
    return d


def data_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.manifest.json"


def dtype_to_str(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"dtype {dtype} is not supported by the checkpoint format")
    return name


def str_to_dtype(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r}") from None


@dataclass
class ItemRecord:
    """One tensor of a rank's data file.

    ``offset``/``nbytes`` locate its bytes in the data file; ``device`` is the
    device type it was saved from ("cuda", "cpu"), used to place tensors that
    have no existing counterpart at restore; ``alias_of`` names an earlier item
    that shares the same memory (tied weights), in which case no bytes are stored.
    """

    key: str
    dtype: str
    shape: list[int]
    device: str
    offset: int
    nbytes: int
    alias_of: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Manifest:
    """Per-rank index of a data file."""

    step: int
    rank: int
    world_size: int
    data_bytes: int
    chunk_bytes: int
    chunks: list[int]
    items: list[ItemRecord]
    tree: Any
    codecs: list[str] | None = None        # per chunk, on tiers that encode chunks (remote); None: raw
    stored_sizes: list[int] | None = None  # per chunk, bytes as stored (after the codec)
    job: list[int] | None = None           # [rank, world size] of the multi-process job that saved it
    replicated: list[int] | None = None    # items the same on every rank: a job tier stores them once (rank 0)
    checksum_algorithm: str = ALGORITHM
    format_version: int = FORMAT_VERSION
    created_unix: float = field(default_factory=time.time)
    generation: str | None = None          # remote tier: the subdirectory holding this copy (Commit.generation)

    def to_bytes(self) -> bytes:
        return json.dumps(_without_unset_generation(asdict(self)), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "Manifest":
        d = _load_json(raw, where)
        try:
            items = [ItemRecord(**it) for it in d.pop("items")]
            m = cls(items=items, **d)
        except (TypeError, KeyError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e})") from None
        m._validate(where)
        return m

    def _validate(self, where: str) -> None:
        def bad(msg: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: {msg}")

        if self.format_version != FORMAT_VERSION:
            raise bad(f"format version {self.format_version!r}, this library reads {FORMAT_VERSION}")
        if self.checksum_algorithm != ALGORITHM:
            raise bad(f"checksum algorithm {self.checksum_algorithm!r}, expected {ALGORITHM!r}")
        for name in ("step", "rank", "world_size", "data_bytes", "chunk_bytes"):
            if not _is_nonneg_int(getattr(self, name)):
                raise bad(f"{name} must be a non-negative integer")
        if self.chunk_bytes <= 0 or self.world_size <= 0 or self.rank >= self.world_size:
            raise bad("chunk_bytes, world_size or rank out of range")
        if not _valid_generation(self.generation):
            raise bad(f"generation must be 'g' and 16 hex digits, got {self.generation!r}")
        if not isinstance(self.chunks, list) or len(self.chunks) != -(-self.data_bytes // self.chunk_bytes):
            raise bad("chunk checksum list does not cover the data file")
        if not all(_is_nonneg_int(c) for c in self.chunks):
            raise bad("chunk checksums must be non-negative integers")
        if (self.codecs is None) != (self.stored_sizes is None):
            raise bad("codecs and stored_sizes must both be present or both absent")
        if self.codecs is not None:
            if not (isinstance(self.codecs, list) and isinstance(self.stored_sizes, list)
                    and len(self.codecs) == len(self.chunks) == len(self.stored_sizes)
                    and all(isinstance(c, str) for c in self.codecs)
                    and all(_is_nonneg_int(n) for n in self.stored_sizes)):
                raise bad("per-chunk codecs / stored sizes do not match the chunk list")
        if self.job is not None and not (isinstance(self.job, list) and len(self.job) == 2
                                         and all(_is_nonneg_int(v) for v in self.job) and self.job[0] < self.job[1]):
            raise bad(f"job must be [rank, world size], got {self.job!r}")
        if self.replicated is not None and not (
                isinstance(self.replicated, list)
                and all(_is_nonneg_int(i) and i < len(self.items) for i in self.replicated)):
            raise bad("replicated must list item indices")
        for i, it in enumerate(self.items):
            dtype = str_to_dtype(it.dtype, where)
            if not isinstance(it.key, str) or not isinstance(it.device, str):
                raise bad(f"item {i}: key and device must be strings")
            if not isinstance(it.shape, list) or not all(_is_nonneg_int(s) for s in it.shape):
                raise bad(f"item {it.key!r}: bad shape {it.shape!r}")
            if it.alias_of is not None:
                if not _is_nonneg_int(it.alias_of) or it.alias_of >= i:
                    raise bad(f"item {it.key!r}: bad alias")
                continue
            if not (_is_nonneg_int(it.offset) and _is_nonneg_int(it.nbytes)):
                raise bad(f"item {it.key!r}: bad byte range")
            if it.nbytes != it.numel * dtype.itemsize or it.offset + it.nbytes > self.data_bytes:
                raise bad(f"item {it.key!r}: byte range [{it.offset}, {it.offset + it.nbytes}) "
                          f"does not fit its shape or the {self.data_bytes}-byte data file")


@dataclass
class Commit:
    """The commit record: a checkpoint exists on a tier iff this file exists there."""

    step: int
    world_size: int
    manifests: dict[str, int]   # manifest file name -> checksum of its bytes
    data: dict[str, int]        # data file name -> size in bytes
    format_version: int = FORMAT_VERSION
    created_unix: float = field(default_factory=time.time)
    # A copy that replaced a committed one on the remote tier lives in step-.../<generation>/ (its manifests
    # and parts), so that putting this record is the switch from the old copy to the new one. None: the
    # step directory itself.
    generation: str | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(_without_unset_generation(asdict(self)), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "Commit":
        d = _load_json(raw, where)
        try:
            c = cls(**d)
        except TypeError as e:
            raise CorruptCheckpointError(f"{where}: malformed commit record ({e})") from None
        ok = (
            c.format_version == FORMAT_VERSION
            and _is_nonneg_int(c.step)
            and _is_nonneg_int(c.world_size) and c.world_size > 0
            and isinstance(c.manifests, dict) and len(c.manifests) == c.world_size
            and all(isinstance(k, str) and _is_nonneg_int(v) for k, v in c.manifests.items())
            and isinstance(c.data, dict)
            and all(isinstance(k, str) and _is_nonneg_int(v) for k, v in c.data.items())
            and _valid_generation(c.generation)
        )
        if not ok:
            raise CorruptCheckpointError(f"{where}: commit record fails validation")
        return c

    @staticmethod
    def manifest_checksum(raw: bytes) -> int:
        return checksum(raw)


def _is_nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _load_json(raw: bytes, where: str) -> dict:
    if len(raw) > MAX_RECORD_BYTES:
        raise CorruptCheckpointError(f"{where}: record of {len(raw)} bytes is larger than any this library writes")
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object")
    return d


def fsync_dir(path: Path | str) -> None:
    """Make a rename or create inside ``path`` durable."""
    fsync_file(path)


def fsync_file(path: Path | str, and_dir: bool = False) -> None:
    """Flush a file (or directory) written through another handle to stable storage; with
    ``and_dir``, its directory too (so that its name is durable as well)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if and_dir:
        fsync_file(os.path.dirname(os.fspath(path)) or ".")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_records(get: "Callable[[str], bytes]", step: int, rank: int, world_size: int,
                 where: str) -> tuple[Commit, Manifest]:
    """Read and validate ``COMMIT`` and rank ``rank``'s manifest of ``step`` through ``get(name)``.

    ``get`` returns a file's bytes by its name inside the step directory (raising
    :class:`~ckpt.errors.IncompleteCheckpointError` when it is missing); ``where``
    prefixes error messages (the step directory's path or URL).
    """
    from .errors import IncompatibleCheckpointError

    cwhere = f"{where}/{COMMIT_NAME}"
    commit = Commit.from_bytes(get(COMMIT_NAME), cwhere)
    if commit.step != step:
        raise CorruptCheckpointError(f"{cwhere}: records step {commit.step}, directory says {step}")
    if commit.world_size != world_size:
        raise IncompatibleCheckpointError(
            f"{cwhere}: saved with world size {commit.world_size}, restoring with {world_size}")
    mname = manifest_name(rank)
    if mname not in commit.manifests:
        raise CorruptCheckpointError(f"{cwhere}: does not list {mname}")
    mpath = mname if commit.generation is None else f"{commit.generation}/{mname}"
    raw = get(mpath)
    if Commit.manifest_checksum(raw) != commit.manifests[mname]:
        raise CorruptCheckpointError(f"{where}/{mpath}: checksum does not match the one recorded in {cwhere}")
    manifest = Manifest.from_bytes(raw, f"{where}/{mpath}")
    if commit.data.get(data_name(rank)) != manifest.data_bytes or manifest.generation != commit.generation:
        raise CorruptCheckpointError(f"{cwhere}: data size or generation record disagrees with {where}/{mpath}")
    return commit, manifest

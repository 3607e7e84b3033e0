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

Every record (manifest, ``COMMIT``, a DCP checkpoint's metadata) is read through one
mechanism: :func:`read_record` (a local file) or :func:`read_record_fs` (an fsspec path)
refuse anything but a regular file before opening it (a FIFO cannot block, a link to
``/dev/zero`` is never read), refuse a file larger than :data:`MAX_RECORD_BYTES` by its size
and never read more than that limit even if the file grows or lies about its size; then
:func:`parse_record` refuses JSON nested deeper than :data:`MAX_JSON_DEPTH` before parsing it.
Data files are opened through :func:`open_regular`, with the same refusal of non-regular files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

from . import values
from .errors import CorruptCheckpointError
from .integrity import ALGORITHM, checksum
from .values import MAX_TREE_DEPTH

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
    "empty_tensor",
    "write_atomic",
    "fsync_dir",
    "read_records",
    "MAX_RECORD_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_TREE_DEPTH",
    "MAX_NDIM",
    "open_regular",
    "read_record",
    "read_record_fs",
    "check_record_size",
    "parse_record",
    "check_shape",
    "new_generation",
]

FORMAT_VERSION = 1
COMMIT_NAME = "COMMIT"
LATEST_NAME = "latest"
#: a record (manifest, COMMIT, DCP metadata) larger than this is refused unread
MAX_RECORD_BYTES = 1 << 30
#: JSON nesting (arrays and objects inside each other) allowed in any record read back
MAX_JSON_DEPTH = 128
# MAX_TREE_DEPTH (from ckpt.values, which refuses deeper values at save time): nesting allowed in a saved
# state tree below its top-level key; with the manifest's own two levels and a DTensor layout's two, a tree
# stays within MAX_JSON_DEPTH
#: dimensions a saved tensor may have
MAX_NDIM = 64
_MAX_INT = (1 << 63) - 1  # every size, offset and count is an int64 to torch
_MAX_SPAN = 1 << 62  # product of a shape's dims (0 counted as 1) times the element size

# ASCII digits to the very end: ``\d`` takes any script's digits (int() reads them) and ``$`` a trailing newline
_STEP_RE = re.compile(r"step-([0-9]{9,})")
_GENERATION_RE = re.compile(r"^g[0-9a-f]{16}$")

#: element size in bytes of every dtype the format stores, by name (the records are read without torch)
_ITEMSIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    # one byte per element each (float4_e2m1fn_x2 packs two fp4 values), stored as their bytes
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """The stored dtypes this torch has, by name (torch is imported on first use: the commands that only read
    records never import it)."""
    import torch

    return {name: getattr(torch, name) for name in _ITEMSIZES if hasattr(torch, name)}


def supported_dtypes() -> list[str]:
    """The names of the tensor dtypes the format stores (those this torch has)."""
    return list(_dtypes())


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory's name, or ``None`` for any other name. One name per step: only
    :func:`step_dir_name`'s (``step-000000001``, never ``step-0000000001``), since every reader and
    writer goes by that name; another name parsed to the same step would list a checkpoint at a path
    that holds none, and hand retention a directory that is not the step's."""
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


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
    if name not in _dtypes():
        raise TypeError(f"dtype {dtype} is not supported by the checkpoint format")
    return name


def empty_tensor(
    shape: Any, dtype: torch.dtype, device: Any = "cpu", pin_memory: bool = False
) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` and ``dtype`` (any stored dtype) on ``device`` (host memory when
    ``None``: never torch's default device, which a training script may have set to a GPU) that the caller
    fills.

    Allocated as its bytes and viewed as ``dtype``: under ``torch.use_deterministic_algorithms(True)``
    torch fills new memory, and it has no fill for the packed sub-byte dtypes (``float4_e2m1fn_x2``)
    that the format stores; a restore must not fail because the user asked for deterministic kernels.
    Never an inference tensor: state a restore made inside ``torch.inference_mode()`` can still be trained.
    """
    import torch

    shape = torch.Size(shape)
    with torch.inference_mode(
        False
    ):  # a normal tensor even in a restore called in inference mode: it trains on
        raw = torch.empty(
            shape.numel() * dtype.itemsize,
            dtype=torch.uint8,
            device=device if device is not None else "cpu",
            pin_memory=pin_memory,
        )
    return raw.view(dtype).view(shape)


def str_to_dtype(name: str, where: str) -> torch.dtype:
    try:
        return _dtypes()[name]
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
    codecs: list[str] | None = None  # per chunk, on tiers that encode chunks (remote); None: raw
    stored_sizes: list[int] | None = None  # per chunk, bytes as stored (after the codec)
    job: list[int] | None = None  # [rank, world size] of the multi-process job that saved it
    replicated: list[int] | None = None  # items the same on every rank: a job tier stores them once (rank 0)
    checksum_algorithm: str = ALGORITHM
    format_version: int = FORMAT_VERSION
    created_unix: float = field(default_factory=time.time)
    generation: str | None = None  # remote tier: the subdirectory holding this copy (Commit.generation)

    def to_bytes(self) -> bytes:
        return json.dumps(
            _without_unset_generation(asdict(self)), separators=(",", ":"), allow_nan=False
        ).encode()

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
            if not _is_nonneg_int(getattr(self, name)) or getattr(self, name) > _MAX_INT:
                raise bad(f"{name} must be a non-negative 64-bit integer")
        if self.chunk_bytes <= 0 or self.world_size <= 0 or self.rank >= self.world_size:
            raise bad("chunk_bytes, world_size or rank out of range")
        if not _is_number(self.created_unix):
            raise bad("created_unix must be a number")
        if not _valid_generation(self.generation):
            raise bad(f"generation must be 'g' and 16 hex digits, got {self.generation!r}")
        if not isinstance(self.chunks, list) or len(self.chunks) != -(-self.data_bytes // self.chunk_bytes):
            raise bad("chunk checksum list does not cover the data file")
        if not all(_is_nonneg_int(c) and c < 1 << 32 for c in self.chunks):
            raise bad("chunk checksums must be 32-bit non-negative integers")
        if (self.codecs is None) != (self.stored_sizes is None):
            raise bad("codecs and stored_sizes must both be present or both absent")
        if self.codecs is not None:
            if not (
                isinstance(self.codecs, list)
                and isinstance(self.stored_sizes, list)
                and len(self.codecs) == len(self.chunks) == len(self.stored_sizes)
                and all(isinstance(c, str) for c in self.codecs)
                and all(_is_nonneg_int(n) for n in self.stored_sizes)
            ):
                raise bad("per-chunk codecs / stored sizes do not match the chunk list")
        if self.job is not None and not (
            isinstance(self.job, list)
            and len(self.job) == 2
            and all(_is_nonneg_int(v) for v in self.job)
            and self.job[0] < self.job[1]
        ):
            raise bad(f"job must be [rank, world size], got {self.job!r}")
        if self.replicated is not None and not (
            isinstance(self.replicated, list)
            and all(_is_nonneg_int(i) and i < len(self.items) for i in self.replicated)
        ):
            raise bad("replicated must list item indices")
        self._validate_items(bad)
        _validate_tree(self.tree, len(self.items), bad)

    def _validate_items(self, bad: Callable[[str], CorruptCheckpointError]) -> None:
        """Every item's dtype, shape and byte range; the ranges must lie inside the data file without
        overlapping, so the destinations a restore allocates never exceed the file's size."""
        ranges = []
        for i, it in enumerate(self.items):
            if not isinstance(it.key, str) or not isinstance(it.device, str):
                raise bad(f"item {i}: key and device must be strings")
            itemsize = _ITEMSIZES.get(it.dtype) if isinstance(it.dtype, str) else None
            if itemsize is None:
                raise bad(f"item {it.key!r}: unknown dtype {it.dtype!r}")
            if not check_shape(it.shape, itemsize):
                raise bad(
                    f"item {it.key!r}: bad shape {it.shape!r} (non-negative ints, at most {MAX_NDIM} "
                    "dimensions, within int64 sizes)"
                )
            if it.alias_of is not None:
                if not _is_nonneg_int(it.alias_of) or it.alias_of >= i:
                    raise bad(f"item {it.key!r}: alias_of must name an earlier item")
                orig = self.items[it.alias_of]
                if orig.alias_of is not None or orig.dtype != it.dtype or orig.shape != it.shape:
                    raise bad(f"item {it.key!r}: an alias must name a stored item of its own dtype and shape")
                continue
            if not (_is_nonneg_int(it.offset) and _is_nonneg_int(it.nbytes)):
                raise bad(f"item {it.key!r}: bad byte range")
            if it.nbytes != it.numel * itemsize or it.offset + it.nbytes > self.data_bytes:
                raise bad(
                    f"item {it.key!r}: byte range [{it.offset}, {it.offset + it.nbytes}) "
                    f"does not fit its shape or the {self.data_bytes}-byte data file"
                )
            if it.nbytes:
                ranges.append((it.offset, it.nbytes, it.key))
        ranges.sort()
        for (a, n, k), (b, _, k2) in zip(ranges, ranges[1:]):
            if b < a + n:
                raise bad(f"items {k!r} and {k2!r} overlap in the data file")


#: how a commit record's own checksum follows its other fields (the last key; over the bytes before it, closed)
_CRC_KEY = b',"crc":'


@dataclass
class Commit:
    """The commit record: a checkpoint exists on a tier iff this file exists there."""

    step: int
    world_size: int
    manifests: dict[str, int]  # manifest file name -> checksum of its bytes
    data: dict[str, int]  # data file name -> size in bytes
    format_version: int = FORMAT_VERSION
    created_unix: float = field(default_factory=time.time)
    # the branch of history (ckpt.policy.Timeline): its number, and [timeline, step] where each ancestor
    # timeline was left; absent (0, []) in a run never rolled back and in files older than the field
    timeline: int = 0
    forks: list[list[int]] = field(default_factory=list)

    # A copy that replaced a committed one on the remote tier lives in step-.../<generation>/ (its manifests
    # and parts), so that putting this record is the switch from the old copy to the new one. None: the
    # step directory itself.
    generation: str | None = None

    def to_bytes(self) -> bytes:
        d = _without_unset_generation(asdict(self))
        if not self.timeline and not self.forks:  # the old record, byte for byte readable by older versions
            del d["timeline"], d["forks"]
            return json.dumps(d, separators=(",", ":"), allow_nan=False).encode()
        # a record on a timeline carries its own checksum (readers before timelines refuse it anyway): its
        # timeline decides which checkpoints are live, and nothing else cross-checks that number
        body = json.dumps(d, separators=(",", ":"), allow_nan=False).encode()
        return body[:-1] + _CRC_KEY + str(checksum(body)).encode() + b"}"

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "Commit":
        d = _load_json(raw, where)
        if isinstance(d, dict) and "crc" in d:
            crc, at = d.pop("crc"), raw.rfind(_CRC_KEY)
            if not _is_nonneg_int(crc) or at < 0 or checksum(raw[:at] + b"}") != crc:
                raise CorruptCheckpointError(f"{where}: the commit record fails its own checksum")
        try:
            c = cls(**d)
        except TypeError as e:
            raise CorruptCheckpointError(f"{where}: malformed commit record ({e})") from None
        ok = (
            c.format_version == FORMAT_VERSION
            and _is_nonneg_int(c.step)
            and c.step <= _MAX_INT
            and _is_nonneg_int(c.world_size)
            and 0 < c.world_size <= _MAX_INT
            and isinstance(c.manifests, dict)
            and len(c.manifests) == c.world_size
            and all(isinstance(k, str) and _is_nonneg_int(v) and v < 1 << 32 for k, v in c.manifests.items())
            and isinstance(c.data, dict)
            and all(isinstance(k, str) and _is_nonneg_int(v) and v <= _MAX_INT for k, v in c.data.items())
            and _is_number(c.created_unix)
            and _is_nonneg_int(c.timeline)
            and isinstance(c.forks, list)
            and all(
                isinstance(f, list)
                and len(f) == 2
                and all(_is_nonneg_int(v) for v in f)
                and f[0] < c.timeline
                for f in c.forks
            )
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


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_shape(shape: Any, itemsize: int = 1) -> bool:
    """Whether ``shape`` is a tensor shape this library reads: a list of at most :data:`MAX_NDIM`
    non-negative ints whose product (a zero dimension counted as one, so that empty tensors are
    bounded too) times ``itemsize`` stays below 2**62, so no size or stride torch derives from it
    overflows. Every dimension is bounded before anything is multiplied."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        return False
    span = itemsize
    for d in shape:
        if not _is_nonneg_int(d) or d > _MAX_SPAN:
            return False
        span *= max(d, 1)
        if span > _MAX_SPAN:
            return False
    return True


# -- reading records ------------------------------------------------------------------------------
def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _need_regular(st: os.stat_result, where: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(f"{where}: is {_kind(st.st_mode)}, not a regular file; refused unread")


def open_regular(
    path: str | os.PathLike, flags: int = os.O_RDONLY, where: str | None = None
) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only (with extra ``flags``, e.g. ``O_DIRECT``) only if it is a regular file.

    The file is checked before it is opened (a symlink is followed: one to a regular file is read,
    one to ``/dev/zero`` or a FIFO is refused), opened with ``O_NONBLOCK`` so that a FIFO swapped in
    meanwhile cannot block, and checked again through the open descriptor. Returns ``(fd, stat)``;
    raises :class:`CorruptCheckpointError` naming the file for anything but a regular file, and
    ``FileNotFoundError`` when it is missing."""
    where = where or os.fspath(path)
    _need_regular(os.stat(path), where)
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        _need_regular(st, where)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_record_size(size: int, where: str, limit: int = MAX_RECORD_BYTES) -> None:
    """Refuse a record of ``size`` bytes when it is larger than ``limit``."""
    if size > limit:
        raise CorruptCheckpointError(
            f"{where}: a record of {size} bytes is larger than the {limit}-byte limit "
            "(larger than any this library writes); refused unread"
        )


def read_record(path: str | os.PathLike, where: str | None = None, limit: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of a record file: a regular file (:func:`open_regular`) of at most ``limit`` bytes,
    checked by its size before any byte is read; at most ``limit + 1`` bytes are ever read, so a
    file that grows, or one that reports no size (``/proc``), is cut off and refused.

    Raises :class:`CorruptCheckpointError` naming the file, or ``FileNotFoundError``."""
    where = where or os.fspath(path)
    st = os.stat(path)
    _need_regular(st, where)
    check_record_size(st.st_size, where, limit)
    fd, st = open_regular(path, os.O_RDONLY, where)
    try:
        check_record_size(st.st_size, where, limit)
        parts, n = [], 0
        want = st.st_size + 1  # one read for the whole file, and one byte to see it ends
        while n <= limit:
            b = os.read(fd, min(want, limit + 1 - n))
            if not b:
                break
            parts.append(b)
            n += len(b)
            want = 1 << 20
    except OSError as e:
        raise OSError(e.errno, e.strerror, where) from None
    finally:
        os.close(fd)
    check_record_size(n, where, limit)
    return b"".join(parts)


def read_record_fs(fs: Any, path: str, where: str | None = None, limit: int = MAX_RECORD_BYTES) -> bytes:
    """:func:`read_record` through an fsspec file system: the local one (``file://``) reads the file
    itself, with every check of :func:`read_record`; on others ``path`` must be listed as a file
    (``info()['type']``) of at most ``limit`` bytes, and the read is a range request of at most
    ``limit + 1`` bytes (an object store returns no more than the object holds).

    Raises :class:`CorruptCheckpointError` naming ``where`` (default: ``path``), or ``FileNotFoundError``."""
    where = where or path
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if any(p in ("file", "local") for p in protocols):
        return read_record(fs._strip_protocol(path), where, limit)
    fs.invalidate_cache(path)  # the record as it is now, not its size in a listing cached before it changed
    info = fs.info(path)
    if info.get("type") != "file":
        raise CorruptCheckpointError(f"{where}: is a {info.get('type')!r}, not a file; refused unread")
    size = info.get("size")
    if _is_nonneg_int(size):  # (a listing may be stale: the read below is bounded on its own)
        check_record_size(size, where, limit)
        if size == 0:  # an empty object (a record truncated behind our back): a range of it is refused (416)
            return b""
    raw = fs.cat_file(path, start=0, end=limit + 1)
    check_record_size(len(raw), where, limit)
    return bytes(raw)


_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_DEPTH_STEP = None


def json_depth(raw: bytes | bytearray | memoryview, stop: int | None = None) -> int:
    """Nesting depth of the arrays and objects in JSON text ``raw`` (exact for valid JSON), found in
    linear time without parsing: escape pairs are cut out, then, block by block, a running parity
    of the quotes marks what lies inside strings and a running sum of the brackets outside them
    gives the depth. With ``stop``, returns once the depth exceeds it."""
    import numpy as np

    global _DEPTH_STEP
    if _DEPTH_STEP is None:
        step = np.zeros(256, dtype=np.int8)
        step[list(b"[{")] = 1
        step[list(b"]}")] = -1
        _DEPTH_STEP = step
    text = bytes(raw)
    if b"\\" in text:
        text = _ESCAPE.sub(b"", text)
    codes = np.frombuffer(text, dtype=np.uint8)
    depth = peak = quotes = 0
    block = 1 << 22
    for a in range(0, len(codes), block):
        c = codes[a : a + block]
        q = np.cumsum(c == 0x22, dtype=np.int32) + (quotes & 1)
        outside = (q & 1) == 0
        run = np.cumsum(_DEPTH_STEP[c] * outside, dtype=np.int32) + np.int64(depth)
        quotes, depth = int(q[-1]), int(run[-1])
        peak = max(peak, int(run.max()))
        if stop is not None and peak > stop:
            break
    return peak


def parse_record(
    raw: bytes | bytearray | memoryview,
    where: str,
    expect: type | None = dict,
    max_depth: int = MAX_JSON_DEPTH,
    limit: int = MAX_RECORD_BYTES,
) -> Any:
    """Parse JSON record ``raw`` (of ``where``): at most ``limit`` bytes, nested at most ``max_depth``
    deep (checked before parsing, so no parser or later walk of the value can exhaust the stack),
    and of type ``expect`` when given. Any problem is a :class:`CorruptCheckpointError` naming
    ``where``."""
    check_record_size(len(raw), where, limit)
    depth = json_depth(raw, stop=max_depth)
    if depth > max_depth:
        raise CorruptCheckpointError(
            f"{where}: JSON nested more than {max_depth} levels deep; refused unparsed"
        )
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from None
    if expect is not None and not isinstance(d, expect):
        raise CorruptCheckpointError(
            f"{where}: expected a JSON {'object' if expect is dict else expect.__name__}"
        )
    return d


def _load_json(raw: bytes, where: str) -> dict:
    return parse_record(raw, where)


# -- the saved state tree ---------------------------------------------------------------------------
_OBJ_KINDS = ("module", "optimizer", "stateful")
#: the tags of a saved tree: the engine's own, and the values' of :mod:`ckpt.values` (bytes not among them)
_TAG_KEYS = {
    "$t": {"$t", "$np", "$dt"},
    "$obj": {"$obj", "sd"},
    **values.TAGS,
    "$dtype": {"$dtype"},
    "$skip": {"$skip"},
}


def _check_layout_record(dt: Any) -> bool:
    """A DTensor layout as :func:`ckpt.plan.dtensor_layout` records it, with bounded fields."""
    if not (isinstance(dt, dict) and set(dt) == {"shape", "mesh", "coord", "placements"}):
        return False
    mesh, coord, placements = dt["mesh"], dt["coord"], dt["placements"]
    return (
        check_shape(dt["shape"])
        and check_shape(mesh)
        and all(m > 0 for m in mesh)
        and isinstance(coord, list)
        and isinstance(placements, list)
        and len(coord) in (0, len(mesh))
        and len(placements) == len(mesh)
        and all(_is_nonneg_int(c) and c < m for c, m in zip(coord, mesh))
        and all(isinstance(p, str) and len(p) <= 64 for p in placements)
    )


def _validate_tree(tree: Any, n_items: int, bad: Callable[[str], CorruptCheckpointError]) -> None:
    """Check the saved tree's structure (the tagged nodes of :mod:`ckpt.plan`) before anything is
    bound to it: every tensor node names an item that exists, once; every tag has its fields of the
    right types. What passes here can only fail to fit a state, never crash the binding."""
    if not isinstance(tree, dict):
        raise bad("the saved state tree is not a JSON object")
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(v, k) for k, v in tree.items()]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((x, f"{path}/{i}") for i, x in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        tags = [k for k in node if k.startswith("$")]
        if not tags:
            stack.extend((v, f"{path}/{k}") for k, v in node.items())
            continue
        tag = next((t for t in _TAG_KEYS if t in node), None)
        if tag is None or not set(node) <= _TAG_KEYS[tag]:
            raise bad(f"tree node at {path!r} has unknown tags {sorted(node)!r}")
        v = node[tag]
        if tag == "$t":
            if not _is_nonneg_int(v) or v >= n_items or v in seen:
                raise bad(f"tree node at {path!r} names item {v!r}: not an item index, or named twice")
            seen.add(v)
            if "$dt" in node and not _check_layout_record(node["$dt"]):
                raise bad(f"tree node at {path!r} has a malformed DTensor layout")
            if node.get("$np", 1) not in (0, 1):
                raise bad(f"tree node at {path!r}: $np must be 0 or 1")
        elif tag == "$obj":
            if v not in _OBJ_KINDS or "sd" not in node:
                raise bad(
                    f"tree node at {path!r}: an object node needs a kind in {_OBJ_KINDS} and a state dict"
                )
            stack.append((node["sd"], path))
        elif tag in values.TAGS:  # $tuple, $d, $f
            why = values.check(tag, node)
            if why is not None:
                raise bad(f"tree node at {path!r}: {why}")
            stack.extend(values.children(tag, node, path))
        elif tag == "$dtype":
            if not (isinstance(v, str) and v in _ITEMSIZES):
                raise bad(f"tree node at {path!r}: unknown dtype {v!r}")


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
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The temporary file's name is unique to this call (two threads, or two processes, writing the same
    record never share one) and it is created exclusively, never through a link left at its name."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
        0o644,
    )
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def read_records(
    get: "Callable[[str], bytes]", step: int, rank: int, world_size: int, where: str
) -> tuple[Commit, Manifest]:
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
            f"{cwhere}: saved with world size {commit.world_size}, restoring with {world_size}"
        )
    mname = manifest_name(rank)
    if mname not in commit.manifests:
        raise CorruptCheckpointError(f"{cwhere}: does not list {mname}")
    mpath = mname if commit.generation is None else f"{commit.generation}/{mname}"
    raw = get(mpath)
    if Commit.manifest_checksum(raw) != commit.manifests[mname]:
        raise CorruptCheckpointError(f"{where}/{mpath}: checksum does not match the one recorded in {cwhere}")
    manifest = Manifest.from_bytes(raw, f"{where}/{mpath}")
    if commit.data.get(data_name(rank)) != manifest.data_bytes or manifest.generation != commit.generation:
        raise CorruptCheckpointError(
            f"{cwhere}: data size or generation record disagrees with {where}/{mpath}"
        )
    return commit, manifest

"""Export a committed checkpoint to the files other tools load: safetensors, a Hugging Face model
directory, or a ``torch.save`` state dict.

A checkpoint of any tier is read the way a restore reads it, without a live state to restore into:
the records are validated by the tier (:meth:`LocalTier.open`, :meth:`RemoteTier.read_manifests`),
every chunk is checked against its CRC-32C before any of its bytes is used, and the tensors are
assembled by :func:`ckpt.reshard.load_resharded` with whole tensors as destinations, so the shards of
a DTensor that N ranks saved into a job tier come out consolidated. Nothing is unpickled.

Output is written into a hidden directory beside the destination and renamed into place at the end:
a failed or interrupted export never leaves a partial destination, and an existing one is replaced
only with ``force``. What an export killed on the way left there is removed by the next export to that
destination (:func:`remove_leftovers`, ``ckpt gc --exports DIR``), once its process is gone.

See ``docs/export.md``.
"""

from __future__ import annotations

import abc
import errno
import functools
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

from . import knobs
from .errors import CorruptCheckpointError, IncompatibleCheckpointError
from .format import (
    LATEST_NAME,
    Manifest,
    empty_tensor,
    parse_record,
    parse_step_dir,
    read_record,
    str_to_dtype,
)
from .policy import live_and_abandoned
from .progress import Progress, wanted
from .reshard import check_layouts, load_resharded, saved_layouts, shard_box
from .scatter import Scatter
from .tiers.local import NO_RENAMEAT2, RENAME_EXCHANGE, RENAME_NOREPLACE
from .tiers.local import renameat2 as _renameat2

__all__ = ["export", "ExportInfo", "FORMATS", "MODEL_KEYS", "leftovers", "remove_leftovers"]

log = logging.getLogger(__name__)

#: what :func:`export` writes
FORMATS = ("safetensors", "hf", "torch")

#: the shard size Hugging Face's ``save_pretrained`` uses by default
DEFAULT_MAX_SHARD_SIZE = "5GB"

#: metadata keys this library adds to the safetensors headers (values are strings, as the format wants)
META_STEP, META_SOURCE, META_KEY, META_VALUES = "ckpt.step", "ckpt.source", "ckpt.key", "ckpt.values"

# prefixes that wrappers put before a model's own state dict keys (DDP, torch.compile)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclass
class ExportInfo:
    """What :func:`export` wrote.

    ``path``: the destination (a directory for ``safetensors`` and ``hf``, a file for ``torch``);
    ``files``: the names written there; ``tensors``/``nbytes``: how many tensors and tensor bytes;
    ``dropped``: what the format cannot hold and was left out, one line each (``"<name>: why"``);
    ``read_bytes``: bytes fetched and verified from the checkpoint."""

    step: int
    format: str
    source: str
    path: str
    key: str | None
    files: list[str]
    tensors: int
    nbytes: int
    read_bytes: int
    seconds: float
    dropped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (what ``ckpt export --json`` prints)."""
        return asdict(self)


def export(
    source: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    format: str = "safetensors",
    step: int | None = None,
    key: str | None = None,
    storage_options: dict[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | torch.dtype | None = None,
    config: Any = None,
    force: bool = False,
    progress: bool = False,
) -> ExportInfo:
    """Write committed checkpoint ``step`` (default: the one a restore would pick) of ``source`` to ``dest``.

    ``source``: a ``local_dir``, or a remote tier's URL (``s3://``, ``file://``, any fsspec URL, with
    ``storage_options``); a job tier (every rank's files under one URL) is consolidated into whole
    tensors. ``format``:

    * ``"safetensors"``: ``dest`` is a directory holding ``model.safetensors``, or shards
      ``model-00001-of-0000N.safetensors`` of at most ``max_shard_size`` each plus
      ``model.safetensors.index.json``; tensors are named by their path in the state (``/`` between
      levels, a module's own keys as in its ``state_dict``); the other values go into the header's
      metadata as JSON (``ckpt.values``: path -> value);
    * ``"hf"``: a Hugging Face model directory (``config.json`` plus safetensors as
      ``save_pretrained`` writes them) for the model at ``key`` (default: the first of
      :data:`MODEL_KEYS` the state has: ``"model"``, where :class:`ckpt.integrations.hf.CheckpointCallback`
      keeps it, ``"module"``, ``"state_dict"``, where the Lightning integrations do). ``config``: a
      ``PretrainedConfig``, a dict, a path to a ``config.json`` or to a directory holding one, or a
      model name for ``AutoConfig.from_pretrained``; ``None`` takes the config saved in the state
      under ``"hf_config"`` (a dict or a JSON string). The weights must be exactly the ones the
      config's architecture has, with the same shapes;
    * ``"torch"``: ``dest`` is one file written with ``torch.save``, holding the state at ``key``
      as nested dicts, lists and tuples of tensors and plain values (a module as its
      ``state_dict``), loadable with ``torch.load(dest, weights_only=True)``.

    ``key``: the part of the state to export (a top-level key, or a ``/``-separated path); default: all
    of it (for ``hf``, the model found as said above). ``dtype``: cast floating-point tensors to it
    (default: keep each tensor's dtype). ``force``: replace an existing ``dest``. ``progress``: draw a progress bar on stderr
    when it is a terminal.

    Every byte exported is checked against its checksum as it is read: a mismatch raises
    :class:`~ckpt.errors.CorruptCheckpointError` naming the file or part, a missing file
    :class:`~ckpt.errors.IncompleteCheckpointError`; then nothing is left at ``dest`` (the output is
    written beside it, in a hidden directory removed on failure, and renamed into place at the end).
    Raises ``FileExistsError`` when ``dest`` exists and not ``force``, ``FileNotFoundError`` when the
    source or the step does not exist, ``ValueError`` for arguments that do not fit the checkpoint.
    """
    t0 = time.perf_counter()
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")
    cast = _parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    shown = Path(dest).expanduser()
    dest = Path(os.path.abspath(shown))  # "." or "x/..": a real name in a real parent directory
    _refuse_existing(dest, force)
    _refuse_overlap(source, storage_options, dest)
    src = _Source.open(source, storage_options, step)
    try:
        tree = src.manifests[0].tree
        if format == "hf" and key is None:
            key = _model_key(tree, src)
        node, base = _select(tree, key, src.where)
        plan = _Plan(src.manifests[0])
        built = _bare_keys(plan.walk(node, base, root=node is tree))
        plan.bare_names()
        if len(src.manifests) == 1:
            _check_whole(plan, src)
        if format != "torch":
            _check_names(plan, format, src)
        if format == "hf":
            writer: _Writer = _HFWriter(plan, config, tree, src)
        elif format == "safetensors":
            writer = _SafetensorsWriter(plan, src, key)
        else:
            writer = _TorchWriter(plan, built)
        stage = _stage_beside(dest)
        try:
            info = writer.write(stage, src, cast, limit, progress)
            _publish(stage, dest, force, single_file=format == "torch")
            remove_leftovers(dest.parent, dest.name)  # an old dest a killed export moved aside: replaced now
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    finally:
        src.close()
    info = ExportInfo(
        step=src.step,
        format=format,
        source=src.where,
        path=str(shown),
        key=key,
        files=info["files"],
        tensors=info["tensors"],
        nbytes=info["nbytes"],
        read_bytes=int(src.read_bytes),
        seconds=time.perf_counter() - t0,
        dropped=plan.dropped + info.get("dropped", []),
    )
    log.info(
        "exported step %d of %s to %s (%s): %d tensors, %.3f GB in %.2f s",
        info.step,
        info.source,
        dest,
        format,
        info.tensors,
        info.nbytes / 1e9,
        info.seconds,
    )
    return info


# ---------------------------------------------------------------------------------------------
# Arguments


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``5000000``, ``"5GB"`` (10^9) or ``"4GiB"`` (2^30) as a number of bytes (at least 1)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max_shard_size must be a number of bytes or a size like '5GB', got {size!r}")
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(f"max_shard_size: cannot read {size!r} as a size (e.g. 5GB, 500MB, 4GiB)")
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size}")
    return size


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(
                f"dtype must be a floating-point dtype (it casts floating-point tensors), got {dtype}"
            )
        return dtype
    name = str(dtype).removeprefix("torch.")
    try:
        t = str_to_dtype(name, "dtype")
    except CorruptCheckpointError:
        raise ValueError(f"dtype: unknown dtype {dtype!r} (e.g. bfloat16, float16, float32)") from None
    return _parse_dtype(t)


def _refuse_existing(dest: Path, force: bool) -> None:
    if not force and os.path.lexists(dest):
        raise FileExistsError(
            errno.EEXIST, "the export destination exists; pass force=True (--force) to replace it", str(dest)
        )
    if not dest.parent.is_dir():
        if os.path.lexists(dest.parent):
            raise NotADirectoryError(
                errno.ENOTDIR, "the export destination's parent is not a directory", str(dest.parent)
            )
        raise FileNotFoundError(
            errno.ENOENT, "the export destination's parent directory does not exist", str(dest.parent)
        )


def _refuse_overlap(source: str | os.PathLike, storage_options: dict[str, Any] | None, dest: Path) -> None:
    """``dest`` must not be the checkpoint directory being read, a directory holding it, or a part of one
    of its steps: replacing it (``force``) would delete the checkpoint, writing into it would add to it."""
    from .fs import is_local_fs, is_url, resolve

    text = os.fspath(source)
    if is_url(text):
        store = resolve(text, storage_options)
        if not is_local_fs(store.fs):
            return
        text = store.root
    src = os.path.realpath(text)
    here = os.path.join(os.path.realpath(dest.parent), dest.name)  # dest itself may be a link: not followed
    inside = os.path.relpath(here, src).split(os.sep)
    if (
        here == src
        or src.startswith(here.rstrip(os.sep) + os.sep)
        or (inside[0] != ".." and (parse_step_dir(inside[0]) is not None or inside[0] == LATEST_NAME))
    ):
        raise ValueError(
            f"the export destination {str(dest)!r} is, holds or lies inside the checkpoint {text!r} "
            "it exports; pass a destination outside it"
        )


# ---------------------------------------------------------------------------------------------
# Reading


class _Source:
    """The committed step's records (every saved rank's manifest) and a verified chunk reader."""

    def __init__(self) -> None:
        self.where = ""
        self.step = -1
        self.manifests: list[Manifest] = []
        self.read_bytes = 0
        self._fetch: Callable[[int, Manifest, int], Any] = lambda r, m, i: b""

    @classmethod
    def open(
        cls, source: str | os.PathLike, storage_options: dict[str, Any] | None, step: int | None
    ) -> "_Source":
        from .tiers.locate import open_tier

        self = cls()
        tier: Any = open_tier(source, storage_options)  # a file:// URL of a local_dir is that local tier
        self.where = tier.location()
        self.step = _pick(tier, step, self.where)
        self.manifests = tier.records(self.step)[1]
        for (
            m
        ) in self.manifests:  # every stored byte there at its committed size, before any size the manifests
            tier.check_stored(self.step, m)  # state is allocated (as a restore checks)
        # each shard's layout against its item; one rank's copy holds a whole tensor only where _check_whole finds it
        check_layouts(self.manifests, f"step {self.step} of {self.where}", whole=False)
        self._fetch = lambda r, m, i: tier.fetch(self.step, r, m, i)
        return self

    def fetch(self, counter: Callable[[int], None]) -> Callable[[int, Manifest, int], Any]:
        """The chunk reader :func:`load_resharded` takes, reporting each verified chunk to ``counter``."""

        def one(rank: int, m: Manifest, i: int) -> Any:
            raw = self._fetch(rank, m, i)
            counter(len(raw))
            return raw

        return one

    def close(self) -> None:
        """Nothing is held open between chunks (each is read and checked on its own)."""


def _pick(tier: Any, step: int | None, where: str) -> int:
    """``step``, which must be committed; by default the newest of the live branch (what a restore picks
    first; a rollback's abandoned branch is never picked)."""
    listed = tier.committed()
    if step is None:
        live = live_and_abandoned(listed)[0]
        if not live:
            raise FileNotFoundError(errno.ENOENT, "no committed checkpoint to export", where)
        return live[0].step
    if step not in {e.step for e in listed}:
        found = sorted({e.step for e in listed}, reverse=True)[:10]
        raise FileNotFoundError(
            errno.ENOENT,
            f"step {step} is not committed there (committed: {found}); pass another step",
            tier.step_location(step),
        )
    return step


#: the top-level keys under which the integrations keep the model: the plain loop's and the Hugging Face
#: callback's ``"model"``, the Lightning callback's ``"module"``, a Lightning ``CheckpointIO`` checkpoint's
#: ``"state_dict"``
MODEL_KEYS = ("model", "module", "state_dict")


def _model_key(tree: Any, src: "_Source") -> str:
    """The first of :data:`MODEL_KEYS` the state has (what ``format="hf"`` exports without a ``key``)."""
    found = next((k for k in MODEL_KEYS if isinstance(tree, dict) and k in tree), None)
    if found is None:
        have = sorted(tree)[:20] if isinstance(tree, dict) else []
        raise ValueError(
            f"step {src.step} of {src.where} has none of the keys a model is kept under "
            f"({', '.join(MODEL_KEYS)}; it has {have}): pass the model's key (key=, --key)"
        )
    return found


def _select(tree: Any, key: str | None, where: str) -> tuple[Any, str]:
    """The node at ``key`` (a ``/``-separated path, through objects' state dicts, dicts, lists and tuples)."""
    if key is None:
        return tree, ""
    node: Any = tree
    for i, part in enumerate(key.split("/")):
        if i and isinstance(node, dict) and "$obj" in node:
            node = node.get("sd")
        # the top level is the state's own keys, whatever they are ("$t" included): never a tagged node
        children = dict(tree) if i == 0 else _children(node)
        if (i and part.startswith("$")) or part not in children:
            here = "/".join(key.split("/")[:i]) or "the state"
            raise ValueError(
                f"key {key!r}: {here} of the checkpoint at {where} has no {part!r} "
                f"(it has {sorted(children)[:20]}); pass another key"
            )
        node = children[part]
    return node, key


def _children(node: Any) -> dict[str, Any]:
    """A saved container's children by the names their paths use."""
    if isinstance(node, list):
        return {str(i): x for i, x in enumerate(node)}
    if not isinstance(node, dict) or "$t" in node:
        return {}
    if "$tuple" in node:
        return {str(i): x for i, x in enumerate(node["$tuple"])}
    if "$d" in node:
        return {str(k): v for k, v in node["$d"]}
    return {k: v for k, v in node.items() if not k.startswith("$")}


def _bare(key: str) -> str:
    """A module's state-dict ``key`` without ``torch.compile``'s ``_orig_mod`` components (``"_orig_mod.0.weight"``,
    ``"layers.0._orig_mod.weight"``), as the uncompiled module names it."""
    parts = key.split(".")
    kept = [p for p in parts if p != "_orig_mod"]
    return ".".join(kept) if kept and len(kept) < len(parts) else key


def _bare_keys(node: Any) -> Any:
    """``node`` (what the torch format writes) with each mapping's keys :func:`_bare` where no two become one."""
    if isinstance(node, list):
        return [_bare_keys(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_bare_keys(v) for v in node)
    if not isinstance(node, dict):
        return node
    keys = [_bare(k) if isinstance(k, str) else k for k in node]
    if len(set(keys)) < len(keys):
        keys = list(node)
    return {k: _bare_keys(v) for k, v in zip(keys, node.values())}


@dataclass
class _Tensor:
    name: str  # the exported name: its path under the selected key
    index: int  # the saved item (rank 0's manifest)
    shape: list[int]  # whole (global) shape
    dtype: torch.dtype


class _Ref:
    """A tensor's place in the structure the torch format writes."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Plan:
    """The selected part of the saved tree: its tensors by name, its other values, and what is dropped."""

    def __init__(self, manifest: Manifest) -> None:
        self.items = manifest.items
        self.layouts = saved_layouts(manifest.tree)
        self.tensors: list[_Tensor] = []
        self.values: dict[str, Any] = {}
        self.dropped: list[str] = []
        self.clashes: list[str] = []  # value names given twice (keys "a/b" and "a" -> "b"; 1 and "1")
        self._base = ""
        self._rank_layouts: dict[int, dict[int, Any]] = {}

    def walk(self, node: Any, base: str, root: bool = False) -> Any:
        """Collect ``node``'s tensors and values; returns it as nested Python with :class:`_Ref` for tensors.
        ``root``: ``node`` is the whole saved tree, a plain mapping of the state's top-level keys (which may
        look like tags: a key ``"$t"`` is saved as it is)."""
        self._base = base
        if root:
            sub = lambda k: f"{base}/{k}" if base else str(k)
            if not node:
                self._value(base, {})
            return {k: self._walk(v, sub(k)) for k, v in node.items() if not _skipped(v, self, sub(k))}
        return self._walk(node, base)

    def _value(self, path: str, value: Any) -> None:
        name = self._name(path)
        if name in self.values:
            self.clashes.append(name)
        self.values[name] = value

    def bare_names(self) -> None:
        """Name the tensors as the plain modules name them: checkpoints written before a module's state was
        stored under its unwrapped keys carry ``torch.compile``'s ``_orig_mod`` components in them
        (:func:`_bare`). Left as they are where that would give two tensors, or a tensor and a value, one name."""
        bare = ["/".join(_bare(part) for part in t.name.split("/")) for t in self.tensors]
        names = [t.name for t in self.tensors]
        if bare != names and len(set(bare)) == len(bare) and not set(bare) & set(self.values):
            for t, b in zip(self.tensors, bare):
                t.name = b

    def _name(self, path: str) -> str:
        if self._base and path.startswith(self._base + "/"):
            return path[len(self._base) + 1 :]
        return path

    def _walk(self, node: Any, path: str) -> Any:
        if isinstance(node, list):
            out = [self._walk(x, f"{path}/{i}" if path else str(i)) for i, x in enumerate(node)]
            if not node:
                self._value(path, [])
            return out
        if not isinstance(node, dict):
            self._value(path, node)
            return node
        sub = lambda k: f"{path}/{k}" if path else str(k)
        if "$t" in node:
            i = node["$t"]
            it = self.items[i]
            dt = self.layouts.get(i)
            shape = [int(s) for s in dt["shape"]] if dt is not None else list(it.shape)
            self.tensors.append(
                _Tensor(self._name(path) or path.rsplit("/", 1)[-1], i, shape, str_to_dtype(it.dtype, it.key))
            )
            return _Ref(i)
        if "$obj" in node:
            return self._walk(node.get("sd"), path)
        if "$tuple" in node:
            return tuple(self._walk(x, sub(i)) for i, x in enumerate(node["$tuple"]))
        if "$d" in node:
            return {k: self._walk(v, sub(k)) for k, v in node["$d"] if not _skipped(v, self, sub(k))}
        if "$f" in node:
            self._value(path, float(node["$f"]))
            return float(node["$f"])
        if "$dtype" in node:
            dt = str_to_dtype(node["$dtype"], path)
            self._value(path, str(dt))
            return dt
        if "$skip" in node:
            return None
        if not node:
            self._value(path, {})
        return {k: self._walk(v, sub(k)) for k, v in node.items() if not _skipped(v, self, sub(k))}

    def load(
        self, tensors: list[_Tensor], src: _Source, counter: Callable[[int], None]
    ) -> dict[int, torch.Tensor]:
        """Read ``tensors`` whole (a DTensor's shards from every saved rank), verified; item -> tensor.

        Tensors stored whole in rank 0's file stream chunk by chunk into place (:class:`~ckpt.scatter.Scatter`,
        as a restore reads a data file); sharded ones are assembled by :func:`load_resharded`."""
        plain: list[torch.Tensor | None] = [None] * len(self.items)
        sharded: list[torch.Tensor | None] = [None] * len(self.items)
        boxes: dict[int, tuple[Any, list[int]]] = {}
        for i in {self._origin(t.index) for t in tensors}:
            it = self.items[i]
            dt = self.layouts.get(i)
            dtype = str_to_dtype(it.dtype, it.key)
            if dt is not None:
                shape = [int(s) for s in dt["shape"]]
                boxes[i] = ((tuple([0] * len(shape)), tuple(shape)), shape)
                sharded[i] = empty_tensor(shape, dtype)
            else:
                plain[i] = empty_tensor(it.shape, dtype)
        fetch = src.fetch(counter)
        if any(d is not None for d in plain):
            _scatter_from(src.manifests[0], plain, fetch)
        if boxes:
            load_resharded(src.manifests, 0, sharded, boxes, fetch)
        dest = [p if p is not None else q for p, q in zip(plain, sharded)]
        return {t.index: dest[self._origin(t.index)] for t in tensors}

    def _origin(self, i: int) -> int:
        """The item holding the bytes of item ``i`` (itself, or the one it shares memory with)."""
        a = self.items[i].alias_of
        return i if a is None else a

    def fetch_bytes(self, tensors: list[_Tensor], src: _Source) -> int:
        """Bytes :meth:`load` fetches for ``tensors``: every chunk that holds a byte of them, on every rank
        that holds a part of them (in rank order, a replica of a shard already counted is not read again,
        as :func:`load_resharded` skips it)."""
        items = {self._origin(t.index) for t in tensors}
        seen: set[tuple[str, Any]] = set()
        total = 0
        for rank, m in enumerate(src.manifests):
            by_key = {it.key: j for j, it in enumerate(m.items) if it.alias_of is None}
            layouts = self.layouts if rank == 0 else self._layouts_of(rank, m)
            chunks: set[int] = set()
            for i in items:
                it = self.items[i]
                if i in self.layouts:
                    j = by_key.get(it.key)
                    if j is None or j not in layouts:
                        continue  # the load refuses this checkpoint
                    box = shard_box(layouts[j], it.key)
                    if (it.key, box) in seen or not math.prod(box[1]):
                        continue
                    seen.add((it.key, box))
                    rec = m.items[j]
                elif rank == 0:
                    rec = it
                else:
                    continue
                if rec.nbytes:
                    c = m.chunk_bytes
                    chunks.update(range(rec.offset // c, (rec.offset + rec.nbytes - 1) // c + 1))
            total += sum(min(m.chunk_bytes, m.data_bytes - k * m.chunk_bytes) for k in chunks)
        return total

    def _layouts_of(self, rank: int, m: Manifest) -> dict[int, Any]:
        if rank not in self._rank_layouts:
            self._rank_layouts[rank] = saved_layouts(m.tree)
        return self._rank_layouts[rank]


def _scatter_from(
    m: Manifest, dest: list[torch.Tensor | None], fetch: Callable[[int, Manifest, int], Any]
) -> None:
    """Fill ``dest`` (items of ``m``'s rank) from the chunks that hold them, read and verified in parallel;
    only the chunks in flight are held in memory."""
    import torch

    sc = Scatter(m.items, dest)
    c = m.chunk_bytes
    need: set[int] = set()
    for it, d in zip(m.items, dest):
        if d is not None and it.alias_of is None and it.nbytes:
            need.update(range(it.offset // c, (it.offset + it.nbytes - 1) // c + 1))

    def one(i: int) -> None:
        raw = fetch(m.rank, m, i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": it is only read
            sc.copy(torch.frombuffer(raw, dtype=torch.uint8), i * c)

    with ThreadPoolExecutor(knobs.get("CKPT_IO_THREADS"), thread_name_prefix="ckpt-export") as pool:
        futures = [pool.submit(one, i) for i in sorted(need)]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:  # a chunk failed: the export fails, read no more
                f.cancel()
            raise


def _check_whole(plan: _Plan, src: _Source) -> None:
    """One saved rank's files hold a whole tensor only where its DTensor was not sharded across ranks."""
    m = src.manifests[0]
    for t in plan.tensors:
        dt = plan.layouts.get(t.index)
        if dt is not None and list(shard_box(dt, t.name)[1]) != [int(s) for s in dt["shape"]]:
            who = f"rank {m.job[0]} of {m.job[1]}" if m.job else "one rank"
            raise IncompatibleCheckpointError(
                f"step {src.step} of {src.where} was saved by {who} alone and holds only its shard of the DTensor "
                f"{t.name!r} ({dt['placements']} over a {dt['mesh']} mesh): export the job tier instead (the url "
                "every rank saved to), which holds every rank's shards, or a key without sharded tensors"
            )


@functools.cache
def _st_dtypes() -> dict[torch.dtype, str]:
    """torch dtype -> the dtype name a safetensors header gives it (complex128 has none)."""
    import torch

    return {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.complex64: "C64",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.uint16: "U16",
        torch.uint32: "U32",
        torch.uint64: "U64",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
    }


def _check_names(plan: _Plan, format: str, src: _Source) -> None:
    """Before anything is read: every tensor must get a name of its own that a safetensors header can hold,
    and a dtype the format has; every value (in the ``ckpt.values`` metadata) a name of its own. A state whose
    names collide once flattened (a key ``"a/b"`` beside ``"a"`` -> ``"b"``; keys ``1`` and ``"1"``) would
    otherwise lose all but one of them."""
    where = f"step {src.step} of {src.where}"
    seen: set[str] = set()
    for t in plan.tensors:
        if t.name in seen:
            raise ValueError(
                f"{where}: two tensors are both named {t.name!r} once their paths are joined with '/' "
                "(a key holding '/', or keys like 1 and '1'); export another key, or format='torch', "
                "which keeps the structure"
            )
        seen.add(t.name)
        if t.name == "__metadata__":
            raise ValueError(
                f"{where}: a tensor is named {t.name!r}, the name a safetensors header reserves for its "
                "metadata; export another key, or format='torch'"
            )
        try:
            t.name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{where}: the tensor name {t.name!r} is not valid Unicode (a lone surrogate); a "
                "safetensors header cannot hold it; export another key, or format='torch'"
            ) from None
        if t.dtype not in _st_dtypes():
            raise ValueError(
                f"{where}: the tensor {t.name!r} is {t.dtype}, which safetensors cannot store; export "
                "another key, or format='torch'"
            )
    if format == "safetensors" and plan.clashes:
        raise ValueError(
            f"{where}: two values are both named {plan.clashes[0]!r} once their paths are joined with '/' "
            "(a key holding '/', or keys like 1 and '1'); export another key, or format='torch', which "
            "keeps the structure"
        )


def _skipped(node: Any, plan: _Plan, path: str) -> bool:
    if isinstance(node, dict) and "$skip" in node:
        plan.dropped.append(
            f"{plan._name(path)}: left out when the checkpoint was saved (on_unsupported='skip')"
        )
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Writing


def _out_nbytes(t: _Tensor, cast: torch.dtype | None) -> int:
    dtype = cast if cast is not None and t.dtype.is_floating_point else t.dtype
    return math.prod(t.shape) * dtype.itemsize


def _shards(tensors: list[_Tensor], cast: torch.dtype | None, limit: int) -> list[list[_Tensor]]:
    """Tensors in order, cut greedily into groups of at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[_Tensor]] = []
    size = 0
    for t in tensors:
        n = _out_nbytes(t, cast)
        if not out or (out[-1] and size + n > limit):
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out or [[]]


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


class _Writer(abc.ABC):
    """Writes an export's files into ``stage``, one format per subclass."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    @abc.abstractmethod
    def write(
        self, stage: Path, src: _Source, cast: torch.dtype | None, limit: int, progress: bool
    ) -> dict[str, Any]:
        """Write the files; returns the export's index (what ``ExportInfo`` reports)."""

    def _progress(self, groups: list[list[_Tensor]], src: _Source, progress: bool) -> Progress:
        enabled = progress and wanted()
        total = sum(self.plan.fetch_bytes(g, src) for g in groups) if enabled else None
        return Progress(total, f"export step {src.step}", enabled)


class _SafetensorsWriter(_Writer):
    """``model.safetensors`` or shards plus ``model.safetensors.index.json``."""

    def __init__(self, plan: _Plan, src: _Source, key: str | None) -> None:
        super().__init__(plan)
        self.meta = {"format": "pt", META_STEP: str(src.step), META_SOURCE: src.where, META_KEY: key or ""}
        self.values: dict[str, Any] | None = plan.values

    def tensors(self) -> list[_Tensor]:
        return self.plan.tensors

    def write(
        self, stage: Path, src: _Source, cast: torch.dtype | None, limit: int, progress: bool
    ) -> dict[str, Any]:
        groups = _shards(self.tensors(), cast, limit)
        names = _shard_names(len(groups))
        weight_map: dict[str, str] = {}
        nbytes = 0
        with self._progress(groups, src, progress) as bar:
            for k, (group, fname) in enumerate(zip(groups, names)):
                loaded = self.plan.load(group, src, bar)
                out: dict[str, torch.Tensor] = {}
                for t in group:
                    x = _cast(loaded[t.index], cast)
                    out[t.name] = x  # tied weights: each name's own bytes in the file, no copy held
                    weight_map[t.name] = fname
                    nbytes += x.numel() * x.element_size()
                meta = dict(self.meta)
                if k == 0 and self.values is not None:
                    meta[META_VALUES] = json.dumps(self.values)
                _write_safetensors(stage / fname, out, meta)
                del loaded, out
            src.read_bytes = int(bar.done)
        files = list(names)
        if len(groups) > 1:
            index: dict[str, Any] = {
                "metadata": {"total_size": nbytes, **self.meta},
                "weight_map": weight_map,
            }
            index["metadata"].pop("format")
            if self.values is not None:
                index["metadata"][META_VALUES] = self.values
            _write_file(
                stage / "model.safetensors.index.json",
                (json.dumps(index, indent=2, sort_keys=False) + "\n").encode("utf-8"),
            )
            files.append("model.safetensors.index.json")
        return {"files": files, "tensors": len(weight_map), "nbytes": nbytes}


#: the largest header the safetensors reader accepts
_ST_MAX_HEADER = 100_000_000


def _create(path: Path) -> int:
    """A new file in the staging directory, never through a link left at its name."""
    return os.open(
        path,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
        0o644,
    )


def _write_file(path: Path, data: bytes) -> None:
    with open(_create(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """One safetensors file, streamed from the tensors (no serialised copy of them is held): an 8-byte
    little-endian header length, the JSON header (padded with spaces to 8 bytes), the tensors' bytes.
    Tensors are laid out by element size, largest first (in order otherwise), as ``safetensors`` lays
    them out, so that each starts aligned to its element size. A write failure (a full disk, a file size
    limit) is the ``OSError`` the system gave, with its errno."""
    import torch

    order = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    off = 0
    for name, x in order:
        n = x.numel() * x.element_size()
        header[name] = {
            "dtype": _st_dtypes()[x.dtype],
            "shape": list(x.shape),
            "data_offsets": [off, off + n],
        }
        off += n
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > _ST_MAX_HEADER:
        raise ValueError(
            f"{path.name}: a safetensors header of {len(raw)} bytes, more than the {_ST_MAX_HEADER} "
            "its readers accept (too many tensors or values): export less at a time (key=) or use a "
            "smaller max_shard_size"
        )
    with open(_create(path), "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, x in order:
            if x.numel():
                f.write(memoryview(x.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


class _Sink:
    """A file ``torch.save`` writes through, keeping the ``OSError`` a write met: torch reports it as a
    ``RuntimeError`` of its own, which loses the errno (a full disk would read as a bug)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, b: Any) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def _cast(x: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    return x.to(cast) if cast is not None and x.is_floating_point() else x


class _TorchWriter(_Writer):
    """One ``torch.save`` file: the selected state as nested containers of tensors and plain values."""

    def __init__(self, plan: _Plan, built: Any) -> None:
        super().__init__(plan)
        self.built = built

    def write(
        self, stage: Path, src: _Source, cast: torch.dtype | None, limit: int, progress: bool
    ) -> dict[str, Any]:
        import torch

        tensors = self.plan.tensors
        with self._progress([tensors], src, progress) as bar:
            loaded = self.plan.load(tensors, src, bar)
            src.read_bytes = int(bar.done)
        done: dict[int, torch.Tensor] = {}

        def build(x: Any) -> Any:
            if isinstance(x, _Ref):
                i = self.plan._origin(x.index)
                if i not in done:  # one tensor per stored item: tied weights stay tied
                    done[i] = _cast(loaded[x.index], cast)
                return done[i]
            if isinstance(x, list):
                return [build(v) for v in x]
            if isinstance(x, tuple):
                return tuple(build(v) for v in x)
            if isinstance(x, dict):
                return {k: build(v) for k, v in x.items()}
            return x

        obj = build(self.built)
        with open(_create(stage / _TORCH_FILE), "wb") as f:
            sink = _Sink(f)
            try:
                torch.save(obj, sink)
                sink.flush()
            except Exception:
                if sink.error is not None:  # the system's error (ENOSPC, EFBIG, EIO), not torch's wrapper
                    raise sink.error from None
                raise
            os.fsync(f.fileno())
        return {
            "files": [_TORCH_FILE],
            "tensors": len(tensors),
            "nbytes": sum(t.numel() * t.element_size() for t in done.values()),
        }


_TORCH_FILE = "state.pt"  # inside the staging directory; renamed to the destination's own name


class _HFWriter(_SafetensorsWriter):
    """A model directory ``from_pretrained`` loads: ``config.json`` and the weights as safetensors,
    named and tied as ``save_pretrained`` writes them."""

    def __init__(self, plan: _Plan, config: Any, tree: Any, src: _Source) -> None:
        super().__init__(plan, src, None)
        self.meta = {"format": "pt", META_STEP: str(src.step), META_SOURCE: src.where}
        self.values = None
        self.config = _config_dict(config, tree, src)  # before anything is read or written
        self.dropped: list[str] = [
            f"{name}: a value, not a tensor (a model directory holds only weights)" for name in plan.values
        ]
        self._chosen: list[_Tensor] = []

    def tensors(self) -> list[_Tensor]:
        return self._chosen

    def write(
        self, stage: Path, src: _Source, cast: torch.dtype | None, limit: int, progress: bool
    ) -> dict[str, Any]:
        try:
            import transformers
        except ImportError:
            raise ImportError("format='hf' needs transformers: pip install 'tierckpt[hf]'") from None
        (stage / "config.json").write_text(json.dumps(self.config))
        cfg = transformers.AutoConfig.from_pretrained(str(stage))
        cls, chosen, dropped = self._match(transformers, cfg)
        self._chosen = chosen
        floats: dict[torch.dtype, int] = {}
        for t in chosen:
            if t.dtype.is_floating_point:
                d = cast or t.dtype
                floats[d] = floats.get(d, 0) + _out_nbytes(t, cast)
        if floats:
            main = max(floats, key=floats.get)
            setattr(cfg, "dtype" if "dtype" in cfg.to_dict() else "torch_dtype", main)
        cfg.architectures = [cls.__name__]
        cfg.save_pretrained(str(stage))
        out = super().write(stage, src, cast, limit, progress)
        out["files"] = ["config.json"] + out["files"]
        out["dropped"] = self.dropped + dropped
        return out

    def _match(self, transformers: Any, cfg: Any) -> tuple[type, list[_Tensor], list[str]]:
        """The model class whose weights are exactly the checkpoint's (names, shapes); the tensors to
        write, named as the model names them; what is left out (weights tied in the model)."""
        import torch

        tensors = self.plan.tensors
        variants = [(tensors, "")]
        prefixes = list(_WRAPPER_PREFIXES)
        if (
            tensors
        ):  # a LightningModule's attribute holding the model ("model." of every name), one or two deep
            parts = tensors[0].name.split(".")
            prefixes += [".".join(parts[:n]) + "." for n in (1, 2) if len(parts) > n]
        for p in dict.fromkeys(prefixes):
            if tensors and all(t.name.startswith(p) for t in tensors):
                variants.append(([_Tensor(t.name[len(p) :], t.index, t.shape, t.dtype) for t in tensors], p))
        names = list(getattr(cfg, "architectures", None) or [])
        classes = [
            getattr(transformers, n) for n in names if isinstance(getattr(transformers, n, None), type)
        ]
        classes += [transformers.AutoModelForCausalLM, transformers.AutoModel]
        first_error: str | None = None
        for cls in classes:
            try:
                with torch.device("meta"):
                    model = cls.from_config(cfg) if hasattr(cls, "from_config") else cls._from_config(cfg)
            except (ValueError, TypeError, KeyError, AttributeError, ImportError, RuntimeError) as e:
                first_error = first_error or f"{cls.__name__} cannot be built from the config ({e})"
                continue
            for ts, prefix in variants:
                problem, chosen, dropped = self._compare(model, ts)
                if problem is None:
                    if prefix:
                        dropped.append(f"the prefix {prefix!r} of every weight name (a wrapper's)")
                    return type(model), chosen, dropped
                first_error = first_error or f"{type(model).__name__}: {problem}"
        raise IncompatibleCheckpointError(
            f"the weights at key {self.plan._base!r} of step {self.meta[META_STEP]} of {self.meta[META_SOURCE]} do "
            f"not fit the model config: {first_error}. Pass the config the model was built from (config=, "
            "--config), or another key (key=, --key)"
        )

    def _compare(self, model: Any, tensors: list[_Tensor]) -> tuple[str | None, list[_Tensor], list[str]]:
        sd = model.state_dict(keep_vars=True)
        tied: dict[str, str] = {}
        first: dict[int, str] = {}
        for n, p in sd.items():
            tied[n] = first.setdefault(id(p), n)
        by_name = {t.name: t for t in tensors}
        chosen, dropped = [], []
        for t in tensors:
            alias = self.plan.items[t.index].alias_of
            head = tied.get(t.name, t.name)
            if head != t.name and head in by_name:
                if alias is None or self.plan._origin(by_name[head].index) != alias:
                    return (
                        f"{t.name!r} is tied to {head!r} in the model, but the checkpoint holds them as "
                        "separate tensors (a config with the weights untied, e.g. tie_word_embeddings=False, "
                        "fits it)",
                        [],
                        [],
                    )
                dropped.append(f"{t.name}: tied to {head} (the model ties them again when it loads)")
                continue
            chosen.append(t)
        have = {t.name for t in chosen}
        missing = [n for n in sd if n not in have and tied[n] not in have]
        unexpected = [t.name for t in chosen if t.name not in sd]
        if missing or unexpected:
            return (
                f"{len(missing)} weight(s) of the model are not in the checkpoint ({missing[:5]}) and "
                f"{len(unexpected)} of the checkpoint are not in the model ({unexpected[:5]})",
                [],
                [],
            )
        for t in chosen:
            if list(sd[t.name].shape) != t.shape:
                want = list(sd[t.name].shape)
                return f"{t.name!r} has shape {t.shape} in the checkpoint, {want} in the model", [], []
        return None, chosen, dropped


def _config_dict(config: Any, tree: Any, src: _Source) -> dict[str, Any]:
    """The model config as a dict, from ``config`` (see :func:`export`) or the state's ``"hf_config"``."""
    if config is None:
        node = tree.get("hf_config") if isinstance(tree, dict) else None
        if node is None:
            raise ValueError(
                f"step {src.step} of {src.where} holds no model config (no 'hf_config' in the state): "
                "pass config= (--config) with a config.json, the directory of the original model, "
                "or a model name"
            )
        value = _Plan(src.manifests[0]).walk(node, "hf_config")
        if isinstance(value, str):  # bounded in depth and size before it is parsed, as every record is
            value = parse_record(
                value.encode("utf-8", "surrogatepass"),
                f"{src.where}: step {src.step}: 'hf_config'",
                expect=None,
            )
        config = value
    if isinstance(config, dict):
        d = config
    elif hasattr(config, "to_dict") and hasattr(config, "model_type"):
        d = config.to_dict()
    elif isinstance(config, (str, os.PathLike)):
        p = Path(config).expanduser()
        if p.is_dir():
            p = p / "config.json"
        if p.is_file():  # a regular file of bounded size and depth (not a FIFO, not /dev/zero)
            try:
                d = parse_record(read_record(p), str(p), expect=None)
            except CorruptCheckpointError as e:
                raise ValueError(f"config: {e}") from None
        elif os.path.lexists(p):
            raise ValueError(f"config: {p} is not a regular file")
        else:
            import transformers

            d = transformers.AutoConfig.from_pretrained(os.fspath(config)).to_dict()
    else:
        raise ValueError(
            f"config must be a PretrainedConfig, a dict, a path or a model name; got {type(config).__name__}"
        )
    if not isinstance(d, dict) or not isinstance(d.get("model_type"), str):
        raise ValueError("config: the model config has no 'model_type' (is it a Hugging Face config.json?)")
    return d


# ---------------------------------------------------------------------------------------------
# Putting the output in place


def _hidden(dest: Path, kind: str) -> Path:
    """``.NAME.KIND-PID-XXXXXXXX`` beside ``dest``, NAME cut so that the whole name stays within the
    255 bytes a file name may have (a destination's own name may use all of them)."""
    name = os.fsdecode(os.fsencode(dest.name)[:200])
    return dest.parent / f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _stage_beside(dest: Path) -> Path:
    remove_leftovers(dest.parent, dest.name)
    stage = _hidden(dest, "export")
    os.mkdir(stage)
    return stage


_LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>export|replaced)-(?P<pid>\d+)-[0-9a-f]{8}$", re.DOTALL)


def leftovers(parent: str | os.PathLike, name: str | None = None) -> list[Path]:
    """What exports that were killed on the way left in ``parent`` (those to the destination ``name``
    when given): their hidden staging directories ``.NAME.export-PID-XXXXXXXX`` (partial output, or after
    the exchange the old destination), and ``.NAME.replaced-PID-XXXXXXXX`` (an old destination moved aside
    where the file system has no atomic exchange) once a destination ``NAME`` exists again. Only those of
    a process that is gone: its pid names no live process of this host, or one that started after the
    leftover was last modified (the pid was reused, :func:`ckpt.procs.alive`). A ``.replaced`` one is
    never listed while ``NAME`` is missing: it is then the only copy of that destination."""
    from . import procs

    cut = os.fsdecode(os.fsencode(name)[:200]) if name is not None else None
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        m = _LEFTOVER_RE.match(e.name)
        if m is None or (cut is not None and m.group("name") != cut):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)) or st.st_uid != os.getuid():
            continue  # never a link (followed by nothing here) nor another user's
        if m.group("kind") == "replaced" and not os.path.lexists(os.path.join(parent, m.group("name"))):
            continue
        if procs.alive(int(m.group("pid")), since=st.st_mtime):
            continue
        out.append(Path(e.path))
    return sorted(out)


def remove_leftovers(parent: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove :func:`leftovers` (of destination ``name``, or every one in ``parent``); returns what was removed.
    An export to a destination does it for that destination before it starts; ``ckpt gc --exports DIR``
    for every destination in ``DIR``."""
    gone = []
    for p in leftovers(parent, name):
        _remove(p)
        if not os.path.lexists(p):
            gone.append(p)
            log.info("removed %s, left by an export that was killed", p)
    return gone


def _publish(stage: Path, dest: Path, force: bool, single_file: bool) -> None:
    """Make the staged output ``dest``: fsync it, then one rename that never replaces anything
    (``renameat2(RENAME_NOREPLACE)``: a destination that appeared meanwhile, even an empty directory,
    is refused), or with ``force`` an atomic exchange with the existing ``dest``, whose old content is
    removed only after that. A destination that appears or goes away meanwhile is handled as it is
    found at the moment of the rename."""
    new = stage / _TORCH_FILE if single_file else stage
    for f in [new] if single_file else sorted(stage.iterdir()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(stage)
    for _ in range(16):
        if os.path.lexists(dest):
            if not force:
                raise FileExistsError(
                    errno.EEXIST,
                    "the export destination appeared while exporting; pass "
                    "force=True (--force) to replace it",
                    str(dest),
                )
            try:
                old = _swap(new, dest, single_file)
            except FileNotFoundError:
                if os.path.lexists(new) and not os.path.lexists(dest):
                    continue  # dest went away meanwhile: put the new one there
                raise
            if old is not None:
                _remove(old)
            break
        try:
            _put(new, dest, single_file)
            break
        except FileExistsError:
            if not force:
                raise FileExistsError(
                    errno.EEXIST,
                    "the export destination appeared while exporting; pass "
                    "force=True (--force) to replace it",
                    str(dest),
                ) from None
            # appeared meanwhile: replace it
    else:
        raise FileExistsError(
            errno.EEXIST,
            "the export destination kept appearing and going away while it was "
            "replaced; nothing was replaced",
            str(dest),
        )
    _fsync_dir(dest.parent)
    if single_file:
        shutil.rmtree(stage, ignore_errors=True)


def _put(new: Path, dest: Path, single_file: bool) -> None:
    """Rename ``new`` to ``dest``, which must not exist: ``FileExistsError`` if it does."""
    try:
        _renameat2(new, dest, RENAME_NOREPLACE)
        return
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "the export destination exists", str(dest)) from None
        if e.errno not in NO_RENAMEAT2:
            raise
    try:  # no renameat2 here: a link fails on an existing name; rename(2) of a directory fails on all but an
        if single_file:  # empty directory, which it would replace: checked just before
            os.link(new, dest)
        elif os.path.lexists(dest):
            raise FileExistsError(errno.EEXIST, "the export destination exists", str(dest))
        else:
            os.rename(new, dest)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, "the export destination exists", str(dest)) from None
        raise


def _swap(new: Path, dest: Path, single_file: bool) -> Path | None:
    """Put ``new`` at ``dest`` in its place; returns where the old ``dest`` now is (None: already gone).

    One atomic exchange where the file system has it. Elsewhere a file replaces a file (or a link) with
    one atomic rename; a directory takes two renames (the old one aside, the new one in), undone if the
    second fails; a kill between them leaves the old one at ``.NAME.replaced-PID-XXXXXXXX``."""
    try:
        _renameat2(new, dest, RENAME_EXCHANGE)
        return new
    except OSError as e:
        if e.errno not in NO_RENAMEAT2:
            raise
    if single_file and not stat.S_ISDIR(os.lstat(dest).st_mode):
        os.replace(new, dest)
        return None
    trash = _hidden(dest, "replaced")
    os.rename(dest, trash)
    try:
        os.rename(new, dest)
    except BaseException:
        try:
            os.rename(trash, dest)
        except OSError:
            log.error(
                "the export could not put %s back after failing to replace it: it is at %s", dest, trash
            )
        raise
    return trash


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning(
            "the replaced export destination could not be removed completely: what is left of it is at %s",
            path,
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Planning: turn a user's state into a JSON tree plus a flat list of tensors, and back.

Saving walks the state once. Modules, optimizers, LR schedulers and anything
``Stateful`` (``state_dict()`` / ``load_state_dict()``) are replaced by their
state dicts; tensors become ``{"$t": index}`` references into a flat list;
everything else must be JSON-safe or the save is refused with the key named.
The JSON tree is built fresh, so later mutations of the user's Python values
cannot tear a snapshot that is still being written.

Restoring walks the saved tree next to the live state: every saved tensor is
bound to a destination, the live tensor itself when shape and dtype match (so
bytes land in place, on the GPU, with no temporary), otherwise a new tensor on
the device type it was saved from. Once the bytes are in, the objects receive
their state dicts through ``load_state_dict``.

Tree encoding (all JSON): the values of :mod:`ckpt.values` (plain JSON, ``{"$tuple": [...]}``,
``{"$d": [[k, v], ...]}`` a dict with non-string keys, ``{"$f": "nan" | "inf" | "-inf"}``; bytes are
refused), and the engine's own nodes: ``{"$t": i}`` tensor ``i`` (``"$np": 1`` for a numpy
array); ``{"$obj": kind, "sd": tree}`` a Stateful object (kind is ``module``,
``optimizer`` or ``stateful``); ``{"$dtype": name}``. A DTensor is saved as its local shard,
``{"$t": i, "$dt": layout}`` (see :func:`dtensor_layout`), and loaded back only into the
same layout.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .errors import IncompatibleCheckpointError, LayoutMismatchError, RefusedStateError
from .format import ItemRecord, dtype_to_str, empty_tensor, str_to_dtype, supported_dtypes
from .scatter import writing_state
from .values import DICT, FLOAT, MAX_TREE_DEPTH, TUPLE, Encoder

__all__ = ["Entry", "Plan", "flatten", "layout", "Binding", "bind"]

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_KNOWN_DTYPES: set[torch.dtype] = set()


@dataclass
class Entry:
    """A tensor of the state, as captured at save time."""

    key: str
    tensor: torch.Tensor
    is_buffer: bool = False  # mutated in place by forward (BatchNorm running stats)
    alias_of: int | None = None  # shares memory with an earlier entry
    version: int = 0  # tensor._version when captured, to detect in-place writes
    sharded: bool = False  # a DTensor's local shard


@dataclass
class Plan:
    tree: Any
    entries: list[Entry] = field(default_factory=list)


def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def _wrapper_paths(module: torch.nn.Module) -> frozenset[str]:
    """Where in ``module``'s state-dict keys a wrapper put a component of its own: ``torch.compile``'s
    ``_orig_mod`` and ``DistributedDataParallel`` / ``DataParallel``'s ``module``, as dotted paths
    (``"layers.0._orig_mod"``), found by the wrapper objects themselves, never by a name alone."""
    frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing can be compiled
    compiled = frame.OptimizedModule if frame is not None else ()
    out = set()
    for name, sub in module.named_modules(remove_duplicate=False):
        attr = (
            "_orig_mod"
            if isinstance(sub, compiled)
            else "module"
            if isinstance(sub, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
            else None
        )
        if attr is not None:
            out.add(f"{name}.{attr}" if name else attr)
    return frozenset(out)


def canonical_key(key: str, wrappers: frozenset[str]) -> str:
    """A module's state-dict ``key`` without the components its wrappers added (:func:`_wrapper_paths`):
    the key the same parameter has in the unwrapped module. A module's state is stored under these keys, so
    a checkpoint of a compiled or DDP-wrapped model restores into the plain model and the other way round."""
    if not wrappers:
        return key
    parts, seen = [], ""
    for p in key.split("."):
        seen = f"{seen}.{p}" if seen else p
        if seen not in wrappers:
            parts.append(p)
    return ".".join(parts)


def _module_sd(
    module: torch.nn.Module, sd: Any, wrappers: frozenset[str] | None = None
) -> tuple[Any, dict[str, str]]:
    """``module``'s state dict ``sd`` under canonical keys (:func:`canonical_key`; ``wrappers``: its
    :func:`_wrapper_paths`, found here when not given), and the map from each canonical key back to the
    module's own."""
    wrappers = _wrapper_paths(module) if wrappers is None else wrappers
    if not wrappers or not isinstance(sd, Mapping) or not all(isinstance(k, str) for k in sd):
        return sd, {}
    own = {canonical_key(k, wrappers): k for k in sd}
    if len(own) != len(sd):  # two keys that differ only by a wrapper: keep the module's own names
        return sd, {}
    return {canonical_key(k, wrappers): v for k, v in sd.items()}, own


def _stored_keys(node: dict, template: Mapping, own: dict[str, str]) -> dict:
    """A saved module state dict's ``node`` with each key as the (canonical) ``template`` has it: checkpoints
    written before keys were canonical carry ``_orig_mod`` components (``torch.compile``), and ``module``
    ones (DDP) that match the target's own keys."""
    raw = {k: c for c, k in own.items()}
    out = {}
    for k, v in node.items():
        if k not in template:
            bare = ".".join(p for p in k.split(".") if p != "_orig_mod")
            k = bare if bare in template else raw.get(k, k)
        out[k] = v
    return out


def _obj_kind(v: Any) -> str:
    if isinstance(v, torch.nn.Module):
        return "module"
    if isinstance(v, torch.optim.Optimizer):
        return "optimizer"
    return "stateful"


def _is_distributed_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor"))


def dtensor_layout(t: Any, path: str) -> dict:
    """How a DTensor is laid out, as saved next to its local shard: global ``shape``, the ``mesh``
    shape, this rank's ``coord`` on it, and ``placements`` (``"S<dim>"`` sharded, ``"R"``
    replicated). A ``Partial`` placement (unreduced values) is refused."""
    placements = []
    for p in t.placements:
        if p.is_shard() and hasattr(p, "split_factor"):  # _StridedShard (FSDP over TP): recorded apart
            placements.append(f"SS{p.dim}:{p.split_factor}")
        elif p.is_shard():
            placements.append(f"S{p.dim}")
        elif p.is_replicate():
            placements.append("R")
        else:
            raise RefusedStateError(
                f"state value at {path!r} is a DTensor with a Partial placement ({p}: values not yet reduced): "
                "redistribute it to Shard or Replicate placements before saving",
                path=path,
            )
    coord = t.device_mesh.get_coordinate()
    return {
        "shape": list(t.shape),
        "mesh": list(t.device_mesh.shape),
        "coord": list(coord or []),
        "placements": placements,
    }


class _Flattener(Encoder):
    """The engine's walk of a state (:class:`ckpt.values.Encoder`, bytes refused): tensors, DTensors,
    numpy arrays, dtypes and ``Stateful`` objects besides the values of the one encoding."""

    remedy = (
        "Store JSON-safe values (numbers, strings, lists, dicts), tensors, or an object with "
        "state_dict()/load_state_dict(); or pass Checkpointer(on_unsupported='skip') to leave such values "
        "out of checkpoints (they are then not restored)."
    )
    leave_out = ", or pass Checkpointer(on_unsupported='skip') to leave it out"

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._seen: dict[tuple, int] = {}

    def tensor(self, t: torch.Tensor, path: str, is_buffer: bool) -> dict:
        # Called once per tensor on every save: keep the common case (a plain dense tensor) cheap.
        dt = None
        if type(t) not in _PLAIN_TENSOR_TYPES and _is_distributed_tensor(t):
            dt = dtensor_layout(t, path)
            t = t.to_local()
        if t.layout is not torch.strided or t.device.type == "meta" or t.is_quantized or t.is_nested:
            raise RefusedStateError(
                f"state value at {path!r} is a {t.layout} / quantized / nested / meta tensor; "
                "only dense tensors can be saved: convert it (e.g. .to_dense()) before saving",
                path=path,
            )
        if t.dtype not in _KNOWN_DTYPES:
            _storable_dtype(t.dtype, path, "tensor")
            _KNOWN_DTYPES.add(t.dtype)
        if t.requires_grad:
            t = t.detach()
        idx = len(self.entries)
        alias = None
        if t.numel():
            ident = (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
            alias = self._seen.get(ident)
            if alias is None:
                self._seen[ident] = idx
        self.entries.append(Entry(path, t, is_buffer, alias, t._version, dt is not None))
        return {"$t": idx} if dt is None else {"$t": idx, "$dt": dt}

    def encode(self, v: Any, path: str, depth: int = 1) -> Any:
        if isinstance(v, torch.Tensor):  # the common case first
            if depth > MAX_TREE_DEPTH:
                self.too_deep(path)
            return self.tensor(v, path, False)
        return super().encode(v, path, depth)

    def extra(self, v: Any, path: str, depth: int) -> Any:
        if _is_stateful(v):
            sd = v.state_dict()
            bufs: frozenset[str] = frozenset()
            if isinstance(v, torch.nn.Module):  # stored under the unwrapped module's keys
                wrappers = _wrapper_paths(v)
                sd, _ = _module_sd(v, sd, wrappers)
                bufs = frozenset(canonical_key(n, wrappers) for n, _ in v.named_buffers())
            return {"$obj": _obj_kind(v), "sd": self._walk_sd(sd, path, bufs, depth + 1)}
        if isinstance(v, torch.Size):
            return {TUPLE: list(v)}
        if isinstance(v, torch.dtype):
            return {"$dtype": _storable_dtype(v, path, "torch.dtype value")}
        np = _numpy()
        if np is not None and isinstance(v, np.ndarray):
            if v.dtype == object:
                raise RefusedStateError(
                    f"state value at {path!r} is a numpy object array, which needs pickle", path=path
                )
            node = self.tensor(torch.from_numpy(np.ascontiguousarray(v)), path, False)
            return {**node, "$np": 1}
        if np is not None and isinstance(v, np.generic):  # (np.float64 NaN too: stored as a float)
            return self.encode(v.item(), path, depth)
        return NotImplemented

    def _walk_sd(self, sd: Any, path: str, buffers: frozenset[str], depth: int) -> Any:
        """A state dict's node; ``buffers``: its keys that hold a module's buffers (mutated in place by
        forward, so a snapshot of them is checked for tears apart from the parameters)."""
        if not isinstance(sd, Mapping):
            return self.encode(sd, path, depth)
        if depth > MAX_TREE_DEPTH:
            self.too_deep(path)
        if not buffers:
            return self.mapping(sd, path, depth)

        def child(k: Any, x: Any, p: str, d: int) -> Any:
            if isinstance(x, torch.Tensor) and str(k) in buffers:
                if d > MAX_TREE_DEPTH:
                    self.too_deep(p)
                return self.tensor(x, p, True)
            return self.encode(x, p, d)

        return self.mapping(sd, path, depth, child)


def _storable_dtype(dtype: torch.dtype, path: str, what: str) -> str:
    """The format's name of ``dtype``, or :class:`RefusedStateError` naming the state value at ``path``."""
    try:
        return dtype_to_str(dtype)
    except TypeError:
        raise RefusedStateError(
            f"state value at {path!r} is a {what} of dtype {dtype}, which the checkpoint format does not store "
            f"(it stores {', '.join(supported_dtypes())}): convert it before saving (e.g. .view(torch.uint8) "
            "keeps the bytes of a sub-byte or packed dtype)"
            + ("" if what == "tensor" else ", or pass Checkpointer(on_unsupported='skip') to leave it out"),
            path=path,
        ) from None


_np_module: Any = False


def _numpy() -> Any:
    global _np_module
    if _np_module is False:
        try:
            import numpy

            _np_module = numpy
        except ImportError:
            _np_module = None
    return _np_module


class SkipUnsupported(_Flattener):
    """A flattener that leaves out values that cannot be stored, instead of refusing them."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[str] = []

    def encode(self, v: Any, path: str, depth: int = 1) -> Any:
        try:
            return super().encode(v, path, depth)
        except RefusedStateError:
            if isinstance(v, torch.Tensor):
                raise
            self.skipped.append(path)
            return {"$skip": 1}


def flatten(state: Mapping[str, Any], on_unsupported: str = "error") -> Plan:
    """Capture ``state`` as a JSON tree plus the list of its tensors (no copies made).

    Raises :class:`RefusedStateError` naming the key of a value that is not
    JSON-safe, unless ``on_unsupported == "skip"``.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of name -> value, got {type(state).__name__}")
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"state keys must be strings, got {bad!r}")
    fl = SkipUnsupported() if on_unsupported == "skip" else _Flattener()
    tree = {k: fl.encode(v, k) for k, v in state.items()}
    return Plan(tree, fl.entries)


def layout(entries: list[Entry], align: int) -> tuple[list[ItemRecord], int]:
    """Assign every non-alias tensor an aligned byte range; returns the records and the total size."""
    records: list[ItemRecord] = []
    cursor = 0
    for e in entries:
        t = e.tensor
        nbytes = t.numel() * t.element_size()
        if e.alias_of is not None:
            records.append(
                ItemRecord(e.key, dtype_to_str(t.dtype), list(t.shape), t.device.type, 0, 0, e.alias_of)
            )
            continue
        offset = -(-cursor // align) * align
        records.append(ItemRecord(e.key, dtype_to_str(t.dtype), list(t.shape), t.device.type, offset, nbytes))
        cursor = offset + nbytes
    return records, cursor


# ---------------------------------------------------------------------------------------------
# Restore side


@dataclass
class Binding:
    """Where each saved item's bytes go, and what to do once they are there.

    ``dest[i]`` is a contiguous tensor of item ``i``'s shape and dtype (``None``
    for aliases, which are resolved by :meth:`finish`, and for items the state does
    not take: keys left out with ``strict=False``; such items are not read). A live
    tensor that is not contiguous (``channels_last``, a transposed view) gets a
    contiguous stand-in that :meth:`finish` copies into it, so it keeps its memory
    format. ``finish()`` then hands every object its state dict and writes plain
    values back into the user's state.
    """

    dest: list[torch.Tensor | None]
    _actions: list[Callable[[], None]]
    _aliases: list[tuple[int, int, torch.Tensor | None]]
    #: with ``reshard``: item -> (the box of the global tensor its destination holds, global shape)
    boxes: dict[int, tuple[Any, list[int]]] = field(default_factory=dict)
    #: (item, live non-contiguous tensor) whose bytes arrive in a contiguous stand-in
    _copy_back: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def finish(self) -> None:
        with writing_state():
            for i, live in self._copy_back:
                live.copy_(self.dest[i])
                self.dest[i] = live
            for i, orig, own in self._aliases:
                src = self.dest[orig]
                if own is not None and own.data_ptr() != src.data_ptr():
                    own.copy_(src)
                    self.dest[i] = own
                else:
                    self.dest[i] = src
        for act in self._actions:
            act()


def _target_device(saved: str) -> torch.device:
    if saved == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Binder:
    def __init__(self, items: list[ItemRecord], reshard: bool = False, strict: bool = True) -> None:
        self.items = items
        self.reshard = reshard
        self.strict = strict
        self.copy_back: list[tuple[int, torch.Tensor]] = []
        self.boxes: dict[int, tuple[Any, list[int]]] = {}
        self.dest: list[torch.Tensor | None] = [None] * len(items)
        self.in_place = [False] * len(items)
        self.actions: list[Callable[[], None]] = []
        self.aliases: list[tuple[int, int, torch.Tensor | None]] = []
        self.dtensor_like: dict[str, Any] = {}  # path of an optimizer's per-parameter state -> its DTensor

    def bind_tensor(self, idx: Any, template: Any, path: str, dt: Any = None) -> torch.Tensor | None:
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(self.items):
            raise IncompatibleCheckpointError(
                f"saved tree at {path!r} references a tensor that does not exist"
            )
        it = self.items[idx]
        dtype = str_to_dtype(it.dtype, path)
        if self.reshard and dt is not None:
            return self._bind_box(idx, template, path, dt, dtype)
        if _is_distributed_tensor(template):
            if dt is None:
                raise LayoutMismatchError(
                    f"tensor at {path!r} was saved as a plain tensor but the state holds a DTensor there: "
                    "restore into the layout it was saved from (sharded state is restored shard by shard)"
                )
            _check_layout(template, dt, path)
            template = template.to_local()
        elif dt is not None and isinstance(template, torch.Tensor):
            raise LayoutMismatchError(
                f"tensor at {path!r} was saved as a DTensor ({_describe(dt)}) but the state holds a plain "
                "tensor there: restore into the same sharding (same mesh and placements)"
            )
        fits = (
            isinstance(template, torch.Tensor)
            and template.dtype == dtype
            and list(template.shape) == it.shape
        )
        if it.alias_of is not None:
            self.aliases.append((idx, it.alias_of, template.detach() if fits else None))
            self.in_place[idx] = fits
            return None
        if fits and template.is_contiguous():
            self.dest[idx] = template.detach()
        elif fits:  # channels_last, a transposed view ...: bytes land in a stand-in, then are copied in
            self.dest[idx] = empty_tensor(it.shape, dtype, template.device)
            self.copy_back.append((idx, template.detach()))
        else:
            self.dest[idx] = empty_tensor(it.shape, dtype, _target_device(it.device))
        self.in_place[idx] = fits
        return self.dest[idx]

    def _bind_box(self, idx: int, live: Any, path: str, dt: Any, dtype: torch.dtype) -> torch.Tensor | None:
        """Bind a saved shard for resharding: the destination is the box of the global tensor that the
        live state holds at ``path`` (its local shard, or the whole tensor where it holds a plain one)."""
        from .reshard import shard_box

        it = self.items[idx]
        if it.alias_of is not None:
            self.aliases.append((idx, it.alias_of, None))
            return None
        shape = dt.get("shape") if isinstance(dt, dict) else None
        if not isinstance(shape, list):
            raise IncompatibleCheckpointError(f"tensor at {path!r}: unreadable sharding layout {dt!r}")
        like = live if _is_distributed_tensor(live) else self.dtensor_like.get(path.rsplit("/", 1)[0])
        if like is not None:
            try:
                now = dtensor_layout(like, path)
            except RefusedStateError as e:
                raise IncompatibleCheckpointError(str(e)) from None
            box, local = shard_box(now, path), like.to_local()
            if list(box[1]) != list(local.shape):
                raise IncompatibleCheckpointError(
                    f"tensor at {path!r}: its local shard has shape {list(local.shape)}, but sharding "
                    f"{now['placements']} over a {now['mesh']} mesh gives {list(box[1])}: a layout this "
                    "library cannot reshard into"
                )
            gshape = now["shape"]
            local = local if _is_distributed_tensor(live) else None
        elif isinstance(live, torch.Tensor):
            gshape, local = list(live.shape), live  # a whole tensor: consolidate the shards into it
            box = (tuple([0] * live.dim()), tuple(live.shape))
        else:
            gshape, local = shape, None
            box = (tuple([0] * len(shape)), tuple(shape))
        if list(gshape) != shape or (local is not None and local.dtype != dtype):
            have = f"{local.dtype if local is not None else dtype}{list(gshape)}".replace("torch.", "")
            raise IncompatibleCheckpointError(
                f"tensor at {path!r}: checkpoint has {it.dtype}{shape} (global), the state has {have}"
            )
        if local is not None:  # the resharding copies are strided: any memory layout takes them in place
            self.dest[idx] = local.detach()
            self.in_place[idx] = True
        else:
            device = like.to_local().device if like is not None else _target_device(it.device)
            self.dest[idx] = empty_tensor(box[1], dtype, device)
        self.boxes[idx] = (box, shape)
        return self.dest[idx]

    def decode(self, node: Any, template: Any, path: str) -> Callable[[], Any]:
        """Bind tensors under ``node`` now; return a thunk that builds the value once bytes are in."""
        if isinstance(node, list):
            subs = [self.decode(x, _index(template, i), f"{path}/{i}") for i, x in enumerate(node)]
            return lambda: [s() for s in subs]
        if not isinstance(node, dict):
            return lambda: node
        if "$skip" in node:  # left out at save time (on_unsupported="skip"): the live value stays
            return lambda: template
        if "$t" in node:
            dt = node.get("$dt")
            self.bind_tensor(node["$t"], template, path, dt)
            idx, as_np = node["$t"], bool(node.get("$np"))
            if dt is not None:
                return self._as_dtensor(idx, dt, path, template if _is_distributed_tensor(template) else None)
            return lambda: self.dest[idx].numpy() if as_np else self.dest[idx]
        if TUPLE in node:
            subs = [self.decode(x, _index(template, i), f"{path}/{i}") for i, x in enumerate(node[TUPLE])]
            return lambda: tuple(s() for s in subs)
        if DICT in node:
            pairs = [
                (k, self.decode(v, _index(template, k), f"{path}/{k}"))
                for k, v in node[DICT]
                if not _skipped(v)
            ]
            return lambda: {k: s() for k, s in pairs}
        if FLOAT in node:
            return lambda: float(node[FLOAT])
        if "$dtype" in node:
            dt = str_to_dtype(node["$dtype"], path)
            return lambda: dt
        if "$obj" in node:
            raise IncompatibleCheckpointError(
                f"saved object at {path!r} has no object to load into: the state passed to restore must hold "
                "the object (module, optimizer, Stateful) at that place"
            )
        subs = {
            k: self.decode(v, _index(template, k), f"{path}/{k}") for k, v in node.items() if not _skipped(v)
        }
        return lambda: {k: s() for k, s in subs.items()}

    def bind_value(self, container: dict | list, key: Any, node: Any, path: str) -> None:
        """Bind saved ``node`` to ``container[key]`` of the live state."""
        live = container[key] if _has(container, key) else None
        if isinstance(node, dict) and "$skip" in node:
            return
        if isinstance(node, dict) and "$obj" in node:
            if not _is_stateful(live):
                raise IncompatibleCheckpointError(
                    f"checkpoint holds a {node['$obj']} at {path!r}, but the state passed to restore has "
                    f"{type(live).__name__} there"
                )
            self._bind_object(live, node, path)
            return
        if isinstance(live, torch.Tensor) and isinstance(node, dict) and "$t" in node:
            self.bind_tensor(node["$t"], live, path, node.get("$dt"))
            idx = node["$t"]
            if not self.in_place[idx]:
                raise IncompatibleCheckpointError(
                    f"tensor at {path!r}: checkpoint has {self.items[idx].dtype}{self.items[idx].shape}, "
                    f"the state has {str(live.dtype).removeprefix('torch.')}{list(live.shape)}"
                )
            return
        if isinstance(live, dict) and isinstance(node, dict) and not any(k.startswith("$") for k in node):
            for k, v in node.items():
                if self.strict or k in live:  # strict=False: only the keys both have
                    self.bind_value(live, k, v, f"{path}/{k}")
            return
        items = node if isinstance(node, list) else node.get(TUPLE) if isinstance(node, dict) else None
        if isinstance(live, (list, tuple)) and isinstance(items, list) and len(items) == len(live):
            # Walk live sequences too, so the objects in them (a list of optimizers) load in place.
            seq = list(live)
            for i, v in enumerate(items):
                self.bind_value(seq, i, v, f"{path}/{i}")
            if isinstance(live, list):
                self.actions.append(lambda: live.__setitem__(slice(None), seq))
            else:
                self.actions.append(lambda: _set(container, key, tuple(seq)))
            return
        build = self.decode(node, live, path)
        self.actions.append(lambda: _set(container, key, build()))

    def _as_dtensor(self, idx: int, dt: dict, path: str, live: Any) -> Callable[[], Any]:
        """The value of a saved local shard: the ``live`` DTensor itself when its bytes landed in its
        local tensor, else a DTensor made on its mesh once the bytes are in. With no live DTensor (the
        state of an optimizer that has not stepped yet) the mesh comes from the state's parameter."""
        like = live if live is not None else self.dtensor_like.get(path.rsplit("/", 1)[0])
        if like is None and self.reshard:
            return lambda: self.dest[idx]  # consolidated into a whole (plain) tensor
        if like is None:
            raise LayoutMismatchError(
                f"tensor at {path!r} was saved as a DTensor ({_describe(dt)}) and the state has no DTensor "
                "there to take its mesh from: restore into the same model and optimizer layout"
            )
        if live is None and not self.reshard:
            _check_layout(
                like, dt, path
            )  # per-parameter state (AdamW's moments) is laid out like the parameter
        from torch.distributed.tensor import DTensor

        def build() -> Any:
            local = self.dest[idx]
            if live is not None and local.data_ptr() == live.to_local().data_ptr():
                return live
            return DTensor.from_local(
                local,
                like.device_mesh,
                like.placements,
                run_check=False,
                shape=like.shape,
                stride=like.stride(),
            )

        return build

    def _bind_object(self, obj: Any, node: Any, path: str) -> None:
        kind, sd_node = node["$obj"], node.get("sd")
        if kind == "optimizer" and isinstance(obj, torch.optim.Optimizer):
            self._note_dtensor_params(obj, sd_node, path)
        template = obj.state_dict()
        module = kind == "module" and isinstance(obj, torch.nn.Module)
        own: dict[str, str] = {}
        if module:  # matched under canonical keys, loaded under the module's own
            template, own = _module_sd(obj, template)
            if (
                isinstance(sd_node, dict)
                and isinstance(template, Mapping)
                and not any(k.startswith("$") for k in sd_node)
            ):
                sd_node = _stored_keys(sd_node, template, own)
        partial = (
            module
            and not self.strict
            and isinstance(sd_node, dict)
            and isinstance(template, Mapping)
            and not any(k.startswith("$") for k in sd_node)
        )
        if partial:  # strict=False: the module's keys that both sides have, nothing else is read
            sd_node = {k: v for k, v in sd_node.items() if k in template}
        build = self.decode(sd_node, template, path)

        def load() -> None:
            sd = build()
            if module and self._all_in_place(sd_node) and (partial or set(sd) == set(template)):
                return  # every tensor already landed in the module's own memory
            if own and isinstance(sd, Mapping):
                sd = {own.get(k, k): v for k, v in sd.items()}
            if partial:
                obj.load_state_dict(sd, strict=False)
            else:
                obj.load_state_dict(sd)

        self.actions.append(load)

    def _note_dtensor_params(self, opt: torch.optim.Optimizer, sd_node: Any, path: str) -> None:
        """Map ``path/state/<id>`` to the live DTensor parameter with saved id ``id`` (ids pair with
        the parameters in param-group order, as ``Optimizer.load_state_dict`` pairs them)."""
        groups = sd_node.get("param_groups") if isinstance(sd_node, dict) else None
        if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
            return
        for saved, live in zip(groups, opt.param_groups):
            ids = saved.get("params") if isinstance(saved, dict) else None
            if isinstance(ids, list) and len(ids) == len(live["params"]):
                for i, p in zip(ids, live["params"]):
                    if _is_distributed_tensor(p):
                        self.dtensor_like[f"{path}/state/{i}"] = p

    def _all_in_place(self, node: Any) -> bool:
        """Whether every value of a module's saved state dict is a tensor whose bytes land in the
        module's own tensor (so ``load_state_dict`` has nothing left to do). Any other value (a
        module's extra state) must still go through ``load_state_dict``."""
        if not isinstance(node, dict) or any(k.startswith("$") for k in node):
            return False
        return all(isinstance(n, dict) and "$t" in n and self.in_place[n["$t"]] for n in node.values())


def _describe(dt: Any) -> str:
    try:
        return f"global shape {dt['shape']}, placements {dt['placements']} over a {dt['mesh']} mesh"
    except (TypeError, KeyError):
        return "unreadable layout"


def _check_layout(live: Any, dt: Any, path: str) -> None:
    """Raise unless the live DTensor has the saved global shape, mesh shape, placements and coordinate."""
    try:
        now = dtensor_layout(live, path)
    except RefusedStateError as e:
        raise IncompatibleCheckpointError(str(e)) from None
    if not isinstance(dt, dict) or any(now[k] != dt.get(k) for k in ("shape", "mesh", "placements", "coord")):
        raise LayoutMismatchError(
            f"tensor at {path!r} was saved as a DTensor ({_describe(dt)}, coordinate "
            f"{dt.get('coord') if isinstance(dt, dict) else '?'}); the state holds {_describe(now)}, coordinate "
            f"{now['coord']}: a rank's own copy loads only into the layout it was saved from. To change world "
            "size, mesh or placements, restore from a job tier (the same url on every rank when saving), "
            "which holds every rank's shards and reshards them"
        )


def _skipped(node: Any) -> bool:
    return isinstance(node, dict) and "$skip" in node


def _has(container: Any, key: Any) -> bool:
    if isinstance(container, Mapping):
        return key in container
    return isinstance(key, int) and 0 <= key < len(container)


def _index(template: Any, key: Any) -> Any:
    try:
        if isinstance(template, Mapping):
            return template.get(key)
        if isinstance(template, (list, tuple)) and isinstance(key, int) and 0 <= key < len(template):
            return template[key]
    except TypeError:
        pass
    return None


def _set(container: Any, key: Any, value: Any) -> None:
    container[key] = value


def bind(
    state: dict, tree: Any, items: list[ItemRecord], strict: bool = True, reshard: bool = False
) -> Binding:
    """Bind a saved tree to the live ``state`` (see :class:`Binding`).

    Raises :class:`IncompatibleCheckpointError` when top-level keys differ (with
    ``strict``) or a tensor's shape or dtype does not match, and its subclass
    :class:`LayoutMismatchError` when sharded state was saved in another layout.

    ``strict=False`` loads exactly the keys both sides have: a top-level key only in
    the checkpoint is not read and never added to ``state``; one only in ``state``
    keeps its value. The same holds one level down for a module's state dict (its
    ``load_state_dict(strict=False)`` gets the common keys) and at every level of a
    plain dict in the state. Optimizers, schedulers and other objects get their saved
    state dict whole (their own ``load_state_dict`` decides what fits).
    ``reshard``: bind sharded tensors to the box of the global tensor the live state
    holds instead (``Binding.boxes``; the bytes then come from :mod:`ckpt.reshard`).
    """
    if not isinstance(tree, dict):
        raise IncompatibleCheckpointError("saved state tree is not a mapping")
    missing = sorted(set(state) - set(tree))
    unexpected = sorted(set(tree) - set(state))
    if strict and (missing or unexpected):
        raise IncompatibleCheckpointError(
            f"state keys differ from the checkpoint's: missing from checkpoint {missing}, "
            f"not in the state {unexpected}; pass restore(..., strict=False) to load the common keys"
        )
    b = _Binder(items, reshard, strict)
    for k, node in tree.items():
        if k in state:  # with strict=False, the keys both have; the state never gains a key
            b.bind_value(state, k, node, k)
    for i, orig, own in b.aliases:
        if b.dest[orig] is None and items[orig].alias_of is None and orig not in b.boxes:
            # the item holding the bytes of a shared tensor is not in the state (left out with
            # strict=False): read it into a stand-in, from which finish() fills the alias
            it = items[orig]
            device = own.device if own is not None else _target_device(it.device)
            b.dest[orig] = empty_tensor(it.shape, str_to_dtype(it.dtype, it.key), device)
    return Binding(b.dest, b.actions, b.aliases, b.boxes, b.copy_back)

"""Non-tensor values as tagged JSON: the one encoding of the engine's state tree and of the DCP adapter.

Plain JSON stands for itself: ``None``, bools, ints, finite floats, strings, lists, and dicts whose keys are
strings that do not start with ``$``. Any other value is an object with one tag (a key starting with ``$``)::

    {"$f": "nan" | "inf" | "-inf"}      a non-finite float
    {"$tuple": [...]}                   a tuple (a ``torch.Size`` too)
    {"$d": [[key, value], ...]}         a dict with a key that is not a plain string (keys: str, int,
                                        float, bool or None; a string key starting with "$" included)
    {"$bytes": "<base64>"}              bytes                      (where bytes are allowed: DCP)
    {"$bytesio": "<base64>", "pos": n}  an io.BytesIO at position n, 0 <= n <= its length  (ditto)

Anything else would need pickle and is refused at save time with :class:`~ckpt.errors.RefusedStateError`
naming the value's key path, its type and what to do instead. A value is nested at most
:data:`MAX_TREE_DEPTH` levels deep, counting every list, dict and tuple, and the tags of a tuple (2) and of a
``$d`` dict (3), so that the records holding it stay within what readers parse.

:class:`Encoder` writes the encoding; the engine (:mod:`ckpt.plan`) subclasses it to add tensors and
``Stateful`` objects, and keeps bytes out of its checkpoints. :func:`decode` reads a value back (the DCP
adapter), and :func:`check` validates one tagged node for readers that walk a tree of their own
(:mod:`ckpt.format`). A malformed node is a :class:`~ckpt.errors.CorruptCheckpointError`.

DCP checkpoints written before this encoding was shared tagged non-finite floats ``{"$float": ...}`` and
dicts with integer keys ``{"$dict": [...]}``; :func:`decode` with ``legacy=True`` reads those too (their
``$tuple``, ``$bytes`` and ``$bytesio`` were already these).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any, Callable, Mapping, NoReturn

from .errors import CorruptCheckpointError, RefusedStateError

__all__ = ["MAX_TREE_DEPTH", "Encoder", "decode", "check", "TAGS", "BYTES_TAGS"]

#: how deep a value nests (every dict, list and tuple counts, a tuple and a ``$d`` dict their tags too):
#: records carrying a tree of this depth stay within ``ckpt.format.MAX_JSON_DEPTH``
MAX_TREE_DEPTH = 100
#: what :func:`decode` descends through at most (the deepest record :func:`ckpt.format.parse_record` takes)
MAX_DECODE_DEPTH = 128

FLOAT, TUPLE, DICT, BYTES, BYTESIO = "$f", "$tuple", "$d", "$bytes", "$bytesio"
NON_FINITE = ("nan", "inf", "-inf")
#: each tag of the encoding, with the keys a node carrying it may have
TAGS: dict[str, frozenset[str]] = {
    TUPLE: frozenset({TUPLE}),
    DICT: frozenset({DICT}),
    FLOAT: frozenset({FLOAT}),
}
BYTES_TAGS: dict[str, frozenset[str]] = {BYTES: frozenset({BYTES}), BYTESIO: frozenset({BYTESIO, "pos"})}
#: the DCP adapter's tags before the encoding was shared, and the tag each now reads as
LEGACY = {"$float": FLOAT, "$dict": DICT}
_TUPLE_LEVELS, _PAIR_LEVELS = 2, 3  # {"$tuple": [x]}, {"$d": [[k, x]]}: x sits 2 and 3 levels below the node
_SCALARS = (bool, int, str, type(None))
_KEY_TYPES = (str, int, float, bool, type(None))


class Encoder:
    """Walks a value into the encoding (:meth:`encode`). ``bytes_ok``: whether ``bytes`` and
    ``io.BytesIO`` are stored (else refused like any other type); ``remedy``: the sentence a refusal ends
    with, saying what the caller can do; ``leave_out``: how to leave a value out instead of nesting it
    flatter (the end of a too-deep refusal)."""

    bytes_ok: bool = False
    remedy: str = "Store JSON-safe values (numbers, strings, lists, tuples, dicts) instead."
    leave_out: str = ""

    def encode(self, v: Any, path: str, depth: int = 1) -> Any:
        """The JSON node of ``v``, found at key path ``path`` (keys joined by ``/``); ``depth``: the
        nesting level the node sits at (a top-level value at 1), so a value too deep to be read back is
        refused here."""
        if isinstance(v, _SCALARS) or (isinstance(v, float) and math.isfinite(v)):
            return v
        if depth > MAX_TREE_DEPTH:
            self.too_deep(path)
        node = self.extra(v, path, depth)
        if node is not NotImplemented:
            return node
        if isinstance(v, float):  # (not repr: numpy 2 spells a np.float64 NaN "np.float64(nan)")
            return {FLOAT: "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, Mapping):
            return self.mapping(v, path, depth)
        if isinstance(v, tuple):
            return {TUPLE: [self.encode(x, f"{path}/{i}", depth + _TUPLE_LEVELS) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]
        if self.bytes_ok and isinstance(v, bytes):
            return {BYTES: base64.b64encode(v).decode("ascii")}
        if self.bytes_ok and isinstance(v, io.BytesIO):
            return self._bytesio(v, path)
        self.refuse(v, path)

    def extra(self, v: Any, path: str, depth: int) -> Any:
        """A subclass's node for a type of its own, or ``NotImplemented`` for the encoding's."""
        return NotImplemented

    def mapping(
        self, v: Mapping, path: str, depth: int, child: Callable[[Any, Any, str, int], Any] | None = None
    ) -> Any:
        """The node of dict ``v``: plain when every key is a string not starting with ``$``, else ``$d``
        pairs. ``child(key, value, path, depth)`` encodes one value (default: :meth:`encode`)."""
        plain = all(isinstance(k, str) and not k.startswith("$") for k in v)
        sub = depth + 1 if plain else depth + _PAIR_LEVELS
        out = []
        for k, x in v.items():
            if not isinstance(k, _KEY_TYPES):
                raise RefusedStateError(
                    f"state dict at {path!r} has a key of type {type(k).__name__}; "
                    "keys must be str, int, float, bool or None",
                    path=path,
                )
            p = f"{path}/{k}"
            out.append((k, self.encode(x, p, sub) if child is None else child(k, x, p, sub)))
        if plain:
            return dict(out)
        return {DICT: [[k, x] for k, x in out]}

    def _bytesio(self, v: io.BytesIO, path: str) -> dict:
        data = v.getbuffer()
        try:
            if v.tell() > len(data):
                raise RefusedStateError(
                    f"state value at {path!r} is an io.BytesIO positioned at {v.tell()}, past its "
                    f"{len(data)} bytes; seek it within its bytes (e.g. .seek(0, 2)) before saving",
                    path=path,
                )
            return {BYTESIO: base64.b64encode(data).decode("ascii"), "pos": v.tell()}
        finally:
            data.release()

    def refuse(self, v: Any, path: str) -> NoReturn:
        raise RefusedStateError(
            f"state value at {path!r} is a {type(v).__module__}.{type(v).__qualname__}, which cannot be "
            f"stored without pickle. {self.remedy}",
            path=path,
        )

    def too_deep(self, path: str) -> NoReturn:
        raise RefusedStateError(
            f"state value at {path!r} is nested more than {MAX_TREE_DEPTH} levels deep (every dict, list "
            "and tuple counts, dicts with non-string keys and tuples their tags too): checkpoints read back "
            f"records only that deep. Store such a value flatter (e.g. as a JSON string or a tensor)"
            f"{self.leave_out}",
            path=path,
        )


def check(tag: str, node: dict, *, bytes_ok: bool = False) -> str | None:
    """What is wrong with ``node``, a node of the encoding tagged ``tag`` (a key of :data:`TAGS`, or of
    :data:`BYTES_TAGS` with ``bytes_ok``), or ``None`` when it is well formed. Its children are not looked
    at (see :func:`children`)."""
    keys = TAGS.get(tag) or (BYTES_TAGS.get(tag) if bytes_ok else None)
    if keys is None or set(node) != keys:
        return f"unknown tags {sorted(node)!r}"
    v = node[tag]
    if tag == TUPLE and not isinstance(v, list):
        return f"{TUPLE} must be a list"
    if tag == DICT and not (
        isinstance(v, list)
        and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], _KEY_TYPES) for p in v)
    ):
        return f"{DICT} must list [key, value] pairs with scalar keys"
    if tag == FLOAT and v not in NON_FINITE:
        return f"{FLOAT} must be one of {NON_FINITE}"
    if tag in BYTES_TAGS and not isinstance(v, str):
        return f"{tag} must be base64 text"
    if tag == BYTESIO and not (isinstance(node["pos"], int) and not isinstance(node["pos"], bool)):
        return "pos must be an int"
    return None


def children(tag: str, node: dict, path: str) -> list[tuple[Any, str]]:
    """The values inside a well-formed (:func:`check`) node tagged ``tag``, with their key paths."""
    if tag == TUPLE:
        return [(x, f"{path}/{i}") for i, x in enumerate(node[TUPLE])]
    if tag == DICT:
        return [(x, f"{path}/{k}") for k, x in node[DICT]]
    return []


def decode(node: Any, where: str, *, legacy: bool = False) -> Any:
    """The value JSON ``node`` encodes (bytes and ``io.BytesIO`` included); ``where`` names the record in
    errors. ``legacy``: read the DCP adapter's tags of before too (:data:`LEGACY`). A node that is not of
    the encoding (an unknown tag, a tag beside other keys, a payload of the wrong type, base64 that does not
    decode, a ``pos`` outside its bytes, more than :data:`MAX_DECODE_DEPTH` levels) is a
    :class:`~ckpt.errors.CorruptCheckpointError`; nothing is evaluated or unpickled."""
    return _decode(node, where, "", 1, legacy)


def _decode(node: Any, where: str, path: str, depth: int, legacy: bool) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if depth > MAX_DECODE_DEPTH:
        _corrupt(where, path, f"value nested more than {MAX_DECODE_DEPTH} levels deep")
    if isinstance(node, list):
        return [_decode(x, where, f"{path}/{i}", depth + 1, legacy) for i, x in enumerate(node)]
    if not isinstance(node, dict):
        _corrupt(where, path, f"unexpected JSON value of type {type(node).__name__}")
    tags = [k for k in node if isinstance(k, str) and k.startswith("$")]
    if not tags:
        return {k: _decode(x, where, f"{path}/{k}", depth + 1, legacy) for k, x in node.items()}
    tag = tags[0] if len(tags) == 1 else None
    if legacy and tag in LEGACY and len(node) == 1:
        node, tag = {LEGACY[tag]: node[tag]}, LEGACY[tag]
    why = check(tag, node, bytes_ok=True) if tag is not None else f"unknown tags {sorted(node)!r}"
    if why is not None:
        _corrupt(where, path, why)
    v = node[tag]
    if tag == FLOAT:
        return float(v)
    if tag == TUPLE:
        return tuple(_decode(x, where, f"{path}/{i}", depth + 2, legacy) for i, x in enumerate(v))
    if tag == DICT:
        return {k: _decode(x, where, f"{path}/{k}", depth + 3, legacy) for k, x in v}
    data = _unbase64(v, where, path)
    if tag == BYTES:
        return data
    pos = node["pos"]
    if not 0 <= pos <= len(data):
        _corrupt(where, path, f"BytesIO position {pos} outside its {len(data)} bytes")
    buf = io.BytesIO(data)
    buf.seek(pos)
    return buf


def _unbase64(text: str, where: str, path: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        _corrupt(where, path, "malformed base64 bytes value")


def _corrupt(where: str, path: str, what: str) -> NoReturn:
    raise CorruptCheckpointError(f"{where}: {what}" + (f" (at {path.lstrip('/')!r})" if path else ""))

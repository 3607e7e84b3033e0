"""Lightning's values made storable without pickle, and tensors moved as ``torch.load``'s ``map_location`` does.

Shared by :class:`~ckpt.integrations.lightning.TieredCheckpointIO` (the checkpoint dict Lightning hands it)
and :class:`~ckpt.integrations.lightning.CheckpointCallback` (the trainer's parts it saves).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import RefusedStateError


def _storable(value: Any, path: str, on_unsupported: str, dropped: list[str]) -> Any:
    """Return ``value`` in a form the engine stores without pickle.

    Tensors, numpy values, ``None``/bool/int/float/str, ``torch.dtype`` and
    ``torch.Size`` pass through. Mappings (``AttributeDict``, ``OrderedDict``)
    become dicts, ``argparse.Namespace`` becomes a dict of its attributes,
    ``os.PathLike`` becomes its string; lists and tuples are converted element
    by element. Anything else raises :class:`RefusedStateError` naming
    ``path``, or with ``on_unsupported="skip"`` is recorded in ``dropped`` and
    replaced by :data:`_SKIP` (the caller leaves it out).
    """
    if isinstance(value, (torch.Tensor, str, int, float, bool, type(None), torch.dtype, torch.Size)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                if on_unsupported == "error":
                    raise RefusedStateError(
                        f"checkpoint dict at {path!r} has a key of type {type(k).__name__} ({k!r}); keys must be "
                        "str, int, float, bool or None. Pass on_unsupported='skip' to leave such entries out.",
                        path=path,
                    )
                dropped.append(f"{path}/{k!r}")
                continue
            sub = _storable(v, f"{path}/{k}", on_unsupported, dropped)
            if sub is not _SKIP:
                out[k] = sub
        return out
    if isinstance(value, argparse.Namespace):
        return _storable(vars(value), path, on_unsupported, dropped)
    if isinstance(value, (list, tuple)):
        items = [_storable(v, f"{path}/{i}", on_unsupported, dropped) for i, v in enumerate(value)]
        # A left-out element becomes None, so the positions of the others do not shift.
        items = [None if v is _SKIP else v for v in items]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "numpy":  # arrays and numpy scalars: the engine stores them natively
        return value
    if on_unsupported == "error":
        raise RefusedStateError(
            f"checkpoint value at {path!r} is a {type(value).__module__}.{type(value).__qualname__}, which cannot "
            "be stored without pickle. Store tensors or JSON-safe values there, or pass on_unsupported='skip' "
            "to leave such values out of the checkpoint (they are then missing when it is loaded).",
            path=path,
        )
    dropped.append(path)
    return _SKIP


class _Skip:
    def __repr__(self) -> str:
        return "<left out>"


_SKIP: Any = _Skip()


def _map_location(value: Any, map_location: Any) -> Any:
    """Move every tensor in ``value`` as ``torch.load(map_location=...)`` would."""
    if map_location is None:
        return value
    if isinstance(value, torch.Tensor):
        if isinstance(map_location, (str, torch.device)):
            return value.to(map_location)
        if isinstance(map_location, Mapping):
            target = map_location.get(str(value.device)) or map_location.get(value.device.type)
            return value if target is None else value.to(target)
        if callable(map_location):
            moved = map_location(value, str(value.device))
            return value if moved is None else moved
        raise TypeError(
            f"map_location must be None, a str, a torch.device, a dict or a callable, "
            f"got {type(map_location).__name__}"
        )
    if isinstance(value, dict):
        return {k: _map_location(v, map_location) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_location(v, map_location) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_location(v, map_location) for v in value)
    return value

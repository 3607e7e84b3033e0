"""Restart fast: build the model empty when a restore will fill it.

A restarted job spends seconds building its model (a 1.24B Llama: 7 s of random initialisation on an
H200) only for :meth:`~ckpt.Checkpointer.restore` to overwrite every value. When
:meth:`~ckpt.Checkpointer.restorable` says a restore will load a checkpoint, build the model inside
:func:`empty_params`: each parameter goes to the meta device as the module registers it (no memory, and
the initialisation that follows runs on meta, costing nothing), while buffers are computed as the model's
code always computes them. :func:`materialize` then gives the parameters storage on the device, after
``fully_shard`` under FSDP2, and puts the buffers' values back; ``restore`` fills every parameter and
persistent buffer. Non-persistent buffers (Hugging Face Llama's ``rotary_emb.inv_freq``) are in no
checkpoint: they keep the values the model's own ``__init__`` gave them, on the device it gave them on,
so they are the bits an ordinary build gives.

Nothing here is collective; ``restorable()`` is (see there).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

__all__ = ["empty_params", "materialize"]

_lock = threading.Lock()
_local = threading.local()
_users = 0
_register_parameter = nn.Module.register_parameter


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if (
        param is not None
        and getattr(_local, "on", False)
        and type(param) is nn.Parameter
        and not param.is_meta
    ):
        empty = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        empty.__dict__.update(param.__dict__)  # attributes set before registration (no_weight_decay flags)
        param = empty
    _register_parameter(module, name, param)


@contextlib.contextmanager
def empty_params(enabled: bool = True) -> Iterator[None]:
    """Within the block, every ``nn.Parameter`` a module registers on this thread (attribute assignment
    or ``register_parameter``) is moved to the meta device as it is registered: the weights' allocation
    and initialisation are skipped. Buffers, and tensors computed in ``__init__``, stay where the code puts
    them (the ``torch.device`` context, the default device), computed as in an ordinary build. Parameters
    already on meta are kept as they are, so weights tied by assignment stay tied. Parameter subclasses
    other than ``nn.Parameter`` itself are left as built.

    ``enabled=False`` makes the block an ordinary build: pass ``ck.restorable()``, so that the first start
    of a job (no checkpoint) initialises its model as it always did. Follow with :func:`materialize` and
    ``restore``; until then the model has no values to compute with.
    """
    global _users
    if not enabled:
        yield
        return
    with _lock:
        if _users == 0:
            nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign]
        _users += 1
    outer = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = outer
        with _lock:
            _users -= 1
            if _users == 0:
                nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Give a model built in :func:`empty_params` (or on the meta device) storage on ``device``, keeping its
    buffers' values; returns ``module``. Under FSDP2 call it after ``fully_shard`` (each rank then allocates
    only its shards), and make the optimizer after it (parameters may be replaced; weights tied before stay
    tied). Every parameter and persistent buffer is then uninitialised memory until ``restore`` (strict)
    fills it.

    A module with no parameter or buffer on meta is returned as it is: after an ordinary build (the
    ``enabled=False`` case) this does nothing. A non-persistent buffer on meta (a model built entirely under
    ``torch.device("meta")``) has no value to keep and none in a checkpoint: ``ValueError`` naming those
    buffers, before anything is changed.
    """
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return module
    kept, lost = [], []
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, buf in owner._buffers.items():
            if buf is None:
                continue
            if not buf.is_meta:
                kept.append((owner, name, buf))
            elif name in owner._non_persistent_buffers_set:
                lost.append(f"{prefix}.{name}" if prefix else name)
    if lost:
        raise ValueError(
            f"materialize(module): non-persistent buffers {sorted(set(lost))} are on the meta device, "
            "and no checkpoint holds them: build the model in ckpt.empty_params() instead of "
            "torch.device('meta'), so that its buffers are computed"
        )
    slots: dict[int, list[tuple[nn.Module, str]]] = {}  # where each parameter is registered (tied: several)
    for _, owner in module.named_modules(remove_duplicate=False):
        for name, param in owner._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((owner, name))
    module.to_empty(device=device)
    for (first, first_name), *others in slots.values():
        # to_empty gives each slot of a tied weight a parameter of its own: tie them again
        for owner, name in others:
            if owner._parameters[name] is not first._parameters[first_name]:
                setattr(owner, name, first._parameters[first_name])
    with torch.no_grad():
        for owner, name, buf in kept:
            owner._buffers[name].copy_(buf)  # type: ignore[union-attr]
    return module

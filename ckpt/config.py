"""The Checkpointer's options, grouped: where checkpoints go (:class:`Storage`), when they are taken and
kept (:class:`Policy`); what signals do is :class:`ckpt.Signals`.

``Checkpointer(storage=..., policy=..., signals=...)`` and the flat keyword arguments are the same
options: a field of a config object may be given either way, not both (``ValueError`` naming it)::

    ck = ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir="/nvme/ckpt", url="s3://bucket/run", peers=True),
        policy=ckpt.Policy(every_steps=10, persist_every={"local": 50, "remote": 500},
                           keep=ckpt.Retention(local=2, remote=10)),
        signals=ckpt.Signals(save=(signal.SIGUSR1,)),
    )

Each object is frozen; ``dataclasses.replace(policy, every_steps=5)`` makes a variant. A running
Checkpointer shows what it uses as ``ck.storage`` and ``ck.policy``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .policy import Retention

__all__ = ["Storage", "Policy"]


@dataclass(frozen=True)
class Storage:
    """Where checkpoints go: the tiers and their settings.

    Args:
        local_dir: the local tier, a directory on this node's fast disk (default ``$CKPT_LOCAL_DIR``),
            or a :class:`~ckpt.tiers.LocalTier` instance. One per rank in a multi-process job.
        url: the remote tier, any fsspec URL (``s3://bucket/run``, ``gs://...``, ``hdfs://...``,
            ``file:///...``), or ``None``. The same url on every rank makes it the job tier.
        storage_options: passed to fsspec for ``url`` (endpoint, credentials, retries).
        compression: ``None`` or ``"zstd"`` for the remote tier.
        peers: the peer tier, each snapshot replicated into another rank's RAM: ``True`` (the same local
            rank on the next node) or a rank distance.
        replicated: top-level state keys whose plain tensors are the same on every rank (uploaded
            once, by rank 0, to a job tier).
        max_in_flight: host buffers of the memory tier, each the size of the state (default 3).
        host_memory_limit: bytes of host memory the buffers may take (default: 80% of what is
            available when one is allocated).
    """

    local_dir: str | os.PathLike | Any | None = None
    url: str | Any | None = None
    storage_options: Mapping[str, Any] | None = None
    compression: str | None = None
    peers: bool | int | None = None
    replicated: tuple[str, ...] = ()
    max_in_flight: int | None = None
    host_memory_limit: int | None = None


@dataclass(frozen=True)
class Policy:
    """When snapshots are taken, when each slower tier persists one, and what each tier keeps.

    Args:
        every_steps: the snapshot cadence of :meth:`~ckpt.Checkpointer.maybe_save` (the memory
            tier's), in steps; with ``every_seconds``, either triggers.
        every_seconds: the same in seconds since the last save.
        interval: ``"auto"``: the Young/Daly interval from the measured cost of saves and ``mtbf``
            (seconds between failures; ``restart_cost`` seconds lost per failure besides the work
            since the last checkpoint), instead of ``every_steps`` / ``every_seconds``; and for each
            persisting tier not in ``persist_every``, its own interval from what its writes cost the
            loop. ``mtbf`` may be a dict per tier (``{"memory": ..., "local": ..., "remote": ...}``).
        persist_every: steps between copies on each slower tier, ``{"local": 50, "remote": 500}``;
            a tier not named writes as often as it keeps up (newest wins).
        if_busy: ``"skip"`` (default: the loop never waits for a slow tier) or ``"wait"`` (every
            snapshot reaches every tier; saves wait for buffers). See :class:`~ckpt.IfBusy`.
        keep: :class:`~ckpt.Retention`, how many checkpoints each tier keeps.
        on_unsupported: ``"error"`` refuses a state value that is not JSON-safe; ``"skip"`` leaves it out.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    interval: str | None = None
    mtbf: float | Mapping[str, float] | None = None
    restart_cost: float = 0.0
    persist_every: Mapping[str, int] | None = None
    if_busy: str = "skip"
    keep: Retention | None = None
    on_unsupported: str = "error"


_UNSET = object()


def merge(config: Any, kind: type, given: dict[str, Any], defaults: dict[str, Any]) -> Any:
    """The ``kind`` config that results from ``config`` (a ``kind`` or ``None``) and the keyword arguments
    ``given`` (field -> value, only those the caller passed, i.e. not equal to ``defaults``). A field set
    both ways is refused."""
    if config is not None and not isinstance(config, kind):
        raise TypeError(f"{kind.__name__.lower()}= takes a ckpt.{kind.__name__}, got {type(config).__name__}")
    base = config if config is not None else kind()
    changes = {}
    for f in dataclasses.fields(kind):
        value = given.get(f.name, _UNSET)
        if value is _UNSET or _same(value, defaults.get(f.name, f.default)):
            continue
        if config is not None and not _same(getattr(config, f.name), f.default) \
                and not _same(getattr(config, f.name), value):
            raise ValueError(f"{f.name} is given twice, as a keyword argument ({value!r}) and in "
                             f"{kind.__name__.lower()}=ckpt.{kind.__name__}({f.name}={getattr(config, f.name)!r}): "
                             "give it once")
        changes[f.name] = value
    return dataclasses.replace(base, **changes) if changes else base


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:   # noqa: BLE001 - values without a plain equality (a tensor, say) differ
        return False


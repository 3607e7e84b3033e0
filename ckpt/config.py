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
import enum
import os
from dataclasses import dataclass
from typing import Any, Mapping

import math
from numbers import Real

from .policy import Retention

__all__ = ["Storage", "Policy", "IfBusy"]


class IfBusy(str, enum.Enum):
    """What a save does when the tiers are slower than the snapshots.

    ``SKIP`` (the default): the loop never waits for a slow tier. A tier still busy with an older
    snapshot writes the newest one next and skips those in between (newest wins; each skipped one
    is reported as superseded on its handle and counted in ``Checkpointer.tier_counts``); a save
    that finds no free host buffer (each is read by a tier, being copied into, or holds the newest
    committed snapshot, which is never overwritten) is skipped as a whole, at once (its handle's status
    is ``"skipped"``, counted in ``Checkpointer.skipped``). A save of :meth:`~ckpt.Checkpointer.maybe_save`
    waits for a buffer at most ``CKPT_BUSY_WAIT_MS`` (default 0), also while the buffers are still being
    allocated in the background (it never allocates one beside that).

    ``WAIT``: every snapshot reaches every tier, in order (subject to ``persist_every``); a save
    that finds every host buffer in use blocks until one is free (the stall is on the handle).
    """

    WAIT = "wait"
    SKIP = "skip"


@dataclass(frozen=True)
class Storage:
    """Where checkpoints go: the tiers and their settings.

    Args:
        local_dir: directory of the local tier, on this node's fast storage (default:
            ``$CKPT_LOCAL_DIR``), or a :class:`~ckpt.tiers.LocalTier` instance (a subclass, say, for
            fault injection or a custom layout). One per rank in a multi-process job. One live
            Checkpointer writes a directory: the first save (or ``promote(to="local")``; in a
            collective job, the construction) makes it the owner until ``close()``, and another writer,
            in any process, gets :class:`~ckpt.errors.LockedError` naming the owner. Restoring needs no
            ownership (a restore that reads the remote tier writes the checkpoint into ``local_dir`` on
            the way only while no other live process owns it).
        url: the durable remote tier, any fsspec URL (``s3://bucket/run``, ``gs://...``,
            ``hdfs://...``, ``file:///...``), or ``None``. Uploads run beside the local write, straight
            from host memory. In a multi-process job give every rank the same url: it becomes the *job
            tier*, one step directory holding every rank's files, committed by rank 0 once all ranks'
            uploads succeeded, and restorable on another number of ranks, into another mesh or
            placements, or into one process holding whole tensors (resharding by overlap of shards).
        storage_options: passed to fsspec for ``url`` (endpoint, credentials, retry configuration). A
            store that cannot be reached does not stop the constructor (a bounded probe,
            ``CKPT_REMOTE_PROBE_S``): it is logged and recorded in ``ck.remote.status``, restore uses the
            nearer tiers and each save's ``handle.wait("remote")`` raises until the store answers again.
            A missing bucket (``FileNotFoundError``) or refused credentials (``PermissionError``) raise
            at construction.
        compression: ``None`` or ``"zstd"`` (byte-shuffled, per chunk) for the remote tier.
        peers: the peer tier (collective jobs): ``True`` replicates every snapshot into the RAM of the
            same local rank on the next node (a distance of ``$LOCAL_WORLD_SIZE`` ranks, as torchrun sets
            it; 1 on one node), an int sets that distance. Each rank holds its source's two newest
            replicas in shared memory (never on disk); a rank whose own copies are gone (a replaced
            node) gets its snapshot back from its holder's RAM at restore, before any remote download.
            ``handle.wait("peer")`` returns once the holder has committed this rank's replica.
        replicated: top-level state keys whose plain tensors are the same on every rank (a DDP model
            and its optimizer: ``("model", "optim")``). On a job tier only rank 0 uploads them; the other
            ranks' restores read them from rank 0's files. DTensor shards are never treated as
            replicated. Every rank's local tier keeps its full state either way. Default: none.
        max_in_flight: host buffers of the memory tier, each the size of the state; default 3: the
            newest committed snapshot stays whole in one until a newer one is committed, a slow tier
            may read another, and the next snapshot is copied into the third, so snapshots every step go
            on while the local tier writes. With the default, fewer are kept when ``host_memory_limit``
            leaves room for fewer (said once in the log; ``tier_figures()["memory"].gives_up``). On
            Linux they are shared-memory segments in ``/dev/shm`` (``CKPT_SHM=0``: this process's pinned
            memory), so the memory tier outlives the process: a new process on the node restores the
            newest snapshot from RAM, each chunk checked. ``close()`` frees them; a process that dies
            leaves them for its successor (``ckpt gc --memory`` frees what no one will use). They are
            allocated in the background from the first ``maybe_save()``, so the first save does not
            wait for seconds of allocation.
        host_memory_limit: bytes of host memory the buffers may take (default: 80% of what psutil
            reports available when a buffer is allocated). When not even one buffer fits, a save raises
            :class:`~ckpt.errors.HostMemoryError`.
        extra_tiers: the settings of tiers registered beyond the built-in ones (a tier class decorated with
            :func:`ckpt.tiers.register`), by tier name: ``{"disk2": "/mnt/hdd/ckpt"}`` makes that tier from
            its setting (:meth:`ckpt.tiers.Tier.for_storage`). A name no registered tier has is a
            ``ValueError`` naming the registered ones. No flat keyword: ``storage=`` only.
    """

    local_dir: str | os.PathLike | Any | None = None
    url: str | Any | None = None
    storage_options: Mapping[str, Any] | None = None
    compression: str | None = None
    peers: bool | int | None = None
    replicated: tuple[str, ...] = ()
    max_in_flight: int | None = None
    host_memory_limit: int | None = None
    extra_tiers: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Policy:
    """When snapshots are taken, when each slower tier persists one, and what each tier keeps.

    Args:
        every_steps: the snapshot cadence of :meth:`~ckpt.Checkpointer.maybe_save` (the memory
            tier's): a save at every step divisible by it; with ``every_seconds``, either triggers. With
            none of ``every_steps``, ``every_seconds`` and ``interval``, ``maybe_save`` raises
            ``ValueError`` (a loop that calls it would never save).
        every_seconds: ... or once this many seconds passed since the last save.
        interval: ``"auto"`` picks the Young/Daly optimum interval from the measured cost of recent
            saves and ``mtbf`` (mean time between failures, seconds; ``restart_cost`` seconds lost per
            failure besides the work since the last checkpoint), updated as measurements come in (see
            :meth:`~ckpt.Checkpointer.interval_report`), instead of ``every_steps`` / ``every_seconds``.
            Each persisting tier without a ``persist_every`` cadence then gets its own Young/Daly
            interval from what its writes cost the loop (:class:`~ckpt.policy.TierCadence`). ``mtbf``
            may be a dict per tier, ``{"memory": ..., "local": ..., "remote": ...}``: the mean time
            between the failures each tier is there for (a process crash for the memory tier, a node's
            loss for the remote one); a tier not named uses the memory tier's.
        persist_every: steps between copies on each slower tier, ``{"local": 50, "remote": 500}``
            (``"peer"`` with ``peers=``). A snapshot is taken at every save (the memory tier); a tier
            writes the ones due by its cadence, and a tier not named writes as often as it keeps up
            (newest wins). ``close()`` writes the newest snapshot to every tier that does not hold it.
        if_busy: ``"skip"`` (default: a snapshot that finds no free host buffer is skipped at once and
            a slow tier skips snapshots, newest wins; ``CKPT_BUSY_WAIT_MS`` sets a bound to wait
            instead) or ``"wait"`` (every snapshot reaches every tier; saves wait for buffers). See
            :class:`~ckpt.IfBusy`.
        keep: :class:`~ckpt.Retention`, how many checkpoints each tier keeps; an int ``N`` (as
            ``save_total_limit`` / ``save_top_k`` are written) is ``Retention.every_tier(N)``: ``N`` on
            every durable tier (``local_dir``, the url, each of ``Storage(extra_tiers=...)``). A dict by tier
            name, ``{"local": 3, "disk2": 5}``, is ``Retention(local=3, disk2=5)`` (any durable tier the Checkpointer has; a tier not named keeps its default). ``None``:
            ``Retention()`` (2 in ``local_dir``, 10 at the url).
        on_unsupported: ``"error"`` (default) refuses a state value that is not JSON-safe, naming its
            key; ``"skip"`` leaves such values out (logged), so they are not restored. Pickle is never
            used.

    Every field is checked here, when the policy is made (and so when a Checkpointer is), with a
    ``ValueError`` (a wrong value) or ``TypeError`` (a wrong type) naming the field: no wrong value
    reaches a save. ``ck.policy.keep`` is always a :class:`~ckpt.Retention` (an int or a dict given is
    converted).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    interval: str | None = None
    mtbf: float | Mapping[str, float] | None = None
    restart_cost: float = 0.0
    persist_every: Mapping[str, int] | None = None
    if_busy: str = "skip"
    keep: Retention | int | Mapping[str, int | None] | None = None
    on_unsupported: str = "error"

    def __post_init__(self) -> None:
        _count("every_steps", self.every_steps)
        _seconds("every_seconds", self.every_seconds, positive=True)
        if self.interval not in (None, "auto"):
            raise ValueError(f"interval must be None or 'auto', got {self.interval!r}")
        if isinstance(self.mtbf, Mapping):
            for name, m in self.mtbf.items():
                if not isinstance(name, str):
                    raise TypeError(
                        f"mtbf= as a dict is keyed by tier name ('memory', 'local', 'remote'), got {name!r}"
                    )
                _seconds(f"mtbf[{name!r}]", m, positive=True)
        else:
            _seconds("mtbf", self.mtbf, positive=True)
        if self.restart_cost is None:
            raise TypeError("restart_cost must be a number of seconds (>= 0), got None")
        _seconds("restart_cost", self.restart_cost, positive=False)
        if self.persist_every is not None:
            if not isinstance(self.persist_every, Mapping):
                raise TypeError(
                    f"persist_every must be a dict of tier name -> steps, e.g. {{'local': 50, 'remote': "
                    f"500}}, got {type(self.persist_every).__name__}"
                )
            for name, n in self.persist_every.items():
                if not isinstance(name, str):
                    raise TypeError(
                        f"persist_every is keyed by tier name ('local', 'peer', 'remote'), got {name!r}"
                    )
                _count(f"persist_every[{name!r}]", n)
        if self.if_busy not in ("skip", "wait"):  # ckpt.IfBusy's values (a str enum) compare equal too
            raise ValueError(f"if_busy must be 'skip' or 'wait', got {self.if_busy!r}")
        if self.on_unsupported not in ("error", "skip"):
            raise ValueError(f"on_unsupported must be 'error' or 'skip', got {self.on_unsupported!r}")
        keep = self.keep
        if isinstance(keep, int) and not isinstance(keep, bool):
            if keep < 1:
                raise ValueError(
                    f"keep={keep!r}: keep at least 1 checkpoint per tier (the newest committed one is "
                    "never deleted), or pass ckpt.Retention(local=..., remote=...) (None keeps all)"
                )
            object.__setattr__(self, "keep", Retention.every_tier(keep))
        elif isinstance(keep, Mapping):  # by tier name; the Checkpointer checks the names against its tiers
            object.__setattr__(self, "keep", Retention.of(keep))
        elif keep is not None and not isinstance(keep, Retention):
            raise TypeError(
                f"keep must be an int (that many checkpoints on every tier), a dict of tier name -> "
                f"checkpoints kept, or a ckpt.Retention(local=..., remote=...), got {keep!r}"
            )


def _count(name: str, n: Any) -> None:
    """``n`` is ``None`` or a positive int (a number of steps): else ``TypeError`` / ``ValueError`` naming ``name``."""
    if n is None:
        return
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"{name} must be a positive int (a number of steps), got {n!r}")
    if n < 1:
        raise ValueError(f"{name} must be a positive number of steps, got {n!r}")


def _seconds(name: str, s: Any, positive: bool) -> None:
    """``s`` is ``None`` or a finite number of seconds, above 0 (``positive``) or at least 0."""
    if s is None:
        return
    if not isinstance(s, Real) or isinstance(s, bool):
        raise TypeError(f"{name} must be a number of seconds, got {s!r}")
    if not math.isfinite(s) or (s <= 0 if positive else s < 0):
        raise ValueError(
            f"{name} must be a finite number of seconds {'above' if positive else 'of at least'} 0, got {s!r}"
        )


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
        if (
            config is not None
            and not _same(getattr(config, f.name), f.default)
            and not _same(getattr(config, f.name), value)
        ):
            raise ValueError(
                f"{f.name} is given twice, as a keyword argument ({value!r}) and in "
                f"{kind.__name__.lower()}=ckpt.{kind.__name__}({f.name}={getattr(config, f.name)!r}): "
                "give it once"
            )
        changes[f.name] = value
    return dataclasses.replace(base, **changes) if changes else base


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality (a tensor, say) differ
        return False


_STORAGE_FIELDS = [f.name for f in dataclasses.fields(Storage)]
_POLICY_FIELDS = [f.name for f in dataclasses.fields(Policy)]


def resolve(
    storage: Storage | None, policy: Policy | None, given: Mapping[str, Any], defaults: Mapping[str, Any]
) -> tuple[Storage, Policy]:
    """A Checkpointer's :class:`Storage` and :class:`Policy`: ``storage`` and ``policy`` (each a config
    object or ``None``) with the flat keyword arguments in ``given`` (argument name -> value; a value equal
    to its entry in ``defaults`` counts as not given) merged in, each option given once (see :func:`merge`)."""
    storage = merge(
        storage,
        Storage,
        {
            f: (tuple(given[f]) if f == "replicated" and isinstance(given[f], list) else given[f])
            for f in _STORAGE_FIELDS
            if f in given
        },
        defaults,
    )
    policy = merge(policy, Policy, {f: given[f] for f in _POLICY_FIELDS}, defaults)
    return storage, policy


def check_storage(storage: Storage) -> None:
    """What a Checkpointer needs of ``storage``'s ``replicated``, ``host_memory_limit`` and ``max_in_flight``
    (a ``ValueError`` naming the field)."""
    replicated, host_memory_limit, max_in_flight = (
        storage.replicated,
        storage.host_memory_limit,
        storage.max_in_flight,
    )
    if isinstance(replicated, str) or not all(isinstance(k, str) for k in replicated):
        raise ValueError(f"replicated must be a tuple of top-level state keys, got {replicated!r}")
    if host_memory_limit is not None and host_memory_limit <= 0:
        raise ValueError(f"host_memory_limit must be a positive number of bytes, got {host_memory_limit!r}")
    if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
        raise ValueError(f"max_in_flight must be a positive number of host buffers, got {max_in_flight!r}")

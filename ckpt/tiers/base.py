"""The tier contract: what every tier (memory, local, peer, remote) offers the rest of the library.

Restore's nearest-tier search, retention, ``Checkpointer.list``, the ``ckpt`` command line and the persist
pipeline iterate a list of :class:`Tier` objects and call only what is declared here; none of them names a
tier. Adding a tier is one module: a subclass of :class:`Tier` (and of :class:`PersistingTier` when the
pipeline writes snapshots to it), decorated with :func:`register`; a Checkpointer has it when its storage
asks (``ckpt.Storage(extra_tiers={name: setting})``, :meth:`Tier.for_storage`), and its cadence
(``persist_every``), restore's fallback, retention and the figures then include it.

Every tier:

- **commits** a step so that it is either whole or absent (:mod:`ckpt.commit`: ``COMMIT`` last; the
  memory tier's commit record last);
- **lists** its committed steps with their timelines (:meth:`Tier.committed`), never a torn one;
- **reads** one (:meth:`Tier.manifest_of`, :meth:`Tier.load`), checking every byte against its checksum
  before it is used, and **verifies** one (:meth:`Tier.verify`: every byte read and checked);
- **deletes** one (:meth:`Tier.delete`: its commit record first, so a crash mid-delete never leaves a
  torn committed step);
- reports **figures** (:meth:`Tier.figures`: what it holds, what it can hold, what its writes and reads
  cost as measured in this process) and what it knows of a step (:meth:`Tier.describe`);
- says whether its storage answers (:attr:`Tier.status`) and what identifies a copy (:meth:`Tier.copy_id`).

A tier with commit records and data files on storage (local, remote) is a :class:`StoredTier` too: it
gives every rank's records of a step (:meth:`StoredTier.records`), checks that a rank's stored bytes are all
there (:meth:`StoredTier.check_stored`), reads one verified chunk (:meth:`StoredTier.fetch`) and says where a
step's files are (:meth:`StoredTier.step_location`): what ``ckpt inspect`` / ``verify`` and export read,
whatever the tier. Callers ask ``isinstance(tier, StoredTier)``; the
memory and peer tiers keep snapshots in RAM and are not stored tiers.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Hashable

if TYPE_CHECKING:
    import torch

    from ..format import Commit
    from .local import OwnerLock

from ..format import Manifest
from ..policy import Committed, Retention, Timeline

__all__ = [
    "Tier",
    "PersistingTier",
    "StoredTier",
    "StepInfo",
    "TierFigures",
    "TierStatus",
    "COPY_UNKNOWN",
    "register",
    "registered",
    "nearness",
]

#: what :meth:`Tier.copy_id` returns on a tier that cannot tell one copy of a step from another
COPY_UNKNOWN: Any = type("CopyUnknown", (), {"__repr__": lambda self: "COPY_UNKNOWN"})()


@dataclass(frozen=True)
class TierStatus:
    """What a tier found the last time it used its storage.

    ``available``: ``True`` when the storage last answered, ``False`` when it could not be reached or did
    not answer (connections refused or dropped, timeouts, 5xx answers), ``None`` before any check.
    ``error``: that failure, an ``OSError`` naming the endpoint. ``since_unix``: when the storage was first
    found unavailable in this outage; ``checked_unix``: the last check. A tier on this node's own disk or RAM
    is always available."""

    available: bool | None = None
    error: OSError | None = None
    since_unix: float | None = None
    checked_unix: float | None = None


@dataclass(frozen=True)
class StepInfo:
    """What a tier can say about one committed step without reading its data: where it is (a path, URL
    or shared-memory segment), its bytes (``nbytes``: what the tier stores, ``None``: unknown), when it
    was committed (seconds since the epoch) and by how many ranks (``world_size``)."""

    path: str | None = None
    nbytes: int | None = None
    created_unix: float | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class TierFigures:
    """A tier's capacity and cost figures, as this process knows them.

    ``committed``: steps committed there; ``bytes_held``: bytes they take (``None``: unknown without a
    listing the tier does not make); ``capacity_bytes``: what it can hold (free space, RAM allowed;
    ``None``: unbounded or unknown); ``writes`` / ``reads``: commits and restores measured in this
    process; ``write_s`` / ``read_s``: seconds of the last one; ``write_gbps`` / ``read_gbps``: their
    throughput, smoothed over recent ones (GB/s, ``None`` before the first).

    The memory tier also says (``None`` on the other tiers): ``buffers``, its host buffers (each the size of
    the state); ``snapshots_skipped``, saves skipped because no buffer was free; ``records_failed``,
    snapshots that stayed in this process only (their record could not be written in the RAM file system);
    ``records_written``, records written in the background (each makes a snapshot outlive the process);
    ``records_superseded``, snapshots a newer one replaced before their record was written (every snapshot
    is committed in this process; at a snapshot every step, records follow as fast as checksums allow);
    ``gives_up``, what it gives up with fewer than three buffers (``None``: nothing)."""

    name: str
    committed: int
    bytes_held: int | None
    capacity_bytes: int | None
    writes: int
    write_s: float | None
    write_gbps: float | None
    reads: int
    read_s: float | None
    read_gbps: float | None
    buffers: int | None = None
    snapshots_skipped: int | None = None
    records_failed: int | None = None
    records_written: int | None = None
    records_superseded: int | None = None
    gives_up: str | None = None


class _Meter:
    """Measured commits and reads of one tier: counts, the last duration, a smoothed throughput."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.n = 0
        self.last_s: float | None = None
        self.gbps: float | None = None

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.n += 1
            self.last_s = seconds
            if seconds > 0 and nbytes > 0:
                g = nbytes / seconds / 1e9
                self.gbps = g if self.gbps is None else 0.7 * self.gbps + 0.3 * g


class Tier(abc.ABC):
    """A place committed checkpoints live (see the module docstring for the contract).

    Class attributes: ``name`` (``"memory"``, ``"local"``, ...: what handles, restore reports and
    ``ckpt ls`` call it) and ``nearness`` (restore tries the tiers holding a step in increasing order).
    Instance attributes the library reads and sets: ``rank`` (this process's rank, whose copies it reads and
    writes; a peer tier holds other ranks' replicas, each manifest naming its source rank),
    ``timeline`` (what a fresh commit records; the Checkpointer sets it) and ``verified`` (step ->
    ``True`` when this process committed it or read it back in full, ``False`` when it failed
    verification; retention keeps the newest ``True`` one).
    """

    name: ClassVar[str]
    nearness: ClassVar[int]
    #: whether its copies live on this node (lost with it when the node is replaced)
    on_node: ClassVar[bool] = True
    #: whether its copies survive a reboot of the node (on a disk or in storage, not in RAM)
    durable: ClassVar[bool] = True
    #: whether restore copies a checkpoint it reads from a farther, durable tier into this one
    refills: ClassVar[bool] = False
    #: whether this tier can load a checkpoint saved in another layout (world size, mesh, placements)
    reshards: ClassVar[bool] = False

    #: what makes a Checkpointer have this tier, for messages (``None``: it always has it)
    needs: ClassVar[str | None] = "Storage(extra_tiers={name: ...})"
    #: the tiers :meth:`for_storage` reads (built first)
    built_after: ClassVar[tuple[str, ...]] = ()

    rank: int = 0
    timeline: Timeline
    verified: dict[int, bool]
    #: whether the storage answers (:class:`TierStatus`); the remote tier keeps it up to date
    status: TierStatus = TierStatus(available=True)

    # -- building -----------------------------------------------------------------------------------
    @classmethod
    def for_storage(cls, storage: Any, built: dict[str, "Tier"], pool: Any, rank: int) -> "Tier | None":
        """This tier as ``storage`` (a :class:`~ckpt.Storage`) asks for it, or ``None`` when it does not.
        ``built``: the tiers made so far, by name (those of :attr:`built_after` among them); ``pool``: the
        memory tier's host buffers; ``rank``: this process's rank in its job (0 alone). The default makes a
        tier registered beyond the built-in ones from its setting, ``storage.extra_tiers[name]``, passed to
        the class (``cls(setting)``)."""
        setting = (storage.extra_tiers or {}).get(cls.name)
        return None if setting is None else cls(setting)

    # -- listing ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def committed(self) -> list[Committed]:
        """Every step committed here, with its timeline and whether it is linked in (never a torn one)."""

    def committed_steps(self) -> list[int]:
        """The committed steps, newest first."""
        return sorted({c.step for c in self.committed()}, reverse=True)

    def owns(self, step: int) -> bool:
        """Whether this tier may delete ``step`` (a linked step is not its own)."""
        return True

    def all_step_dirs(self) -> Any:
        """Every step with files here, committed or not (retention removes uncommitted leftovers)."""
        return self.committed_steps()

    @abc.abstractmethod
    def location(self) -> str:
        """Where this tier keeps its checkpoints (a directory, URL or RAM file system), for messages."""

    @abc.abstractmethod
    def describe(self, step: int, timeline: Timeline | None = None) -> StepInfo:
        """What is known of committed ``step`` without reading its data (empty fields when unreadable)."""

    # -- reading ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def manifest_of(self, step: int, timeline: Timeline | None = None) -> Manifest:
        """The validated manifest of this rank's copy of ``step`` (on ``timeline``, when given): raises
        :class:`~ckpt.errors.CorruptCheckpointError` / :class:`~ckpt.errors.IncompleteCheckpointError`
        naming the file, ``LookupError`` when the tier no longer holds it, ``OSError`` from storage."""

    def check(self, step: int, timeline: Timeline | None = None) -> None:
        """The checks a restore makes before it reads data (records valid and agreeing; sizes as
        committed), for every rank's files this tier holds. Raises as :meth:`manifest_of`."""
        self.manifest_of(step, timeline)

    @abc.abstractmethod
    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None]) -> None:
        """Read ``step`` (described by ``manifest``), check every chunk, scatter it into ``dest``."""

    @abc.abstractmethod
    def verify(self, step: int) -> list[Manifest]:
        """Read every byte of ``step`` and check it; returns the manifests of every rank's copy of it this tier
        holds, in rank order (a job tier: every saved rank's; a rank's own tier: its one). Raises as
        :meth:`manifest_of` (a bad byte: :class:`~ckpt.errors.CorruptCheckpointError` naming the file)."""

    def copy_id(self, step: int) -> Hashable | None:
        """What tells the copy of ``step`` committed here now from another (``None``: not committed here now;
        :data:`COPY_UNKNOWN`: this tier cannot tell). A restore compares it before and after a failed read: a
        copy that another process removed or replaced meanwhile is listed again, not taken for a corrupt one.
        May raise ``OSError`` when the storage does not answer."""
        return COPY_UNKNOWN

    def acquire_owner(self) -> OwnerLock | None:
        """Become the one writer of this tier's storage where it has such an owner (a ``local_dir``), raising
        :class:`~ckpt.errors.LockedError` while another live process is; ``None``: nothing to own here."""
        return None

    def left_in_ram(self) -> "Tier | None":
        """The memory tier of what processes that owned this tier's storage left in this node's RAM (their
        snapshots outlive them there; ``ckpt ls`` of a ``local_dir`` lists them first), or ``None``: this
        tier's storage names no snapshots in RAM, or there are none."""
        return None

    def where(self, step: int) -> str:
        """How messages name this rank's copy of ``step`` here."""
        return self.describe(step).path or f"step {step} on the {self.name} tier"

    def restore_into(
        self,
        state: dict,
        step: int,
        timeline: Timeline | None,
        strict: bool,
        job: list[int] | None,
        refill: "Tier | None" = None,
    ) -> int:
        """Load this rank's copy of ``step`` into ``state`` in place; returns the bytes read.

        ``job``: this process's ``[rank, world size]`` in a multi-process job (a copy saved at another
        place in the job is refused with :class:`~ckpt.loading.OtherRanksCopy`); ``refill``: a nearer
        tier to write the checkpoint to on the way (a tier that reads over the network uses it so that
        the next restore is local). Raises :class:`~ckpt.errors.LayoutMismatchError` when the copy is in
        another layout, the errors of :meth:`manifest_of` and :meth:`load` when it is unusable, and
        :class:`~ckpt.errors.IncompatibleCheckpointError` when it does not fit ``state``.
        """
        from ..loading import bind_checked, check_job, finish

        manifest = self.manifest_of(step, timeline)
        check_job(manifest, job, self.name, step)
        binding = bind_checked(state, manifest.tree, manifest.items, strict, self.where(step))
        self.load(step, manifest, binding.dest)
        finish(binding)
        return manifest.data_bytes

    # -- deleting -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def delete(self, step: int) -> None:
        """Remove ``step``, its commit record first."""

    # -- retention ----------------------------------------------------------------------------------
    def keep_of(self, keep: Retention) -> int | None:
        """How many steps :class:`~ckpt.policy.Retention` keeps here (``None``: all): a durable tier of no
        kind the retention names, :attr:`~ckpt.policy.Retention.others` (``keep=N``: ``N``); a tier in RAM,
        all (its buffers bound it)."""
        return keep.others if self.durable else None

    def prunes_here(self) -> bool:
        """Whether this process applies retention to this tier (a job tier: rank 0 alone)."""
        return True

    # -- figures ------------------------------------------------------------------------------------
    def capacity_bytes(self) -> int | None:
        """What the tier can hold (``None``: unbounded or unknown)."""
        return None

    def bytes_held(self) -> int | None:
        """Bytes its committed steps take (``None``: unknown without reading more than a listing)."""
        return None

    def figures(self) -> TierFigures:
        """The tier's capacity and cost figures (:class:`TierFigures`)."""
        w, r = self._meters()
        return TierFigures(
            self.name,
            len(self.committed()),
            self.bytes_held(),
            self.capacity_bytes(),
            w.n,
            w.last_s,
            w.gbps,
            r.n,
            r.last_s,
            r.gbps,
        )

    def _meters(self) -> tuple[_Meter, _Meter]:
        meters = self.__dict__.get("_tier_meters")
        if meters is None:
            meters = self.__dict__.setdefault("_tier_meters", (_Meter(), _Meter()))
        return meters

    def measured_write(self, nbytes: int, seconds: float) -> None:
        """Record a commit of ``nbytes`` that took ``seconds`` (for :meth:`figures`)."""
        self._meters()[0].add(nbytes, seconds)

    def measured_read(self, nbytes: int, seconds: float) -> None:
        """Record a restore of ``nbytes`` that took ``seconds`` (for :meth:`figures`)."""
        self._meters()[1].add(nbytes, seconds)


class PersistingTier(Tier):
    """A tier the persist pipeline writes snapshots to, from host memory, on a worker of its own."""

    @abc.abstractmethod
    def write(self, step: int, manifest: Manifest, data: memoryview) -> float:
        """Commit ``data`` (this rank's data file image, ``manifest.data_bytes`` bytes) as ``step``; returns
        the seconds spent. All or nothing: a failure leaves a committed copy of ``step`` as it was."""

    def abstain(self, step: int) -> None:
        """This rank has nothing to write for ``step`` (its snapshot failed): a tier whose commit needs
        every rank (a job tier) is told, so that no rank waits for this one."""


class StoredTier(Tier):
    """A tier whose checkpoints are commit records and data files on storage (a directory, a URL), so that
    a reader outside the training process (``ckpt inspect`` / ``verify``, export, the DCP adapter) can list
    every rank's records of a step and read each chunk verified, whatever the tier."""

    @abc.abstractmethod
    def step_location(self, step: int) -> str:
        """Where the files of ``step`` are, or would be, on this tier's storage (its directory; a URL on a store),
        without asking the storage: what a message about the step names, committed or not."""

    @abc.abstractmethod
    def records(self, step: int) -> tuple[Commit, list[Manifest]]:
        """The validated commit record of ``step`` and the manifests of every rank's files this tier holds of
        it, in rank order (a job tier: every saved rank's; a rank's own tier: its one). Raises as
        :meth:`~Tier.manifest_of`."""

    @abc.abstractmethod
    def check_stored(self, step: int, manifest: Manifest) -> None:
        """Every stored byte of the rank ``manifest`` describes is there at its committed size, checked before
        any is read or room for the data allocated: :class:`~ckpt.errors.IncompleteCheckpointError` naming the
        file otherwise."""

    @abc.abstractmethod
    def fetch(self, step: int, rank: int, manifest: Manifest, i: int) -> bytes | bytearray:
        """Chunk ``i`` of rank ``rank``'s data of ``step`` (described by ``manifest``), decoded and checked
        against its checksum (:class:`~ckpt.errors.CorruptCheckpointError` naming the file and the byte range
        otherwise)."""

    def stored_bytes(self, step: int) -> int:
        """The bytes verifying ``step`` reads here (every stored chunk of every rank's files it holds)."""
        return sum(m.data_bytes for m in self.records(step)[1])


_REGISTRY: dict[str, type[Tier]] = {}


def register(cls: type[Tier]) -> type[Tier]:
    """Class decorator: make ``cls`` a known tier (its ``name`` and ``nearness``)."""
    if not (isinstance(getattr(cls, "name", None), str) and isinstance(getattr(cls, "nearness", None), int)):
        raise TypeError(f"{cls.__name__}: a tier class needs a str `name` and an int `nearness`")
    other = _REGISTRY.get(cls.name)
    if other is not None and not issubclass(cls, other):
        raise ValueError(f"a tier named {cls.name!r} is registered already ({other.__qualname__})")
    _REGISTRY.setdefault(cls.name, cls)
    return cls


def registered() -> list[type[Tier]]:
    """The registered tier classes, nearest first."""
    return sorted(_REGISTRY.values(), key=lambda c: c.nearness)


def nearness(name: str) -> int:
    """The nearness of the tier registered as ``name`` (unknown names last)."""
    cls = _REGISTRY.get(name)
    return cls.nearness if cls is not None else 1 << 30

"""The library's own exceptions: semantic failures only.

Storage failures stay built-in :class:`OSError` s (``FileNotFoundError``,
``ENOSPC`` ...) so callers can handle them the way they handle any I/O error.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "IncompatibleCheckpointError",
    "LayoutMismatchError",
    "RefusedStateError",
    "TornSnapshotError",
    "HostMemoryError",
    "NoCheckpointError",
    "LockedError",
    "Preempted",
]


class CheckpointError(Exception):
    """Base class of every semantic checkpoint failure."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint's bytes do not match their checksums, or its metadata is malformed."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint lacks a file or bytes that its commit record promises."""


class IncompatibleCheckpointError(CheckpointError):
    """A valid checkpoint does not fit the state it is loaded into (keys, shapes, dtypes, world size)."""


class LayoutMismatchError(IncompatibleCheckpointError):
    """Sharded state was saved in another layout (world size, mesh or placements) than the live one.

    Restore reshards such a checkpoint when the tier holds every saved rank's shards (a job
    tier: one ``url`` given to every rank); a rank's own copy on its local tier cannot."""


class RefusedStateError(CheckpointError, TypeError):
    """A state value cannot be stored (without pickle, or in the format), so the save is refused.

    ``path``: where in the state, its keys joined by ``/`` (``"model/layer.w"``), or ``None`` where the
    refusal is about the state as a whole."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.path)


class TornSnapshotError(CheckpointError):
    """A tensor was modified in place while its snapshot copy could still be in flight.

    ``keys``: the state keys of the tensors found modified (the first few, in state order)."""

    def __init__(self, message: str, *, keys: list[str] | None = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])


class HostMemoryError(CheckpointError, MemoryError):
    """The pinned staging buffer would exceed ``host_memory_limit``.

    ``needed``: bytes the new state's buffer needs; ``allocated``: bytes of staging buffers
    allocated when it was refused (including one that the new buffer would replace);
    ``limit``: the bytes allowed (``host_memory_limit``, or its default).
    """

    def __init__(
        self,
        message: str,
        *,
        needed: int | None = None,
        allocated: int | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message)
        self.needed, self.allocated, self.limit = needed, allocated, limit


class NoCheckpointError(CheckpointError):
    """Checkpoints exist but none of them could be verified and loaded."""


class LockedError(CheckpointError):
    """Another live Checkpointer owns the ``local_dir`` (one writer per directory).

    ``path``: the directory; ``pid``, ``host``: the owner's process and host as it recorded them
    (``None`` when it could not be read: the owner may be on another host of a network file system).
    """

    def __init__(self, message: str, path: str, pid: int | None = None, host: str | None = None) -> None:
        super().__init__(message)
        self.path, self.pid, self.host = path, pid, host

    def __reduce__(self):  # keep the fields through copy/pickle (multiprocessing) like any exception's args
        return (type(self), (str(self), self.path, self.pid, self.host))


class Preempted(CheckpointError):
    """Raised by ``maybe_save`` after a preemption signal, when ``on_preempt="raise"``.

    ``signum``: the signal; ``step``: the step saved; ``durable``: whether the
    save reached ``drain_tier`` within ``drain_deadline``.
    """

    def __init__(self, signum: int, step: int, durable: bool) -> None:
        import signal as _signal

        name = _signal.Signals(signum).name
        super().__init__(
            f"preempted by {name}: step {step} saved"
            f"{'' if durable else ' but NOT durable within drain_deadline'}"
        )
        self.signum, self.step, self.durable = signum, step, durable

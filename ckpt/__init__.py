"""ckpt: almost-free checkpointing for PyTorch training, and fused Triton kernels.

Phase 1 snapshots the state into a reusable host buffer, overlapped with the
next forward/backward; phase 2 persists it in the background; restore reads
the newest verified checkpoint from the nearest tier. See ``docs/``.

``import ckpt`` imports neither triton nor lightning nor s3fs, nor torch until a name that needs it is
used (``ckpt.Checkpointer``...): the ``ckpt`` commands that only read files start without it.
"""

from ._lazy import exports
from .config import IfBusy, Policy, Storage
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    HostMemoryError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    LayoutMismatchError,
    LockedError,
    NoCheckpointError,
    Preempted,
    RefusedStateError,
    TornSnapshotError,
)
from .export import ExportInfo, export  # bound here: the submodule ckpt.export must not shadow the function
from .policy import AutoInterval, Retention


def _installed_version() -> str:
    """The version pyproject.toml gives, as the installed distribution's metadata records it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierckpt")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "IfBusy",
    "Storage",
    "Policy",
    "promote",
    "empty_params",
    "materialize",
    "export",
    "ExportInfo",
    "Retention",
    "Signals",
    "WorkerSignals",
    "AutoInterval",
    "RNGState",
    "SaveHandle",
    "SnapshotStats",
    "RestoreInfo",
    "CheckpointError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "IncompatibleCheckpointError",
    "LayoutMismatchError",
    "NoCheckpointError",
    "LockedError",
    "Preempted",
    "RefusedStateError",
    "TornSnapshotError",
    "HostMemoryError",
]

#: where each public name that needs torch lives (imported on first use, PEP 562)
_WHERE = {
    "Checkpointer": "api",
    "CheckpointInfo": "catalog",
    "promote": "promotion",
    "SaveHandle": "pipeline",
    "Signals": "preempt",
    "WorkerSignals": "preempt",
    "RestoreInfo": "restore",
    "RNGState": "rng",
    "SnapshotStats": "stage",
    "empty_params": "fast_start",
    "materialize": "fast_start",
}


__getattr__, __dir__ = exports(__name__, _WHERE)

"""ckpt: almost-free checkpointing for PyTorch training, and fused Triton kernels.

Phase 1 snapshots the state into a reusable host buffer, overlapped with the
next forward/backward; phase 2 persists it in the background; restore reads
the newest verified checkpoint from the nearest tier. See ``docs/``.

``import ckpt`` imports neither triton nor lightning nor s3fs.
"""

from .api import Checkpointer, CheckpointInfo, IfBusy, promote
from .config import Policy, Storage
from .errors import (CheckpointError, CorruptCheckpointError, HostMemoryError, IncompatibleCheckpointError,
                     IncompleteCheckpointError, LayoutMismatchError, NoCheckpointError, Preempted, RefusedStateError,
                     TornSnapshotError)
from .errors import LockedError
from .export import ExportInfo, export
from .pipeline import SaveHandle
from .policy import AutoInterval, Retention
from .preempt import Signals, WorkerSignals
from .restore import RestoreInfo
from .rng import RNGState
from .stage import SnapshotStats

def _installed_version() -> str:
    """The version pyproject.toml gives, as the installed distribution's metadata records it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierckpt")
    except PackageNotFoundError:   # a source tree on sys.path that was never installed
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "IfBusy",
    "Storage",
    "Policy",
    "promote",
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

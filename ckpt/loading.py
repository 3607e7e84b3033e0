"""Loading one tier's copy of a checkpoint into a live state: binding its records to the state's
tensors, and the checks that make a copy that does not fit a storage fault or a user error.

Shared by every tier's :meth:`~ckpt.tiers.base.Tier.restore_into` and by :mod:`ckpt.restore`.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from .format import ItemRecord
from .plan import Binding, bind

__all__ = ["OtherRanksCopy", "check_job", "bind_checked", "finish"]


class OtherRanksCopy(LookupError):
    """A rank's own copy that another place in the job saved (the world size changed)."""


def check_job(manifest: Any, job: list[int] | None, tier: str, step: int) -> None:
    """Refuse (:class:`OtherRanksCopy`) a rank's own copy saved at another place in the job."""
    saved = manifest.job
    if job is not None and saved is not None and list(saved) != list(job):
        raise OtherRanksCopy(
            f"this {tier} copy of step {step} holds the state of rank {saved[0]} of {saved[1]}, this is rank "
            f"{job[0]} of {job[1]}: a copy of one rank's own state loads into that rank only (a job tier, the "
            "same url on every rank, reshards into another world size)"
        )


def bind_checked(
    state: dict, tree: Any, items: list[ItemRecord], strict: bool, where: str, reshard: bool = False
) -> Binding:
    """:func:`~ckpt.plan.bind`, where any failure that is not a verdict of the library's own (the
    checkpoint does not fit the state) makes this candidate corrupt, naming its manifest, so that
    restore skips it for the next one instead of crashing."""
    try:
        return bind(state, tree, items, strict, reshard=reshard)
    except CheckpointError:
        raise
    except (
        TypeError,
        ValueError,
        RuntimeError,
        LookupError,
        AttributeError,
        ArithmeticError,
        RecursionError,
        MemoryError,
    ) as e:
        raise CorruptCheckpointError(
            f"{where}: cannot be bound to the state ({type(e).__name__}: {e})"
        ) from e


def finish(binding: Any) -> None:
    """After the bytes landed: wait for the copies to the device, then hand the values to the state."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    try:
        binding.finish()
    except CheckpointError:
        raise
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise IncompatibleCheckpointError(f"the checkpoint does not fit the state: {e}") from e

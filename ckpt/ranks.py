"""The ranks of a multi-process job, and the small agreements the checkpointer needs between them.

When ``torch.distributed`` is initialised with more than one rank, a few decisions must come
out the same on every rank or the job silently diverges: which step ``restore`` loads (a
rank that crashed mid-save has an older newest checkpoint than its peers), whether a
time-based policy saves at this step (clocks differ), and whether a preemption signal that
reached only some ranks triggers the drain. Each is one tiny collective of integers.

They run over a CPU (gloo) process group: the default group when it is gloo already, else
one made with ``new_group(backend="gloo")`` when the :class:`Ranks` is created. Agreement
then never touches the GPU, so it adds no device synchronisation to the training step (an
NCCL all-reduce read back with ``.item()`` would wait for every queued kernel). Values
travel as int64 tensors, never pickled.

Collective contract: creating a :class:`Ranks` and each of its methods must be called on
every rank, in the same order.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch

__all__ = ["Ranks", "distributed_world", "collective_job", "job_ranks", "check_elastic_store"]

log = logging.getLogger(__name__)
_checked_elastic_store = False


def distributed_world() -> int:
    """World size of the initialised default process group, or 1 when there is none."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def collective_job(collective: bool | None) -> bool:
    """Whether a Checkpointer's ranks agree (its ``collective`` argument): by default when torch.distributed
    is initialised with more than one rank; ``True`` without that is a ``ValueError``."""
    world = distributed_world()
    if collective and world <= 1:
        raise ValueError(
            "collective=True needs torch.distributed initialised with more than one rank "
            "(call init_process_group first, or leave collective=None)"
        )
    return world > 1 if collective is None else collective


class Ranks:
    """This process's place in the job and a CPU group to agree over. Collective to create."""

    def __init__(self, timeout_s: float = 1800.0, own_group: bool = False) -> None:
        """``own_group``: always make a new gloo group, for agreements that run on another thread
        than the caller's (collectives of one group must be issued in one order on every rank)."""
        dist = torch.distributed
        if distributed_world() <= 1:
            raise RuntimeError("Ranks needs torch.distributed initialised with a world size above 1")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if dist.get_backend() == "gloo" and not own_group:
            self.group = None  # the default group already runs on the CPU
        else:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of integers, in rank order (lists may differ in length)."""
        dist = torch.distributed
        n = torch.tensor([len(values)], dtype=torch.int64, device="cpu")
        sizes = [torch.zeros(1, dtype=torch.int64, device="cpu") for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        width = max(int(s) for s in sizes)
        if width == 0:
            return [[] for _ in range(self.world)]
        mine = torch.zeros(width, dtype=torch.int64, device="cpu")
        mine[: len(values)] = torch.tensor(values, dtype=torch.int64, device="cpu")
        out = [torch.zeros(width, dtype=torch.int64, device="cpu") for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [o[: int(s)].tolist() for o, s in zip(out, sizes)]

    def max(self, values: list[int]) -> list[int]:
        """Element-wise largest of ``values`` (the same length on every rank) over the ranks."""
        t = torch.tensor(values, dtype=torch.int64, device="cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.tolist()


def check_elastic_store() -> bool:
    """Warn (once per process, on each node's local rank 0) when torchrun will restart this job
    (``--max-restarts`` above 0) with its rendezvous store shared with the workers: a restarted attempt's
    ``init_process_group`` then reads the killed attempt's addresses from that store (torch keeps one store,
    and its keys, for every attempt) and fails or hangs. Returns whether it warned."""
    global _checked_elastic_store
    env = os.environ
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False
    if (
        _checked_elastic_store
        or restarts <= 0
        or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or env.get("LOCAL_RANK", "0") != "0"
    ):
        return False
    _checked_elastic_store = True
    log.warning(
        "torchrun restarts this job (--max-restarts %d) and shares its rendezvous store with the workers: "
        "after a restart, init_process_group reads the failed attempt's addresses from that store and fails "
        "(Connection refused) or hangs (pytorch/pytorch#135712, #167288). Launch torchrun with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the c10d rendezvous (--standalone, or --rdzv-backend c10d "
        "--rdzv-endpoint HOST:PORT); see docs/guides/launchers.md",
        restarts,
    )
    return True


def job_ranks(collective: bool) -> Ranks | None:
    """A Checkpointer's ranks: ``None`` unless ``collective``; then :class:`Ranks` (a collective: every rank
    must get this far), after checking that a torchrun restart of this job could meet again."""
    if not collective:
        return None
    ranks = Ranks()
    check_elastic_store()  # a torchrun restart of this job would fail before it gets here again
    return ranks

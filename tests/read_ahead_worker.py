"""Child-process side of the collective read-ahead test (tests/test_read_ahead.py).

    python read_ahead_worker.py ROOT RANK WORLD   (through helpers.run_ranks)

A gloo job whose ranks each save step 3 of a CPU state (standing in for the GPU's: the read-ahead's device
is the CPU), then restore it; rank 1 comes to its restore 0.5 s after the others (a replaced node still
coming up), so their agreement waits. Prints ``ahead RANK STEP TIER EXACT STARTED TAKEN``: whether a
read-ahead was started and what each load of the memory tier was handed (1: the copy read ahead).
"""

from __future__ import annotations

import os
import sys
import time

import torch


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(50_000, generator=g), "b": torch.randn(3, generator=g)}


def main() -> None:
    root, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.makedirs(f"{root}/shm-{rank}", exist_ok=True)
    os.environ["CKPT_SHM_DIR"] = f"{root}/shm-{rank}"
    import ckpt
    from ckpt import restore
    from ckpt.tiers import memory

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    restore.state_gpu = lambda s: torch.device("cpu")
    started, taken = [], []
    read_ahead, take = memory.MemoryTier.read_ahead, memory._ReadAhead.take
    memory.MemoryTier.read_ahead = lambda tier, dev: started.append(1) or read_ahead(tier, dev)
    memory._ReadAhead.take = lambda ahead, buf, m: (lambda out: taken.append(int(out is not None)) or out)(
        take(ahead, buf, m)
    )
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=f"{root}/rank-{rank}"),
        policy=ckpt.Policy(persist_every={"local": 1000}),
    ) as ck:
        ck.save(3, state(rank, 3)).wait()
        target = {k: torch.zeros_like(v) for k, v in state(rank, 0).items()}
        torch.distributed.barrier()
        if rank == 1:
            time.sleep(0.5)
        step = ck.restore(target)
        exact = all(torch.equal(target[k], v) for k, v in state(rank, 3).items())
        left = ck.memory._ahead is not None or any(b.holds for b in ck.pool.buffers)
        print(
            "ahead", rank, step, ck.last_restore.tier, int(exact), sum(started), taken, int(left), flush=True
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

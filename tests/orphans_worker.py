"""A rank of a gloo job for tests/test_shm_orphans.py: ``orphans_worker.py ROOT RANK WORLD MODE``.

* ``leave``: save step 1 into ROOT/rank-RANK and close keeping the snapshot in RAM (what a killed job leaves).
* ``restart``: the same job started again (LOCAL_RANK set as torchrun does), rank 1 a second late to make its
  Checkpointer; prints how many warnings the ``ckpt.shm`` logger gave while the Checkpointer was made.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import ckpt


def main(argv: list[str]) -> int:
    root, rank, world, mode = argv[0], int(argv[1]), int(argv[2]), argv[3]
    os.environ["LOCAL_RANK"] = str(rank)  # one node: each rank its own local rank
    dist.init_process_group("gloo", rank=rank, world_size=world)
    local_dir = os.path.join(root, f"rank-{rank}")
    if mode == "leave":
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
        ck.save(1, {"w": torch.full((1 << 14,), float(rank))}).wait()
        ck.close(keep_memory=True)
    else:
        warnings: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = warnings.append
        logging.getLogger("ckpt.shm").addHandler(handler)
        if rank == 1:
            time.sleep(1.0)
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
        # a job's ranks run on: none closes (and gives its local_dir up) while rank 0 is still looking for dead
        # jobs' RAM in its constructor
        dist.barrier()
        print("warnings", len(warnings), flush=True)
        for w in warnings:
            print(w.getMessage(), file=sys.stderr, flush=True)
        ck.close(keep_memory=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

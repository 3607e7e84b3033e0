"""Child-process side of the ownership tests (tests/test_owner.py).

    python owner_worker.py LOCAL_DIR MODE

``hold``: save step 5 (every element 1.0) into LOCAL_DIR, print ``saved PID``, then sleep until killed.
``fork``: the same, then fork a child that sleeps, close the Checkpointer, print ``closed CHILD_PID``
and sleep until killed (the child must not keep the directory locked).
``python owner_worker.py ROOT RANK WORLD rank`` (through helpers.run_ranks): a gloo job whose ranks
each make a collective Checkpointer on ROOT/rank-RANK.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import ckpt


def state(value: float) -> dict:
    return {"w": torch.full((10_000,), value), "value": value}


def main() -> None:
    if sys.argv[-1] == "rank":
        return rank_main()
    local_dir, mode = sys.argv[1], sys.argv[2]
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    ck.save(5, state(1.0)).wait()
    if mode == "fork":
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(w, b"x")  # fork() has returned here: the child's fork handlers have run
            time.sleep(3600)
            os._exit(0)
        os.read(r, 1)
        ck.close()
        print(f"closed {child}", flush=True)
    else:
        print(f"saved {os.getpid()}", flush=True)
    time.sleep(3600)


def rank_main() -> None:
    """Each rank makes a collective Checkpointer on ROOT/rank-RANK and saves; prints ``ok`` or the
    exception it raised."""
    import torch.distributed as dist

    root, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=os.path.join(root, f"rank-{rank}")))
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"raised {type(e).__name__}: {e}", flush=True)
    else:
        ck.save(7, state(float(rank))).wait()
        ck.close()
        print("ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

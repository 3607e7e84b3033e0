"""Child side of the peer-tier tests: one gloo rank whose checkpoints are also kept by another rank.

``python peer_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
Each rank checkpoints into ``ROOT/rank-<RANK>`` with ``peers=1``: rank r's copies go to rank r+1
(mod WORLD), which keeps them under its own ``peers/`` directory. The state is ``{"w": 6 floats,
"step": int}``; at step s, ``w`` is ``100 * rank + s`` everywhere.

* ``save``: steps 1..4, saved at 2 and 4; prints ``saved`` and the steps of the copies it keeps.
* ``durable``: saves step 5 and waits for the ``peer`` tier; prints whether the peer's copy is committed.
* ``drain``: SIGTERM to rank 0 at step 3 with ``drain_tier="peer"``; prints ``preempted S DURABLE KEPT``.
* ``rollback``: saves step 7 and restores at once (the exchange may still run); prints ``restored``.
* ``restore``: prints ``restored S W T`` (step, ``w[0]`` after it, the tier it came from).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

import ckpt


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    state = {"w": torch.zeros(6), "step": 0}
    try:
        drain = mode == "drain"
        with ckpt.Checkpointer(local_dir=f"{root}/rank-{rank}", every_steps=2, peers=1, on_preempt="raise", if_busy="wait",
                               signals=(signal.SIGTERM,) if drain else (), drain_tier="peer" if drain else "local",
                               drain_deadline=60) as ck:
            assert "peer" in ck.tiers
            if mode == "save":
                for step in range(1, 5):
                    ck.wait_staged()
                    state["w"].fill_(100 * rank + step)
                    state["step"] = step
                    h = ck.maybe_save(step, state)
                    if h is not None:
                        h.wait()
                print("saved", ck.peer.store.committed_steps(), flush=True)
            elif drain:   # SIGTERM reaches rank 0 only; both ranks save step 3 and wait until their peer has it
                try:
                    for step in range(1, 10):
                        ck.wait_staged()   # before the in-place update: the last save may still be copying w
                        state["w"].fill_(100 * rank + step)
                        if step == 3 and rank == 0:
                            os.kill(os.getpid(), signal.SIGTERM)
                        ck.maybe_save(step, state)
                except ckpt.Preempted as e:
                    dst = (rank + 1) % world
                    kept = (Path(root) / f"rank-{dst}" / "peers" / f"rank-{rank:05d}" / f"step-{e.step:09d}" / "COMMIT")
                    print(f"preempted {e.step} {e.durable} {kept.is_file()}", flush=True)
            elif mode == "durable":   # handle.wait("peer"): the peer has committed this rank's copy by then
                state["w"].fill_(100 * rank + 5)
                ck.save(5, state).wait("peer")
                dst = (rank + 1) % world
                print("durable", (Path(root) / f"rank-{dst}" / "peers" / f"rank-{rank:05d}" / "step-000000005"
                                  / "COMMIT").is_file(), flush=True)
            elif mode == "rollback":   # restore while the save's exchange with the peers may still run
                state["w"].fill_(100 * rank + 7)
                ck.save(7, state)
                ck.wait_staged()   # the copy into host memory, not the exchange with the peer
                state["w"].fill_(float("nan"))
                step = ck.restore(state)
                print(f"restored {step} {float(state['w'][0])} {ck.last_restore.tier}", flush=True)
            else:
                step = ck.restore(state)
                print(f"restored {step} {float(state['w'][0])} {ck.last_restore.tier}", flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

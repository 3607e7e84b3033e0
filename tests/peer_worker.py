"""Child side of the peer-tier tests: one gloo rank whose checkpoints are also kept by another rank.

``python peer_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
Each rank checkpoints into ``ROOT/rank-<RANK>`` with ``peers=1``: rank r's copies go to rank r+1
(mod WORLD), which keeps them under its own ``peers/`` directory. The state is ``{"w": 6 floats,
"step": int}``; at step s, ``w`` is ``100 * rank + s`` everywhere.

* ``save``: steps 1..4, saved at 2 and 4; prints ``saved`` and the steps of the copies it keeps.
* ``rollback``: saves step 7 and restores at once (the exchange may still run); prints ``restored``.
* ``restore``: prints ``restored S W T`` (step, ``w[0]`` after it, the tier it came from).
"""

from __future__ import annotations

import sys

import torch

import ckpt


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    state = {"w": torch.zeros(6), "step": 0}
    try:
        with ckpt.Checkpointer(local_dir=f"{root}/rank-{rank}", every_steps=2, peers=1) as ck:
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
            elif mode == "rollback":   # restore while the save's exchange with the peers may still run
                state["w"].fill_(100 * rank + 7)
                ck.save(7, state)
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

"""Child side of the timeline tests: one process (or one gloo rank) checkpointing ``{"w", "step"}``.

``python timeline_worker.py ROOT RANK WORLD MODE [KEEP]``; with WORLD > 1, MASTER_ADDR / MASTER_PORT
come from the environment and each rank checkpoints into ``ROOT/rank-RANK``. At step ``s`` every
element of ``w`` equals ``s``. ``KEEP`` is ``Retention(local=KEEP)`` (default 3).

* ``save``: saves steps 100, 200 and 300; prints ``saved``.
* ``rollback``: ``restore(step=100)``, then saves 110, 120 and 130; prints ``restored S W T``.
* ``resume``: ``restore()``; prints ``restored S W T``.
* ``resume-save``: ``restore()``, then saves the next step (``S + 10``); prints ``restored S W T``.

``S`` is the step restored, ``W`` is ``w[0]`` after it, ``T`` the timeline the following saves
go to (``Checkpointer.timeline``). ``CKPT_TEST_PEERS=1`` adds the peer tier (``peers=True``).
"""

from __future__ import annotations

import os
import sys

import torch

import ckpt


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    keep = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    if world > 1:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    local_dir = f"{root}/rank-{rank}" if world > 1 else root
    state = {"w": torch.zeros(8), "step": 0}

    def save(ck: ckpt.Checkpointer, step: int) -> None:
        ck.wait_staged()  # w is written in place below, outside optimizer.step()
        state["w"].fill_(step)
        state["step"] = step
        ck.save(step, state).wait()

    def report(ck: ckpt.Checkpointer, step: int | None) -> None:
        print(f"restored {step} {float(state['w'][0])} {ck.timeline.number}", flush=True)
        if ck.last_restore is not None:
            info = ck.last_restore
            print(
                f"from {info.tier} {info.timeline.number} {[list(f) for f in info.timeline.forks]}",
                flush=True,
            )

    try:
        peers = True if os.environ.get("CKPT_TEST_PEERS") == "1" else None
        # with peers, each run leaves its RAM (snapshots, replicas held) as a crash would: close(keep_memory=True)
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir, peers=peers),
            policy=ckpt.Policy(keep=ckpt.Retention(local=keep)),
        ) as ck:
            if mode == "save":
                for s in (100, 200, 300):
                    save(ck, s)
                print("saved", flush=True)
            elif mode == "rollback":
                step = ck.restore(state, step=100)
                report(ck, step)
                for s in (110, 120, 130):
                    save(ck, s)
            elif mode in ("resume", "resume-save"):
                step = ck.restore(state)
                report(ck, step)
                if mode == "resume-save":
                    save(ck, step + 10)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
            if peers:
                ck.close(keep_memory=True)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Child side of the preemption tests: the demo's training loop with SIGTERM handling.

``python preempt_worker.py DIR STEPS [RANK WORLD]``: trains the demo model for
STEPS steps (50 ms each at least), prints ``step N`` after each, checkpoints only when preempted
(every_steps is larger than the run), restores first if DIR has a checkpoint,
and prints ``final <sha256>`` at the end. With RANK and WORLD it joins a gloo
process group first (MASTER_ADDR / MASTER_PORT from the environment).
"""

from __future__ import annotations

import signal
import sys
import time

import torch

import ckpt
from ckpt.demo import _build, _digest, _train_step


def main() -> None:
    local_dir, steps = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        torch.distributed.init_process_group("gloo", rank=int(sys.argv[3]), world_size=int(sys.argv[4]))
    state = _build(torch.device("cpu"), 64)
    with ckpt.Checkpointer(local_dir=local_dir, every_steps=10**9, signals=(signal.SIGTERM,),
                           drain_deadline=60) as ck:
        last = ck.restore(state)
        print(f"restored {last}", flush=True)
        for step in range(1 if last is None else last + 1, steps + 1):
            _train_step(state)
            time.sleep(0.05)   # a step of realistic length, so the signal lands mid-run
            state["step"] = step
            ck.maybe_save(step, state)
            print(f"step {step}", flush=True)
    print(f"final {_digest(state['model'])}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

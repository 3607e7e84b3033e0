"""Child side of the signal tests: the demo's training loop with signal handling.

``python preempt_worker.py DIR STEPS [RANK WORLD] [--save-on SIG] [--every N] [--evaluate-after K]``: trains the demo model for STEPS
steps (50 ms each at least), prints ``step N <sha256 of the model>`` after each, checkpoints only when
a signal asks (every_steps is larger than the run), restores first if DIR has a checkpoint, and
prints ``final <sha256>`` at the end. With RANK and WORLD it joins a gloo process group first
(MASTER_ADDR / MASTER_PORT from the environment).

Without ``--save-on`` SIGTERM preempts (``signals=(signal.SIGTERM,)``: the keyword form). With
``--save-on USR1`` the config is ``ckpt.Signals(save=(SIGUSR1,))`` (SIGTERM still preempts): the
loop prints ``saved N <status> <sha256 of the model>`` when ``maybe_save`` returns a handle, logs at
INFO, and trains on. ``--every N`` snapshots every N steps; ``--evaluate-after K`` prints ``evaluating``
after step K (its snapshot in RAM) and sleeps for minutes without calling ``maybe_save``.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

import torch

import ckpt
from ckpt.demo import _build, _digest, _train_step


def main() -> None:
    args = sys.argv[1:]
    save_on = None
    if "--save-on" in args:
        i = args.index("--save-on")
        save_on = signal.Signals["SIG" + args[i + 1]]
        del args[i : i + 2]
    every, evaluate_after = 10**9, None
    if "--every" in args:  # snapshots every N steps (in RAM; the local tier as it keeps up)
        i = args.index("--every")
        every = int(args[i + 1])
        del args[i : i + 2]
    if "--evaluate-after" in args:  # after step K: "evaluating" for minutes, with no maybe_save
        i = args.index("--evaluate-after")
        evaluate_after = int(args[i + 1])
        del args[i : i + 2]
    local_dir, steps = args[0], int(args[1])
    if len(args) > 2:
        torch.distributed.init_process_group("gloo", rank=int(args[2]), world_size=int(args[3]))
    if save_on is None:
        options = dict(signals=(signal.SIGTERM,), drain_deadline=60)
    else:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        options = dict(signals=ckpt.Signals(save=(save_on,), deadline=60))
    state = _build(torch.device("cpu"), 64)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=every), **options
    ) as ck:
        last = ck.restore(state)
        print(f"restored {last}", flush=True)
        for step in range(1 if last is None else last + 1, steps + 1):
            _train_step(state)
            time.sleep(0.05)  # a step of realistic length, so the signal lands mid-run
            state["step"] = step
            handle = ck.maybe_save(step, state)
            if handle is not None:
                print(f"saved {step} {handle.status} {_digest(state['model'])}", flush=True)
            print(f"step {step} {_digest(state['model'])}", flush=True)
            if step == evaluate_after:
                handle.wait("memory")
                print("evaluating", flush=True)
                time.sleep(300)
    print(f"final {_digest(state['model'])}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""A training process for the memory-tier tests: snapshots every step, the local tier rarely.

``memory_worker.py LOCAL_DIR STEPS MODE [ARG]``:

* ``train``: train STEPS steps from whatever the tiers hold (restore first), snapshot every step with
  the local tier persisting every 1000 steps; print ``restored <step> <tier>``, then ``step <n>`` after
  each save once its snapshot is in memory, then ``final <sha256 of the weights>``.
* ``tear``: snapshot steps 1 and 2 (each committed to memory), then start step 3's copy into step 1's
  buffer and stall in the middle of it (``copying`` is printed): the parent kills it there.
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch

import ckpt
from helpers import stall_second_tensor_copy


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    local_dir, steps, mode = argv[0], int(argv[1]), argv[2]
    model, opt = model_and_opt()
    state = {"model": model, "optim": opt, "step": 0}
    if mode == "train":
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir),
            policy=ckpt.Policy(every_steps=1, persist_every={"local": 1000}),
        )
        start = ck.restore(state) or 0
        print("restored", start, ck.last_restore.tier if ck.last_restore else None, flush=True)
        for step in range(start + 1, steps + 1):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["step"] = step
            h = ck.maybe_save(step, state)
            h.wait("memory")
            print("step", step, flush=True)
            time.sleep(float(argv[3]) if len(argv) > 3 else 0.0)
        ck.close()
        print("final", digest(model), flush=True)
    elif mode == "tear":
        # two buffers: step 3 must go into step 1's (with a third it would take that one)
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir, max_in_flight=2),
            policy=ckpt.Policy(persist_every={"local": 1000}),
        )
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(step)
            ck.save(step, state).wait()  # step 1 on the local tier too: its buffer is free again
        stall_second_tensor_copy()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(3)
        ck.save(3, state)
        time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

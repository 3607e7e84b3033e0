"""Child side of the sharded-state tests: one gloo rank of an FSDP2 (DTensor) job on the CPU.

``python dtensor_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
A small MLP is sharded with ``fully_shard`` over all ranks and trained with AdamW on data seeded
by the step; every rank checkpoints into ``ROOT/rank-<rank>``. Prints ``digest <sha256>`` of the
full (gathered) parameters after the last step, on rank 0.

* ``run N``: train steps 1..N from scratch (saving every 3 steps), no restore.
* ``resume N``: restore, then train on to step N; prints ``restored S`` first.
* ``resume-plain``: restore into the same model left unsharded (plain tensors): must fail.

With ``CKPT_TEST_BACKEND=nccl`` each rank uses GPU ``RANK`` and NCCL instead (the ``multigpu`` tests).
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckpt


BACKEND = os.environ.get("CKPT_TEST_BACKEND", "gloo")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"


def build(world: int, shard: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6)).to(DEVICE)
    if shard:
        mesh = init_device_mesh(DEVICE, (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 12, generator=g).to(DEVICE)
    loss = (model(x) - x[:, :6]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    last = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(BACKEND, rank=rank, world_size=world)
    try:
        model, opt = build(world, shard=mode != "resume-plain")
        state = {"model": model, "optim": opt, "step": 0}
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=f"{root}/rank-{rank}"), policy=ckpt.Policy(every_steps=3)
        ) as ck:
            start = 1
            if mode.startswith("resume"):
                step = ck.restore(state)
                print(f"restored {step}", flush=True)
                start = step + 1
            for step in range(start, last + 1):
                train_step(model, opt, step, rank)
                state["step"] = step
                ck.maybe_save(step, state)
        d = digest(model)
        if rank == 0:
            print(f"digest {d}", flush=True)
        # Let go of FSDP's state (and its device mesh) while the interpreter still runs: otherwise a
        # gloo worker thread may free an all-gather's tensors during interpreter shutdown, cannot take
        # the GIL there and aborts the process ("terminate called without an active exception"), a
        # PyTorch shutdown race seen about once in 25 runs with or without a checkpointer.
        del model, opt, state
        gc.collect()
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

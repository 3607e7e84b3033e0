"""Child side of the DCP adapter tests: ``dcp.save`` / ``dcp.load`` of an FSDP2 model and AdamW
through :mod:`ckpt.integrations.dcp`, one gloo rank on the CPU.

``python dcp_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
Rank ``r`` uses ``ROOT/node-<r>`` as its local tier (one node per rank: only the coordinator's node
gets the ``COMMIT``) and ``file://ROOT/remote`` as the remote tier; the checkpoint id is ``step-3``.

* ``save``: train 3 steps, save model, optimizer (DCP's ``get_state_dict``) and plain values;
  prints ``digest D`` on rank 0 (the full parameters and optimizer state).
* ``retain``: 4 saves (``step-1`` .. ``step-4``) with ``keep=Retention(local=2, remote=3)``.
* ``load``: a fresh model and optimizer on ``WORLD`` ranks (any number), loaded; prints
  ``digest D`` on rank 0 and ``extra E`` (the plain values, as Python sees them) on every rank,
  then trains one more step (the loaded optimizer state must be usable).

With ``CKPT_TEST_BACKEND=nccl`` each rank uses GPU ``RANK`` and NCCL instead (the ``multigpu`` test).
"""

from __future__ import annotations

import gc
import hashlib
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter
from dtensor_worker import BACKEND, DEVICE, build, train_step

EXTRA = {"step": 3, "betas": (0.9, 0.95), "name": "run-a", "lrs": [1e-2, None, True], "inf": float("inf")}


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().contiguous()


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        h.update(full(p).numpy().tobytes())
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in sorted(opt.state[p].items()):
                h.update(k.encode() + full(v).numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(BACKEND, rank=rank, world_size=world)
    tiers = {"local_dir": f"{root}/node-{rank}", "url": f"file://{root}/remote"}
    try:
        model, opt = build(world)
        if mode == "retain":
            from ckpt import Retention

            for step in range(1, 5):
                train_step(model, opt, step, rank)
                msd, osd = get_state_dict(model, opt)
                dcp.save(
                    {"model": msd, "optim": osd},
                    checkpoint_id=f"step-{step}",
                    storage_writer=TierStorageWriter(**tiers, keep=Retention(local=2, remote=3)),
                )
                torch.distributed.barrier()
            return
        if mode == "save":
            for step in range(1, 4):
                train_step(model, opt, step, rank)
            msd, osd = get_state_dict(model, opt)
            dcp.save(
                {"model": msd, "optim": osd, "extra": dict(EXTRA)},
                storage_writer=TierStorageWriter(**tiers),
                checkpoint_id="step-3",
            )
        else:
            msd, osd = get_state_dict(model, opt)
            state = {
                "model": msd,
                "optim": osd,
                "extra": {"step": 0, "betas": None, "name": "", "lrs": None, "inf": 0.0},
            }
            dcp.load(state, storage_reader=TierStorageReader(**tiers), checkpoint_id="step-3")
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            print(f"extra {state['extra']!r}", flush=True)
        d = digest(model, opt)
        if rank == 0:
            print(f"digest {d}", flush=True)
        if mode == "load":
            train_step(model, opt, 4, rank)
        del model, opt
        gc.collect()
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

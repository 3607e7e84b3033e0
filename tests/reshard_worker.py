"""Child side of the job-tier and resharding tests: one gloo rank (or a single process) on the CPU.

``python reshard_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
Every rank gives the Checkpointer the same url, ``file://ROOT/job`` (the job tier), and its own
local directory ``ROOT/local-<WORLD>/rank-<RANK>``. ``WORLD`` 1 runs without torch.distributed.

* ``save-dt``: DTensors cut from known global tensors (``GLOBALS``) with ``SAVE_PLACEMENTS``, a plain
  tensor and JSON values, saved as step 5; prints ``saved``.
* ``load-dt``: the same names in ``LOAD_PLACEMENTS`` (other placements, another world size), zeroed,
  then restored; checks every local shard against the global tensor; prints ``restored S``.
* ``load-whole``: one process, plain tensors of the global shapes: the shards are consolidated.
* ``fsdp-save``: a small FSDP2 model and AdamW trained 3 steps, saved; prints ``digest D`` (the full
  parameters and optimizer state) on rank 0.
* ``fsdp-load``: a fresh FSDP2 model and optimizer (``WORLD`` may differ) restored; prints ``digest D``,
  then trains one more step (the restored optimizer state must be usable).
* ``fsdp-whole``: one process, the same model unsharded with a plain AdamW, restored; prints ``digest D``.
* ``dedupe-save`` / ``dedupe-load``: ``replicated=("model",)``: the model is the same on every rank and
  rank 0 alone uploads it; each rank's ``mine`` is its own (a rank that did not save reads rank 0's).
* ``rank-dies``: rank 1 exits before its upload; rank 0 prints ``error`` and ``remote``.
* ``steps-differ``: rank 0 saves step 1, rank 1 step 2 (a mistake); prints ``error`` and ``remote``.
With ``CKPT_TEST_BACKEND=nccl`` each rank uses GPU ``RANK`` and NCCL (the ``multigpu`` tests; the
single-process modes then put the model on GPU 0).

* ``commit-fail``: saves steps 1..3 every step; rank 1's upload of step 2 fails. Prints ``errors``
  with the steps whose save failed on this rank and ``remote`` with the steps committed there.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh

import ckpt
from ckpt.tiers import RemoteTier
from dtensor_worker import BACKEND, DEVICE, build, train_step

GLOBALS = {  # name -> (shape, dtype)
    "a": ((7, 5), torch.float32),
    "b": ((6, 9), torch.bfloat16),
    "c": ((4, 3), torch.float32),
    "e": ((2, 3), torch.float32),  # fewer rows than ranks: some shards are empty
}
SAVE_PLACEMENTS = {"a": Shard(0), "b": Shard(1), "c": Replicate(), "e": Shard(0)}
LOAD_PLACEMENTS = {"a": Shard(1), "b": Shard(0), "c": Shard(0), "e": Shard(1)}


def global_tensor(name: str, device: str = "cpu") -> torch.Tensor:
    shape, dtype = GLOBALS[name]
    n = torch.tensor(shape).prod().item()
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 0.5 + ord(name)).to(
        device=device, dtype=dtype
    )


def dt_state(mesh, placements: dict, zero: bool) -> dict:
    state = {}
    for name in GLOBALS:
        g = global_tensor(name, DEVICE)
        state[name] = distribute_tensor(torch.zeros_like(g) if zero else g, mesh, [placements[name]])
    state["plain"] = torch.zeros(3) if zero else torch.tensor([1.0, 2.0, 3.0])
    state["meta"] = {"epoch": 0 if zero else 7, "name": "" if zero else "run"}
    return state


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode() + full.detach().cpu().contiguous().numpy().tobytes())
        for k, v in sorted(opt.state.get(p, {}).items()):
            v = v.full_tensor() if isinstance(v, DTensor) else v
            h.update(k.encode() + v.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class FailingRemote(RemoteTier):
    """Rank 1's remote tier: the upload of step 2 fails after its parts went up."""

    def _write_files(self, step, manifest, data, elem_size, commit, **kwargs):
        raw = super()._write_files(step, manifest, data, elem_size, commit, **kwargs)
        if step == 2:
            raise OSError(5, "injected upload failure")
        return raw


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    url, local = f"file://{root}/job", f"{root}/local-{world}/rank-{rank}"
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    if world > 1:
        torch.distributed.init_process_group(BACKEND, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh(DEVICE, (world,)) if world > 1 else None
        if mode == "save-dt":
            with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=local)) as ck:
                ck.save(5, dt_state(mesh, SAVE_PLACEMENTS, zero=False))
            print("saved", flush=True)
        elif mode in ("load-dt", "load-whole"):
            if mode == "load-dt":
                state = dt_state(mesh, LOAD_PLACEMENTS, zero=True)
            else:
                state = {name: torch.zeros(GLOBALS[name][0], dtype=GLOBALS[name][1]) for name in GLOBALS}
                state.update(plain=torch.zeros(3), meta={"epoch": 0, "name": ""})
            with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=local)) as ck:
                step = ck.restore(state)
            for name in GLOBALS:
                want = global_tensor(name)
                if mode == "load-dt":
                    want = distribute_tensor(want.to(DEVICE), mesh, [LOAD_PLACEMENTS[name]]).to_local()
                    got = state[name].to_local()
                    assert state[name].placements == (LOAD_PLACEMENTS[name],), state[name].placements
                else:
                    got = state[name]
                assert got.dtype == want.dtype and torch.equal(got, want), (name, got, want)
            assert torch.equal(state["plain"], torch.tensor([1.0, 2.0, 3.0])) and state["meta"] == {
                "epoch": 7,
                "name": "run",
            }
            print(f"restored {step} from {ck.last_restore.tier}", flush=True)
        elif mode in ("fsdp-save", "fsdp-load", "fsdp-whole"):
            model, opt = build(world, shard=mode != "fsdp-whole")
            state = {"model": model, "optim": opt}
            with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=local)) as ck:
                if mode == "fsdp-save":
                    for step in range(1, 4):
                        train_step(model, opt, step, rank)
                    ck.save(3, state)
                else:
                    print(f"restored {ck.restore(state)}", flush=True)
            d = digest(model, opt)
            if rank == 0:
                print(f"digest {d}", flush=True)
            if mode != "fsdp-save":
                train_step(model, opt, 4, rank)
            del model, opt, state  # see dtensor_worker: FSDP2 + gloo at interpreter exit
            gc.collect()
        elif mode == "commit-fail":
            remote = FailingRemote(url) if rank == 1 else url
            errors = []
            with ckpt.Checkpointer(
                storage=ckpt.Storage(url=remote, local_dir=local),
                policy=ckpt.Policy(keep=ckpt.Retention(local=5, remote=5)),
            ) as ck:
                for step in (1, 2, 3):
                    handle = ck.save(step, {"w": torch.full((4,), float(step)), "rank": rank})
                    try:
                        handle.wait("remote")
                    except (ckpt.CheckpointError, OSError) as e:
                        errors.append(step)
                        print(f"error {step}: {e}", flush=True)
                try:
                    ck.wait()
                except (ckpt.CheckpointError, OSError):
                    pass  # the failure above, raised again by the checkpointer
                print("errors", errors, flush=True)
                print("remote", sorted(c.step for c in ck.list() if "remote" in c.tiers), flush=True)
        elif mode in ("dedupe-save", "dedupe-load"):
            # "model" is the same on every rank (replicated=("model",)); "mine" is each rank's own
            model = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(5)}
            state = {
                "model": model
                if mode == "dedupe-save"
                else {k: torch.zeros_like(v) for k, v in model.items()},
                "mine": torch.full((3,), float(rank)) if mode == "dedupe-save" else torch.zeros(3),
            }
            with ckpt.Checkpointer(
                storage=ckpt.Storage(url=url, local_dir=local, replicated=("model",))
            ) as ck:
                if mode == "dedupe-save":
                    ck.save(1, state).wait()
                    print("saved", flush=True)
                else:
                    step = ck.restore(state)
                    assert all(torch.equal(state["model"][k], v) for k, v in model.items())
                    assert torch.equal(state["mine"], torch.full((3,), float(rank if rank < 2 else 0)))
                    print(f"restored {step} from {ck.last_restore.tier}", flush=True)
        elif mode == "rank-dies":  # rank 1 dies before its upload reports; rank 0 must hear of it at once
            # if_busy="wait": the save itself agrees nothing with the other ranks, so the upload is what fails
            with ckpt.Checkpointer(
                storage=ckpt.Storage(url=url, local_dir=local), policy=ckpt.Policy(if_busy="wait")
            ) as ck:
                if rank == 1:
                    os._exit(3)
                try:
                    ck.save(1, {"w": torch.ones(4)}).wait("remote")
                except ckpt.CheckpointError as e:
                    print(f"error {e}", flush=True)
                print("remote", sorted(c.step for c in ck.list() if "remote" in c.tiers), flush=True)
                ck.close(raise_errors=False)
            os._exit(0)  # the process group cannot be torn down with a dead member
        elif mode == "steps-differ":  # a rank-dependent save: rank 0 saves step 1, rank 1 step 2
            with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=local)) as ck:
                try:
                    ck.save(1 + rank, {"w": torch.ones(2)}).wait("remote")
                except ckpt.CheckpointError as e:
                    print(f"error {e}", flush=True)
                try:
                    ck.wait()
                except ckpt.CheckpointError:
                    pass
                print("remote", sorted(c.step for c in ck.list() if "remote" in c.tiers), flush=True)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

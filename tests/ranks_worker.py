"""Child side of the multi-rank agreement tests: one gloo rank with its own checkpoint directory.

``python ranks_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
The state is ``{"w": 8 floats, "step": int}``; at step ``s`` every element of ``w`` equals ``s``.

* ``save``: steps 1..30 with ``every_steps=10`` (commits 10, 20, 30); prints ``saved``.
* ``save-keep``: as ``save``, then closes keeping the memory tier's segments (as a crash leaves them).
* ``takeover``: prints ``takeover STARTED ADOPTED restored S TIER W AFTER``: whether the Checkpointer began
  taking the previous process's segments over when it was made, the (step, checked) of each buffer taken
  over, the restore, and the buffers after it.
* ``restore``: prints ``restored S W`` (the step restore agreed on and ``w[0]`` after it).
* ``restore-wide``: rank 1's ``w`` has 9 elements, so the checkpoint does not fit it there.
* ``restore-30``: ``restore(step=30)``.
* ``seconds``: ``every_seconds=50`` where rank 0's clock moves 60 s per reading and rank 1's
  never moves; prints ``committed`` and the committed steps.
* ``same-dir`` / ``same-url``: two ranks share a ``local_dir`` / a ``url`` (three ranks for the
  latter: the third has its own); prints ``accepted`` if the Checkpointer allows it.
* ``skip``: ``if_busy="skip"`` with one host buffer, where rank 1's disk takes 0.5 s per write
  and saves come every 0.05 s; prints ``committed``, the committed steps and the skip count.
* ``allocating``: ``every_steps=1`` where rank 1's host buffers take 4 s each to allocate (rank 0's
  do not) and ``CKPT_BUSY_WAIT_MS=500``: saves step 1 while rank 1's background allocation runs, waits
  for it, then saves step 2; prints ``step S STATUS SKIPPED`` for each, then ``allocated by`` and the
  names of the threads that allocated a buffer.

With ``CKPT_TEST_BACKEND=nccl`` the default group is NCCL (one GPU per rank) and the agreements
run on the gloo group the Checkpointer makes for them (the ``multigpu`` tests).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

import ckpt
from ckpt.tiers import LocalTier


class SlowTier(LocalTier):
    def __init__(self, root, seconds: float = 0.5) -> None:
        super().__init__(root)
        self.seconds = seconds

    def write(self, step, manifest, data):
        time.sleep(self.seconds)
        return super().write(step, manifest, data)


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    backend = os.environ.get("CKPT_TEST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    local_dir = f"{root}/rank-{rank}"
    width = 9 if mode == "restore-wide" and rank == 1 else 8
    state = {"w": torch.zeros(width), "step": 0}
    try:
        if mode in ("save", "save-keep"):
            ck = ckpt.Checkpointer(
                storage=ckpt.Storage(local_dir=local_dir),
                policy=ckpt.Policy(every_steps=10, keep=ckpt.Retention(local=5), if_busy="wait"),
            )
            for step in range(1, 31):
                ck.wait_staged()  # w is updated in place below, outside optimizer.step()
                state["w"].fill_(step)
                state["step"] = step
                ck.maybe_save(step, state)
            ck.close(keep_memory=mode == "save-keep")  # save-keep: the RAM stays, as a crash leaves it
            print("saved", flush=True)
        elif mode == "takeover":
            with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
                started = ck.pool.adopt_span is not None or ck.pool._adopting is not None
                ck.pool.wait_adopted()
                adopted = sorted((b.image_step, b.checked) for b in ck.pool.buffers)
                step = ck.restore(state)
                after = sorted((b.image_step, b.checked) for b in ck.pool.buffers)
                print(
                    f"takeover {started} {adopted} restored {step} {ck.last_restore.tier} "
                    f"{float(state['w'][0])} {after}",
                    flush=True,
                )
                print("passed over:", ck.last_restore.skipped, flush=True)  # for a failing test's message
        elif mode.startswith("restore"):
            with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
                step = ck.restore(state, step=30 if mode == "restore-30" else None)
            print(f"restored {step} {float(state['w'][0]) if step is not None else None}", flush=True)
        elif mode == "seconds":
            now = [0.0]

            def clock() -> float:
                if rank == 0:
                    now[0] += 60.0
                return now[0]

            with ckpt.Checkpointer(
                storage=ckpt.Storage(local_dir=local_dir),
                policy=ckpt.Policy(every_seconds=50, if_busy="wait", keep=ckpt.Retention(local=100)),
                clock=clock,
            ) as ck:
                for step in range(1, 6):
                    ck.wait_staged()
                    state["w"].fill_(step)
                    ck.maybe_save(step, state)
                ck.wait()
                print("committed", sorted(c.step for c in ck.list() if "local" in c.tiers), flush=True)
        elif mode == "auto-tiers":
            # interval="auto": each rank's clock and costs set its tiers' cadences; rank 0's clock moves
            # 60 s per reading, rank 1's 0.001 s, and rank 1's disk is slow. The ranks must still hand the
            # same snapshots to each tier (the job tier commits only what every rank uploaded).
            now = [0.0]

            def clock() -> float:
                now[0] += 60.0 if rank == 0 else 0.001
                return now[0]

            tier = SlowTier(local_dir, 0.15) if rank == 1 else LocalTier(local_dir)
            with ckpt.Checkpointer(
                storage=ckpt.Storage(url=f"file://{root}/job", local_dir=tier),
                policy=ckpt.Policy(interval="auto", mtbf=3600, keep=ckpt.Retention(local=100, remote=100)),
                clock=clock,
            ) as ck:
                for step in range(1, 41):
                    ck.wait_staged()
                    state["w"].fill_(step)
                    ck.maybe_save(step, state)
                    time.sleep(0.05)
                ck.wait()
                print("cadences", ck.interval_report()["tiers"], flush=True)
                print(
                    "committed",
                    sorted(c.step for c in ck.list() if "local" in c.tiers),
                    sorted(c.step for c in ck.list() if "remote" in c.tiers),
                    flush=True,
                )
        elif mode in ("same-dir", "same-url"):
            shared = mode == "same-dir"
            # same-url: ranks 0 and 1 share a url, rank 2 has its own (a job tier needs every rank)
            url = f"file://{root}/remote" + ("" if mode == "same-url" and rank < 2 else f"/rank-{rank}")
            with ckpt.Checkpointer(
                storage=ckpt.Storage(url=url, local_dir=f"{root}/shared" if shared else local_dir)
            ):
                print("accepted", flush=True)
        elif mode == "skip":
            tier = SlowTier(local_dir) if rank == 1 else LocalTier(local_dir)
            with ckpt.Checkpointer(
                storage=ckpt.Storage(local_dir=tier),
                policy=ckpt.Policy(if_busy="skip", keep=ckpt.Retention(local=100)),
            ) as ck:
                for step in range(1, 13):
                    ck.wait_staged()
                    state["w"].fill_(step)
                    ck.save(step, state)
                    time.sleep(0.05)
                ck.wait()
                # the tier's skips (busy on either rank), decided together: the same steps on both ranks
                print(
                    "committed",
                    sorted(c.step for c in ck.list() if "local" in c.tiers),
                    ck.tier_counts["local"].busy,
                    flush=True,
                )
        elif mode == "allocating":
            from ckpt import knobs
            from ckpt.pool import HostPool

            threads = []
            real = HostPool._allocate

            def slow(self, *args, **kwargs):
                threads.append(threading.current_thread().name)
                if rank == 1:
                    time.sleep(4.0)
                return real(self, *args, **kwargs)

            HostPool._allocate = slow
            with (
                knobs.override(CKPT_BUSY_WAIT_MS=500),
                ckpt.Checkpointer(
                    storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1)
                ) as ck,
            ):
                for step in (1, 2):
                    ck.wait_staged()
                    state["w"].fill_(step)
                    handle = ck.maybe_save(step, state)
                    if handle.status != "skipped":
                        handle.wait()
                    print("step", step, handle.status, ck.skipped, flush=True)
                    ck.pool._prepared.join(60)  # every buffer is there before the next step
                    torch.distributed.barrier()
            print("allocated by", *threads, flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""A two-rank gloo job on one file:// job tier that saves step 5 again (tests/test_promote.py).

    python replace_worker.py ROOT RANK WORLD MODE VALUE      (through helpers.run_ranks)

``save``: every rank saves step 5 (``w`` full of VALUE + rank) and waits for the job tier.
``fail``: the same, but rank 1's upload fails after its first part (an outage halfway); prints ``error``.
``check``: every rank restores step 5 from the job tier into an empty local_dir; prints ``restored S V``.
"""

from __future__ import annotations

import errno
import shutil
import sys

import torch

import ckpt
from ckpt.tiers import RemoteTier


class FailingRemote(RemoteTier):
    def _put(self, path, data, sync_dir=False):
        if "/part-" in path and not path.endswith("part-000000"):
            raise OSError(errno.EIO, "injected outage", path)
        return super()._put(path, data, sync_dir)


def main() -> None:
    root, rank, world, mode, value = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        float(sys.argv[5]),
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    url = f"file://{root}/job"
    try:
        if mode in ("save", "fail"):
            remote = FailingRemote(url) if mode == "fail" and rank == 1 else url
            with ckpt.Checkpointer(
                storage=ckpt.Storage(url=remote, local_dir=f"{root}/local/rank-{rank}")
            ) as ck:
                try:
                    ck.save(5, {"w": torch.full((100_000,), value + rank)}).wait("remote")
                    print("saved", flush=True)
                except (ckpt.CheckpointError, OSError) as e:
                    print(f"error {type(e).__name__}: {e}", flush=True)
                ck.close(raise_errors=False)
        else:
            fresh = f"{root}/fresh/rank-{rank}"
            state = {"w": torch.zeros(100_000)}
            with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=fresh)) as ck:
                step = ck.restore(state)
            shutil.rmtree(fresh)
            print(f"restored {step} {state['w'][0].item() - rank}", flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

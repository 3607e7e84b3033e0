"""A process for tests/test_persist_restored.py: a job killed while its local tier writes the newest snapshot,
and the processes that come after it on the same node.

``restored_worker.py LOCAL_DIR MODE [URL [RANK WORLD]]`` (URL: a remote tier, which writes step 1 only:
persist_every 1000; ``-`` for none). With RANK and WORLD it is that rank of a gloo job (MASTER_ADDR and
MASTER_PORT in the environment) with its own ``LOCAL_DIR/rank-RANK``, MODE a comma-separated list, one per
rank, and URL its job tier.

* ``stall``: save steps 1 and 2 (every tier has them), then step 3 with the local tier's write of it stalled:
  prints ``stalled 3 <sha256 of step 3's state>`` once that write has begun; the parent kills it there.
* ``written``: the same, but step 3 reaches the local tier: prints ``written 3 <sha256>``, then sleeps until
  killed (it never closes: its snapshots stay in RAM).
* ``restore``: restore what the tiers hold and wait for every write that started (``ck.wait()``); prints
  ``restored <step> <tier> <sha256 of the state> <local writes of this process> <remote writes>``, then
  ``failed <error type>`` when ``ck.wait()`` raised.
* ``restore-lost``: the same, but the snapshot restored from RAM cannot be taken again to be written (a chunk
  fails its checksum when the writers take it).

The state is two float tensors of a few 4 KiB chunks (the parent sets ``CKPT_CHUNK_BYTES``).
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time

import torch

import ckpt
from ckpt.tiers import LocalTier

STALLED = 3
RECORDED = threading.Event()  # step 3 is recorded in RAM (it outlives the process)


RANK = 0


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step * 100 + RANK)
    return {"a": torch.randn(3000, generator=g), "b": torch.randn(1500, generator=g), "step": step}


def digest(s: dict) -> str:
    h = hashlib.sha256()
    for k in ("a", "b"):
        h.update(s[k].contiguous().view(torch.uint8).numpy().tobytes())
    h.update(str(s["step"]).encode())
    return h.hexdigest()


class StalledLocal(LocalTier):
    """A local tier whose write of step 3 stops after its first chunk (a disk that stopped answering): the
    process is killed with the step half written in a staging directory."""

    def write(self, step, manifest, data):
        if step != STALLED:
            return super().write(step, manifest, data)
        c = manifest.chunk_bytes

        def chunk(i):
            if i == 1:
                # RAM holds the step once its record is written (in the background, beside this write)
                assert RECORDED.wait(60), "the memory tier never recorded the stalled step"
                print("stalled", step, digest(state(step)), flush=True)
                time.sleep(3600)
            return data[i * c : (i + 1) * c]

        return self.write_chunks(step, manifest, chunk, compute_checksums=True)


def main(argv: list[str]) -> int:
    global RANK
    local_dir, mode, url = argv[0], argv[1], (argv[2] if len(argv) > 2 and argv[2] != "-" else None)
    if len(argv) > 3:
        import torch.distributed as dist

        RANK, world = int(argv[3]), int(argv[4])
        dist.init_process_group("gloo", rank=RANK, world_size=world)
        local_dir, mode = f"{local_dir}/rank-{RANK}", mode.split(",")[RANK]
    persist_every = {"remote": 1000} if url else None
    if mode in ("stall", "written"):
        local = StalledLocal(local_dir) if mode == "stall" else local_dir
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(url=url, local_dir=local), policy=ckpt.Policy(persist_every=persist_every)
        )
        for step in (1, 2):
            ck.save(step, state(step)).wait()
        h = ck.save(STALLED, state(STALLED))
        h.wait("memory")
        RECORDED.set()
        if mode == "written":
            h.wait()
            print("written", STALLED, digest(state(STALLED)), flush=True)
        time.sleep(3600)
    elif mode in ("restore", "restore-lost"):
        if mode == "restore-lost":  # the snapshot read at restore cannot be taken again to be written
            from ckpt.errors import CorruptCheckpointError
            from ckpt.tiers.memory import MemoryTier

            def lost(self, step, *args, **kwargs):
                raise CorruptCheckpointError(f"step {step}: a chunk changed in RAM after the restore read it")

            MemoryTier.hold_image = lost
        target = {"a": torch.zeros(3000), "b": torch.zeros(1500), "step": None}
        with ckpt.Checkpointer(
            storage=ckpt.Storage(url=url, local_dir=local_dir),
            policy=ckpt.Policy(persist_every=persist_every),
        ) as ck:
            step = ck.restore(target)
            outcome = []
            try:
                ck.wait()
            except ckpt.CheckpointError as e:
                outcome = ["failed", type(e).__name__]
            counts = ck.tier_counts
            print(
                "restored",
                step,
                ck.last_restore.tier,
                digest(target),
                counts["local"].persisted,
                counts["remote"].persisted if url else 0,
                *outcome,
                flush=True,
            )
    if len(argv) > 3:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A process for the takeover tests (tests/test_takeover_hostile.py): it owns LOCAL_DIR, so it takes the
memory-tier segments its predecessor left over (maps them as its own buffers), and stops where told.

``takeover_worker.py LOCAL_DIR MODE [STEP ...]``:

* ``stall-takeover``: own LOCAL_DIR (the background takeover starts), and stall the takeover thread right
  after it has mapped slot 0's segment (``adopted 0`` is printed): the parent kills it there.
* ``stall-save``: save step 5 (its first save takes the segments over, then reuses the buffer of the older
  adopted snapshot) and stall the copy after the first tensor is written into that buffer (``copying`` is
  printed): the parent kills it there.
* ``restore``: own LOCAL_DIR, wait for the takeover, then restore each STEP and print
  ``restored <step> <tier> <sha256 of the state> <checked of the buffer holding it, or None>``; close
  keeping the segments in RAM.

The state is :func:`state` (two float tensors of a few 4 KiB chunks; the parent sets ``CKPT_CHUNK_BYTES``).
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch

import ckpt
from ckpt import pool as pool_mod
from helpers import stall_second_tensor_copy


def state(seed: int) -> dict:
    """18288 bytes of data at 4096-byte alignment: ``a`` at [0, 12000), ``b`` at [12288, 18288)."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3000, generator=g), "b": torch.randn(1500, generator=g)}


def zeros() -> dict:
    return {k: torch.zeros_like(v) for k, v in state(0).items()}


def digest(s: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(s):
        h.update(k.encode())
        h.update(s[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    local_dir, mode, steps = argv[0], argv[1], [int(a) for a in argv[2:]]
    if mode == "stall-takeover":
        real = pool_mod.HostPool._adopt_slot

        def stall(self, space, slot, shm):
            buf = real(self, space, slot, shm)
            if slot == 0:
                print("adopted", slot, flush=True)
                time.sleep(600)
            return buf

        pool_mod.HostPool._adopt_slot = stall
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
        ck._node.own()  # what a collective job's Checkpointer does when it is made
        time.sleep(600)
    elif mode == "stall-save":
        stall_second_tensor_copy()
        # two buffers: step 5 must reuse an adopted one (with a third it would allocate instead)
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir, max_in_flight=2),
            policy=ckpt.Policy(persist_every={"local": 1000}),
        )
        ck.save(5, state(5))
        time.sleep(600)
    elif mode == "restore":
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
        ck._node.own()
        ck.pool.wait_adopted()
        for step in steps:
            target = zeros()
            got = ck.restore(target, step=step)
            buf = next((b for b in ck.pool.buffers if b.image_step == step), None)
            print(
                "restored",
                got,
                ck.last_restore.tier,
                digest(target),
                None if buf is None else buf.checked,
                flush=True,
            )
        ck.close(keep_memory=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

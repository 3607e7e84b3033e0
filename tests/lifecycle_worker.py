"""Snapshots every step with a slow local tier (it holds the buffer it reads), printing each step once it
is committed to the memory tier; killed by tests/test_buffer_lifecycle.py.

``lifecycle_worker.py LOCAL_DIR BUFFERS STALL_AT``: restore, print ``restored <step> <value>``, then snapshot
every step; the snapshot taken after STALL_AT more steps stops in the middle of its copy (``copying`` is
printed): the parent kills the process there, or at a random moment before (STALL_AT -1: never stalls)."""

import sys
import time

import torch

import ckpt
from ckpt.tiers import LocalTier
from helpers import stall_second_tensor_copy


class SlowLocal(LocalTier):
    def write(self, step, manifest, data):
        time.sleep(0.2)  # a slow disk
        return super().write(step, manifest, data)


def main() -> None:
    ck = ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=SlowLocal(sys.argv[1]), max_in_flight=int(sys.argv[2]))
    )
    stall_at = int(sys.argv[3])
    state = {"a": torch.zeros(1 << 18), "b": torch.zeros(1 << 18)}
    last = ck.restore(state)
    assert torch.equal(state["a"], state["b"])
    print("restored", last, float(state["a"][0]), flush=True)
    step = 0 if last is None else last + 1
    n = 0
    while True:
        if n == stall_at:
            stall_second_tensor_copy()
        state["a"].fill_(float(step))
        state["b"].fill_(float(step))
        h = ck.save(step, state)
        if h.status != "skipped":
            h.wait("memory")
            print("committed", step, flush=True)
            n += 1
        step += 1
        time.sleep(0.01)  # the rest of a training step


if __name__ == "__main__":
    main()

"""Child-process side of the kill tests: save forever, content derived from the step.

Run as ``python killworker.py LOCAL_DIR NUMEL CHUNK_BYTES``: prints ``ready``
once imports are done, then saves steps 1, 2, ... as fast as the pipeline
allows, each tensor filled with a pattern of its step, until it is killed.
:func:`save_forever` is the same for a process forked from a fork server
(``ready``: an event it sets instead of printing).
"""

from __future__ import annotations

import sys

import torch

import ckpt
from ckpt import knobs


def pattern(step: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32).add_(step * 1000.0)


def save_forever(local_dir: str, numel: int, chunk: int, ready=None) -> None:
    with knobs.override(CKPT_CHUNK_BYTES=chunk):
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=2))
        )
        if ready is None:
            print("ready", flush=True)
        else:
            ready.set()
        step = 0
        base = pattern(0, numel)
        while True:
            step += 1
            w = base + step * 1000.0
            ck.save(step, {"w": w, "step": step, "b": w[: numel // 3].clone()})


def main() -> None:
    save_forever(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))


if __name__ == "__main__":
    main()

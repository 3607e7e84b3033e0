"""Child side of the data-loader signal tests: a training loop fed by a ``DataLoader`` with two forked
workers; prints ``ready`` at step 5, stops at step 40 and prints ``done`` with the steps committed.
``python dataloader_signal_worker.py LOCAL_DIR [MODE]``; MODE ``save`` (default):
``signals=ckpt.Signals(save=(signal.SIGUSR1,))``; ``preempt``: the default signals (SIGTERM preempts: save,
then exit 143) and ``worker_init_fn=ckpt.WorkerSignals(note)``, where ``note`` prints ``worker N``."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import ckpt


class _Slow(Dataset):
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.full((4,), float(i))


def note(worker_id: int) -> None:
    # one write of one line (atomic on a pipe): print's pieces from two workers interleave
    os.write(sys.stdout.fileno(), f"worker {worker_id}\n".encode())


def main() -> None:
    w = torch.zeros(4)
    preempt = len(sys.argv) > 2 and sys.argv[2] == "preempt"
    signals = ckpt.Signals() if preempt else ckpt.Signals(save=(signal.SIGUSR1,))
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1]), signals=signals) as ck:
        loader = DataLoader(
            _Slow(),
            batch_size=2,
            num_workers=2,
            multiprocessing_context="fork",
            worker_init_fn=ckpt.WorkerSignals(note) if preempt else None,
        )
        for step, batch in enumerate(loader, 1):
            w += batch.sum(0)
            ck.maybe_save(step, {"w": w})
            if step == 5:
                print("ready", flush=True)
            if step == 40:
                break
            time.sleep(0.05)
        print("done", [c.step for c in ck.list()], flush=True)


if __name__ == "__main__":
    main()

"""Child-process side of the retention kill tests: a process deleting checkpoints, stopped at a chosen
point of a deletion so that the test can SIGKILL it there.

Run as ``python retention_worker.py MODE LOCAL_DIR WHERE``:

* ``gc``: ``ckpt gc LOCAL_DIR --keep 1`` (the command line, owning the directory while it deletes);
* ``save``: a Checkpointer with ``Retention(local=1)`` that restores and saves the next step, so that
  its own retention deletes the older ones;
* ``memory``: ``save``, stopped before the memory tier writes its first snapshot record instead.

``WHERE`` is when the first deletion stops: ``uncommitted`` (its ``COMMIT`` removed, nothing else) or
``half`` (one more file of the step removed). Prints ``stopped STEP`` there, then sleeps until killed.
Each step's tensor is filled with the step number.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import torch

import ckpt
from ckpt.cli import main as cli
from ckpt.format import parse_step_dir


def stop_deletions(where: str) -> None:
    """The first ``shutil.rmtree`` of a step directory (after ``remove_step_dir`` took its ``COMMIT``
    away) stops, with ``half`` after removing one more of its files."""
    real = shutil.rmtree

    def rmtree(path, *args, dir_fd=None, **kwargs):
        step = parse_step_dir(os.path.basename(os.fspath(path)))
        if step is None:
            return real(path, *args, dir_fd=dir_fd, **kwargs)
        if where == "half":
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                os.unlink(sorted(os.listdir(fd))[0], dir_fd=fd)
            finally:
                os.close(fd)
        print(f"stopped {step}", flush=True)
        time.sleep(600)

    shutil.rmtree = rmtree


def stop_first_memory_record() -> None:
    """The memory tier's first snapshot record is never written: the owner holds its segments, none with
    a record yet (as between a first save's allocation and its first memory commit)."""
    from ckpt import shm
    from ckpt.tiers import memory

    def write_record(*args, **kwargs):
        print("stopped 0", flush=True)
        time.sleep(600)

    shm.write_record = memory.shm.write_record = write_record


def main(argv: list[str]) -> int:
    mode, local_dir, where = argv
    if mode == "memory":
        stop_first_memory_record()
        mode = "save"
    stop_deletions(where)
    if mode == "gc":
        return cli(["gc", local_dir, "--keep", "1", "--no-progress"])
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    ) as ck:
        state = {"w": torch.zeros(1000)}
        step = ck.restore(state)
        state["w"].fill_(step + 1)
        ck.save(step + 1, state).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

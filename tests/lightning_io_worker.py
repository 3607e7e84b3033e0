"""Another process with a ``TieredCheckpointIO`` save pending, for tests/test_lightning_io.py.

    python lightning_io_worker.py PATH

Saves step 3 (``state_dict/w`` = ``arange(64)``) to PATH through a disk that writes nothing until a line
arrives on stdin. Prints ``reserved`` once ``save_checkpoint`` returned, then, after that line, waits for
the save (``teardown``) and prints ``committed``. Killing it instead leaves the save pending forever.
"""

from __future__ import annotations

import sys
import threading

import torch

from ckpt.integrations.lightning import TieredCheckpointIO
from ckpt.tiers import LocalTier

_go = threading.Event()


class _GatedLocal(LocalTier):
    def write(self, step, manifest, data):
        _go.wait()
        return super().write(step, manifest, data)


def main(path: str) -> int:
    io = type("GatedIO", (TieredCheckpointIO,), {"_local_tier": _GatedLocal})()
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.arange(64, dtype=torch.float32)}}, path)
    print("reserved", flush=True)
    sys.stdin.readline()
    _go.set()
    io.teardown()
    print("committed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

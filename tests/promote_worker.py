"""Child-process side of the promote kill tests (tests/test_promote.py).

    python promote_worker.py TO LOCAL_DIR URL STEP PAUSE_AT STORAGE_OPTIONS_JSON

Runs ``ckpt.promote(STEP, TO, ...)`` with every call that changes a file counted: ``os.pwrite``,
``os.replace``, ``os.rename``, ``os.unlink``, ``shutil.rmtree``, the local tier's directory
exchange, and the remote file system's ``pipe_file``/``rm``/``rm_file``/``mv``. Before call number
PAUSE_AT it prints ``paused N NAME ARG`` and sleeps (the test SIGKILLs it there); with PAUSE_AT 0 it
runs to the end and prints ``events N``, the number of such calls.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import threading
import time

import ckpt
from ckpt.tiers import local as local_tier, remote as remote_tier


def main() -> None:
    to, local_dir, url, step, pause_at = (
        sys.argv[1],
        sys.argv[2],
        sys.argv[3],
        int(sys.argv[4]),
        int(sys.argv[5]),
    )
    opts = json.loads(sys.argv[6]) or None
    counter, lock = itertools.count(1), threading.Lock()
    seen = [0]

    def hooked(name, fn):
        def call(*args, **kwargs):
            with lock:
                n = next(counter)
                seen[0] = n
            if n == pause_at:
                print(f"paused {n} {name} {args[0] if args else ''}", flush=True)
                time.sleep(3600)
            return fn(*args, **kwargs)

        return call

    for name in ("pwrite", "replace", "rename", "unlink"):
        setattr(os, name, hooked(name, getattr(os, name)))
    shutil.rmtree = hooked("rmtree", shutil.rmtree)
    if hasattr(local_tier, "_exchange"):
        local_tier._exchange = hooked("exchange", local_tier._exchange)

    init = remote_tier.RemoteTier.__init__

    def remote_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for name in ("pipe_file", "rm", "rm_file", "mv"):
            setattr(self.fs, name, hooked(f"fs.{name}", getattr(self.fs, name)))

    remote_tier.RemoteTier.__init__ = remote_init
    ckpt.promote(step, to, local_dir=local_dir, url=url, storage_options=opts)
    print(f"events {seen[0]}", flush=True)


if __name__ == "__main__":
    main()

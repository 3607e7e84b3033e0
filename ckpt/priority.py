"""Background threads yield the CPU to the training loop.

A persist writes gigabytes through the page cache and checksums them on ``CKPT_IO_THREADS``
threads; on a node whose cores are all busy, the training thread that launches the GPU's kernels
would get a share of the CPU like any of them, and the GPU would wait on it. The persist lanes,
the pool's background allocation and the threads they start therefore run at a lower scheduling
priority (Linux ``nice``, per thread; threads inherit it from the thread that starts them), set by
``CKPT_PERSIST_NICE`` (default 10: the training thread gets about ten times their share of a
contended core; 0 leaves them at the process's priority). Restores and the save path itself keep
the caller's priority. Raising one's own nice value needs no privilege; where the platform has no
per-thread priority, nothing changes.
"""

from __future__ import annotations

import logging
import os
import threading

from . import knobs

__all__ = ["lower_this_thread"]

log = logging.getLogger(__name__)


def lower_this_thread() -> None:
    """Lower the calling thread's priority by ``CKPT_PERSIST_NICE`` (call first thing in a background
    thread's body; the threads it starts inherit the new value)."""
    step = knobs.get("CKPT_PERSIST_NICE")
    if step <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + step))
    except OSError as e:  # a sandbox that forbids it: the thread runs at the process's priority
        log.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, e)

"""Background threads yield the CPU: the persist lanes run at a lower priority than the caller."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckpt
from ckpt import knobs, priority
from ckpt.tiers import LocalTier

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_persist_writers_run_below_the_training_thread(local_dir):
    seen: list[tuple[str, int]] = []

    class Spy(LocalTier):
        def write(self, step, manifest, data):
            seen.append((threading.current_thread().name, _nice(threading.get_native_id())))
            return super().write(step, manifest, data)

    me = _nice(threading.get_native_id())
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=Spy(local_dir))) as ck:
        ck.save(1, {"w": torch.ones(1000)}).wait()
    assert _nice(threading.get_native_id()) == me  # the caller's own priority is untouched
    [(name, nice)] = seen
    assert name.startswith("ckpt-persist") and nice == min(19, me + knobs.get("CKPT_PERSIST_NICE"))


def test_nice_zero_leaves_background_threads_alone():
    got = []
    with knobs.override(CKPT_PERSIST_NICE=0):
        t = threading.Thread(
            target=lambda: (priority.lower_this_thread(), got.append(_nice(threading.get_native_id())))
        )
        t.start()
        t.join()
    assert got == [_nice(threading.get_native_id())]

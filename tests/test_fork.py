"""A process that forks (DataLoader workers with the ``fork`` start method, ``multiprocessing`` children)
while a Checkpointer works: the child must neither touch nor wait for the parent's checkpointing, at any
moment of the fork, and the parent's checkpoints are unaffected.

The hardest moment is forked here on purpose: a save in flight (its local write held back) and the
pipeline's lock held by another thread of the parent. A child that ran the parent's exit hooks would wait
on that lock forever (it is never released in the child: the thread holding it does not exist there)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

import ckpt
from ckpt import pipeline


def _child(q) -> None:
    q.put(len(list(pipeline._live)))  # the parent's pipelines are not the child's


@pytest.mark.timeout(120)
def test_a_child_forked_mid_save_with_the_pipelines_lock_held_exits_at_once(local_dir, monkeypatch):
    from ckpt.tiers.local import LocalTier

    gate = threading.Event()
    real = LocalTier.write

    def held(self, step, manifest, data):
        assert gate.wait(60)
        return real(self, step, manifest, data)

    monkeypatch.setattr(LocalTier, "write", held)
    state = {"w": torch.randn(1 << 16)}
    ctx = mp.get_context("fork")
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        handle = ck.save(1, state)  # its local write waits for the gate: in flight at the fork
        ck.wait_staged()
        locked, release = threading.Event(), threading.Event()

        def hold_lock() -> None:
            with ck._pipeline._cv:
                locked.set()
                release.wait(60)

        holder = threading.Thread(target=hold_lock)
        holder.start()
        assert locked.wait(10)
        q = ctx.Queue()
        child = ctx.Process(target=_child, args=(q,))
        t0 = time.monotonic()
        child.start()
        release.set()
        holder.join()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive, "the forked child hung at its exit"
        assert child.exitcode == 0 and q.get(timeout=5) == 0
        assert time.monotonic() - t0 < 30
        gate.set()
        handle.wait()
        got = {"w": torch.zeros(1 << 16)}
        assert ck.restore(got) == 1 and torch.equal(got["w"], state["w"])
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir)
    ) as ck:  # committed on disk by the parent
        got = {"w": torch.zeros(1 << 16)}
        assert ck.restore(got) == 1 and torch.equal(got["w"], state["w"])

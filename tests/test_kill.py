"""Real processes killed with SIGKILL: restore always finds the newest committed step, never a torn one."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import shm
from helpers import fork_server
from killworker import pattern, save_forever

HERE = Path(__file__).parent
NUMEL = 1 << 20  # 4 MiB of float32 + a third of that again: a few chunks per save


def _start_worker(local_dir: Path):
    """killworker.save_forever in a real process of its own, forked from a fork server that imported torch
    and ckpt once (a fresh interpreter would spend seconds on them per round); returns once it is ready."""
    ctx = fork_server()
    ready = ctx.Event()
    proc = ctx.Process(target=save_forever, args=(str(local_dir), NUMEL, 256 << 10, ready), daemon=True)
    proc.start()
    assert ready.wait(120), "the worker never got ready"
    return proc


def _check_restore(local_dir: Path) -> int | None:
    """The newest snapshot committed anywhere (the local tier, or the memory tier's shared memory, which
    outlives the killed process) is restored, exactly; a snapshot torn by the kill is never served."""
    committed = sorted(int(p.name[5:]) for p in local_dir.glob("step-*") if (p / "COMMIT").exists())
    committed = sorted(
        set(committed)
        | {r.step for g in shm.segments(prefix=shm.prefix_for(local_dir, 0, create=True)) for r in g.records}
    )
    target = {"w": torch.empty(NUMEL), "step": None, "b": torch.empty(NUMEL // 3)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        step = ck.restore(target)
        skipped = ck.last_restore.skipped if ck.last_restore else []
    if not committed:
        assert step is None
        return None
    assert skipped == [], f"a committed checkpoint was torn: {skipped}"
    assert step == committed[-1], f"restored {step}, newest committed is {committed[-1]}"
    assert target["step"] == step
    expected = pattern(step, NUMEL)
    assert torch.equal(target["w"], expected)
    assert torch.equal(target["b"], expected[: NUMEL // 3])
    return step


def _kill_rounds(tmp_path: Path, rounds: int, seed: int) -> list[int | None]:
    rng = random.Random(seed)
    results = []
    local_dir = tmp_path / "local"
    local_dir.mkdir()
    for _ in range(rounds):
        proc = _start_worker(local_dir)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        results.append(_check_restore(local_dir))
    return results


def test_random_sigkills_during_phase_two_never_expose_a_torn_step(tmp_path):
    results = _kill_rounds(tmp_path, rounds=20, seed=1)
    assert sum(r is not None for r in results) >= 10, f"too few rounds got to commit anything: {results}"


@pytest.mark.slow
def test_many_random_sigkills(tmp_path):
    results = _kill_rounds(tmp_path, rounds=200, seed=2)
    assert sum(r is not None for r in results) >= 100


def test_demo_kills_its_training_child_and_resumes_bit_identically():
    out = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "demo", "--steps", "24", "--every", "4", "--width", "128"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SIGKILLed at step" in out.stdout
    # at least the newest step on disk before the kill is restored: from RAM (the killed child's snapshots
    # outlive it there, newer ones too) where its record was written in time (records follow in the background;
    # a loaded machine may kill the child first), else from the local tier. A loaded machine may also kill the
    # child before the local tier committed any step: the restore then comes from RAM.
    committed = re.search(r"committed before the kill: \[([0-9, ]*)\]", out.stdout)
    assert committed, out.stdout
    newest = max((int(s) for s in committed.group(1).split(",") if s.strip()), default=0)
    restores = [line for line in out.stdout.splitlines() if line.startswith("restore")]
    first = re.search(r"step (\d+) from the (\w+) tier", restores[0]) if restores else None
    assert len(restores) == 2 and first and int(first.group(1)) >= newest, out.stdout
    assert first.group(2) == "memory" or int(first.group(1)) == newest, out.stdout
    assert first.group(2) in (("memory", "local") if shm.shm_root() is not None else ("local",)), out.stdout
    assert "from the memory tier" in restores[1], out.stdout
    assert "IDENTICAL bit for bit" in out.stdout


def test_process_that_exits_with_saves_in_flight_finishes_them_first(tmp_path):
    """A script that saves and returns at once (no wait, no close) still leaves both saves committed
    and exits 0: the exit hook finishes the queued persists before the interpreter kills daemon
    threads (one killed inside torch's tensor deallocation used to abort the process)."""
    code = (
        "import sys, torch, ckpt\n"
        "ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1], max_in_flight=2),\n"
        "                       policy=ckpt.Policy(if_busy='wait'))  # both must land\n"
        "state = {'w': torch.arange(16 << 20, dtype=torch.float32)}\n"
        "ck.save(1, state)\n"
        "ck.wait_staged()\n"
        "state['w'] += 1\n"
        "ck.save(2, state)\n"
        "print('returning', flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    committed = sorted(int(p.name[5:]) for p in tmp_path.glob("step-*") if (p / "COMMIT").exists())
    assert committed == [1, 2], (committed, out.stderr)
    target = {"w": torch.empty(16 << 20)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path)) as ck:
        assert ck.restore(target) == 2
    assert torch.equal(target["w"], torch.arange(16 << 20, dtype=torch.float32) + 1)


def test_exit_wait_is_bounded_by_ckpt_exit_wait_s(tmp_path):
    """With CKPT_EXIT_WAIT_S=1 and a local write that hangs (injected: the disk stalls), the process
    still exits promptly, says which step it did not wait for, and leaves no committed (or torn) step."""
    code = (
        "import sys, time, torch, ckpt\n"
        "from ckpt.tiers import LocalTier\n"
        "LocalTier.write = lambda self, *a, **k: time.sleep(60)   # a stalled disk\n"
        "ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1]))\n"
        "ck.save(7, {'w': torch.ones(1024)})\n"
        "ck.wait_staged()\n"
    )
    env = dict(os.environ, CKPT_EXIT_WAIT_S="1")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=50
    )
    assert time.monotonic() - t0 < 40, "the exit hook did not stop waiting"
    assert "step(s) [7] finished persisting" in out.stderr and "CKPT_EXIT_WAIT_S" in out.stderr, out.stderr
    assert not [p for p in tmp_path.glob("step-*") if (p / "COMMIT").exists()]

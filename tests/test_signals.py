"""SIGTERM before a node drains: flag-only handler, forced durable save at the step boundary, exit 128+15."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt

HERE = Path(__file__).parent
STEPS = 40


def _spawn(local_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    return subprocess.Popen([sys.executable, str(HERE / "preempt_worker.py"), str(local_dir), str(STEPS), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_step(proc: subprocess.Popen, n: int) -> None:
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= n:
            return
    raise AssertionError(f"worker ended before step {n}: {proc.stderr.read()}")


def _final(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=120)
    lines = out.splitlines()
    assert proc.returncode == 0, err
    return next(l.split()[1] for l in lines if l.startswith("final")), next(l for l in lines if l.startswith("restored"))


def _committed(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.glob("step-*") if (p / "COMMIT").exists())


def test_sigterm_saves_exits_143_and_the_resumed_run_is_bit_identical(tmp_path):
    reference, _ = _final(_spawn(tmp_path / "ref"))
    d = tmp_path / "run"
    proc = _spawn(d)
    _wait_for_step(proc, 5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received" in err
    saved = _committed(d)
    assert len(saved) == 1 and 5 <= saved[0] < STEPS
    digest, restored = _final(_spawn(d))
    assert restored == f"restored {saved[0]}"
    assert digest == reference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_agree_when_only_one_receives_sigterm(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [_spawn(tmp_path / f"rank{r}", str(r), "2", env=env) for r in range(2)]
    for p in procs:
        _wait_for_step(p, 5)
    procs[1].send_signal(signal.SIGTERM)   # rank 0 never sees the signal
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 128 + signal.SIGTERM, err
    steps = [_committed(tmp_path / f"rank{r}") for r in range(2)]
    assert steps[0] == steps[1] and len(steps[0]) == 1, steps


def test_on_preempt_raise_and_handlers_are_restored(local_dir):
    before = signal.getsignal(signal.SIGUSR1)
    w = torch.zeros(4)
    with ckpt.Checkpointer(local_dir=local_dir, every_steps=1000, signals=(signal.SIGUSR1,),
                           on_preempt="raise") as ck:
        assert ck.maybe_save(1, {"w": w}) is None
        os.kill(os.getpid(), signal.SIGUSR1)   # the handler only sets the flag
        assert ck.preempted == signal.SIGUSR1 and ck.list() == []
        with pytest.raises(ckpt.Preempted, match="SIGUSR1: step 2 saved") as info:
            ck.maybe_save(2, {"w": w})
        assert info.value.durable and info.value.step == 2
        assert [i.step for i in ck.list()] == [2]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_bad_preemption_arguments_name_the_argument(local_dir):
    with pytest.raises(ValueError, match="drain_tier"):
        ckpt.Checkpointer(local_dir=local_dir, signals=(signal.SIGTERM,), drain_tier="remote")   # no url
    with pytest.raises(ValueError, match="drain_tier"):
        ckpt.Checkpointer(local_dir=local_dir, signals=(signal.SIGTERM,), drain_tier="tape")
    with pytest.raises(ValueError, match="on_preempt"):
        ckpt.Checkpointer(local_dir=local_dir, on_preempt="ignore")


def test_drain_to_the_remote_tier_waits_for_the_upload(tmp_path):
    w = torch.ones(1000)
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(url, local_dir=tmp_path / "local", every_steps=1000, signals=(signal.SIGUSR1,),
                           drain_tier="remote", on_preempt="raise") as ck:
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(ckpt.Preempted) as info:
            ck.maybe_save(7, {"w": w})
        assert info.value.durable
        assert ck.remote.committed_steps() == [7]

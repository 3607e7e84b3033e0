"""What a process says about the checkpoints and the RAM it leaves when it ends without a clean close."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckpt import shm

pytestmark = pytest.mark.skipif(shm.shm_root() is None, reason="needs a RAM file system for the memory tier")

_LOOP = """
import logging, os, signal, sys, time, torch, ckpt
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
state = {"w": torch.zeros(1 << 16)}
{open}
for step in range(1000):
    state["w"] = torch.full((1 << 16,), float(step))  # a new tensor: no write in place beside a copy
    ck.maybe_save(step, state)
    if step == 5:
        ck.wait()
        {end}
    time.sleep(0.01)
"""


@pytest.fixture(autouse=True)
def own_shm(monkeypatch):
    """A RAM file system directory of this test's own: no other test's segments are in sight."""
    import tempfile

    d = tempfile.mkdtemp(prefix="ckpt-exit-", dir=shm.shm_root())
    monkeypatch.setenv("CKPT_SHM_DIR", d)
    yield d
    shm.free(shm.shm_root())
    os.rmdir(d)


def _run(tmp_path, open_: str, end: str) -> subprocess.CompletedProcess:
    code = _LOOP.replace("{open}", open_).replace("{end}", end)
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "local")], capture_output=True, text=True, timeout=120
    )


def test_ctrl_c_in_the_with_block_says_once_what_it_waits_for_and_what_ram_it_keeps(tmp_path):
    code = _LOOP.replace(
        # if_busy="wait": a loaded machine's skipped snapshot would say so on the same logger
        "{open}",
        "with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1]),"
        " policy=ckpt.Policy(every_steps=1, if_busy='wait')) as ck:\n if True:",
    )
    code = (
        code.replace("\nfor step", "\n  for step")
        .replace("\n    state[", "\n      state[")
        .replace("\n    ck.maybe", "\n      ck.maybe")
        .replace("\n    if step", "\n      if step")
        .replace("\n        ck.wait()", "\n          ck.wait()")
        .replace("\n        {end}", "\n          os.kill(os.getpid(), signal.SIGINT)")
        .replace("\n    time.sleep", "\n      time.sleep")
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "local")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "KeyboardInterrupt" in out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING ckpt")]
    assert len([w for w in warnings if "ckpt.api" in w]) == 1, out.stderr  # one line: what the exit waits for
    assert len([w for w in warnings if "ckpt.tiers.memory" in w]) == 1, (
        out.stderr
    )  # the RAM kept, and how to free it
    assert "During handling of the above exception" not in out.stderr  # no chained traceback
    assert shm.prefix_for(tmp_path / "local", 0) is not None
    assert shm.segments(prefix=shm.prefix_for(tmp_path / "local", 0))  # kept for the next process


def test_a_process_that_never_closes_says_what_ram_it_keeps(tmp_path):
    out = _run(
        tmp_path,
        "ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1]),"
        " policy=ckpt.Policy(every_steps=1))",
        "sys.exit(0)",
    )
    assert out.returncode == 0, out.stderr
    kept = [line for line in out.stderr.splitlines() if line.startswith("WARNING ckpt.tiers.memory")]
    assert len(kept) == 1, out.stderr
    assert shm.segments(prefix=shm.prefix_for(tmp_path / "local", 0))
    shm.free(prefix=shm.prefix_for(tmp_path / "local", 0))


def test_a_clean_close_keeps_no_ram_and_says_nothing(tmp_path):
    out = _run(
        tmp_path,
        # if_busy='wait': on a loaded machine a save may find every buffer busy, a legitimate (logged) skip
        "ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1]),"
        " policy=ckpt.Policy(every_steps=1, if_busy='wait'))",
        "ck.close(); sys.exit(0)",
    )
    assert out.returncode == 0, out.stderr
    assert not [line for line in out.stderr.splitlines() if line.startswith("WARNING")], out.stderr
    assert shm.segments(prefix=shm.prefix_for(tmp_path / "local", 0)) == []

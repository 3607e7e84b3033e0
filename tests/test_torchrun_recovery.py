"""The torchrun recipe of docs/guides/launchers.md (``--max-restarts``) recovers from a killed worker.

The recipe's script runs under ``python -m torch.distributed.run --standalone --nproc-per-node 2
--max-restarts 2`` (two gloo ranks on the CPU), launched as the page says (with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). On the first attempt rank 1 SIGKILLs itself right after a snapshot
is in its memory tier; torchrun stops rank 0 and starts both again; each restarted rank must restore that
step from its memory tier and the job must end with the weights of a run that was never interrupted, bit for
bit. The failure is injected from outside the recipe (tests/elastic_worker.py wraps it), and every decision
is on files the workers write, never on log or exception text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt import shm

HERE = Path(__file__).parent
PAGE = HERE.parent / "docs" / "guides" / "launchers.md"
KILL_STEP = 15  # a multiple of the recipe's every_steps=5, well before its last step (39)

pytestmark = [
    pytest.mark.skipif(shm.shm_root() is None, reason="no RAM file system (/dev/shm) here"),
    pytest.mark.timeout(300),
]


def _recipe() -> str:
    blocks = re.findall(r"```python\n(# runnable-example: torchrun_elastic\n.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1, "launchers.md has one torchrun_elastic example"
    return blocks[0]


def _torchrun(tmp: Path, name: str, *kill: str) -> dict[int, dict]:
    """Run the recipe under torchrun as launchers.md launches it; returns what each rank reported at the end."""
    script, out = tmp / "train.py", tmp / name
    script.write_text(_recipe())
    out.mkdir()
    env = {
        **os.environ,
        "CKPT_LOCAL_DIR": str(tmp / f"{name}-ckpt"),
        "CUDA_VISIBLE_DEVICES": "",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # the page's launch line: see "Why" there
        "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        str(HERE / "elastic_worker.py"),
        str(script),
        str(out),
        *kill,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    reports = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)}
    if kill:
        assert (out / "killed-at").read_text() == kill[0]  # the first attempt's rank 1 did die by SIGKILL
    return reports


def test_a_worker_sigkilled_under_torchrun_resumes_from_ram_bit_identically(tmp_path):
    reference = _torchrun(tmp_path, "uninterrupted")
    assert [reference[r]["attempt"] for r in (0, 1)] == [0, 0] and reference[0]["restored"] is None
    killed = _torchrun(tmp_path, "killed", str(KILL_STEP))
    for r in (0, 1):
        assert killed[r]["attempt"] == 1  # the restarted attempt finished the run
        assert killed[r]["restored"] == [KILL_STEP, "memory"]
        assert killed[r]["digest"] == reference[r]["digest"]
    assert killed[0]["digest"] == killed[1]["digest"]  # DDP replicas


@pytest.mark.parametrize(
    "env, warns",
    [
        (
            {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"},
            True,
        ),  # torchrun's default
        (
            {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"},
            False,
        ),  # the variable set
        ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),  # no restarts
        (
            {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True", "LOCAL_RANK": "1"},
            False,
        ),
        ({}, False),  # not under torchrun
    ],
)
def test_a_launch_whose_restarts_would_reuse_the_store_is_warned_about(monkeypatch, caplog, env, warns):
    from ckpt import ranks

    for k in ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ranks, "_checked_elastic_store", False)
    caplog.set_level("WARNING", logger="ckpt.ranks")
    assert ranks.check_elastic_store() is warns
    assert [r.levelname for r in caplog.records if r.name == "ckpt.ranks"] == (["WARNING"] if warns else [])
    assert ranks.check_elastic_store() is False  # once per process

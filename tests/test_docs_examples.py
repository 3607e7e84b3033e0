"""The runnable examples of docs/examples.md run as they are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parent.parent / "docs"


def _examples() -> dict[str, str]:
    text = (DOCS / "examples.md").read_text()
    blocks = re.findall(r"```python\n(# runnable-example: (\w+)\n.*?)```", text, re.S)
    return {name: code for code, name in blocks}


def test_the_page_has_both_examples():
    assert set(_examples()) == {"plain_loop", "torchrun_job"}


def test_plain_loop_example_runs_and_resumes(tmp_path):
    script = tmp_path / "plain_loop.py"
    script.write_text(_examples()["plain_loop"])
    env = {**os.environ, "CKPT_LOCAL_DIR": str(tmp_path / "ck")}
    expected = [("resumed from step None", "checkpoints: [(40, ['memory', 'local']), (30, ['memory', 'local'])]"),
                ("resumed from step 40", "checkpoints: [(40, ['local']), (30, ['local'])]")]
    for resumed, listing in expected:   # the second run restores step 40 and trains steps 41 to 49
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        assert resumed in out.stdout and listing in out.stdout, out.stdout


def test_torchrun_example_runs_on_two_gloo_ranks(tmp_path):
    script = tmp_path / "torchrun_job.py"
    script.write_text(_examples()["torchrun_job"])
    env = {**os.environ, "CKPT_LOCAL_DIR": str(tmp_path / "ck"), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "newest checkpoint: 20" in out.stdout
    for r in range(2):
        assert (tmp_path / "ck" / f"rank-{r}" / "step-000000020" / "COMMIT").exists()
        # the other rank keeps a copy (peer tier); the job tier holds both ranks' files under one COMMIT
        assert (tmp_path / "ck" / f"rank-{1 - r}" / "peers" / f"rank-{r:05d}" / "step-000000020" / "COMMIT").exists()
    assert (tmp_path / "ck" / "job" / "step-000000020" / "COMMIT").exists()

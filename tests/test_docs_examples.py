"""The runnable examples of docs/examples.md run as they are."""

from __future__ import annotations

import ast
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
    # the last step, 49, is always kept (maybe_save(final=True)); the one before it is the newest earlier save
    # the local tier wrote: 40, or older when the tier was still busy with an older snapshot and newer ones
    # superseded each other (if_busy="skip": newest wins)
    runs = [("resumed from step None", ["memory", "local"]), ("resumed from step 49", ["local"])]
    for resumed, tiers in runs:   # the second run restores step 49 and trains nothing
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == resumed, out.stdout
        listing = ast.literal_eval(lines[1].removeprefix("checkpoints: "))
        assert listing[0] == (49, tiers) and len(listing) == 2, out.stdout
        assert listing[1][0] in (0, 10, 20, 30, 40) and listing[1][1] == tiers, out.stdout


def test_torchrun_example_runs_on_two_gloo_ranks(tmp_path):
    script = tmp_path / "torchrun_job.py"
    script.write_text(_examples()["torchrun_job"])
    env = {**os.environ, "CKPT_LOCAL_DIR": str(tmp_path / "ck"), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "newest checkpoint: 29" in out.stdout   # the last step (final=True), off the every_steps=10 cadence
    for r in range(2):
        assert (tmp_path / "ck" / f"rank-{r}" / "step-000000029" / "COMMIT").exists()
    # the job tier holds both ranks' files under one COMMIT (the peer tier's replicas were in RAM: freed at close)
    assert (tmp_path / "ck" / "job" / "step-000000029" / "COMMIT").exists()

"""Every code block of the docs is run by a test or marked as a fragment; the runnable examples of
docs/examples.md and docs/quickstart.md run as they are.

The convention, one for every page and the README: a code block whose first line is
``# runnable-example: NAME`` is run by the test listed for it in ``RUNNABLE``; any other block is a
fragment (a pattern, a command line, a log excerpt) and says so with a ``<!-- fragment -->`` line right
before its fence (invisible on GitHub and on the site)."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent / "docs"
ROOT = DOCS.parent

# (page, name) of every runnable example -> the test file that runs it
RUNNABLE = {
    ("examples.md", "plain_loop"): "tests/test_docs_examples.py",
    ("examples.md", "torchrun_job"): "tests/test_docs_examples.py",
    ("quickstart.md", "quickstart"): "tests/test_docs_examples.py",
    ("migrate-dcp.md", "migrate_dcp"): "tests/test_docs_examples.py",
    ("launchers.md", "torchrun_elastic"): "tests/test_torchrun_recovery.py",
    ("hf.md", "trainer"): "tests/test_hf.py",
    ("hf.md", "accelerate"): "tests/test_hf.py",
    ("export.md", "export"): "tests/test_export.py",
    ("export.md", "export_hf"): "tests/test_export.py",
    ("lightning.md", "lightning"): "tests/test_lightning.py",
}
FRAGMENT = "<!-- fragment -->"
_FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")


def _blocks(path: Path) -> list[tuple[int, str, str]]:
    """Each fenced code block of ``path``: (line number, the line before its fence, its first line)."""
    lines = path.read_text().splitlines()
    found, fence = [], None
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if fence is None and m:
            before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
            found.append((i + 1, before, lines[i + 1].strip() if i + 1 < len(lines) else ""))
            fence = m.group(2)
        elif fence is not None and m and m.group(2).startswith(fence) and not m.group(3).strip():
            fence = None
    return found


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_code_block_is_run_by_a_test_or_marked_as_a_fragment():
    unmarked, runnable = [], set()
    for path in _pages():
        for line, before, first in _blocks(path):
            if first.startswith("# runnable-example:"):
                runnable.add((path.name, first.split(":", 1)[1].strip()))
            elif before != FRAGMENT:
                unmarked.append(f"{path.relative_to(ROOT)}:{line}")
    assert not unmarked, (
        f"mark these blocks with a {FRAGMENT} line before the fence, or make them runnable: {unmarked}"
    )
    assert runnable == set(RUNNABLE), (
        "runnable examples without a test (add them to RUNNABLE and run them), or "
        f"listed ones that are gone: {runnable ^ set(RUNNABLE)}"
    )
    for (page, name), test in RUNNABLE.items():
        assert page in (ROOT / test).read_text(), f"{test} does not read {page}"


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
    for resumed, tiers in runs:  # the second run restores step 49 and trains nothing
        out = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == resumed, out.stdout
        listing = ast.literal_eval(lines[1].removeprefix("checkpoints: "))
        assert listing[0] == (49, tiers), out.stdout
        # then the local tier's one earlier checkpoint (keep=2), and the memory tier's earlier snapshots (three
        # buffers: the newest and up to two before it, in RAM only)
        earlier = listing[1:]
        assert 1 <= len(earlier) <= 2 and all(s in (0, 10, 20, 30, 40) for s, _ in earlier), out.stdout
        assert sum("local" in t for _, t in earlier) == 1, out.stdout


def test_torchrun_example_runs_on_two_gloo_ranks(tmp_path):
    script = tmp_path / "torchrun_job.py"
    script.write_text(_examples()["torchrun_job"])
    env = {**os.environ, "CKPT_LOCAL_DIR": str(tmp_path / "ck"), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "newest checkpoint: 29" in out.stdout  # the last step (final=True), off the every_steps=10 cadence
    for r in range(2):
        assert (tmp_path / "ck" / f"rank-{r}" / "step-000000029" / "COMMIT").exists()
    # the job tier holds both ranks' files under one COMMIT (the peer tier's replicas were in RAM: freed at close)
    assert (tmp_path / "ck" / "job" / "step-000000029" / "COMMIT").exists()


def _quickstart() -> str:
    blocks = re.findall(
        r"```python\n(# runnable-example: quickstart\n.*?)```", (DOCS / "quickstart.md").read_text(), re.S
    )
    assert len(blocks) == 1
    return blocks[0]


def test_quickstart_killed_midway_resumes_to_the_uninterrupted_runs_weights(tmp_path):
    """docs/quickstart.md as a new user runs it: once straight through; once SIGKILLed after a checkpoint
    was committed, then again. Both end with the same weights (model, optimizer, data order, dropout)."""
    pytest.importorskip("torchdata")
    script = tmp_path / "train.py"
    script.write_text(_quickstart())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def run(cwd: Path) -> list[str]:
        out = subprocess.run(
            [sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout.splitlines()

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    reference = run(straight)
    assert reference[0] == "starting at step 0" and reference[-1].startswith("weights: ")
    assert "(99, " in reference[-2], reference  # the final save is listed

    p = subprocess.Popen(
        [sys.executable, str(script)], cwd=killed, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        deadline = time.monotonic() + 240
        while not (killed / "ckpt-quickstart" / "step-000000020" / "COMMIT").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    resumed = run(killed)
    start = int(resumed[0].removeprefix("starting at step "))
    assert 20 < start < 100, resumed
    assert resumed[-1] == reference[-1]
    # the loss lines the resumed run printed are the uninterrupted run's
    assert [line for line in resumed if line.startswith("step ")] == [
        line for line in reference if line.startswith("step ") and int(line.split()[1]) >= start
    ]
    again = run(killed)  # a finished run trains nothing more and reports the same weights
    assert again[0] == "starting at step 100" and again[-1] == reference[-1]


def test_the_dcp_migration_guide_shows_the_silent_wrong_resume(tmp_path):
    """docs/guides/migrate-dcp.md: DCP with state_dict() resumes with no optimizer state and no error;
    DCP's state-dict helpers and a Checkpointer resume exactly."""
    text = (DOCS / "guides" / "migrate-dcp.md").read_text()
    code = re.findall(r"```python\n(# runnable-example: migrate_dcp\n.*?)```", text, re.S)[0]
    script = tmp_path / "migrate_dcp.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert [" ".join(line.split()) for line in out.stdout.splitlines()] == [
        "dcp, state_dict(): optimizer states 0; resumed exactly: False",
        "dcp, get_state_dict(): resumed exactly: True",
        "ckpt: optimizer states 2; resumed exactly: True",
    ]

"""The ``ckpt`` command on bad input: one ``ckpt: error: ...`` line on stderr, never a traceback.

Every subcommand is run as a real process (the installed console script, and ``python -m
ckpt.cli``) on a corrupt checkpoint, a missing step and a directory that does not exist.
Usage mistakes exit with status 2, operational failures with 1 (``verify`` keeps its documented
status 1 when a step fails its check, with its per-step report on stdout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import cli

CONSOLE = Path(sys.executable).parent / "ckpt"


def run(*args: str, module: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ckpt.cli", *args] if module else [str(CONSOLE), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def one_error_line(p: subprocess.CompletedProcess, status: int, *names: str) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == status, (p.returncode, p.stderr)
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("ckpt: error: "), p.stderr
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """good: steps 1 and 2; corrupt: step 1's manifest is not JSON; truncated: step 1's data file is
    short; nodata: step 1's data file is gone; remote: a file:// copy of good's step 2."""
    root = tmp_path_factory.mktemp("cli")
    out = {}
    for name in ("good", "corrupt", "truncated", "nodata"):
        d = root / name
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=d), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
        ) as ck:
            for s in (1, 2):
                ck.save(s, {"w": torch.full((5000,), float(s))}).wait()
        out[name] = d
    (out["corrupt"] / "step-000000001" / "rank-00000.manifest.json").write_text("{not json")
    data = out["truncated"] / "step-000000001" / "rank-00000.bin"
    with open(data, "r+b") as f:
        f.truncate(100)
    (out["nodata"] / "step-000000001" / "rank-00000.bin").unlink()
    out["remote"] = f"file://{root}/remote"
    ckpt.promote(2, "remote", local_dir=out["good"], url=out["remote"])
    out["missing"] = root / "does-not-exist"
    out["root"] = root
    return out


@pytest.mark.parametrize("which", ["corrupt", "truncated", "nodata"])
def test_inspect_of_a_damaged_step_is_one_line_naming_the_file(dirs, which):
    one_error_line(run("inspect", str(dirs[which]), "--step", "1"), 1, "step-000000001")


def test_inspect_of_a_missing_step_is_one_line(dirs):
    one_error_line(run("inspect", str(dirs["good"]), "--step", "7"), 1, "step-000000007")


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify", "gc"])
def test_a_directory_that_does_not_exist_is_one_line_and_is_not_created(dirs, cmd):
    one_error_line(run(cmd, str(dirs["missing"])), 1, str(dirs["missing"]))
    assert not dirs["missing"].exists()


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify"])
def test_a_url_that_does_not_exist_is_one_line_and_is_not_created(dirs, cmd):
    url = f"file://{dirs['root']}/no-remote"
    one_error_line(run(cmd, url), 1, "no-remote")
    assert not (dirs["root"] / "no-remote").exists()


def test_verify_of_a_damaged_step_reports_on_stdout_and_one_error_line(dirs):
    p = run("verify", str(dirs["truncated"]))
    one_error_line(p, 1, "1 of 2")
    assert "step 1: FAILED" in p.stdout and "step 2: OK" in p.stdout


def test_verify_of_a_missing_step_is_status_1(dirs):
    p = run("verify", str(dirs["good"]), "--step", "7")
    one_error_line(p, 1)
    assert "step 7: FAILED" in p.stdout


def test_promote_of_a_corrupt_step_is_one_line(dirs, tmp_path):
    one_error_line(
        run("promote", str(dirs["corrupt"]), f"file://{tmp_path}/r", "--step", "1", "--to", "remote"),
        1,
        "step-000000001",
    )


def test_promote_of_a_missing_step_is_one_line(dirs, tmp_path):
    one_error_line(
        run(
            "promote", str(dirs["good"]), f"file://{tmp_path}/r", "--step", "9", "--to", "remote", module=True
        ),
        1,
        "step-000000009",
    )
    one_error_line(
        run("promote", str(tmp_path / "dst"), dirs["remote"], "--step", "9", "--to", "local"),
        1,
        "step-000000009",
    )


@pytest.mark.parametrize(
    "args, names",
    [
        ([], []),
        (["nosuch"], ["nosuch"]),
        (["inspect"], ["dir"]),
        (["inspect", "D", "--step", "x"], ["--step"]),
        (["gc", "D", "--keep", "many"], ["--keep"]),
        (["ls", "D", "--storage-options", "{not json"], ["--storage-options"]),
        (["ls", "D", "--storage-options", "[1, 2]"], ["--storage-options"]),
        (["promote", "D", "file:///x", "--step", "1", "--to", "elsewhere"], ["--to"]),
        (["demo", "--steps", "x"], ["--steps"]),
    ],
)
def test_usage_mistakes_are_status_2_and_one_line(dirs, args, names):
    args = [str(dirs["good"]) if a == "D" else a for a in args]
    one_error_line(run(*args), 2, *names)


def test_a_rank_the_step_does_not_have_is_a_usage_error(dirs):
    one_error_line(run("inspect", dirs["remote"], "--rank", "3", module=True), 2, "--rank")


def test_debug_shows_the_traceback(dirs):
    p = run("--debug", "inspect", str(dirs["corrupt"]), "--step", "1")
    assert p.returncode == 1
    assert "Traceback (most recent call last)" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("ckpt: error: ")
    p = run("inspect", str(dirs["corrupt"]), "--step", "1", "--debug")  # after the subcommand too
    assert p.returncode == 1 and "Traceback (most recent call last)" in p.stderr


def test_an_unexpected_exception_is_one_line_with_a_hint_to_rerun_with_debug(dirs, monkeypatch, capsys):
    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr(cli, "_ls", broken)
    assert cli.main(["ls", str(dirs["good"])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and err[0].startswith("ckpt: error: ") and "KeyError" in err[0] and "--debug" in err[0]
    )
    assert cli.main(["--debug", "ls", str(dirs["good"])]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_good_input_still_succeeds_quietly(dirs):
    p = run("inspect", str(dirs["good"]))
    assert p.returncode == 0 and p.stderr == "" and "step 2" in p.stdout


def test_export_of_a_corrupt_or_missing_step_is_one_line_and_writes_nothing(dirs, tmp_path):
    for which, step in (("corrupt", "1"), ("truncated", "1"), ("nodata", "1"), ("good", "7")):
        one_error_line(
            run("export", str(dirs[which]), str(tmp_path / which), "--step", step), 1, f"step-00000000{step}"
        )
        assert not (tmp_path / which).exists()
    one_error_line(run("export", str(dirs["missing"]), str(tmp_path / "m")), 1, str(dirs["missing"]))
    assert not dirs["missing"].exists() and not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_export_over_an_existing_destination_is_one_line_naming_force(dirs, tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    one_error_line(run("export", str(dirs["good"]), str(dest)), 1, str(dest), "--force")
    assert list(dest.iterdir()) == []
    p = run("export", str(dirs["good"]), str(dest), "--force")
    assert p.returncode == 0 and p.stderr == "" and (dest / "model.safetensors").is_file()


def test_export_with_a_key_the_state_lacks_is_one_line(dirs, tmp_path):
    one_error_line(run("export", str(dirs["good"]), str(tmp_path / "o"), "--key", "nope"), 1, "'nope'", "key")


@pytest.mark.parametrize(
    "args, names",
    [
        (["export", "D"], ["dest"]),
        (["export", "D", "OUT", "--format", "zip"], ["--format"]),
        (["export", "D", "OUT", "--max-shard-size", "lots"], ["--max-shard-size"]),
        (["export", "D", "OUT", "--dtype", "int8"], ["--dtype"]),
        (["verify", "D", "--no-progress", "--step", "x"], ["--step"]),
        (["ls", "file:///x", "--url", "file:///y"], ["--url"]),
    ],
)
def test_export_and_progress_usage_mistakes_are_status_2_and_one_line(dirs, tmp_path, args, names):
    args = [str(dirs["good"]) if a == "D" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    one_error_line(run(*args), 2, *names)
    assert not (tmp_path / "out").exists()

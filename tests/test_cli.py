"""The ``ckpt`` command line on a real local tier."""

from __future__ import annotations

import json

import torch

import ckpt
from ckpt.cli import main


def _two_steps(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((1000,), float(s)), "note": "x"}).wait()


def test_ls_lists_committed_steps_newest_first(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["ls", str(local_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [2, 1]


def test_inspect_shows_the_tensors(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["inspect", str(local_dir)]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and "float32" in out and "[1000]" in out


def test_verify_fails_on_a_flipped_bit(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["verify", str(local_dir)]) == 0
    data = local_dir / "step-000000001" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 1
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(local_dir), "--json"]) == 1
    res = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert res[2]["ok"] and not res[1]["ok"] and "checksum" in res[1]["error"]


def test_gc_keeps_the_newest(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["gc", str(local_dir), "--keep", "1"]) == 0
    assert [p.name for p in local_dir.glob("step-*")] == ["step-000000002"]


def test_promote_to_a_file_url_and_back(local_dir, tmp_path, capsys):
    _two_steps(local_dir)
    url = f"file://{tmp_path}/remote"
    assert main(["promote", str(local_dir), url, "--step", "2", "--to", "remote"]) == 0
    other = tmp_path / "other"
    assert main(["promote", str(other), url, "--step", "2", "--to", "local"]) == 0
    assert main(["verify", str(other), "--step", "2"]) == 0


# ---------------------------------------------------------------------------------------------
# Progress bars, ls, help, export: the real ``ckpt`` entry point in a subprocess

import os  # noqa: E402
import pty  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CONSOLE = Path(sys.executable).parent / "ckpt"
COMMANDS = ("demo", "ls", "inspect", "verify", "gc", "promote", "export")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CONSOLE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def _run_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """``ckpt args`` with stderr on a pseudo-terminal (stdout a pipe): (status, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    p = subprocess.Popen(
        [str(CONSOLE), *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    os.close(slave)
    got = b""
    while True:
        try:
            block = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not block:
            break
        got += block
    out = p.stdout.read().decode()
    p.wait(timeout=300)
    os.close(master)
    return p.returncode, out, got.decode(errors="replace")


@pytest.fixture
def tiers(tmp_path):
    """A local_dir with steps 1 and 2 of 3 MB each, step 2 also on a file:// remote tier."""
    local = tmp_path / "local"
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((750_000,), float(s)), "note": "x"}).wait()
    url = f"file://{tmp_path}/remote"
    ckpt.promote(2, "remote", local_dir=local, url=url)
    return local, url, tmp_path


def _bar_cases(local, url, tmp):
    return {
        "verify": (["verify", str(local), "--step", "2"], "verify step 2"),
        "gc": (["gc", str(local), "--keep", "1", "--dry-run"], "verify step 2"),
        "promote-remote": (["promote", str(local), url, "--step", "1", "--to", "remote"], "promote step 1"),
        "promote-local": (
            ["promote", str(tmp / "other"), url, "--step", "2", "--to", "local"],
            "promote step 2",
        ),
        "export": (["export", str(local), str(tmp / "out")], "export step 2"),
    }


@pytest.mark.parametrize("case", ["verify", "gc", "promote-remote", "promote-local", "export"])
def test_a_progress_bar_with_bytes_and_rate_is_drawn_on_a_terminal(tiers, case):
    args, desc = _bar_cases(*tiers)[case]
    status, out, terminal = _run_on_a_terminal(*args)
    assert status == 0, terminal
    assert desc in terminal and "2.86M" in terminal and "B/s" in terminal, terminal  # its size, the rate
    assert "\r" in terminal and desc not in out  # drawn in place on stderr; stdout keeps the plain report


@pytest.mark.parametrize("case", ["verify", "gc", "promote-remote", "promote-local", "export"])
def test_no_bar_when_stderr_is_not_a_terminal(tiers, case):
    args, desc = _bar_cases(*tiers)[case]
    p = _run(*args)
    assert p.returncode == 0 and p.stderr == "", p.stderr


@pytest.mark.parametrize("flag", ["--json", "--no-progress"])
def test_no_bar_with_json_or_no_progress_even_on_a_terminal(tiers, flag):
    local, url, tmp = tiers
    for args in (["verify", str(local)], ["export", str(local), str(tmp / f"out{flag}")]):
        status, out, terminal = _run_on_a_terminal(*args, flag)
        assert status == 0 and "B/s" not in terminal and terminal.strip() == "", terminal
        if flag == "--json":
            json.loads(out)


def test_the_byte_counter_sees_each_byte_once_and_is_off_by_default(tiers):
    from ckpt import integrity
    from ckpt.progress import Progress, counting
    from ckpt.tiers import LocalTier

    local, url, tmp = tiers
    tier = LocalTier(local)
    data = tier.open(2)[1].data_bytes
    records = 64 << 10  # COMMIT and manifests are checksummed too: a few hundred bytes each
    assert integrity.on_bytes is None
    with counting(Progress(data, "", False)) as p:
        tier.verify(2)
    assert data <= p.done <= data + records  # the data once (and the records)
    with counting(Progress(data, "", False, weight=0.5)) as p:  # as `ckpt promote --to local` counts
        ckpt.promote(2, "local", local_dir=tmp / "down", url=url)
    assert data <= p.done <= data + records
    assert integrity.on_bytes is None


def test_ls_shows_tiers_age_and_which_step_a_restore_picks(tiers):
    local, url, tmp = tiers
    p = _run("ls", str(local), "--url", url, "--json")
    rows = {r["step"]: r for r in json.loads(p.stdout)}
    assert rows[2]["tiers"] == ["local", "remote"] and rows[1]["tiers"] == ["local"]
    assert rows[2]["restore"] == "local" and rows[1]["restore"] is None
    assert all(0 <= r["age_s"] < 600 and r["bytes"] > 3_000_000 for r in rows.values())
    human = _run("ls", str(local), "--url", url).stdout.splitlines()
    assert "tiers" in human[0] and "age" in human[0]
    line2 = next(l for l in human if l.split()[0] == "2")
    assert "local,remote" in line2 and "<- restore picks this (local tier)" in line2
    assert "restore" not in next(l for l in human if l.split()[0] == "1")
    # the newest local copy loses its data file: a restore takes it from the remote tier
    (local / "step-000000002" / "rank-00000.bin").unlink()
    rows = {r["step"]: r for r in json.loads(_run("ls", str(local), "--url", url, "--json").stdout)}
    assert rows[2]["restore"] == "remote"
    # without the remote tier, the older step
    rows = {r["step"]: r for r in json.loads(_run("ls", str(local), "--json").stdout)}
    assert rows[2]["restore"] is None and rows[1]["restore"] == "local"


def test_ls_never_marks_the_abandoned_branch(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.zeros(3)}).wait()
        ck.restore({"w": torch.zeros(3)}, step=1)  # a rollback: the next save starts timeline 1
        ck.save(2, {"w": torch.ones(3)}).wait()
    rows = json.loads(_run("ls", str(local_dir), "--json").stdout)
    assert [(r["step"], r["timeline"], r["abandoned"], r["restore"]) for r in rows] == [
        (2, 1, False, "local"),
        (1, 0, False, None),
        (3, 0, True, None),
    ]  # one directory per step: 2 replaced


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_shows_an_example(cmd):
    p = _run(cmd, "--help")
    assert p.returncode == 0 and "examples:" in p.stdout and f"\n  ckpt {cmd}" in p.stdout, p.stdout


def test_top_level_help_lists_every_command_with_examples():
    p = _run("--help")
    assert p.returncode == 0 and "examples:" in p.stdout
    assert all(c in p.stdout for c in COMMANDS)


def test_export_from_the_command_line(tiers):
    from safetensors.torch import load_file

    local, url, tmp = tiers
    p = _run("export", url, str(tmp / "w"), "--key", "w", "--json")
    info = json.loads(p.stdout)
    assert p.returncode == 0 and info["step"] == 2 and info["files"] == ["model.safetensors"]
    assert torch.equal(load_file(tmp / "w" / "model.safetensors")["w"], torch.full((750_000,), 2.0))
    p = _run(
        "export", str(local), str(tmp / "s.pt"), "--format", "torch", "--step", "1", "--dtype", "bfloat16"
    )
    assert p.returncode == 0 and "exported step 1" in p.stdout and "s.pt" in p.stdout
    got = torch.load(tmp / "s.pt", weights_only=True)
    assert got["note"] == "x" and torch.equal(got["w"], torch.ones(750_000, dtype=torch.bfloat16))
    assert got["w"].dtype == torch.bfloat16
    p = _run("export", str(local), str(tmp / "sh"), "--max-shard-size", "1MB")
    # one 3 MB tensor over a 1 MB limit: a file of its own, which is all there is
    assert p.returncode == 0 and sorted(f.name for f in (tmp / "sh").iterdir()) == ["model.safetensors"]


# -- polish: JSON everywhere it is offered, hints, exact errors ------------------------------------------


def test_gc_json_prints_json(local_dir, capsys):
    _two_steps(local_dir)
    capsys.readouterr()
    assert main(["gc", str(local_dir), "--keep", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["removed"] == [1] and out["kept_verified"] == 2 and out["dry_run"] is False


def test_gc_memory_json_prints_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CKPT_SHM_DIR", str(tmp_path))  # an empty RAM directory of its own
    capsys.readouterr()
    assert main(["gc", "--memory", "--json", "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["freed_bytes"] == 0 and out["removed"] == [] and out["dry_run"] is True


def test_every_option_a_commands_help_names_is_one_it_takes(capsys):
    import re

    for cmd in ("ls", "inspect", "verify", "gc", "promote", "export"):
        capsys.readouterr()
        try:
            main([cmd, "--help"])
        except SystemExit:
            pass
        text = capsys.readouterr().out
        usage = text.split("\n\n", 1)[0] + text.split("options:", 1)[1].split("examples:", 1)[0]
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", text))
        taken = set(re.findall(r"^\s+(--[a-z][a-z-]+)", usage, re.M)) | {"--help"}
        assert named <= taken, (cmd, named - taken)


def test_promote_json(local_dir, tmp_path, capsys):
    _two_steps(local_dir)
    capsys.readouterr()
    assert (
        main(["promote", str(local_dir), f"file://{tmp_path}/r", "--step", "2", "--to", "remote", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["copied"] is True and out["step"] == 2


def test_ls_of_a_dcp_checkpoint_directory_hints_dcp(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from ckpt.integrations.dcp import TierStorageWriter

    dcp.save({"w": torch.ones(3)}, storage_writer=TierStorageWriter(local_dir=tmp_path), checkpoint_id="c1")
    capsys.readouterr()
    assert main(["ls", str(tmp_path)]) == 0
    assert "--dcp" in capsys.readouterr().err


def test_inspect_of_a_step_that_never_existed_is_file_not_found(local_dir, capsys):
    _two_steps(local_dir)
    capsys.readouterr()
    assert main(["inspect", str(local_dir), "--step", "7", "--debug"]) == 1
    assert (
        "FileNotFoundError" in capsys.readouterr().err
    )  # the traceback's type, not IncompleteCheckpointError


def test_promote_with_zstd_prints_no_warning(local_dir, tmp_path):
    import subprocess
    import sys

    _two_steps(local_dir)
    p = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::UserWarning",
            "-m",
            "ckpt.cli",
            "promote",
            str(local_dir),
            f"file://{tmp_path}/r",
            "--step",
            "2",
            "--to",
            "remote",
            "--compression",
            "zstd",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr


_NO_TORCH = r"""
import sys
from ckpt.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:   # --help
    rc = e.code
sys.stdout.flush()
print("RC", rc, "torch" in sys.modules, file=sys.stderr)
"""


def test_the_commands_that_only_read_files_do_not_import_torch(local_dir, tmp_path):
    """``--help``, ``ls``, ``inspect``, ``verify`` and ``gc`` on a local and a remote tier start in a fraction of
    the seconds importing torch takes (with no memory-tier snapshots in RAM to list)."""
    import subprocess
    import sys

    _two_steps(local_dir)
    url = f"file://{tmp_path}/r"
    ckpt.promote(2, "remote", local_dir=local_dir, url=url)
    (tmp_path / "shm").mkdir()
    env = {**__import__("os").environ, "CKPT_SHM_DIR": str(tmp_path / "shm")}
    for args in (
        ["--help"],
        ["ls", "--help"],
        ["export", "--help"],
        ["demo", "--help"],
        ["ls", str(local_dir)],
        ["ls", url],
        ["inspect", str(local_dir)],
        ["inspect", url],
        ["verify", str(local_dir)],
        ["verify", url],
        ["gc", str(local_dir), "--keep", "1"],
        ["gc", url, "--dry-run"],
        ["gc", "--memory", "--dry-run"],
    ):
        p = subprocess.run(
            [sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert p.stderr.splitlines()[-1] == "RC 0 False", (args, p.stderr[-2000:])


def test_import_ckpt_still_gives_every_public_name():
    import subprocess
    import sys

    code = (
        "import ckpt; missing = [n for n in ckpt.__all__ if not hasattr(ckpt, n)]; "
        "assert not missing, missing; assert callable(ckpt.export) and callable(ckpt.promote)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

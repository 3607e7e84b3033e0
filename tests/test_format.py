"""The code is formatted by ruff (line length 110, pyproject.toml): `ruff format` leaves every file as it is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    exe = shutil.which("ruff")
    if exe is not None:
        return [exe]
    try:
        import ruff  # noqa: F401 - the dev extra installs it as a module with its binary
    except ImportError:
        return None
    return [sys.executable, "-m", "ruff"]


def test_the_code_is_formatted():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run(
        ruff + ["format", "--check", "ckpt", "kernels", "integrations", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, f"run `ruff format` (the files it would change):\n{out.stdout}{out.stderr}"

"""mypy passes on the docs' runnable examples against ckpt's public API (``py.typed``).

The examples are type-checked as the library ships: ``ckpt`` and its ``ckpt.kernels`` /
``ckpt.integrations`` folders laid out as the wheel installs them (the checkout keeps the last two at the
top level, which mypy does not map), third-party packages taken as untyped (``follow_imports = skip``) so
that what is checked is the use of ``ckpt``: its names, arguments and return types (``restore`` returns
``int | None``, say). A few seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY = [
    "torch",
    "transformers",
    "lightning",
    "accelerate",
    "torchdata",
    "safetensors",
    "numpy",
    "triton",
    "fsspec",
    "s3fs",
    "pyarrow",
]


def _examples() -> dict[str, str]:
    found = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for code, name in re.findall(
            r"```python\n(# runnable-example: (\w+)\n.*?)```", page.read_text(), re.S
        ):
            found[name] = code
    return found


def test_mypy_passes_on_the_docs_runnable_examples(tmp_path):
    pytest.importorskip("mypy")
    package = tmp_path / "src" / "ckpt"
    package.mkdir(parents=True)
    for entry in (ROOT / "ckpt").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in ("kernels", "integrations"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    examples = tmp_path / "examples"
    examples.mkdir()
    found = _examples()
    assert len(found) >= 8, sorted(found)
    for name, code in found.items():  # example_*: a file named accelerate.py would import itself
        (examples / f"example_{name}.py").write_text(code)
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\npython_version = 3.11\nfollow_imports = silent\nignore_missing_imports = True\n"
        f"[mypy-{','.join(m + '.*' for m in THIRD_PARTY)}]\nfollow_imports = skip\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            str(examples),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MYPYPATH": str(tmp_path / "src")},
    )
    assert out.returncode == 0, out.stdout + out.stderr

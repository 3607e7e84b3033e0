"""Packaging contracts: one import root, light imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def test_import_ckpt_does_not_import_triton_lightning_or_s3fs():
    code = (
        "import sys, ckpt, ckpt.integrations; "
        "bad = [m for m in ('triton', 'lightning', 'pytorch_lightning', 's3fs') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kernels_and_integrations_live_under_ckpt_only():
    assert importlib.util.find_spec("ckpt.kernels") is not None
    assert importlib.util.find_spec("ckpt.integrations") is not None
    for top in ("kernels", "integrations"):
        spec = importlib.util.find_spec(top)
        assert spec is None or "site-packages" not in (spec.origin or ""), f"top-level {top} installed"


def test_public_names_are_listed():
    import ckpt

    for name in ckpt.__all__:
        assert hasattr(ckpt, name), name


def test_wheel_ships_every_module(tmp_path):
    """A non-editable install must carry every module of the source tree.

    Editable installs hide a missing ``packages`` entry (the source folder is on
    the path); a wheel does not. Build one and compare its file list with the
    tree: ckpt/** as is, kernels/** and integrations/** under ckpt/.
    """
    import pathlib
    import zipfile

    pytest = __import__("pytest")
    setuptools = pytest.importorskip("setuptools")
    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1):  # bdist_wheel moved into setuptools in 70.1
        pytest.importorskip("wheel")
    import shutil

    root = pathlib.Path(__file__).resolve().parents[1]
    # Build from a copy: setuptools reuses a build/ folder left in the
    # checkout, which would still hold modules the configuration now misses.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (root / name).exists():
            shutil.copy(root / name, src / name)
    for name in ("ckpt", "kernels", "integrations"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    wheels = list(tmp_path.glob("tierckpt-*.whl"))
    assert len(wheels) == 1, wheels
    shipped = set(zipfile.ZipFile(wheels[0]).namelist())
    expected = set()
    for src, dst in (("ckpt", "ckpt"), ("kernels", "ckpt/kernels"), ("integrations", "ckpt/integrations")):
        for f in (root / src).rglob("*.py"):
            rel = f.relative_to(root / src).as_posix()
            if src == "ckpt" and rel.startswith(("kernels/", "integrations/")):
                continue
            expected.add(f"{dst}/{rel}")
    missing = sorted(expected - shipped)
    assert not missing, f"wheel lacks {missing}: add their packages to [tool.setuptools] packages"

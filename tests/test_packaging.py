"""Packaging contracts: one import root, light imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def test_import_ckpt_does_not_import_triton_lightning_or_s3fs():
    code = ("import sys, ckpt, ckpt.integrations; "
            "bad = [m for m in ('triton', 'lightning', 'pytorch_lightning', 's3fs') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
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

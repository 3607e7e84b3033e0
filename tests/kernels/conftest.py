"""Kernel tests: run the Triton kernels through the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before Triton is first imported (Triton fixes the mode
of its own ``tl`` helpers at import), so it is set here, at conftest import time, which
pytest reaches before it imports any test module under ``tests/kernels``.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

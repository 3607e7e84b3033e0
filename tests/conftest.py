"""Shared fixtures and marker handling.

Markers: ``gpu`` (needs CUDA), ``multigpu`` (two or more GPUs), ``s3`` (a
real S3 server on loopback), ``slow`` (runs only when selected with
``-m slow`` or ``CKPT_SLOW=1``).
"""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("-m") or ""
    run_slow = "slow" in markexpr or os.environ.get("CKPT_SLOW") == "1"
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: select with -m slow or CKPT_SLOW=1"))
        if "gpu" in item.keywords and ngpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)"))
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture
def local_dir(tmp_path):
    d = tmp_path / "local"
    d.mkdir()
    return d

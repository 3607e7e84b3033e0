"""Shared fixtures and marker handling.

Markers: ``gpu`` (needs CUDA), ``multigpu`` (two or more GPUs), ``s3`` (a
real S3 server on loopback), ``slow`` (runs only when selected with
``-m slow`` or ``CKPT_SLOW=1``).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """The memory tier's shared-memory segments of this session (and of the processes its tests start)
    go to a directory of their own in the RAM file system, removed at the end: a test that kills a
    training process on purpose leaves its segments, as it should, and they must not pile up."""
    # under pytest-xdist each worker gets a directory of its own (it inherits the controller's variable):
    # the RAM each worker's tests leave is its own to free after each test
    inherited = os.environ.get("_CKPT_TESTS_SHM_DIR")
    if hasattr(config, "workerinput") and inherited and os.environ.get("CKPT_SHM_DIR") == inherited:
        os.environ.pop("CKPT_SHM_DIR")
    if "CKPT_SHM_DIR" not in os.environ and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = tempfile.mkdtemp(prefix="ckpt-tests-", dir="/dev/shm")
        os.environ["CKPT_SHM_DIR"] = os.environ["_CKPT_TESTS_SHM_DIR"] = config._ckpt_shm_dir = d


@pytest.fixture(autouse=True)
def _free_the_ram_of_dead_test_jobs(request):
    """After each test, the memory-tier segments that no live process uses any more (a worker the test
    killed, a Checkpointer closed keeping its RAM) are freed: the next test's jobs then start on a node as
    clean as a real one, instead of one where hundreds of dead jobs left RAM (which every job's first save
    looks at, and names)."""
    yield
    root = getattr(request.config, "_ckpt_shm_dir", None)
    if root is None or os.environ.get("CKPT_SHM_DIR") != root:
        return
    from ckpt import shm

    for o in shm.orphans():
        shm.free(None, o.group.prefix)


def pytest_unconfigure(config: pytest.Config) -> None:
    d = getattr(config, "_ckpt_shm_dir", None)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)
        os.environ.pop("CKPT_SHM_DIR", None)
        os.environ.pop("_CKPT_TESTS_SHM_DIR", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("-m") or ""
    run_slow = "slow" in markexpr or os.environ.get("CKPT_SLOW") == "1"
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: select with -m slow or CKPT_SLOW=1"))
        if item.get_closest_marker("gpu") and ngpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)"))
        if item.get_closest_marker("multigpu") and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture(autouse=True)
def _torch_global_modes():
    """Each test starts from torch's default global modes and leaves them so: a real Lightning
    ``Trainer(deterministic=True)`` turns ``torch.use_deterministic_algorithms`` on for the whole
    process and never turns it off, which changed what later tests ran (torch then fills new memory,
    and has no fill for some dtypes). Tests of those modes (and of ``torch.set_default_device``) set
    them themselves."""
    det = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(det[0], warn_only=det[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.set_default_device(None)


@pytest.fixture
def local_dir(tmp_path):
    d = tmp_path / "local"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 at a free port, for the whole session."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    from s3server import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield port
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the session's S3 server; returns (bucket, port)."""
    import re

    import s3fs
    from s3server import storage_options

    import uuid

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:30].strip("-") + "-" + uuid.uuid4().hex[:12]
    fs = s3fs.S3FileSystem(**storage_options(s3_server), skip_instance_cache=True)
    fs.mkdir(name)
    yield name, s3_server


@pytest.fixture(params=["s3fs", "arrow"])
def s3_client(request, monkeypatch):
    """Each S3 client the remote tier can use (``CKPT_S3_BACKEND``): s3fs, and pyarrow's where installed."""
    if request.param == "arrow":
        pytest.importorskip("pyarrow")
    monkeypatch.setenv("CKPT_S3_BACKEND", request.param)
    return request.param


@pytest.fixture
def slow_staging(monkeypatch):
    """CPU staging copies that take 50 ms each (:func:`helpers.delay_staging`)."""
    from helpers import delay_staging

    delay_staging(monkeypatch, 0.05)


@pytest.fixture(scope="module")
def frozen_heap():
    """The objects alive when a module starts are left out of the garbage collector's passes until it ends
    (``gc.freeze``); what its tests create is collected as usual. Hugging Face's ``Trainer`` collects
    (``gc.collect()``, three times per ``train()``: accelerate's ``clear_device_cache``), and late in the
    suite this process holds millions of objects (every library the suite imports): each collection took
    seconds, ten times the tiny training run it belonged to."""
    gc.freeze()
    yield
    gc.unfreeze()

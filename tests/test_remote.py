"""The remote tier against a real S3 server (moto's server mode on loopback) and file:// / memory://."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import knobs
from helpers import DiskLog
from s3server import FaultProxy, storage_options

HERE = Path(__file__).parent
CHUNK = 256 << 10


def _state(seed: float, n: int = 300_000) -> dict:
    return {
        "w": torch.arange(n, dtype=torch.float32).mul_(0.001).add_(seed),
        "step": int(seed),
        "h": torch.full((n // 3,), seed, dtype=torch.bfloat16),
    }


def _target(n: int = 300_000) -> dict:
    return {"w": torch.empty(n), "step": None, "h": torch.empty(n // 3, dtype=torch.bfloat16)}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["h"], b["h"])


@pytest.fixture(autouse=True)
def small_chunks():
    with knobs.override(CKPT_CHUNK_BYTES=CHUNK):
        yield


_ARROW_SLOW = {
    "test_a_remote_outage_at_restart_resumes_from_local_and_saves_report_it",
    "test_transient_server_faults_are_retried_and_the_save_completes",
    "test_a_store_answering_5xx_at_start_is_an_outage_not_a_configuration_error",
    "test_a_new_run_in_a_bucket_named_like_bucket_starts",
    "test_sigkill_mid_upload_leaves_no_visible_step_and_the_previous_restorable",
    "test_a_read_error_on_a_remote_part_names_the_part_not_the_local_dir",
    "test_an_unreachable_endpoint_is_named_not_called_a_missing_bucket",
}


def pytest_generate_tests(metafunc):
    """Every test runs through each client that can serve its store (ckpt.fs): s3fs and pyarrow's S3 for the
    ``s3`` tests, fsspec's and pyarrow's local file system for the others."""
    s3 = metafunc.definition.get_closest_marker("s3") is not None
    # the tests that take seconds a case run pyarrow's client with -m slow (tests/test_arrow.py and the cheaper
    # tests here run it in the default suite)
    arrow = (
        pytest.param("arrow", marks=pytest.mark.slow)
        if metafunc.definition.originalname in _ARROW_SLOW
        else "arrow"
    )
    metafunc.parametrize("backend", ["s3fs", arrow] if s3 else ["fsspec", arrow], indirect=True)


@pytest.fixture(autouse=True)
def backend(request, monkeypatch):
    """The backend of this run, chosen through the environment (so child processes use it too)."""
    if request.param == "arrow":
        pytest.importorskip("pyarrow")
    s3 = request.node.get_closest_marker("s3") is not None
    monkeypatch.setenv("CKPT_S3_BACKEND" if s3 else "CKPT_FILE_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_round_trip_through_fsspec_urls(tmp_path, scheme, compression):
    url = (
        f"file://{tmp_path}/remote" if scheme == "file" else f"memory://ckpt-test-{os.getpid()}-{compression}"
    )
    with ckpt.Checkpointer(url, local_dir=tmp_path / "a", compression=compression) as ck:
        h = ck.save(3, _state(3.0)).wait()
        assert h.done("remote") and h.stats.persist_s["remote"] > 0
    target = _target()
    with ckpt.Checkpointer(url, local_dir=tmp_path / "b") as ck:
        assert ck.restore(target) == 3 and ck.last_restore.tier == "remote"
    assert _same(target, _state(3.0))


@pytest.mark.s3
def test_s3_round_trip_refills_the_local_tier(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url, opts = f"s3://{bucket}/run", storage_options(port)
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "a", compression="zstd") as ck:
        ck.save(1, _state(1.0)).wait()
        ck.save(2, _state(2.0)).wait()
        assert [(i.step, i.tiers) for i in ck.list()][0] == (2, ["memory", "local", "remote"])
    fresh = tmp_path / "fresh"  # a replaced node: nothing local
    target = _target()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=fresh) as ck:
        assert ck.restore(target) == 2 and ck.last_restore.tier == "remote"
        assert _same(target, _state(2.0))
        assert (fresh / "step-000000002" / "COMMIT").exists()
        target = _target()
        assert ck.restore(target) == 2 and ck.last_restore.tier == "local"  # filled on the way
        assert _same(target, _state(2.0))


@pytest.mark.s3
def test_a_corrupted_object_is_detected_and_restore_falls_back(tmp_path, s3_bucket):
    import s3fs

    bucket, port = s3_bucket
    url, opts = f"s3://{bucket}/run", storage_options(port)
    with ckpt.Checkpointer(
        url, storage_options=opts, local_dir=tmp_path / "a", keep=ckpt.Retention(remote=None)
    ) as ck:
        ck.save(1, _state(1.0)).wait()
        ck.save(2, _state(2.0)).wait()
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    part = f"{bucket}/run/step-000000002/rank-00000/part-000001"
    raw = bytearray(fs.cat_file(part))
    raw[100] ^= 0xFF
    fs.pipe_file(part, bytes(raw))
    target = _target()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "b") as ck:
        with pytest.warns(RuntimeWarning, match="part-000001"):
            assert ck.restore(target) == 1
    assert _same(target, _state(1.0))
    assert not (tmp_path / "b" / "step-000000002").exists(), (
        "a corrupt download must not be committed locally"
    )


@pytest.mark.s3
def test_a_missing_bucket_names_storage_options(tmp_path, s3_server):
    with pytest.raises(OSError, match="storage_options"):
        ckpt.Checkpointer(
            "s3://no-such-bucket-here/run", storage_options=storage_options(s3_server), local_dir=tmp_path
        )


@pytest.mark.s3
def test_bad_credentials_name_storage_options(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    proxy.faults.forbid = True
    try:
        with pytest.raises(OSError, match="storage_options"):
            ckpt.Checkpointer(
                f"s3://{bucket}/run",
                local_dir=tmp_path,
                storage_options=storage_options(proxy.port, key="wrong", secret="wrong"),
            )
    finally:
        proxy.close()


@pytest.mark.s3
@pytest.mark.parametrize("fault", ["503", "500", "drop", "slow"])
def test_transient_server_faults_are_retried_and_the_save_completes(tmp_path, s3_bucket, fault):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        opts = storage_options(
            proxy.port,
            config_kwargs={
                "retries": {"max_attempts": 10, "mode": "standard"},
                "read_timeout": 5,
                "connect_timeout": 5,
            },
        )
        with ckpt.Checkpointer(f"s3://{bucket}/run", storage_options=opts, local_dir=tmp_path / "a") as ck:
            f = proxy.faults
            if fault in ("503", "500"):
                f.fail_status, f.fail_next = int(fault), 3
            elif fault == "drop":
                f.drop_next = 3
            else:
                f.delay = 0.05
            h = ck.save(1, _state(1.0))
            h.wait()
            assert h.status == "done"
            assert fault == "slow" or f.injected >= 3
            f.delay = 0.0
        target = _target()
        with ckpt.Checkpointer(
            f"s3://{bucket}/run", storage_options=storage_options(port), local_dir=tmp_path / "b"
        ) as ck:
            assert ck.restore(target) == 1 and ck.last_restore.tier == "remote"
        assert _same(target, _state(1.0))
    finally:
        proxy.close()


@pytest.mark.s3
def test_a_failed_upload_is_reported_and_leaves_the_previous_checkpoint(tmp_path, s3_bucket, caplog):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        opts = storage_options(proxy.port, config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}})
        url = f"s3://{bucket}/run"
        with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "a") as ck:
            ck.save(1, _state(1.0)).wait()
            proxy.faults.fail_next = 10**6  # an outage
            h = ck.save(2, _state(2.0))
            with pytest.raises(OSError, match="previous remote checkpoint is untouched"):
                h.wait("remote")
            h.wait("local")  # the local tier still commits it (it may finish after the remote failed)
            assert h.tier_status("local") == "done" and not h.errors.get("local")
            assert "failed on the remote tier" in caplog.text
            with pytest.raises(OSError):
                ck.wait()
            proxy.faults.fail_next = 0
        target = _target()
        with ckpt.Checkpointer(url, storage_options=storage_options(port), local_dir=tmp_path / "b") as ck:
            assert ck.restore(target) == 1
        assert _same(target, _state(1.0))
    finally:
        proxy.close()


@pytest.mark.s3
def test_sigkill_mid_upload_leaves_no_visible_step_and_the_previous_restorable(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        url = f"s3://{bucket}/run"
        with ckpt.Checkpointer(url, storage_options=storage_options(port), local_dir=tmp_path / "a") as ck:
            ck.save(1, _state(1.0)).wait()
        proxy.faults.delay = 0.25  # slow uploads (32 parts, 8 in flight): the kill lands mid-upload
        code = (
            "import sys, torch, ckpt\n"
            "from ckpt import knobs\n"
            "from s3server import storage_options\n"
            f"with knobs.override(CKPT_CHUNK_BYTES={CHUNK}):\n"
            f"    ck = ckpt.Checkpointer('{url}', storage_options=storage_options({proxy.port}),"
            f" local_dir=r'{tmp_path / 'child'}')\n"
            "    w = torch.arange(2_000_000, dtype=torch.float32)\n"
            "    h = ck.save(2, {'w': w, 'step': 2, 'h': w[:10].to(torch.bfloat16)})\n"
            "    h.wait('local')\n"
            "    print('uploading', flush=True)\n"
            "    h.wait()\n"
        )
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout.readline().strip() == "uploading"
        import s3fs

        fs = s3fs.S3FileSystem(**storage_options(port), skip_instance_cache=True)
        parts = f"{bucket}/run/step-000000002/rank-00000"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # kill once some parts, not all, are up
            fs.invalidate_cache()
            if fs.exists(parts) and len(fs.ls(parts)) >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proxy.faults.delay = 0.0
        fs.invalidate_cache()
        assert 2 <= len(fs.ls(parts)) < 32, "the kill should land mid-upload"
        assert not fs.exists(f"{bucket}/run/step-000000002/COMMIT")
        target = _target()
        with ckpt.Checkpointer(url, storage_options=storage_options(port), local_dir=tmp_path / "b") as ck:
            assert [i.step for i in ck.list()] == [1]
            assert ck.restore(target) == 1
        assert _same(target, _state(1.0))
    finally:
        proxy.close()


def test_promote_copies_between_tiers_and_verifies(tmp_path):
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(local_dir=tmp_path / "a") as ck:
        ck.save(5, _state(5.0)).wait()
    with ckpt.Checkpointer(url, local_dir=tmp_path / "a") as ck:
        ck.promote(5, to="remote")
        assert ck.list()[0].tiers == ["local", "remote"]
    ckpt.promote(5, "local", local_dir=tmp_path / "c", url=url)
    assert (tmp_path / "c" / "step-000000005" / "COMMIT").exists()
    with ckpt.Checkpointer(url, local_dir=tmp_path / "c") as ck:
        with pytest.raises(ValueError, match="to must be"):
            ck.promote(5, to="tape")
    data = tmp_path / "a" / "step-000000005" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[7] ^= 1
    data.write_bytes(bytes(raw))
    with ckpt.Checkpointer(f"file://{tmp_path}/remote2", local_dir=tmp_path / "a") as ck:
        with pytest.raises(ckpt.CorruptCheckpointError):
            ck.promote(5, to="remote")
        assert ck.remote.committed_steps() == []


def test_remote_retention_keeps_the_newest_n(tmp_path):
    with ckpt.Checkpointer(
        f"file://{tmp_path}/r", local_dir=tmp_path / "a", keep=ckpt.Retention(local=1, remote=2)
    ) as ck:
        for s in range(1, 5):
            ck.save(s, _state(float(s), 1000)).wait()
        assert ck.remote.committed_steps() == [4, 3]
        assert ck.local.committed_steps() == [4]


def _vouched_files_synced_before_commit(log: DiskLog, step_dir: Path) -> None:
    commit = step_dir / "COMMIT"
    w = log.first("write", commit)
    vouched = [p for p in step_dir.rglob("*") if p != commit]
    assert vouched
    for p in vouched + [step_dir]:
        assert log.synced_before(p, w), f"{p} was not on disk before COMMIT was written"
    # and COMMIT's own name reaches the disk after: its file or its directory fsynced once it is written
    assert any(
        k == "fsync" and q in (os.path.realpath(commit), os.path.realpath(step_dir))
        for k, q in log.events[w + 1 :]
    )


def test_a_file_url_commit_reaches_the_disk_after_the_files_it_vouches_for(tmp_path, monkeypatch, backend):
    log = DiskLog(monkeypatch)
    if backend == "arrow":  # the same spy on writes through pyarrow's local file system
        from ckpt.fs import ArrowFileSystem

        real = ArrowFileSystem.pipe_file

        def pipe_file(fs, path, value, *a, **kw):
            out = real(fs, path, value, *a, **kw)
            log.events.append(("write", os.path.realpath(fs._strip_protocol(path))))
            return out

        monkeypatch.setattr(ArrowFileSystem, "pipe_file", pipe_file)
    with ckpt.Checkpointer(f"file://{tmp_path}/remote", local_dir=tmp_path / "a") as ck:
        ck.save(1, _state(1.0)).wait()
    (step_dir,) = [p for p in (tmp_path / "remote").iterdir() if p.is_dir()]
    _vouched_files_synced_before_commit(log, step_dir)


# -- hostile or damaged remote manifests and parts ----------------------------------------------------


def _saved_remote(tmp_path: Path, compression: str | None = "zstd") -> tuple[str, Path]:
    """Steps 1 and 2 on a file:// remote tier (zstd parts); returns the url and step 2's directory."""
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(
        url, local_dir=tmp_path / "a", compression=compression, keep=ckpt.Retention(remote=None)
    ) as ck:
        ck.save(1, _state(1.0)).wait()
        ck.save(2, _state(2.0)).wait()
    return url, tmp_path / "remote" / "step-000000002"


def _tamper(step_dir: Path, edit) -> None:
    """Rewrite rank 0's manifest with ``edit(dict)`` and re-sign it in ``COMMIT``, as someone with
    write access to the bucket could: every record stays self-consistent."""
    from ckpt.format import Commit

    mpath = step_dir / "rank-00000.manifest.json"
    m = json.loads(mpath.read_bytes())
    edit(m)
    raw = json.dumps(m).encode()
    mpath.write_bytes(raw)
    cpath = step_dir / "COMMIT"
    c = json.loads(cpath.read_bytes())
    c["manifests"]["rank-00000.manifest.json"] = Commit.manifest_checksum(raw)
    c["data"]["rank-00000.bin"] = m["data_bytes"]
    cpath.write_bytes(json.dumps(c).encode())


def _zstd_frame_claiming(nbytes: int, rle: int = 1000) -> bytes:
    """A zstd frame whose header declares ``nbytes`` of content, holding one RLE block of ``rle`` zeros."""
    # magic, then a descriptor: an 8-byte content size, single segment (no window descriptor)
    header = struct.pack("<I", 0xFD2FB528) + bytes([0b11100000]) + struct.pack("<Q", nbytes)
    block = 1 | (1 << 1) | (rle << 3)  # last block, RLE
    return header + block.to_bytes(3, "little") + b"\x00"


def _restores_step_1_warning_about(url: str, tmp_path: Path, name: str) -> None:
    target = _target()
    with ckpt.Checkpointer(url, local_dir=tmp_path / "fresh") as ck:
        with pytest.warns(RuntimeWarning, match=name):
            assert ck.restore(target) == 1
        assert ck.last_restore.tier == "remote"
    assert _same(target, _state(1.0))


@pytest.mark.parametrize("codec", ["zstd:shuffle0", "zstd:shuffle-2", "zstd:shuffle3", "lz4", "RAW"])
def test_an_unknown_part_codec_makes_the_checkpoint_corrupt_when_its_manifest_is_read(tmp_path, codec):
    url, step2 = _saved_remote(tmp_path)
    _tamper(step2, lambda m: m["codecs"].__setitem__(1, codec))
    with ckpt.Checkpointer(url, local_dir=tmp_path / "b") as ck:
        with pytest.raises(ckpt.CorruptCheckpointError, match="part-000001") as ei:
            ck.remote.open(2)
        assert codec in str(ei.value)
    _restores_step_1_warning_about(url, tmp_path, "part-000001")


def test_a_zstd_frame_declaring_16_tib_is_refused_before_any_allocation(tmp_path):
    url, step2 = _saved_remote(tmp_path)
    frame = _zstd_frame_claiming(16 << 40)
    (step2 / "rank-00000" / "part-000001").write_bytes(frame)
    _tamper(
        step2, lambda m: (m["codecs"].__setitem__(1, "zstd"), m["stored_sizes"].__setitem__(1, len(frame)))
    )
    with ckpt.Checkpointer(url, local_dir=tmp_path / "b") as ck:
        with pytest.raises(ckpt.CorruptCheckpointError, match="part-000001"):
            ck.remote.verify(2)
    _restores_step_1_warning_about(url, tmp_path, "part-000001")


def test_a_zstd_frame_that_decodes_past_its_chunk_is_refused(tmp_path):
    import zstandard

    url, step2 = _saved_remote(tmp_path)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(
        bytes(4 * CHUNK)
    )  # no size in the header
    (step2 / "rank-00000" / "part-000001").write_bytes(frame)
    _tamper(
        step2, lambda m: (m["codecs"].__setitem__(1, "zstd"), m["stored_sizes"].__setitem__(1, len(frame)))
    )
    with ckpt.Checkpointer(url, local_dir=tmp_path / "b") as ck:
        with pytest.raises(ckpt.CorruptCheckpointError, match="part-000001"):
            ck.remote.verify(2)


def test_manifest_sizes_beyond_what_the_objects_hold_are_refused_before_any_allocation(tmp_path, monkeypatch):
    """A self-consistent manifest claiming one 16 TiB chunk, and a part whose frame header agrees: the
    claim is bounded by the object's own size (a zstd block of at most 128 KiB takes at least 4 bytes)."""
    url, step2 = _saved_remote(tmp_path)
    huge = 16 << 40
    frame = _zstd_frame_claiming(huge)
    (step2 / "rank-00000" / "part-000000").write_bytes(frame)

    def edit(m: dict) -> None:
        m.update(data_bytes=huge, chunk_bytes=huge, chunks=[0], codecs=["zstd"], stored_sizes=[len(frame)])

    _tamper(step2, edit)
    asked: list[int] = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (asked.append(n), real(fd, off, n))[1])
    with ckpt.Checkpointer(url, local_dir=tmp_path / "b") as ck:
        with pytest.raises(ckpt.CorruptCheckpointError, match="part-000000"):
            ck.remote.open(2)
        with pytest.raises(ckpt.CorruptCheckpointError, match="part-000000"):
            ck.remote.verify(2)
    _restores_step_1_warning_about(url, tmp_path, "part-000000")
    assert asked and max(asked) < 1 << 30, f"the local tier was asked to preallocate {max(asked)} bytes"


def test_a_raw_part_whose_recorded_size_is_not_its_chunk_is_corrupt(tmp_path):
    url, step2 = _saved_remote(tmp_path, compression=None)
    _tamper(step2, lambda m: m["stored_sizes"].__setitem__(1, 1 << 44))
    with ckpt.Checkpointer(url, local_dir=tmp_path / "b") as ck:
        with pytest.raises(ckpt.CorruptCheckpointError, match="part-000001"):
            ck.remote.open(2)


# -- what the remote tier says when the store fails -------------------------------------------------


def _fast(port: int, **extra) -> dict:
    """storage_options whose failures show within seconds (2 attempts, short timeouts)."""
    return storage_options(
        port,
        config_kwargs={
            "retries": {"max_attempts": 2, "mode": "standard"},
            "connect_timeout": 2,
            "read_timeout": 5,
        },
        **extra,
    )


@pytest.fixture
def named_bucket(s3_server):
    """make(name): an empty bucket of exactly that name on the session's server."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options(s3_server), skip_instance_cache=True)

    def make(name: str) -> str:
        if fs.exists(name):
            fs.rm(name, recursive=True)  # left by an earlier test: empty it
        if not fs.exists(name):
            fs.mkdir(name)
        fs.invalidate_cache()
        return name

    return make


@pytest.mark.s3
@pytest.mark.parametrize("prefix", ["run1", "", "a/b"])
@pytest.mark.parametrize("name", ["ml-bucket", "bucket", "my-bucket-1"])
def test_a_new_run_in_a_bucket_named_like_bucket_starts(tmp_path, s3_server, named_bucket, name, prefix):
    bucket = named_bucket(name)
    url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    opts = _fast(s3_server)
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "a") as ck:
        assert ck.remote.status.available is True
        ck.save(1, _state(1.0)).wait()
    target = _target()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "b") as ck:
        assert ck.restore(target) == 1 and ck.last_restore.tier == "remote"
    assert _same(target, _state(1.0))


@pytest.mark.s3
@pytest.mark.parametrize("name", ["no-such-bucket-here", "nothing-here-x"])
def test_a_missing_bucket_is_a_file_not_found_error_naming_it(tmp_path, s3_server, name):
    with pytest.raises(FileNotFoundError) as ei:
        ckpt.Checkpointer(f"s3://{name}/run", storage_options=_fast(s3_server), local_dir=tmp_path)
    assert ei.value.errno == errno.ENOENT
    assert repr(name) in str(ei.value) and "storage_options" in str(ei.value)


@pytest.mark.s3
def test_refused_credentials_are_a_permission_error(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    proxy.faults.forbid = True
    try:
        with pytest.raises(PermissionError) as ei:
            ckpt.Checkpointer(
                f"s3://{bucket}/run",
                local_dir=tmp_path,
                storage_options=_fast(proxy.port, key="wrong", secret="wrong"),
            )
        assert ei.value.errno == errno.EACCES and "credentials" in str(ei.value)
        assert "wrong" not in str(ei.value)  # never the key or secret themselves
    finally:
        proxy.close()


@pytest.mark.s3
def test_an_unreachable_endpoint_is_named_not_called_a_missing_bucket(tmp_path, s3_bucket):
    from s3server import free_port

    bucket, _ = s3_bucket
    dead = free_port()  # nothing listens there
    url, opts = f"s3://{bucket}/run", _fast(dead)
    with pytest.raises(ConnectionError) as ei:  # a tool's RemoteTier: the outage is an error
        ckpt.tiers.RemoteTier(url, opts)
    assert f"http://127.0.0.1:{dead}" in str(ei.value) and "endpoint_url" in str(ei.value)
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path) as ck:  # a job goes on without it
        status = ck.remote.status
        assert status.available is False and isinstance(status.error, ConnectionError)
        assert f"http://127.0.0.1:{dead}" in str(status.error)
        h = ck.save(1, _state(1.0))
        h.wait("local")
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{dead}"):
            h.wait("remote")
        with pytest.raises(ConnectionError):
            ck.wait()


def _two_remote_steps(tmp_path: Path, bucket: str, port: int) -> str:
    url = f"s3://{bucket}/run"
    with ckpt.Checkpointer(
        url, storage_options=storage_options(port), local_dir=tmp_path / "a", keep=ckpt.Retention(remote=None)
    ) as ck:
        ck.save(1, _state(1.0)).wait()
        ck.save(2, _state(2.0)).wait()
    return url


@pytest.mark.s3
def test_a_read_error_on_a_remote_part_names_the_part_not_the_local_dir(tmp_path, s3_bucket, backend):
    bucket, port = s3_bucket
    url = _two_remote_steps(tmp_path, bucket, port)
    proxy = FaultProxy(port)
    proxy.faults.fail_if = lambda method, path: (
        method == "GET" and "step-000000002/rank-00000/part-000002" in path
    )
    try:
        opts = _fast(proxy.port)
        with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "b") as ck:
            with pytest.raises(OSError) as ei:
                ck.promote(2, to="local")  # downloads into the local tier (a refill)
            msg = str(ei.value)
            assert f"s3://{bucket}/run/step-000000002/rank-00000/part-000002" in msg
            assert "local_dir" not in msg and str(tmp_path / "b") not in msg
            # the store's 503, as s3fs reports it; pyarrow's error has no errno and the store answers our own check
            assert ei.value.errno == (errno.EBUSY if backend == "s3fs" else errno.EIO)
            assert not (tmp_path / "b" / "step-000000002").exists()
        target = _target()
        with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "c") as ck:
            with pytest.warns(RuntimeWarning, match="part-000002"):
                assert ck.restore(target) == 1
            assert any("part-000002" in s and "local_dir" not in s for s in ck.last_restore.skipped)
        assert _same(target, _state(1.0))
    finally:
        proxy.close()


@pytest.mark.s3
def test_a_local_write_error_during_a_refill_names_the_local_path(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url = _two_remote_steps(tmp_path, bucket, port)
    local = tmp_path / "b"
    local.mkdir()
    (local / "step-000000002").write_bytes(b"")  # a file where the refill needs a directory
    with ckpt.Checkpointer(url, storage_options=_fast(port), local_dir=local) as ck:
        with pytest.raises(OSError) as ei:
            ck.promote(2, to="local")
        assert ei.value.errno == errno.ENOTDIR
        assert str(local / "step-000000002") in str(ei.value) and "local_dir" in str(ei.value)
        assert "s3://" not in str(ei.value)


@pytest.mark.s3
@pytest.mark.timeout(
    120
)  # a hang detector: the outage must not hold construction for the upload retry policy
@pytest.mark.parametrize("outage", ["refused", "dropped", pytest.param("hanging", marks=pytest.mark.slow)])
def test_a_remote_outage_at_restart_resumes_from_local_and_saves_report_it(
    tmp_path, s3_bucket, outage, caplog
):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        url = f"s3://{bucket}/run"
        opts = storage_options(
            proxy.port
        )  # the library's upload retry policy (10 attempts, ~2 min when down)
        with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "a") as ck:
            ck.save(1, _state(1.0)).wait()
            ck.save(2, _state(2.0)).wait()
        if outage == "refused":
            proxy.down()
        elif outage == "dropped":
            proxy.faults.drop_next = 10**9
        else:
            proxy.faults.delay = 30.0
        target = _target()
        with knobs.override(CKPT_REMOTE_PROBE_S=3):
            with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "a") as ck:
                assert ck.remote.status.available is False
                assert isinstance(ck.remote.status.error, ConnectionError)
                assert f"127.0.0.1:{proxy.port}" in str(ck.remote.status.error)
                assert any(r.levelname == "WARNING" and url in r.getMessage() for r in caplog.records)
                assert ck.restore(target) == 2 and ck.last_restore.tier == "local"
                assert _same(target, _state(2.0))
                h = ck.save(3, _state(3.0))
                h.wait("local")
                with pytest.raises(ConnectionError, match=f"127.0.0.1:{proxy.port}"):
                    h.wait("remote")
                with pytest.raises(ConnectionError):
                    ck.wait()
                # the store comes back: the next save uploads again
                if outage == "refused":
                    proxy.up()
                proxy.faults.drop_next, proxy.faults.delay = 0, 0.0
                h = ck.save(4, _state(4.0))
                h.wait()
                assert h.status == "done" and ck.remote.status.available is True
        target = _target()
        with ckpt.Checkpointer(
            url, storage_options=storage_options(port), local_dir=tmp_path / "fresh"
        ) as ck:
            assert [i.step for i in ck.list()] == [4, 2, 1]
            assert ck.restore(target) == 4 and ck.last_restore.tier == "remote"
        assert _same(target, _state(4.0))
    finally:
        proxy.close()


@pytest.mark.s3
@pytest.mark.parametrize(
    "status, code", [(503, "ServiceUnavailable"), (502, "BadGateway"), (500, "InternalError")]
)
def test_a_store_answering_5xx_at_start_is_an_outage_not_a_configuration_error(
    tmp_path, s3_bucket, status, code
):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    proxy.faults.fail_status, proxy.faults.fail_code, proxy.faults.fail_next = status, code, 10**9
    try:
        url = f"s3://{bucket}/run"
        with ckpt.Checkpointer(url, storage_options=_fast(proxy.port), local_dir=tmp_path) as ck:
            assert ck.remote.status.available is False
            assert isinstance(ck.remote.status.error, ConnectionError)
            assert ck.restore(_target()) is None
            proxy.faults.fail_next = 0
            h = ck.save(1, _state(1.0))
            h.wait()
            assert ck.remote.status.available is True and ck.remote.committed_steps() == [1]
    finally:
        proxy.close()


@pytest.mark.s3
@pytest.mark.timeout(
    120
)  # a hang detector: explicit reads must not run the upload retry policy into an outage
def test_reads_from_a_store_known_to_be_down_probe_it_instead_of_retrying_each_request(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        url = _two_remote_steps(tmp_path, bucket, proxy.port)
        f = proxy.faults
        f.drop_next = 10**9  # every connection dropped: an outage
        opts = storage_options(
            proxy.port
        )  # the library's upload retry policy: 10 attempts (and s3fs's 5 rounds)
        with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "b") as ck:
            before = f.requests
            with pytest.raises(ConnectionError, match=f"127.0.0.1:{proxy.port}") as ei:
                ck.promote(2, to="local")
            assert "step-000000002" in str(ei.value)
            assert f.requests - before <= 8, f"{f.requests - before} requests into a store known to be down"
            f.drop_next = 0
            ck.promote(2, to="local")  # the store is back: the next read probes it and goes ahead
            assert ck.local.committed_steps() == [2]
    finally:
        proxy.close()


_KILLED_MID_COMMIT = """
import os, signal, sys
import torch
import ckpt
from fsspec.implementations.local import LocalFileSystem

def dying(real):
    def pipe_file(fs, path, value, *a, **kw):
        if os.path.basename(str(path)).startswith(".COMMIT") or str(path).endswith("/COMMIT"):
            with open(fs._strip_protocol(path), "wb") as f:   # half of the record reaches the file, then SIGKILL
                f.write(value[: len(value) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fs, path, value, *a, **kw)
    return pipe_file

LocalFileSystem.pipe_file = dying(LocalFileSystem.pipe_file)
url, local = sys.argv[1], sys.argv[2]
remote = url.removeprefix("file://") + "/"
real_replace = os.replace

def replace(src, dst, *a, **kw):   # the remote COMMIT written under a temporary name: SIGKILL before its rename
    if os.path.basename(str(src)).startswith(".COMMIT") and str(dst).startswith(remote):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, *a, **kw)

os.replace = replace
try:
    from ckpt.fs import ArrowFileSystem
    ArrowFileSystem.pipe_file = dying(ArrowFileSystem.pipe_file)
except ImportError:
    pass
with ckpt.Checkpointer(url, local_dir=local, keep=ckpt.Retention(remote=None)) as ck:
    ck.save(2, {"w": torch.full((1000,), 2.0)}).wait()
"""


def test_a_process_killed_while_it_writes_a_commit_on_a_file_url_leaves_no_torn_commit(tmp_path):
    """On a file:// (or mounted) remote tier, records are written under a temporary name and renamed: a
    writer killed half way through a COMMIT leaves none, so the step is simply not committed (a torn COMMIT
    would list a step that fails its checks)."""
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(url, local_dir=tmp_path / "a", keep=ckpt.Retention(remote=None)) as ck:
        ck.save(1, {"w": torch.full((1000,), 1.0)}).wait()
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_MID_COMMIT)
    proc = subprocess.run(
        [sys.executable, str(script), url, str(tmp_path / "b")], capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    step2 = tmp_path / "remote" / "step-000000002"
    assert step2.is_dir() and not (step2 / "COMMIT").exists()
    tier = ckpt.tiers.RemoteTier(url)
    assert tier.committed_steps() == [1]
    target = {"w": torch.zeros(1000)}
    with ckpt.Checkpointer(url, local_dir=tmp_path / "c") as ck:
        assert ck.restore(target) == 1 and ck.last_restore.skipped == []
    assert torch.equal(target["w"], torch.full((1000,), 1.0))

"""The remote tier against a real S3 server (moto's server mode on loopback) and file:// / memory://."""

from __future__ import annotations

import os
import signal
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
    return {"w": torch.arange(n, dtype=torch.float32).mul_(0.001).add_(seed), "step": int(seed),
            "h": torch.full((n // 3,), seed, dtype=torch.bfloat16)}


def _target(n: int = 300_000) -> dict:
    return {"w": torch.empty(n), "step": None, "h": torch.empty(n // 3, dtype=torch.bfloat16)}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["h"], b["h"])


@pytest.fixture(autouse=True)
def small_chunks():
    with knobs.override(CKPT_CHUNK_BYTES=CHUNK):
        yield


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_round_trip_through_fsspec_urls(tmp_path, scheme, compression):
    url = f"file://{tmp_path}/remote" if scheme == "file" else f"memory://ckpt-test-{os.getpid()}-{compression}"
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
    fresh = tmp_path / "fresh"                  # a replaced node: nothing local
    target = _target()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=fresh) as ck:
        assert ck.restore(target) == 2 and ck.last_restore.tier == "remote"
        assert _same(target, _state(2.0))
        assert (fresh / "step-000000002" / "COMMIT").exists()
        target = _target()
        assert ck.restore(target) == 2 and ck.last_restore.tier == "local"   # filled on the way
        assert _same(target, _state(2.0))


@pytest.mark.s3
def test_a_corrupted_object_is_detected_and_restore_falls_back(tmp_path, s3_bucket):
    import s3fs

    bucket, port = s3_bucket
    url, opts = f"s3://{bucket}/run", storage_options(port)
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "a", keep=ckpt.Retention(remote=None)) as ck:
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
    assert not (tmp_path / "b" / "step-000000002").exists(), "a corrupt download must not be committed locally"


@pytest.mark.s3
def test_a_missing_bucket_names_storage_options(tmp_path, s3_server):
    with pytest.raises(OSError, match="storage_options"):
        ckpt.Checkpointer("s3://no-such-bucket-here/run", storage_options=storage_options(s3_server),
                          local_dir=tmp_path)


@pytest.mark.s3
def test_bad_credentials_name_storage_options(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    proxy.faults.forbid = True
    try:
        with pytest.raises(OSError, match="storage_options"):
            ckpt.Checkpointer(f"s3://{bucket}/run", local_dir=tmp_path,
                              storage_options=storage_options(proxy.port, key="wrong", secret="wrong"))
    finally:
        proxy.close()


@pytest.mark.s3
@pytest.mark.parametrize("fault", ["503", "500", "drop", "slow"])
def test_transient_server_faults_are_retried_and_the_save_completes(tmp_path, s3_bucket, fault):
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        opts = storage_options(proxy.port, config_kwargs={"retries": {"max_attempts": 10, "mode": "standard"},
                                                          "read_timeout": 5, "connect_timeout": 5})
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
        with ckpt.Checkpointer(f"s3://{bucket}/run", storage_options=storage_options(port),
                               local_dir=tmp_path / "b") as ck:
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
            proxy.faults.fail_next = 10**6          # an outage
            h = ck.save(2, _state(2.0))
            with pytest.raises(OSError, match="previous remote checkpoint is untouched"):
                h.wait("remote")
            assert h.done("local") and not h.errors.get("local")   # the local tier still committed it
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
        proxy.faults.delay = 0.25                   # slow uploads (32 parts, 8 in flight): the kill lands mid-upload
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
        while time.monotonic() < deadline:          # kill once some parts, not all, are up
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
    with ckpt.Checkpointer(f"file://{tmp_path}/r", local_dir=tmp_path / "a",
                           keep=ckpt.Retention(local=1, remote=2)) as ck:
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
    assert log.first("fsync", commit) > w


def test_a_file_url_commit_reaches_the_disk_after_the_files_it_vouches_for(tmp_path, monkeypatch):
    log = DiskLog(monkeypatch)
    with ckpt.Checkpointer(f"file://{tmp_path}/remote", local_dir=tmp_path / "a") as ck:
        ck.save(1, _state(1.0)).wait()
    (step_dir,) = [p for p in (tmp_path / "remote").iterdir() if p.is_dir()]
    _vouched_files_synced_before_commit(log, step_dir)

"""``promote`` never costs the destination its committed copy.

Step 5 holds one content (A) on the destination tier and another (B) on the source tier. Whatever
goes wrong during ``promote(5, ...)`` (a corrupt source, an outage halfway through the upload or
the download, a SIGKILL at any point), the destination afterwards restores A or B, never nothing.
Run against a ``file://`` URL and a real S3 server (moto on loopback, through a fault-injecting proxy).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import knobs
from ckpt.tiers import RemoteTier
from s3server import FaultProxy, storage_options

HERE = Path(__file__).parent
CHUNK = 64 << 10
N = 40_000  # 160 kB of float32 plus a third of that in bfloat16: 4 chunks
STEP = 5
DATA = "step-000000005/rank-00000.bin"


@pytest.fixture(autouse=True)
def small_chunks():
    with knobs.override(CKPT_CHUNK_BYTES=CHUNK):
        yield


def _state(seed: float) -> dict:
    return {
        "w": torch.arange(N, dtype=torch.float32).mul_(0.001).add_(seed),
        "seed": seed,
        "h": torch.full((N // 3,), seed, dtype=torch.bfloat16),
    }


def _target() -> dict:
    return {"w": torch.empty(N), "seed": None, "h": torch.empty(N // 3, dtype=torch.bfloat16)}


def _which(target: dict) -> float | None:
    """The seed whose state ``target`` holds exactly (A=1.0 or B=2.0), or None."""
    for seed in (1.0, 2.0):
        ref = _state(seed)
        if (
            target["seed"] == seed
            and torch.equal(target["w"], ref["w"])
            and torch.equal(target["h"], ref["h"])
        ):
            return seed
    return None


def _save_local(local_dir: Path, seed: float) -> None:
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(STEP, _state(seed)).wait()


def _save_remote(url: str, seed: float, scratch: Path, opts: dict | None = None) -> None:
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, storage_options=opts, local_dir=scratch)) as ck:
        ck.save(STEP, _state(seed)).wait()
    shutil.rmtree(scratch)


def _local_holds(local_dir: Path) -> float | None:
    """What a restore from ``local_dir`` alone finds at step 5 (None: nothing usable)."""
    target = _target()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        try:
            ck.restore(target, step=STEP)
        except (ckpt.CheckpointError, FileNotFoundError):
            return None
    return _which(target)


def _remote_holds(url: str, scratch: Path, opts: dict | None = None) -> float | None:
    """What a restore from the URL finds at step 5 (through an empty local_dir)."""
    target = _target()
    try:
        with ckpt.Checkpointer(storage=ckpt.Storage(url=url, storage_options=opts, local_dir=scratch)) as ck:
            try:
                ck.restore(target, step=STEP)
            except (ckpt.CheckpointError, FileNotFoundError):
                return None
            assert ck.last_restore.tier == "remote"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _which(target)


def _flip(path: Path, at: int = 1000) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


# -- a corrupt source ------------------------------------------------------------------------------
def test_a_corrupt_local_source_is_reported_and_the_remote_copy_survives(tmp_path):
    url = f"file://{tmp_path}/remote"
    _save_remote(url, 1.0, tmp_path / "s")
    _save_local(tmp_path / "a", 2.0)
    _flip(tmp_path / "a" / DATA, CHUNK + 10)
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.promote(STEP, "remote", local_dir=tmp_path / "a", url=url)
    assert str(tmp_path / "a" / DATA) in str(e.value)  # names the corrupt file, not the upload
    assert _remote_holds(url, tmp_path / "s") == 1.0


@pytest.mark.s3
def test_a_corrupt_local_source_leaves_the_s3_copy(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url, opts = f"s3://{bucket}/run", storage_options(port)
    _save_remote(url, 1.0, tmp_path / "s", opts)
    _save_local(tmp_path / "a", 2.0)
    _flip(tmp_path / "a" / DATA)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path / "a")
    ) as ck:
        with pytest.raises(ckpt.CorruptCheckpointError, match="rank-00000.bin"):
            ck.promote(STEP, "remote")
    assert _remote_holds(url, tmp_path / "s", opts) == 1.0


def test_a_corrupt_remote_source_is_reported_and_the_local_copy_survives(tmp_path):
    url = f"file://{tmp_path}/remote"
    _save_remote(url, 2.0, tmp_path / "s")
    _save_local(tmp_path / "a", 1.0)
    _flip(tmp_path / "remote" / "step-000000005" / "rank-00000" / "part-000002")
    with pytest.raises(ckpt.CorruptCheckpointError, match="part-000002"):
        ckpt.promote(STEP, "local", local_dir=tmp_path / "a", url=url)
    assert _local_holds(tmp_path / "a") == 1.0


# -- an outage halfway --------------------------------------------------------------------------------
def _failing_after(monkeypatch, calls: int, what: str = "part-") -> None:
    """Make fsspec's local file system fail every write of a part after the first ``calls`` (EIO)."""
    from fsspec.implementations.local import LocalFileSystem

    real, seen = LocalFileSystem.pipe_file, []

    def pipe_file(fs, path, value, *a, **kw):
        if what in str(path):
            seen.append(path)
            if len(seen) > calls:
                raise OSError(errno.EIO, "injected I/O error", str(path))
        return real(fs, path, value, *a, **kw)

    monkeypatch.setattr(LocalFileSystem, "pipe_file", pipe_file)


def test_an_upload_failing_halfway_leaves_the_remote_copy(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/remote"
    _save_remote(url, 1.0, tmp_path / "s")
    _save_local(tmp_path / "a", 2.0)
    with monkeypatch.context() as m:
        _failing_after(m, 2)
        with pytest.raises(OSError) as e:
            ckpt.promote(STEP, "remote", local_dir=tmp_path / "a", url=url)
    assert not isinstance(e.value, ckpt.CheckpointError) and e.value.errno == errno.EIO
    assert url in str(e.value)
    assert _remote_holds(url, tmp_path / "s") == 1.0


def _outage_after(proxy: FaultProxy, parts: int) -> None:
    """The proxy answers 503 to every request for a part after the first ``parts`` ones."""
    faults, seen = proxy.faults, []
    real = faults.take

    def take(path: str = "", method: str = "GET") -> str | None:
        if "part-" in path:
            seen.append(path)
            if len(seen) > parts:
                faults.injected += 1
                return "fail"
        return real(path, method)

    faults.take = take


@pytest.mark.s3
def test_an_s3_outage_halfway_through_the_upload_leaves_the_remote_copy(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url = f"s3://{bucket}/run"
    _save_remote(url, 1.0, tmp_path / "s", storage_options(port))
    _save_local(tmp_path / "a", 2.0)
    proxy = FaultProxy(port)
    try:
        _outage_after(proxy, 2)
        opts = storage_options(proxy.port, config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}})
        with pytest.raises(OSError) as e:
            ckpt.promote(STEP, "remote", local_dir=tmp_path / "a", url=url, storage_options=opts)
        assert not isinstance(e.value, ckpt.CheckpointError) and url in str(e.value)
        assert proxy.faults.injected > 0
    finally:
        proxy.close()
    assert _remote_holds(url, tmp_path / "s", storage_options(port)) == 1.0


@pytest.mark.s3
def test_an_s3_outage_halfway_through_the_download_leaves_the_local_copy(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url = f"s3://{bucket}/run"
    _save_remote(url, 2.0, tmp_path / "s", storage_options(port))
    _save_local(tmp_path / "a", 1.0)
    proxy = FaultProxy(port)
    try:
        _outage_after(proxy, 2)
        opts = storage_options(proxy.port, config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}})
        with pytest.raises(OSError) as e:
            ckpt.promote(STEP, "local", local_dir=tmp_path / "a", url=url, storage_options=opts)
        assert not isinstance(e.value, ckpt.CheckpointError)
        assert url in str(e.value) and str(tmp_path / "a") not in str(
            e.value
        )  # the store failed, not the disk
    finally:
        proxy.close()
    assert _local_holds(tmp_path / "a") == 1.0


# -- success: replaced in place, nothing left behind ---------------------------------------------------
@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_promote_replaces_a_different_copy_and_leaves_no_old_parts(tmp_path, scheme):
    url = (
        f"file://{tmp_path}/remote" if scheme == "file" else f"memory://promote-{os.getpid()}-{tmp_path.name}"
    )
    _save_remote(url, 1.0, tmp_path / "s")
    _save_local(tmp_path / "a", 2.0)
    ckpt.promote(STEP, "remote", local_dir=tmp_path / "a", url=url)
    assert _remote_holds(url, tmp_path / "s") == 2.0
    tier = RemoteTier(url)
    step_dir = tier.step_dir(STEP)
    manifest = tier.open(STEP)[1]
    files = [p for p in tier.fs.find(step_dir)]
    assert len(files) == 2 + len(manifest.chunks), files  # COMMIT, the manifest, one object per part
    if scheme == "file":  # the command line reads the replaced layout too
        from ckpt.cli import main as cli

        assert cli(["verify", url]) == 0 and cli(["inspect", url]) == 0
    ckpt.promote(STEP, "local", local_dir=tmp_path / "b", url=url)
    _save_local(tmp_path / "c", 1.0)
    ckpt.promote(STEP, "local", local_dir=tmp_path / "c", url=url)
    assert _local_holds(tmp_path / "c") == 2.0
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if not p.name.startswith(".ckpt")) == [
        "latest",
        "step-000000005",
    ]


def test_promoting_an_identical_copy_writes_nothing(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "a")) as ck:
        ck.save(STEP, _state(1.0)).wait()
    remote_commit = tmp_path / "remote" / "step-000000005" / "COMMIT"
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "remote").rglob("*")}
    local_data = (tmp_path / "a" / DATA).stat()
    from fsspec.implementations.local import LocalFileSystem

    def refuse(*a, **kw):
        raise AssertionError("an identical promote must not write")

    with monkeypatch.context() as m:
        m.setattr(LocalFileSystem, "pipe_file", refuse)
        ckpt.promote(STEP, "remote", local_dir=tmp_path / "a", url=url)
        ckpt.promote(STEP, "local", local_dir=tmp_path / "a", url=url)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "remote").rglob("*")} == before
    after = (tmp_path / "a" / DATA).stat()
    assert (after.st_ino, after.st_mtime_ns) == (local_data.st_ino, local_data.st_mtime_ns)
    assert remote_commit.exists()


def test_an_identical_but_corrupt_destination_is_repaired(tmp_path):
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "a")) as ck:
        ck.save(STEP, _state(1.0)).wait()
    _flip(tmp_path / "remote" / "step-000000005" / "rank-00000" / "part-000001")
    ckpt.promote(STEP, "remote", local_dir=tmp_path / "a", url=url)
    assert _remote_holds(url, tmp_path / "s") == 1.0
    _flip(tmp_path / "a" / DATA)
    ckpt.promote(STEP, "local", local_dir=tmp_path / "a", url=url)
    assert _local_holds(tmp_path / "a") == 1.0


def test_promote_refuses_to_replace_a_job_tier_step_with_one_ranks_copy(tmp_path):
    url = f"file://{tmp_path}/remote"
    _save_remote(url, 1.0, tmp_path / "s")
    commit = tmp_path / "remote" / "step-000000005" / "COMMIT"
    record = json.loads(commit.read_bytes())  # make it look like a two-rank job's step
    record["world_size"] = 2
    record["manifests"]["rank-00001.manifest.json"] = 0
    commit.write_text(json.dumps(record))
    before = sorted(p.name for p in (tmp_path / "remote").rglob("*"))
    _save_local(tmp_path / "a", 2.0)
    with pytest.raises(ckpt.IncompatibleCheckpointError, match="world size 2"):
        ckpt.promote(STEP, "remote", local_dir=tmp_path / "a", url=url)
    assert sorted(p.name for p in (tmp_path / "remote").rglob("*")) == before


# -- SIGKILL at every I/O step of a promote -----------------------------------------------------------
def _worker(to: str, local_dir: Path, url: str, pause_at: int, opts: dict | None = None) -> tuple[str, int]:
    """Run tests/promote_worker.py; with ``pause_at`` it stops before that I/O call and is SIGKILLed there.
    Returns (what it printed last, the number of I/O calls it made when it ran to the end)."""
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = [
        sys.executable,
        str(HERE / "promote_worker.py"),
        to,
        str(local_dir),
        url,
        str(STEP),
        str(pause_at),
        json.dumps(opts or {}),
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("paused"):
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                return line.strip(), 0
            if line.startswith("events"):
                assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
                return line.strip(), int(line.split()[1])
        proc.wait(timeout=60)
        raise AssertionError(f"worker ended without pausing: {proc.returncode} {proc.stderr.read()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_points(total: int) -> list[int]:
    """Every I/O call with CKPT_SLOW=1 (or -m slow); otherwise the first, the last and every fifth one
    (each point costs a Python process with torch imported)."""
    if os.environ.get("CKPT_SLOW") == "1":
        return list(range(1, total + 1))
    return sorted({1, total, *range(2, total, 5)})


def _sweep(to: str, prepare, holds, make_args) -> None:
    """SIGKILL a promote before each of its I/O calls in turn; the destination always holds A or B."""
    where, args = prepare("count")
    last, total = _worker(to, *args)
    assert total >= 6, last
    assert holds(where) == 2.0, "the uninterrupted promote must succeed"
    outcomes = []
    for k in _kill_points(total):
        where, args = prepare(str(k))
        paused, _ = _worker(to, *make_args(args, k))
        got = holds(where)
        assert got in (1.0, 2.0), f"after a SIGKILL at {paused!r} the destination holds nothing usable"
        outcomes.append(got)
    assert outcomes[0] == 1.0 and 2.0 in outcomes, outcomes  # both sides of the switch were hit
    # a promote after the kill succeeds and tidies up
    where, args = prepare("again")
    _worker(to, *make_args(args, total // 2))
    _worker(to, *args)
    assert holds(where) == 2.0


def test_sigkill_at_any_point_of_a_promote_to_local_leaves_the_old_or_the_new_copy(tmp_path):
    url = f"file://{tmp_path}/remote"
    _save_remote(url, 2.0, tmp_path / "s")
    _save_local(tmp_path / "template", 1.0)

    def prepare(name: str):
        dest = tmp_path / f"dest-{name}"
        shutil.copytree(tmp_path / "template", dest)
        return dest, (dest, url, 0)

    _sweep("local", prepare, _local_holds, lambda a, k: (a[0], a[1], k))
    dest = tmp_path / "dest-again"
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".ckpt")) == [
        "latest",
        "step-000000005",
    ]


def test_sigkill_at_any_point_of_a_promote_to_a_file_url_leaves_the_old_or_the_new_copy(tmp_path):
    _save_local(tmp_path / "a", 2.0)
    _save_remote(f"file://{tmp_path}/template", 1.0, tmp_path / "s")

    def prepare(name: str):
        dest = tmp_path / f"remote-{name}"
        shutil.copytree(tmp_path / "template", dest)
        return f"file://{dest}", (tmp_path / "a", f"file://{dest}", 0)

    _sweep("remote", prepare, lambda url: _remote_holds(url, tmp_path / "s"), lambda a, k: (a[0], a[1], k))


@pytest.mark.s3
@pytest.mark.slow  # its default siblings: the same kill sweep to a file:// URL (the remote tier's code) and to local
def test_sigkill_at_any_point_of_a_promote_to_s3_leaves_the_old_or_the_new_copy(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    opts = storage_options(port)
    _save_local(tmp_path / "a", 2.0)

    def prepare(name: str):
        url = f"s3://{bucket}/run-{name}"
        _save_remote(url, 1.0, tmp_path / "s", opts)
        return url, (tmp_path / "a", url, 0, opts)

    _sweep(
        "remote",
        prepare,
        lambda url: _remote_holds(url, tmp_path / "s", opts),
        lambda a, k: (a[0], a[1], k, a[3]),
    )


# -- the same mechanism under every write, not only promote -------------------------------------------
def test_saving_a_committed_step_again_keeps_the_old_copy_when_the_write_fails(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "a")) as ck:
        ck.save(STEP, _state(1.0)).wait()
    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "injected: no space left")
        return real(fd, data, offset)

    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", pwrite)
        _failing_after(m, 2)
        with ckpt.Checkpointer(
            storage=ckpt.Storage(url=url, local_dir=tmp_path / "a")
        ) as ck:  # a run that went back to step 4
            h = ck.save(STEP, _state(2.0))
            with pytest.raises(OSError) as local_error:
                h.wait("local")
            with pytest.raises(OSError):
                h.wait("remote")
            ck.close()  # both failures were raised by h.wait() already: close() does not raise them again
    assert local_error.value.errno == errno.ENOSPC
    assert _local_holds(tmp_path / "a") == 1.0
    assert _remote_holds(url, tmp_path / "s") == 1.0
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".step-")], "staging left behind"


def test_without_an_atomic_exchange_a_replacement_still_switches(tmp_path, monkeypatch):
    from ckpt.tiers import local as local_tier

    def no_exchange(a, b):
        raise OSError(errno.EINVAL, "not supported here", str(a))

    url = f"file://{tmp_path}/remote"
    _save_remote(url, 2.0, tmp_path / "s")
    _save_local(tmp_path / "a", 1.0)
    monkeypatch.setattr(local_tier, "_exchange", no_exchange)
    ckpt.promote(STEP, "local", local_dir=tmp_path / "a", url=url)
    assert _local_holds(tmp_path / "a") == 2.0
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".step-")]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_copy_left_aside_by_a_killed_writer_is_put_back_and_staging_is_swept(tmp_path):
    from ckpt.tiers import local as local_tier

    root = tmp_path / "a"
    _save_local(root, 1.0)
    tag, pid = local_tier._host_tag(), _dead_pid()
    # killed between the two renames of a file system without an exchange: the old copy is aside,
    # the new one (complete, committed in its staging directory) never made it into place
    aside = root / f".step-000000005.old-{pid}-{tag}-0badc0de"
    (root / "step-000000005").rename(aside)
    staged = root / f".step-000000005.new-{pid}-{tag}-00c0ffee"
    shutil.copytree(aside, staged)
    live = root / f".step-000000006.new-{os.getpid()}-{tag}-12345678"  # a live writer's: left alone
    live.mkdir()
    assert _local_holds(root) is None  # readers do not repair; the next writer does
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=root)) as ck:
        ck.save(7, _state(2.0)).wait()
    assert _local_holds(root) == 1.0
    assert not aside.exists() and not staged.exists() and live.exists()


def test_a_job_tier_step_saved_again_keeps_its_old_copy_until_every_rank_uploaded_the_new_one(tmp_path):
    from helpers import run_ranks

    def run(mode: str, value: float) -> list[str]:
        results = run_ranks(
            HERE / "replace_worker.py",
            str(tmp_path),
            mode,
            str(value),
            timeout=180,
            env={"CKPT_CHUNK_BYTES": str(CHUNK)},
        )  # 400 kB: 7 parts per rank
        assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
        return [r.stdout.strip().splitlines()[-1] for r in results]

    assert run("save", 1.0) == ["saved"] * 2
    assert all(line.startswith("error") for line in run("fail", 2.0))  # rank 1's upload failed halfway
    assert run("check", 0.0) == ["restored 5 1.0"] * 2  # the old step 5, on every rank
    assert run("save", 3.0) == ["saved"] * 2
    assert run("check", 0.0) == ["restored 5 3.0"] * 2
    step_dir = tmp_path / "job" / "step-000000005"
    (gen,) = [p.name for p in step_dir.iterdir() if p.is_dir()]  # the old copies' files are gone
    assert sorted(p.name for p in step_dir.iterdir()) == ["COMMIT", gen]
    from ckpt.cli import main as cli

    assert cli(["verify", f"file://{tmp_path}/job"]) == 0

"""The remote tier's guarantees, tried as hard as we can break them.

What docs/concepts.md, docs/operations.md and docs/format.md promise about the remote tier, each
against a hostile store: a real S3 server (moto's server mode on loopback, tests/s3server.py) behind
a proxy that stops, hangs, fails chosen requests or holds one while its client is SIGKILLed; objects
deleted, truncated, replaced or shadowed behind the library's back; manifests that claim 2**60 bytes,
nest 100,000 levels deep or store nothing at all; junk keys in the listing; a second process with
the same url and local_dir; retention while uploads keep failing.

* a checkpoint is committed only when complete and verified, and one that is listed verifies
* an upload cut off by an outage or a killed process is never listed or restored, and its
  leftovers are removed by retention once a newer step commits
* retention never deletes the last good checkpoint
* a slow, hanging or failing store never makes ``save()`` wait
* restore falls back tier by tier, and older step by older step
* a failed write or promote leaves the destination's committed copy as it was
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import knobs
from ckpt.format import Commit
from ckpt.tiers import RemoteTier
from s3server import FaultProxy, storage_options

HERE = Path(__file__).parent
CHUNK = 64 << 10
N = 40_000  # 160 kB of float32 and 27 kB of bfloat16: 3 parts of 64 kB


@pytest.fixture(autouse=True)
def small_chunks():
    with knobs.override(CKPT_CHUNK_BYTES=CHUNK):
        yield


@pytest.fixture(autouse=True)
def s3fs_backend(monkeypatch):
    """s3fs and fsspec's local file system, here and in the processes the tests start: the faults below
    are made for s3fs's client (its read timeout cuts off a put that the store then takes)."""
    monkeypatch.setenv("CKPT_S3_BACKEND", "s3fs")
    monkeypatch.setenv("CKPT_FILE_BACKEND", "fsspec")


def _state(seed: float) -> dict:
    return {
        "w": torch.arange(N, dtype=torch.float32).mul_(0.001).add_(seed),
        "seed": seed,
        "h": torch.full((N // 3,), seed, dtype=torch.bfloat16),
    }


def _target() -> dict:
    return {"w": torch.empty(N), "seed": None, "h": torch.empty(N // 3, dtype=torch.bfloat16)}


def _seed_of(target: dict) -> float | None:
    """The seed whose state ``target`` holds exactly, or None."""
    seed = target["seed"]
    if not isinstance(seed, float):
        return None
    ref = _state(seed)
    return seed if torch.equal(target["w"], ref["w"]) and torch.equal(target["h"], ref["h"]) else None


def _fs(port: int):
    import s3fs

    return s3fs.S3FileSystem(**storage_options(port), skip_instance_cache=True)


def _fast(port: int, **extra) -> dict:
    """storage_options whose failures show within seconds (2 attempts, short timeouts)."""
    return storage_options(
        port,
        config_kwargs={
            "retries": {"max_attempts": 2, "mode": "standard"},
            "connect_timeout": 2,
            "read_timeout": 3,
        },
        **extra,
    )


def _save(url: str, opts: dict | None, local_dir: Path, steps, compression: str | None = None) -> None:
    """Steps (each holding the state of its own number as seed) on the remote tier, nothing deleted."""
    with ckpt.Checkpointer(
        url,
        storage_options=opts,
        local_dir=local_dir,
        compression=compression,
        keep=ckpt.Retention(remote=None),
    ) as ck:
        for s in steps:
            ck.save(s, _state(float(s))).wait()


def _direct():
    """The probe's default bound for the checks a test makes on the store directly (not through the fault
    proxy): a test's short bound is for the outages it makes, and a loaded 2-core machine can take over 2 s
    to answer a healthy store."""
    return knobs.override(CKPT_REMOTE_PROBE_S=knobs._DEFAULTS["CKPT_REMOTE_PROBE_S"])


def _listed_and_verified(url: str, opts: dict | None) -> list[int]:
    """The steps the remote tier lists, each verified (every part of every rank read and checked)."""
    with _direct():
        tier = RemoteTier(url, opts)
        steps = tier.committed_steps()
        for s in steps:
            tier.verify(s)  # raises if a listed step is not whole
    return steps


def _restore(
    url: str, opts: dict | None, local_dir: Path, **kw
) -> tuple[int | None, float | None, str | None]:
    """(step, seed of the restored state, tier) through a Checkpointer with ``local_dir``."""
    target = _target()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=local_dir) as ck:
        step = ck.restore(target, **kw)
        tier = ck.last_restore.tier if ck.last_restore is not None else None
    return step, (_seed_of(target) if step is not None else None), tier


def _resign(fs, step_dir: str, manifest_raw: bytes, data_bytes: int | None = None) -> None:
    """Put ``manifest_raw`` as rank 0's manifest and re-sign it in ``COMMIT``, as someone with write
    access to the bucket could: the records stay self-consistent."""
    fs.pipe_file(f"{step_dir}/rank-00000.manifest.json", manifest_raw)
    c = json.loads(fs.cat_file(f"{step_dir}/COMMIT"))
    c["manifests"]["rank-00000.manifest.json"] = Commit.manifest_checksum(manifest_raw)
    if data_bytes is not None:
        c["data"]["rank-00000.bin"] = data_bytes
    fs.pipe_file(f"{step_dir}/COMMIT", json.dumps(c).encode())
    fs.invalidate_cache()


class Hold:
    """Holds the ``nth`` request of ``method`` whose path contains ``key`` at the proxy until
    :meth:`let_go`; it then reaches the store (``land``) or is answered 503 without reaching it.
    ``then``: what the proxy does to the later requests that match (``"fail"``: 503)."""

    def __init__(
        self,
        proxy: FaultProxy,
        method: str,
        key: str,
        nth: int = 1,
        then: str | None = None,
        hold_s: float | None = None,
    ) -> None:
        self.hit, self.released = threading.Event(), threading.Event()
        self.land, self.seen, self.lock = True, 0, threading.Lock()
        self.forwarded = threading.Event()
        real = proxy.faults.take

        def take(path: str = "", verb: str = "GET") -> str | None:
            if verb == method and key in path:
                with self.lock:
                    self.seen += 1
                    mine = self.seen == nth
                if mine:
                    self.hit.set()
                    self.released.wait(hold_s if hold_s is not None else 60)
                    if self.land:
                        self.forwarded.set()
                        return None
                    return "fail"
                if self.seen > nth and then is not None:
                    return then
            return real(path, verb)

        proxy.faults.take = take

    def let_go(self, land: bool) -> None:
        self.land = land
        self.released.set()


# -- objects deleted, truncated, replaced or shadowed behind the library's back ------------------------


def _part(step_dir: str, i: int = 1) -> str:
    return f"{step_dir}/rank-00000/part-{i:06d}"


def _deep(depth: int = 100_000) -> bytes:
    return b"[" * depth + b"]" * depth


def _claim_2_60(fs, d: str) -> None:
    """A self-consistent manifest claiming one 2**60-byte chunk stored in 2**60 bytes."""
    m = json.loads(fs.cat_file(f"{d}/rank-00000.manifest.json"))
    huge = 1 << 60
    m.update(
        data_bytes=huge,
        chunk_bytes=huge,
        chunks=[m["chunks"][0]],
        codecs=[m["codecs"][0]],
        stored_sizes=[huge],
    )
    _resign(fs, d, json.dumps(m).encode(), data_bytes=huge)


def _stored_size_2_60(fs, d: str) -> None:
    m = json.loads(fs.cat_file(f"{d}/rank-00000.manifest.json"))
    m["stored_sizes"][1] = 1 << 60
    _resign(fs, d, json.dumps(m).encode())


def _flip(fs, path: str) -> None:
    raw = bytearray(fs.cat_file(path))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(raw))


TAMPER = {
    "part deleted": lambda fs, d: fs.rm(_part(d)),
    "part one byte shorter": lambda fs, d: fs.pipe_file(_part(d), fs.cat_file(_part(d))[:-1]),
    "part one byte longer": lambda fs, d: fs.pipe_file(_part(d), fs.cat_file(_part(d)) + b"\0"),
    "part emptied": lambda fs, d: fs.pipe_file(_part(d), b""),
    "part replaced by other bytes of its size": lambda fs, d: _flip(fs, _part(d)),
    "manifest emptied": lambda fs, d: fs.pipe_file(f"{d}/rank-00000.manifest.json", b""),
    "manifest deleted": lambda fs, d: fs.rm(f"{d}/rank-00000.manifest.json"),
    "manifest 100k deep, re-signed": lambda fs, d: _resign(fs, d, _deep()),
    "COMMIT 100k deep": lambda fs, d: fs.pipe_file(f"{d}/COMMIT", _deep()),
    "COMMIT emptied": lambda fs, d: fs.pipe_file(f"{d}/COMMIT", b""),
    "stored size 2**60, re-signed": _stored_size_2_60,
    "chunk and data of 2**60 bytes, re-signed": _claim_2_60,
}


@pytest.mark.s3
@pytest.mark.parametrize("how", list(TAMPER))
def test_a_damaged_newest_checkpoint_is_refused_and_restore_falls_back(tmp_path, s3_bucket, how, monkeypatch):
    bucket, port = s3_bucket
    url, opts, fs = f"s3://{bucket}/run", storage_options(port), _fs(port)
    _save(url, opts, tmp_path / "w", (1, 2), compression="zstd")
    d = f"{bucket}/run/step-000000002"
    TAMPER[how](fs, d)
    fs.invalidate_cache()
    asked: list[int] = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (asked.append(n), real(fd, off, n))[1])
    tier = RemoteTier(url, opts)
    with pytest.raises(ckpt.CheckpointError):  # corrupt or incomplete: never a bare OSError of the store
        tier.verify(2)
    tier.verify(1)
    fresh = tmp_path / "fresh"
    with pytest.warns(RuntimeWarning):
        assert _restore(url, opts, fresh) == (1, 1.0, "remote")
    assert not (fresh / "step-000000002" / "COMMIT").exists(), (
        "a damaged download must not be committed locally"
    )
    assert not asked or max(asked) < 1 << 30, f"the local tier was asked to preallocate {max(asked)} bytes"


@pytest.mark.s3
@pytest.mark.parametrize("how", ["COMMIT emptied", "COMMIT 100k deep", "manifest emptied", "part emptied"])
def test_a_damaged_step_can_be_saved_again_over_and_restores(tmp_path, s3_bucket, how):
    bucket, port = s3_bucket
    url, opts, fs = f"s3://{bucket}/run", storage_options(port), _fs(port)
    _save(url, opts, tmp_path / "w", (1, 2))
    TAMPER[how](fs, f"{bucket}/run/step-000000002")
    fs.invalidate_cache()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "again") as ck:
        ck.save(2, _state(22.0)).wait()  # raises if the damaged copy keeps the new one out
    assert _listed_and_verified(url, opts) == [2, 1]
    assert _restore(url, opts, tmp_path / "fresh") == (2, 22.0, "remote")


@pytest.mark.s3
def test_a_junk_key_under_a_parts_name_does_not_make_a_whole_checkpoint_unusable(tmp_path, s3_bucket):
    """S3 holds ``part-000001`` and ``part-000001/junk`` side by side: the part is still there, whole."""
    bucket, port = s3_bucket
    url, opts, fs = f"s3://{bucket}/run", storage_options(port), _fs(port)
    _save(url, opts, tmp_path / "w", (1, 2))
    fs.pipe_file(f"{_part(f'{bucket}/run/step-000000002')}/junk", b"not a part")
    fs.invalidate_cache()
    RemoteTier(url, opts).verify(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no step is skipped
        assert _restore(url, opts, tmp_path / "fresh") == (2, 2.0, "remote")


def _all_parts_absent(manifest: dict) -> dict:
    """What a rank whose every chunk held only replicated tensors uploads: no part at all."""
    n = len(manifest["codecs"])
    return dict(manifest, codecs=["absent"] * n, stored_sizes=[0] * n)


@pytest.mark.parametrize("scheme", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_single_rank_manifest_that_stores_no_part_never_verifies(tmp_path, request, scheme):
    """Only a job tier's rank above 0 leaves out chunks (those rank 0 stores). A rank-0 manifest that
    says its parts are "absent" holds no data: it must neither verify (else ``ckpt gc`` keeps it as
    the one good checkpoint and deletes the real one) nor count as the copy a promote would write."""
    from ckpt.cli import main as cli

    if scheme == "s3":
        bucket, port = request.getfixturevalue("s3_bucket")
        url, opts, fs = f"s3://{bucket}/run", storage_options(port), _fs(port)
        d = f"{bucket}/run/step-000000002"
    else:
        import fsspec

        url, opts, fs = f"file://{tmp_path}/remote", None, fsspec.filesystem("file")
        d = f"{tmp_path}/remote/step-000000002"
    _save(url, opts, tmp_path / "w", (1, 2))
    m = json.loads(fs.cat_file(f"{d}/rank-00000.manifest.json"))
    _resign(fs, d, json.dumps(_all_parts_absent(m)).encode())
    fs.rm(f"{d}/rank-00000", recursive=True)
    with pytest.raises(ckpt.CorruptCheckpointError):
        RemoteTier(url, opts).verify(2)
    argv = ["gc", url, "--keep", "1"] + (["--storage-options", json.dumps(opts)] if opts else [])
    cli(argv)
    assert 1 in RemoteTier(url, opts).committed_steps(), "gc deleted the only checkpoint that verifies"
    with pytest.warns(RuntimeWarning):
        assert _restore(url, opts, tmp_path / "fresh") == (1, 1.0, "remote")
    # the local copy of step 2 is promoted over the empty one, not taken for it
    assert ckpt.promote(2, "remote", local_dir=tmp_path / "w", url=url, storage_options=opts) is True
    assert _restore(url, opts, tmp_path / "fresh2") == (2, 2.0, "remote")


# -- junk in the listing -------------------------------------------------------------------------------


@pytest.mark.s3
def test_junk_keys_in_the_listing_are_not_steps_and_cost_no_checkpoint(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url, opts, fs = f"s3://{bucket}/run", storage_options(port), _fs(port)
    _save(url, opts, tmp_path / "w", (1, 2))
    junk = {
        "step-abc/COMMIT": b"{}",
        "step-/COMMIT": b"{}",
        "notastep/COMMIT": b"{}",
        "step-000000006": b"object",
        "step-000000009/COMMIT/inside": b"a COMMIT that is a directory commits nothing",
        "step-0000000008/COMMIT": b"{}",  # 10 digits: not step-000000008
        "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0667/COMMIT": b"{}",  # Arabic-Indic digits
        "latest": b"\xff\xfe garbage",
        "step-000000002/rank-00000/part-000099": b"a part no manifest names",
        "step-000000002/stray": b"x",
    }
    for key, value in junk.items():
        fs.pipe_file(f"{bucket}/run/{key}", value)
    fs.invalidate_cache()
    tier = RemoteTier(url, opts)
    assert tier.committed_steps() == [2, 1]
    assert sorted(tier.all_step_dirs()) == [1, 2, 6, 9], "only canonical step names are step directories"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing listed fails to load
        assert _restore(url, opts, tmp_path / "fresh") == (2, 2.0, "remote")
    with ckpt.Checkpointer(
        url, storage_options=opts, local_dir=tmp_path / "next", keep=ckpt.Retention(remote=1)
    ) as ck:
        assert [i.step for i in ck.list()] == [2, 1]
        ck.save(3, _state(3.0)).wait()
    assert _listed_and_verified(url, opts) == [3]
    fs.invalidate_cache()
    left = {p.split("/run/", 1)[1] for p in fs.find(f"{bucket}/run")}
    for key in junk:  # retention removed steps 1 and 2 (with what lay inside) and touched nothing else
        if not key.startswith(("step-000000002/", "step-000000006")):
            assert key in left, f"retention deleted the junk key {key!r}"


def test_step_names_that_only_look_like_a_steps_are_not_steps_on_a_file_url(tmp_path):
    """Another spelling of a step's number names another directory than the one every read goes to."""
    url, root = f"file://{tmp_path}/remote", tmp_path / "remote"
    _save(url, None, tmp_path / "w", (1, 2))
    commit = (root / "step-000000002" / "COMMIT").read_bytes()
    for name in (
        "step-0000000005",
        "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0666",
        "step-000000007\n",
        "step-00000000\uff18",
    ):
        (root / name).mkdir()
        (root / name / "COMMIT").write_bytes(commit)
    tier = RemoteTier(url)
    assert tier.committed_steps() == [2, 1]
    assert sorted(tier.all_step_dirs()) == [1, 2]
    with ckpt.Checkpointer(url, local_dir=tmp_path / "next", keep=ckpt.Retention(remote=1)) as ck:
        ck.save(3, _state(3.0)).wait()
    assert _listed_and_verified(url, None) == [3]
    assert (
        len([p for p in root.iterdir() if p.name.startswith("step-")]) == 5
    )  # the lookalikes are left alone


# -- a COMMIT put that fails but lands after all ---------------------------------------------------------


def _late_commit(proxy: FaultProxy, key: str) -> Hold:
    """The first put of ``key`` reaches the store 7 s late, after its client gave up (3 s read timeout,
    :func:`_fast`) and its retry was answered 503: the writer sees a failure, the store gets the put."""
    return Hold(proxy, "PUT", key, nth=1, then="fail", hold_s=7.0)


@pytest.mark.s3
@pytest.mark.parametrize(
    "how",
    [
        "fresh step",
        pytest.param("step saved again", marks=pytest.mark.slow),
        pytest.param("promote", marks=pytest.mark.slow),
    ],
)  # one late PUT by default
def test_a_commit_put_that_lands_after_the_writer_gave_up_never_vouches_for_deleted_files(
    tmp_path, s3_bucket, how
):
    bucket, port = s3_bucket
    url, direct = f"s3://{bucket}/run", storage_options(port)
    _save(url, direct, tmp_path / "w", (1,))
    step = 2 if how == "fresh step" else 1
    proxy = FaultProxy(port)
    try:
        hold = _late_commit(proxy, f"run/{'step-%09d' % step}/COMMIT")
        opts = _fast(proxy.port)
        if how == "promote":
            with ckpt.Checkpointer(local_dir=tmp_path / "src") as ck:
                ck.save(1, _state(11.0)).wait()
            with pytest.raises(OSError):
                ckpt.promote(1, "remote", local_dir=tmp_path / "src", url=url, storage_options=opts)
        else:
            with ckpt.Checkpointer(
                url, storage_options=opts, local_dir=tmp_path / "a", keep=ckpt.Retention(remote=None)
            ) as ck:
                h = ck.save(step, _state(11.0))
                with pytest.raises(OSError):
                    h.wait("remote")
                with pytest.raises(OSError):
                    ck.wait()
        assert hold.forwarded.wait(10), "the late put did not reach the store"
        time.sleep(0.5)  # the store takes it
    finally:
        proxy.close()
    listed = _listed_and_verified(url, direct)  # whatever is listed is whole
    assert 1 in listed
    got = _restore(url, direct, tmp_path / "fresh", step=step)
    assert got[0] == step and got[1] in ((1.0, 11.0) if step == 1 else (11.0,))


class _OneRankJob:
    """A job of one rank (``Ranks``' collectives, trivially): the job tier's commit path in-process."""

    rank, world = 0, 1

    def gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def max(self, values: list[int]) -> list[int]:
        return list(values)


@pytest.mark.s3
def test_a_job_tiers_commit_put_that_lands_late_never_vouches_for_deleted_files(tmp_path, s3_bucket):
    from ckpt.tiers import LocalTier

    bucket, port = s3_bucket
    url, direct = f"s3://{bucket}/job", storage_options(port)
    with ckpt.Checkpointer(local_dir=tmp_path / "src") as ck:
        ck.save(4, _state(4.0)).wait()
    local = LocalTier(tmp_path / "src")
    _, manifest = local.open(4)
    proxy = FaultProxy(port)
    try:
        hold = _late_commit(proxy, "job/step-000000004/COMMIT")
        tier = RemoteTier(url, _fast(proxy.port))
        tier.join_job(_OneRankJob())
        with local.mapped(4) as data, pytest.raises((ckpt.CheckpointError, OSError)):
            tier.write(4, manifest, data)
        assert hold.forwarded.wait(10)
        time.sleep(0.5)
    finally:
        proxy.close()
    assert _listed_and_verified(url, direct) in ([], [4])


# -- SIGKILL of the uploading process, with the request in flight landing or not -----------------------

KILL_POINTS = {
    # name: (method, key in the request's path, which such request, whether it reaches the store)
    "a part, lost": ("PUT", "step-000000003/rank-00000/part-000001", 1, False),
    "the manifest, landed": ("PUT", "step-000000003/rank-00000.manifest.json", 1, True),
    "COMMIT, lost": ("PUT", "step-000000003/COMMIT", 1, False),
    "COMMIT, landed": ("PUT", "step-000000003/COMMIT", 1, True),
    "latest, landed": ("PUT", "run/latest", 1, True),
    "retention removing step 2's COMMIT, landed": ("POST", "?delete", 1, True),
    "retention removing step 2's files, lost": ("POST", "?delete", 2, False),
}

_CHILD = """
import sys, ckpt
from ckpt import knobs
from s3server import storage_options
from test_remote_hostile import _state, CHUNK
url, port, local_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with knobs.override(CKPT_CHUNK_BYTES=CHUNK):
    ck = ckpt.Checkpointer(url, storage_options=storage_options(port), local_dir=local_dir,
                           keep=ckpt.Retention(remote=1))
    ck.save(3, _state(3.0)).wait()
    print("finished", flush=True)
"""


#: the kill points of the default suite (a part lost, the COMMIT landing, retention's delete landing); the
#: others, a real process killed at each, with -m slow
DEFAULT_KILL_POINTS = ("a part, lost", "COMMIT, landed", "retention removing step 2's COMMIT, landed")


@pytest.mark.s3
@pytest.mark.parametrize(
    "point", [p if p in DEFAULT_KILL_POINTS else pytest.param(p, marks=pytest.mark.slow) for p in KILL_POINTS]
)
def test_sigkill_of_the_uploader_leaves_only_whole_steps_listed(tmp_path, s3_bucket, point):
    bucket, port = s3_bucket
    url, direct, fs = f"s3://{bucket}/run", storage_options(port), _fs(port)
    _save(url, direct, tmp_path / "w", (1, 2))
    method, key, nth, land = KILL_POINTS[point]
    proxy = FaultProxy(port)
    try:
        hold = Hold(proxy, method, key, nth)
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, str(proxy.port), str(tmp_path / "child")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            if not hold.hit.wait(90):
                proc.kill()
                pytest.fail(f"the uploader never sent {method} {key}: {proc.communicate()[1][-3000:]}")
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        hold.let_go(land)
        if land:
            assert hold.forwarded.wait(10)
            time.sleep(0.5)  # the store takes it
    finally:
        proxy.close()
    fs.invalidate_cache()
    listed = _listed_and_verified(url, direct)
    retention = point.startswith("retention")  # step 3 committed, step 2's COMMIT removed (or being)
    assert (3 in listed) == (retention or point in ("COMMIT, landed", "latest, landed")), listed
    assert (2 in listed) == (not retention), listed
    assert 1 in listed
    step, seed, tier = _restore(url, direct, tmp_path / "fresh")
    assert (step, seed, tier) == (listed[0], float(listed[0]), "remote")
    # the next writer's retention removes whatever the killed one left
    with ckpt.Checkpointer(
        url, storage_options=direct, local_dir=tmp_path / "next", keep=ckpt.Retention(remote=1)
    ) as ck:
        ck.save(4, _state(4.0)).wait()
    assert _listed_and_verified(url, direct) == [4]
    assert sorted(RemoteTier(url, direct).all_step_dirs()) == [4]


# -- the store stopped in the middle of an upload, and started again -------------------------------------


class _Outage:
    """At the first request for ``key`` the store goes away: that request and every one after it is
    dropped unanswered at once, then the port is closed and every open connection cut; with
    ``outage_s`` it comes back that much later, else at :meth:`end`."""

    def __init__(self, proxy: FaultProxy, key: str, outage_s: float | None) -> None:
        self.proxy, self.hit, self.cut = proxy, threading.Event(), threading.Event()
        real = proxy.faults.take

        def take(path: str = "", verb: str = "GET") -> str | None:
            if key in path and not self.hit.is_set():
                self.cut.set()
                self.hit.set()
            if self.cut.is_set():
                return "drop"
            return real(path, verb)

        def outage() -> None:
            self.hit.wait(60)
            proxy.down()
            if outage_s is not None:
                time.sleep(outage_s)
                self.end()

        proxy.faults.take = take
        threading.Thread(target=outage, daemon=True).start()

    def end(self) -> None:
        self.proxy.up()
        self.cut.clear()


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_a_short_outage_mid_upload_is_ridden_out_by_the_retries(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url = f"s3://{bucket}/run"
    proxy = FaultProxy(port)
    try:
        with ckpt.Checkpointer(
            url, storage_options=storage_options(proxy.port), local_dir=tmp_path / "a"
        ) as ck:
            ck.save(1, _state(1.0)).wait()
            outage = _Outage(proxy, "step-000000002/rank-00000/part-000001", outage_s=1.5)
            h = ck.save(2, _state(2.0))
            h.wait()  # the library's retry policy (10 attempts) outlasts 1.5 s
            assert outage.hit.is_set() and h.status == "done"
    finally:
        proxy.close()
    assert _listed_and_verified(url, storage_options(port)) == [2, 1]
    assert _restore(url, storage_options(port), tmp_path / "fresh") == (2, 2.0, "remote")


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_an_outage_mid_upload_fails_the_save_and_the_next_save_after_it_cleans_up(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url, direct = f"s3://{bucket}/run", storage_options(port)
    proxy = FaultProxy(port)
    try:
        # the constructor's probe and the first save with the default bound, then 2 s from the outage on
        with ckpt.Checkpointer(
            url, storage_options=_fast(proxy.port), local_dir=tmp_path / "a", keep=ckpt.Retention(remote=1)
        ) as ck:
            ck.save(1, _state(1.0)).wait()
            with knobs.override(CKPT_REMOTE_PROBE_S=2):
                outage = _Outage(proxy, "step-000000002/rank-00000/part-000001", outage_s=None)
                h = ck.save(2, _state(2.0))
                with pytest.raises(ConnectionError):
                    h.wait("remote")
                assert h.tier_status("local") == "done"
                assert ck.remote.status.available is False
                assert ck.remote.committed_steps() == []  # left out while down (logged), never the partial
                assert _listed_and_verified(url, direct) == [1]
            outage.end()
            ck.save(3, _state(3.0)).wait("remote")
            with pytest.raises(ConnectionError):
                ck.wait()
    finally:
        proxy.close()
    assert _listed_and_verified(url, direct) == [3]
    assert sorted(RemoteTier(url, direct).all_step_dirs()) == [3], "the partial upload of step 2 is left"
    assert _restore(url, direct, tmp_path / "fresh") == (3, 3.0, "remote")


# -- a slow, hanging or failing store never makes save() wait ---------------------------------------------


@pytest.mark.s3
@pytest.mark.timeout(180)  # a hang detector: a listing through the upload retry policy takes minutes
@pytest.mark.parametrize("outage", ["refused", pytest.param("hanging", marks=pytest.mark.slow)])
def test_a_store_that_goes_down_after_start_does_not_hold_the_first_save(tmp_path, s3_bucket, outage):
    """No restore() first, so the first save() finds the newest checkpoint's timeline itself, on every
    tier: the remote listing must not run the upload retry policy into an outage on the training
    thread (it fails within a bounded probe, like every other request to a store found down)."""
    bucket, port = s3_bucket
    url = f"s3://{bucket}/run"
    proxy = FaultProxy(port)
    try:
        opts = storage_options(proxy.port)  # the library's upload retry policy: 10 attempts
        # the constructor's probe with its default bound (a loaded 2-core CI machine took over 2 s), then 2 s
        with (
            ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "a") as ck,
            knobs.override(CKPT_REMOTE_PROBE_S=2),
        ):
            assert ck.remote.status.available is True
            if outage == "refused":
                proxy.down()
            else:
                proxy.faults.delay = 120.0
            t0 = time.monotonic()
            h = ck.save(1, _state(1.0))
            took = time.monotonic() - t0
            h.wait("local")
            with pytest.raises(ConnectionError):
                h.wait("remote")
            assert ck.remote.status.available is False
            t0 = time.monotonic()
            ck.save(2, _state(2.0))
            second = time.monotonic() - t0
            with pytest.raises(ConnectionError):
                ck.wait()
            proxy.up()
            proxy.faults.delay = 0.0
        assert took < 12, f"the first save() waited {took:.1f} s for a store that is down"
        assert second < 2, f"the second save() waited {second:.1f} s"
    finally:
        proxy.faults.delay = 0.0
        proxy.close()


@pytest.mark.s3
def test_a_slow_store_makes_the_remote_tier_skip_snapshots_never_save_wait(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url = f"s3://{bucket}/run"
    proxy = FaultProxy(port)
    try:
        with ckpt.Checkpointer(
            url, storage_options=storage_options(proxy.port), local_dir=tmp_path / "a"
        ) as ck:
            assert ck.restore(_target()) is None
            proxy.faults.delay = 0.25  # every request to the store takes 0.25 s: an upload ~2.5 s
            stalls, handles = [], []
            for s in range(1, 7):
                t0 = time.monotonic()
                handles.append(ck.save(s, _state(float(s))))
                stalls.append(time.monotonic() - t0)
                time.sleep(0.05)
            ck.wait()
            proxy.faults.delay = 0.0
            remote = ck.remote.committed_steps()
        assert max(stalls) < 1.5, f"save() waited for the slow store: {[round(s, 2) for s in stalls]}"
        assert all(h.tier_status("local") in ("done", "skipped") for h in handles)
        assert any(h.tier_status("remote") == "skipped" for h in handles), (
            "the store was not slower than the saves"
        )
        newest = max(h.step for h in handles if h.status != "skipped")
        assert newest in remote, "the remote tier did not write the newest snapshot next (newest wins)"
    finally:
        proxy.faults.delay = 0.0
        proxy.close()
    assert all(s in _listed_and_verified(url, storage_options(port)) for s in remote)


# -- retention while uploads keep failing ------------------------------------------------------------------

# the requests the store answers 503 while a step is saved: its upload fails at each stage in turn, or
# its upload commits and retention after it fails
UPLOAD_FAILS = {
    2: lambda verb, path: verb == "PUT" and "part-000002" in path,
    3: lambda verb, path: verb == "PUT" and "manifest" in path,
    4: lambda verb, path: verb == "PUT" and "step-000000004/COMMIT" in path,
}
RETENTION_FAILS = {
    2: lambda verb, path: verb == "POST" and "delete" in path,
    3: lambda verb, path: verb in ("GET", "HEAD") and "COMMIT" in path and "step-000000003" not in path,
}


@pytest.mark.s3
@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing", [pytest.param("uploads", marks=pytest.mark.slow), "retention"])
def test_retention_under_repeated_failures_always_keeps_a_checkpoint_that_verifies(
    tmp_path, s3_bucket, failing
):
    bucket, port = s3_bucket
    url, direct = f"s3://{bucket}/run", storage_options(port)
    failures = UPLOAD_FAILS if failing == "uploads" else RETENTION_FAILS
    last = max(failures) + 1
    proxy = FaultProxy(port)
    try:
        # the store answers every request (503 to the failing ones): the probe keeps its default bound
        with ckpt.Checkpointer(
            url,
            storage_options=_fast(proxy.port),
            local_dir=tmp_path / "a",
            keep=ckpt.Retention(local=1, remote=1),
        ) as ck:
            ck.save(1, _state(1.0)).wait()
            good = {1}
            for step in range(2, last + 1):
                proxy.faults.fail_if = failures.get(step)
                h = ck.save(step, _state(float(step)))
                try:
                    h.wait("remote")
                    good.add(step)
                except OSError:
                    assert failing == "uploads" and step in failures
                proxy.faults.fail_if = None
                listed = _listed_and_verified(url, direct)  # only whole steps, every time
                assert listed and listed[0] == max(good), (step, listed)
                assert set(listed) <= good, (step, listed)
            with pytest.raises(OSError) if failing == "uploads" else contextlib.nullcontext():
                ck.wait()
    finally:
        proxy.close()
    assert _listed_and_verified(url, direct) == [last]
    assert sorted(RemoteTier(url, direct).all_step_dirs()) == [last], "leftovers of the failed writes remain"
    assert _restore(url, direct, tmp_path / "fresh") == (last, float(last), "remote")


# -- restore falls back tier by tier ---------------------------------------------------------------------


@pytest.mark.s3
def test_restore_falls_back_tier_by_tier_and_refills_the_local_copy(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url, opts, fs = f"s3://{bucket}/run", storage_options(port), _fs(port)
    local = tmp_path / "a"
    with ckpt.Checkpointer(
        url, storage_options=opts, local_dir=local, keep=ckpt.Retention(local=None, remote=None)
    ) as ck:
        for s in (1, 2, 3):
            ck.save(s, _state(float(s))).wait()
    shutil.rmtree(local / "step-000000003")  # 3: on the remote tier alone, and damaged there
    _flip(fs, _part(f"{bucket}/run/step-000000003", 0))
    data = local / "step-000000002" / "rank-00000.bin"  # 2: damaged on the local tier, whole on the remote
    raw = bytearray(data.read_bytes())
    raw[5000] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = _target()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=local) as ck:
        with pytest.warns(RuntimeWarning):
            assert ck.restore(target) == 2
        assert ck.last_restore.tier == "remote" and _seed_of(target) == 2.0
        assert ck.remote.verified.get(3) is False and len(ck.last_restore.skipped) == 2  # remote 3, local 2
    assert _restore(url, opts, local, step=2) == (2, 2.0, "local")  # the local copy was replaced on the way
    # the store down as well: the local tier alone, older steps
    proxy = FaultProxy(port)
    proxy.down()
    try:
        with knobs.override(CKPT_REMOTE_PROBE_S=2):
            raw = bytearray(data.read_bytes())
            raw[5000] ^= 0xFF
            data.write_bytes(bytes(raw))
            with pytest.warns(RuntimeWarning):
                assert _restore(url, _fast(proxy.port), local) == (1, 1.0, "local")
    finally:
        proxy.close()


# -- two processes with the same url and local_dir -------------------------------------------------------

_OWNER = """
import sys, ckpt
from ckpt import knobs
from s3server import storage_options
from test_remote_hostile import _state, CHUNK
url, port, local_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with knobs.override(CKPT_CHUNK_BYTES=CHUNK):
    with ckpt.Checkpointer(url, storage_options=storage_options(port), local_dir=local_dir,
                           keep=ckpt.Retention(remote=2)) as ck:
        for line in sys.stdin:
            step = int(line)
            ck.save(step, _state(float(step))).wait()
            print("saved", step, flush=True)
print("closed", flush=True)
"""


@pytest.mark.s3
def test_a_second_process_with_the_same_url_and_local_dir_writes_nothing_to_the_store(tmp_path, s3_bucket):
    bucket, port = s3_bucket
    url, direct = f"s3://{bucket}/run", storage_options(port)
    local = tmp_path / "shared"
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, url, str(port), str(local)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proxy = FaultProxy(port)  # the second process's own way to the store: every request it sends is seen
    writes: list[tuple[str, str]] = []
    real = proxy.faults.take

    def take(path: str = "", verb: str = "GET") -> str | None:
        if verb in ("PUT", "POST", "DELETE"):
            writes.append((verb, path))
        return real(path, verb)

    proxy.faults.take = take
    try:

        def owner_saves(step: int) -> None:
            owner.stdin.write(f"{step}\n")
            owner.stdin.flush()
            line = owner.stdout.readline()
            assert line.split() == ["saved", str(step)], (
                line,
                owner.stderr.read()[-3000:] if not line else "",
            )

        owner_saves(1)
        with ckpt.Checkpointer(
            url, storage_options=storage_options(proxy.port), local_dir=local, keep=ckpt.Retention(remote=1)
        ) as ck:
            with pytest.raises(ckpt.LockedError):
                ck.save(2, _state(-2.0))
            with pytest.raises(ckpt.LockedError):
                ck.promote(1, to="local")
            target = _target()
            assert ck.restore(target) == 1 and _seed_of(target) == 1.0  # reading needs no lock
            owner_saves(2)
            owner_saves(3)
            assert ck.remote.committed_steps() == [3, 2]
            with pytest.raises(ckpt.LockedError):
                ck.save(4, _state(-4.0))
        owner_saves(4)
        owner.stdin.close()
        assert owner.stdout.readline().strip() == "closed"
        assert owner.wait(60) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        proxy.close()
    assert writes == [], f"the second process wrote to the store: {writes}"
    assert _listed_and_verified(url, direct) == [4, 3]
    assert _restore(url, direct, tmp_path / "fresh") == (4, 4.0, "remote")


@pytest.mark.s3
def test_a_consumer_restoring_while_the_trainer_prunes_the_store_loads_the_newer_step(
    tmp_path, s3_bucket, monkeypatch
):
    """A second job (evaluation, a fresh node) restores from the store a training job keeps writing: the steps
    it listed are pruned and a newer one committed before it reads them. It lists again and loads the newer
    one, instead of falling back past them to "no checkpoint"."""
    bucket, port = s3_bucket
    url, opts = f"s3://{bucket}/run", storage_options(port)
    _save(url, opts, tmp_path / "trainer", [1, 2])
    real, fired = RemoteTier.restore_into, []

    def racing(self, state, step, *a, **kw):
        if (
            not fired
        ):  # the trainer commits 3 and its retention (remote=1) deletes 1 and 2, just before the read
            fired.append(step)
            with ckpt.Checkpointer(
                url,
                storage_options=opts,
                local_dir=tmp_path / "trainer",
                keep=ckpt.Retention(local=None, remote=1),
            ) as trainer:
                trainer.save(3, _state(3.0)).wait()
        return real(self, state, step, *a, **kw)

    monkeypatch.setattr(RemoteTier, "restore_into", racing)
    target = _target()
    with ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "consumer") as ck:
        assert ck.restore(target) == 3
        assert ck.last_restore.tier == "remote" and ck.last_restore.skipped == []
        assert ck.timeline.number == 0  # the newest was restored: no rollback, no new branch
    assert fired == [2] and _seed_of(target) == 3.0

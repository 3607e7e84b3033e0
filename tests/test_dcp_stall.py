"""A DCP save or load whose store stalls is bounded (``CKPT_REMOTE_STALL_S``, ckpt.stall), and the layouts the
DCP adapter's data files take on an object store round-trip.

The store, behind a TCP relay on loopback (tests/s3server.py ``StallProxy``) in front of moto's server, accepts
the connections and then stops reading and answering. Each request of the adapter (a part of a rank's data
file, a record, a listing, a range read) runs under the watchdog: it is aborted and sent again after
``CKPT_REMOTE_STALL_S`` seconds, and after three attempts the save fails with a ``TimeoutError`` naming the
rank's file (no ``COMMIT``, the previous checkpoint untouched), and so does a load. Both S3 clients: s3fs (a
data file is one object, by a multipart upload whose every request is watched) and pyarrow's (one object per
part, ``rank-RRRRR.dcp.bin.parts/NNNNNN``).
"""

from __future__ import annotations

import errno
import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt import Retention, knobs
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter, list_checkpoints, prune, verify
from s3server import StallProxy, storage_options

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

#: seconds within which a stalled save or load must have failed: 3 attempts of 1 s, the backoffs between
#: them, and a loaded 2-core machine's slack; the client's own policy alone takes minutes
BOUND_S = 25
MIB = 1 << 20


@pytest.fixture
def stalling(s3_bucket, s3_client):
    """(url, options through the relay, the relay, direct options) with a 1 s stall deadline and 1 MiB parts
    (s3fs's multipart parts: S3's least, 5 MiB)."""
    bucket, port = s3_bucket
    proxy = StallProxy(port)
    # the client alone would wait 2 x 5 s for an answer: longer than the watchdog's 1 s (what is tested), and
    # short enough that the calls the watchdog abandons to their threads (pyarrow's: it cannot cancel them) end
    # within seconds; until they do, pyarrow's S3 client makes the next request in this process wait
    client = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "read_timeout": 5}}
    with knobs.override(CKPT_CHUNK_BYTES=MIB, CKPT_REMOTE_STALL_S=1, CKPT_REMOTE_PROBE_S=2):
        yield f"s3://{bucket}/run", storage_options(proxy.port, **client), proxy, storage_options(port)
    proxy.close()


def _state(seed: int, mib: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = mib * MIB // 4 // 3
    return {
        "model": {
            **{f"w{i}": torch.randn(n, generator=g) for i in range(3)},
            "empty": torch.zeros(0, 7),
            "half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        },
        "extra": {"step": seed, "name": "run", "blob": b"\x00\x01"},
    }


def _blank(state: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "extra": {"step": 0, "name": "", "blob": b""},
    }


def _assert_equal(loaded: dict, ref: dict) -> None:
    for k, v in ref["model"].items():
        assert loaded["model"][k].dtype == v.dtype and torch.equal(loaded["model"][k], v), k
    assert loaded["extra"] == ref["extra"]


def _s3fs(opts: dict):
    import s3fs

    return s3fs.S3FileSystem(**opts, skip_instance_cache=True)


def _inner(exc: CheckpointException) -> BaseException:
    return exc.failures[0][0]


def test_a_save_whose_upload_stalls_mid_file_fails_in_bounded_time_and_commits_nothing(
    stalling, s3_client, monkeypatch
):
    url, opts, proxy, direct = stalling
    first = _state(1)
    dcp.save(first, storage_writer=TierStorageWriter(url=url, storage_options=opts), checkpoint_id="step-1")
    # the third part's request, and everything after it: s3fs's multipart part 3, pyarrow's part object 000002
    proxy.stall(after=b"partNumber=3&" if s3_client == "s3fs" else b".dcp.bin.parts/000002")
    t0 = time.monotonic()
    with pytest.warns(UserWarning), pytest.raises(CheckpointException) as e:
        dcp.save(
            _state(2), storage_writer=TierStorageWriter(url=url, storage_options=opts), checkpoint_id="step-2"
        )
    took = time.monotonic() - t0
    err = _inner(e.value)
    assert isinstance(err, TimeoutError) and err.errno == errno.ETIMEDOUT, repr(err)
    assert "/run/step-2/rank-00000.dcp.bin" in err.filename, (
        err.filename
    )  # the URL of rank 0's file (or part)
    if s3_client == "arrow":
        assert err.filename.endswith(".dcp.bin.parts/000002"), err.filename
    assert took < BOUND_S, took
    fs = _s3fs(direct)
    root = url.removeprefix("s3://")
    assert fs.exists(f"{root}/step-1/COMMIT") and not fs.exists(f"{root}/step-2/COMMIT")
    assert not fs.exists(f"{root}/step-2/rank-00000.dcp.bin")  # no object published from a torn upload
    # read back through s3fs: pyarrow's S3 client would first wait for the calls left to their threads
    monkeypatch.setenv("CKPT_S3_BACKEND", "s3fs")
    loaded = _blank(first)
    dcp.load(
        loaded, storage_reader=TierStorageReader(url=url, storage_options=direct), checkpoint_id="step-1"
    )
    _assert_equal(loaded, first)


def test_an_upload_from_local_dir_that_stalls_commits_the_local_copy_only(
    stalling, s3_client, tmp_path, monkeypatch
):
    # the rank's file goes up from local_dir in parallel parts (the remote tier's pool): a stalled part
    # fails that upload within the bound, the remote tier gets no COMMIT, the local copy is committed
    url, opts, proxy, direct = stalling
    local = tmp_path / "local"
    first = _state(5)
    dcp.save(
        first,
        storage_writer=TierStorageWriter(local_dir=local, url=url, storage_options=opts),
        checkpoint_id="step-1",
    )
    proxy.stall(after=b"partNumber=3&" if s3_client == "s3fs" else b".dcp.bin.parts/000002")
    second = _state(6)
    t0 = time.monotonic()
    with pytest.warns(UserWarning):
        dcp.save(
            second,
            storage_writer=TierStorageWriter(local_dir=local, url=url, storage_options=opts),
            checkpoint_id="step-2",
        )
    assert time.monotonic() - t0 < BOUND_S
    fs = _s3fs(direct)
    root = url.removeprefix("s3://")
    assert fs.exists(f"{root}/step-1/COMMIT") and not fs.exists(f"{root}/step-2/COMMIT")
    assert not fs.exists(f"{root}/step-2/rank-00000.dcp.bin")  # no object published from a torn upload
    assert (local / "step-2" / "COMMIT").is_file()
    loaded = _blank(second)
    dcp.load(loaded, storage_reader=TierStorageReader(local_dir=local), checkpoint_id="step-2")
    _assert_equal(loaded, second)
    monkeypatch.setenv("CKPT_S3_BACKEND", "s3fs")  # pyarrow's client waits for the calls left to threads
    loaded = _blank(first)
    dcp.load(
        loaded, storage_reader=TierStorageReader(url=url, storage_options=direct), checkpoint_id="step-1"
    )
    _assert_equal(loaded, first)


def test_a_load_whose_reads_stall_fails_in_bounded_time(stalling, s3_client, monkeypatch):
    url, opts, proxy, direct = stalling
    state = _state(3, mib=3)
    monkeypatch.setenv("CKPT_S3_BACKEND", "s3fs")  # written directly; read through the relay by `s3_client`
    dcp.save(state, storage_writer=TierStorageWriter(url=url, storage_options=direct), checkpoint_id="step-3")
    monkeypatch.setenv("CKPT_S3_BACKEND", s3_client)
    proxy.stall(after=b"rank-00000.dcp.bin")  # the COMMIT and the metadata come through, the data does not
    t0 = time.monotonic()
    with pytest.raises(CheckpointException) as e:
        dcp.load(
            _blank(state),
            storage_reader=TierStorageReader(url=url, storage_options=opts),
            checkpoint_id="step-3",
        )
    assert time.monotonic() - t0 < BOUND_S
    err = _inner(e.value)
    assert isinstance(err, TimeoutError) and err.errno == errno.ETIMEDOUT, repr(err)
    assert "/run/step-3/rank-00000.dcp.bin" in err.filename, err.filename


@pytest.mark.parametrize("writer,reader", [("s3fs", "arrow"), ("arrow", "s3fs"), ("arrow", "arrow")])
@pytest.mark.parametrize("with_local", [False, True], ids=["url-only", "local+url"])
def test_a_data_file_in_parts_or_in_one_object_round_trips_bit_exact(
    s3_bucket, tmp_path, monkeypatch, writer, reader, with_local
):
    pytest.importorskip("pyarrow")
    bucket, port = s3_bucket
    url, opts = f"s3://{bucket}/run", storage_options(port)
    tiers = {"url": url, "storage_options": opts, **({"local_dir": tmp_path / "local"} if with_local else {})}
    state = _state(4)
    # a request the loaded store never answers is the watchdog's to retry (after 10 s), not the client's (60 s)
    with knobs.override(CKPT_CHUNK_BYTES=MIB, CKPT_REMOTE_STALL_S=10):
        monkeypatch.setenv("CKPT_S3_BACKEND", writer)
        dcp.save(state, storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-4")
        fs = _s3fs(opts)
        base = f"{bucket}/run/step-4"
        items = json.loads(fs.cat_file(f"{base}/metadata.json"))["items"]
        size = max(i["offset_bytes"] + i["length"] for i in items)
        if writer == "s3fs":  # one object (a multipart upload of 5 MiB parts); nothing says parts
            assert fs.info(f"{base}/rank-00000.dcp.bin")["size"] == size
            assert all("part_bytes" not in i for i in items)
        else:  # one object per 1 MiB part, the part size recorded with every item
            parts = sorted(fs.ls(f"{base}/rank-00000.dcp.bin.parts"))
            assert len(parts) == -(-size // MIB) > 1 and not fs.exists(f"{base}/rank-00000.dcp.bin")
            assert [fs.info(p)["size"] for p in parts] == [MIB] * (len(parts) - 1) + [
                size - MIB * (len(parts) - 1)
            ]
            assert all(i["part_bytes"] == MIB for i in items)
        assert [r["bytes"] for r in list_checkpoints(url, opts)] == [size]
        monkeypatch.setenv("CKPT_S3_BACKEND", reader)
        assert verify(url, "step-4", opts)["bytes"] == size
        loaded = _blank(state)
        dcp.load(
            loaded, storage_reader=TierStorageReader(url=url, storage_options=opts), checkpoint_id="step-4"
        )
    _assert_equal(loaded, state)


def _ids(fs, root: str) -> set[str]:
    """The checkpoint ids of the objects under ``root`` (not the empty directory markers pyarrow makes)."""
    return {p[len(root) :].split("/")[1] for p in fs.find(root) if not p.endswith("/")}


def test_retention_and_prune_remove_a_checkpoints_parts(s3_bucket, monkeypatch):
    pytest.importorskip("pyarrow")
    monkeypatch.setenv("CKPT_S3_BACKEND", "arrow")  # the layout of parts
    bucket, port = s3_bucket
    url, opts = f"s3://{bucket}/run", storage_options(port)
    fs = _s3fs(opts)
    with knobs.override(CKPT_CHUNK_BYTES=64 << 10):
        for i in (1, 2, 3):
            dcp.save(
                _state(i, mib=1),
                storage_writer=TierStorageWriter(url=url, storage_options=opts, keep=Retention(remote=1)),
                checkpoint_id=f"step-{i}",
            )
        assert [r["id"] for r in list_checkpoints(url, opts)] == ["step-3"]
        assert _ids(fs, f"{bucket}/run") == {"step-3"}
        assert len(fs.ls(f"{bucket}/run/step-3/rank-00000.dcp.bin.parts")) > 1
        dcp.save(
            _state(4, mib=1),
            storage_writer=TierStorageWriter(url=url, storage_options=opts),
            checkpoint_id="step-4",
        )
        assert prune(url, 1, opts) == ["step-3"]
    assert _ids(fs, f"{bucket}/run") == {"step-4"}

"""A remote request that stalls is bounded (``CKPT_REMOTE_STALL_S``, ckpt.stall).

The store, behind a TCP relay on loopback (tests/s3server.py ``StallProxy``) in front of moto's server,
accepts the connections and then stops reading and answering. The client's own policy (botocore's 60 s
read timeout, 10 attempts) would hold the upload for many minutes; the watchdog aborts each request after
``CKPT_REMOTE_STALL_S`` seconds, sends it again, and after three attempts fails that save's remote copy
with a ``TimeoutError`` naming the part's URL. ``wait()``, ``close()`` and a restore never hang. Both S3
clients: s3fs (an asynchronous file system: the request is cancelled) and pyarrow's (a blocking call: it
is left to its thread).
"""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

import ckpt
from ckpt import knobs
from s3server import StallProxy, storage_options

pytestmark = pytest.mark.s3

N = 100_000  # 400 kB of float32: 7 parts of 64 kB
#: seconds within which a stalled save or restore must have failed: 3 attempts of 1 s, the backoffs between
#: them, a bounded probe, and a loaded 2-core machine's slack; the client's own policy alone takes minutes
BOUND_S = 25


@pytest.fixture
def stalling(s3_bucket, s3_client):
    """(url through the relay, its storage_options, the relay, a direct url and options) with a 1 s stall
    deadline and a 2 s probe."""
    bucket, port = s3_bucket
    proxy = StallProxy(port)
    # The client alone would wait 2 x 5 s for an answer: longer than the watchdog's 1 s (what is tested), and
    # short enough that the calls the watchdog abandons to their threads (pyarrow's: it cannot cancel them) end
    # within seconds; until they do, pyarrow's S3 client makes the next request in this process wait
    client = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "read_timeout": 5}}
    with knobs.override(CKPT_CHUNK_BYTES=64 << 10, CKPT_REMOTE_STALL_S=1, CKPT_REMOTE_PROBE_S=2):
        yield f"s3://{bucket}/run", storage_options(proxy.port, **client), proxy, storage_options(port)
    proxy.close()


def _state(seed: float) -> dict:
    return {"w": torch.arange(N, dtype=torch.float32).add_(seed), "seed": seed}


def _closed_within(ck: ckpt.Checkpointer, seconds: float) -> bool:
    t = threading.Thread(target=ck.close, kwargs={"raise_errors": False}, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_a_stalled_upload_fails_the_saves_remote_copy_in_bounded_time(stalling, local_dir):
    url, opts, proxy, direct = stalling
    ck = ckpt.Checkpointer(url, storage_options=opts, local_dir=local_dir)
    try:
        ck.save(1, _state(1.0)).wait()  # through the relay while it forwards
        proxy.stall(after=b"/part-")  # the next part's request, and everything after it
        t0 = time.monotonic()
        handle = ck.save(2, _state(2.0))
        with pytest.raises(OSError) as e:
            handle.wait("remote", timeout=120)
        took = time.monotonic() - t0
        assert isinstance(e.value, TimeoutError) and e.value.errno == errno.ETIMEDOUT, repr(e.value)
        assert "/step-000000002/rank-00000/part-" in e.value.filename, e.value.filename
        assert took < BOUND_S, took
        handle.wait("local")  # the nearer tiers have the step
        assert 2 in ck.local.committed_steps()
    finally:
        t0 = time.monotonic()
        assert _closed_within(ck, BOUND_S * 2), "close() hung"
    assert time.monotonic() - t0 < BOUND_S * 2
    import s3fs  # asked directly (pyarrow's S3 client waits for its calls left to their threads to end)

    fs = s3fs.S3FileSystem(**direct, skip_instance_cache=True)
    root = url.removeprefix("s3://")
    assert fs.exists(f"{root}/step-000000001/COMMIT") and not fs.exists(f"{root}/step-000000002/COMMIT")


# pyarrow's client leaves each stalled call to its thread and waits for those at the end: about a minute
@pytest.mark.parametrize("s3_client", ["s3fs", pytest.param("arrow", marks=pytest.mark.slow)], indirect=True)
def test_a_restore_whose_reads_stall_falls_back_in_bounded_time(stalling, tmp_path):
    url, opts, proxy, direct = stalling
    with ckpt.Checkpointer(url, storage_options=direct, local_dir=tmp_path / "writer") as ck:
        ck.save(3, _state(3.0)).wait()
    reader = ckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "fresh")
    try:
        proxy.stall(after=b"/part-")  # the listing and the records come through, the data does not
        t0 = time.monotonic()
        with pytest.raises(ckpt.NoCheckpointError) as e:
            reader.restore({"w": torch.empty(N), "seed": None})
        assert time.monotonic() - t0 < BOUND_S
        assert "/step-000000003/rank-00000/part-" in str(
            e.value
        )  # what stalled is named among what was tried
        assert not (tmp_path / "fresh" / "step-000000003").exists()  # no refill of a read that stalled
    finally:
        assert _closed_within(reader, BOUND_S), "close() hung"

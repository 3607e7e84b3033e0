"""A file of a caller's own layout on a store (:mod:`ckpt.tiers.remote_file`, what the DCP adapter keeps a rank's
data file in), through the remote tier's store client built as the tier builds it: it goes up in parts, as it is
produced or from a finished file, in the form its store takes (one file on a ``file://`` URL, one object per part
on ``memory://``), any range of it reads back bit-exact, and an upload that fails mid-file publishes nothing and
leaves nothing behind. The S3 forms (s3fs's multipart upload, pyarrow's parts) run through the DCP adapter in
tests/test_dcp_stall.py and tests/test_dcp_adapter.py."""

from __future__ import annotations

import errno
import os
import uuid

import pytest

from ckpt.fs import resolve
from ckpt.tiers.remote_file import PARTS, FileUpload, form_of, read_file
from ckpt.tiers.remote_store import OnHost, StoreClient

PART = 4096


def _client(tmp_path, scheme: str) -> StoreClient:
    url = f"file://{tmp_path}/store" if scheme == "file" else f"memory://remote-file-{uuid.uuid4().hex}"
    return StoreClient(url, resolve(url))


def _upload(client: StoreClient, path: str, data: bytes, feed: str, tmp_path) -> FileUpload:
    up = FileUpload(client, path, "the test's file", PART)
    if feed == "stream":
        for a in range(0, len(data), 3000):  # pieces that straddle the parts
            up.write(data[a : a + 3000])
        up.close()
    else:
        src = tmp_path / "src.bin"
        src.write_bytes(data)
        up.send_file(str(src))
    return up


@pytest.mark.parametrize("feed", ["stream", "from-file"])
@pytest.mark.parametrize("scheme,form", [("file", "file"), ("memory", "parts")])
def test_a_file_goes_up_in_its_stores_form_and_any_range_reads_back_bit_exact(tmp_path, scheme, form, feed):
    client = _client(tmp_path, scheme)
    assert form_of(client) == form
    data = os.urandom(10 * PART + 123)
    path = f"{client.root}/ck/rank.bin"
    _upload(client, path, data, feed, tmp_path)
    if form == "file":
        assert os.path.getsize(path) == len(data)
        assert os.listdir(os.path.dirname(path)) == ["rank.bin"]  # no temporary file left
        part_bytes = None
    else:
        parts = sorted(client.fs.ls(path + PARTS, detail=False))
        assert len(parts) == 11 and not client.fs.exists(path)
        part_bytes = PART
    n = len(data)
    for start, end in [(0, n), (0, 1), (PART - 1, PART + 1), (5000, 13000), (n - 5, n + 100), (n, n)]:
        got = read_file(client, path, start, end, part_bytes)
        assert bytes(got) == data[start:end], (start, end)


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_an_upload_that_fails_mid_file_publishes_nothing_and_leaves_nothing(tmp_path, scheme, monkeypatch):
    client = _client(tmp_path, scheme)
    path = f"{client.root}/ck/rank.bin"
    full = OSError(errno.ENOSPC, "no space left (injected)")
    if scheme == "file":
        write_at = OnHost.write_at

        def failing(p, data, offset):
            if offset >= 2 * PART:
                raise full
            write_at(p, data, offset)

        monkeypatch.setattr(OnHost, "write_at", staticmethod(failing))
    else:
        pipe_file = client.fs.inner.pipe_file

        def failing(p, data, **kw):
            if p.endswith("/000002"):
                raise full
            return pipe_file(p, data, **kw)

        monkeypatch.setattr(client.fs.inner, "pipe_file", failing)
    up = FileUpload(client, path, "the test's file", PART)
    with pytest.raises(OSError) as e:
        for _ in range(5):
            up.write(os.urandom(PART))
        up.close()
    assert e.value.errno == errno.ENOSPC
    assert up.abort() is None  # everything it sent is removed
    assert not client.fs.exists(path) and not client.fs.exists(path + PARTS)
    if scheme == "file":
        assert os.listdir(os.path.dirname(path)) == []  # the temporary file went too

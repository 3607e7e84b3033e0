"""CRC-32C of a buffer's chunks on its GPU (``ckpt.device_crc``): the same values as the host's
``ckpt.integrity.checksum``, for every length (whole blocks, a tail, a chunk shorter than a block) and
chunk size (a power of two of blocks or not), and a changed byte changes its own chunk's value only. The
same tensor operations run on the CPU here and on the GPU of the device machine, where a snapshot-sized
buffer is checked too."""

from __future__ import annotations

import types

import pytest
import torch

from ckpt import device_crc
from ckpt.integrity import checksum

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

B = device_crc.BLOCK


def _host(data: torch.Tensor, chunk: int) -> list[int]:
    flat = data.cpu()
    return [checksum(memoryview(flat[i : i + chunk].numpy())) for i in range(0, flat.numel(), chunk)]


@pytest.mark.parametrize(
    "n, chunk",
    [
        (5 * B + 123, 2 * B),  # whole blocks, then a tail in the last chunk
        (33 * B + 7, 16 * B),  # chunks of 16 blocks (four carry operators), a short last chunk
        (100, B),  # less than a block: all on the host
        (8 * B, 8 * B),  # one chunk, exactly
        (8 * B + 4, 8 * B),  # a last chunk of four bytes
        (13 * B + 9, 3 * B),  # three blocks a chunk: padded in front to four
        ((64 << 20) + 4093, 16 << 20),  # the format's default chunk, a tail
    ],
    ids=[
        "tail",
        "sixteen-blocks",
        "under-a-block",
        "one-chunk",
        "four-byte-chunk",
        "three-block-chunks",
        "default-chunks",
    ],
)
def test_chunk_checksums_equal_the_hosts(n, chunk):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEVICE)
    assert device_crc.usable(data, chunk)
    assert device_crc.chunk_checksums(data, chunk) == _host(data, chunk)


def test_a_changed_byte_changes_its_own_chunk_only():
    chunk = 2 * B
    data = torch.randint(0, 256, (6 * B,), dtype=torch.uint8, device=DEVICE)
    before = device_crc.chunk_checksums(data, chunk)
    data[3 * B + 17] ^= 1  # a bit flip in chunk 1
    after = device_crc.chunk_checksums(data, chunk)
    assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [1]
    assert after == _host(data, chunk)


def test_buffers_it_cannot_check_are_said_so_and_refused():
    data = torch.zeros(4 * B + 1, dtype=torch.uint8, device=DEVICE)
    assert not device_crc.usable(data, B + 4)  # chunks not a multiple of a block
    assert not device_crc.usable(data.view(torch.int8), B)  # not bytes
    assert not device_crc.usable(data[1:], B)  # not four-byte aligned
    assert not device_crc.usable(data.view(1, -1), B)  # not flat
    with pytest.raises(ValueError):
        device_crc.chunk_checksums(data[1:], B)
    assert device_crc.chunk_checksums(data[:0], B) == []


@pytest.mark.gpu
def test_a_snapshot_sized_buffer_on_the_gpu():
    """Over 2 GiB and a tail (more than one pass of the first stage; int32 word offsets past 2**31 bytes),
    chunks of 16 MiB: every value equal to the host's."""
    n, chunk = (2 << 30) + (48 << 20) + 4093, 16 << 20
    data = torch.randint(-(2**31), 2**31 - 1, (-(-n // 4),), dtype=torch.int32, device="cuda").view(
        torch.uint8
    )[:n]
    assert device_crc.chunk_checksums(data, chunk) == _host(data, chunk)


class _Wire:
    """Stands in for the peer tier's transport: the bytes 'land' in ``into`` as the holder sent them."""

    device = None  # the transport moves host bytes (no GPU staging)

    def __init__(self, sent: torch.Tensor) -> None:
        self.sent = sent

    def data(self, out, to, into, frm, in_piece, landed, out_ready=None):
        into.copy_(self.sent)
        landed(0, into.numel())


@pytest.mark.parametrize("flip", [None, 0, 2, "last"])
def test_a_copy_received_onto_the_device_is_checked_there_and_a_bad_chunk_named(monkeypatch, flip):
    """The peer tier's receive (``checked_receive``) with the copy landing on a device: the device computes
    the checks, and a changed byte names exactly its chunk (the restore then refuses the copy)."""
    from ckpt.tiers import peer

    monkeypatch.setattr(
        peer, "_checked_where_it_lands", lambda into: True
    )  # this CPU tensor stands for a GPU's
    called = []
    real = device_crc.chunk_checksums
    monkeypatch.setattr(device_crc, "chunk_checksums", lambda d, c: called.append(d.numel()) or real(d, c))
    chunk, n = 4 * B, 13 * B + 21
    sent = torch.randint(0, 256, (n,), dtype=torch.uint8)
    manifest = types.SimpleNamespace(chunk_bytes=chunk, data_bytes=n, chunks=_host(sent, chunk))
    if flip is not None:
        at = {0: 5, 2: 2 * chunk + 7, "last": n - 1}[flip]
        sent = sent.clone()
        sent[at] ^= 0x40
    into = torch.empty(n, dtype=torch.uint8)
    bad = peer.checked_receive(_Wire(sent), None, None, into, 1, 1 << 20, manifest)
    assert called == [n]
    assert bad == ({None: [], 0: [0], 2: [2], "last": [3]}[flip])


def test_a_manifest_listing_other_chunks_than_the_bytes_fails(monkeypatch):
    from ckpt.tiers import peer

    monkeypatch.setattr(peer, "_checked_where_it_lands", lambda into: True)
    chunk, n = 2 * B, 6 * B
    sent = torch.randint(0, 256, (n,), dtype=torch.uint8)
    sums = _host(sent, chunk)
    for listed in (sums[:-1], sums + [0]):  # one chunk short, one too many
        manifest = types.SimpleNamespace(chunk_bytes=chunk, data_bytes=n, chunks=listed)
        assert peer.checked_receive(
            _Wire(sent), None, None, torch.empty(n, dtype=torch.uint8), 1, 1 << 20, manifest
        ) == [len(sums) - 1 if len(listed) < len(sums) else len(sums)]


def test_warm_without_triton_makes_the_tables_a_check_uses(monkeypatch):
    monkeypatch.setattr(device_crc, "_kernels_ready", {})
    monkeypatch.setattr(
        device_crc, "_lane_bytes", lambda chunk: None
    )  # as for a chunk the kernel cannot take
    device_crc._tables.cache_clear()
    device_crc.warm(torch.device(DEVICE), 16 * B)
    assert not device_crc.ready(torch.device(DEVICE))
    made = device_crc._tables.cache_info().currsize
    assert made >= 5  # the four-byte step and one per level of the 16-block combine
    data = torch.randint(0, 256, (40 * B,), dtype=torch.uint8, device=DEVICE)
    assert device_crc.chunk_checksums(data, 16 * B) == _host(data, 16 * B)
    assert device_crc._tables.cache_info().currsize == made  # nothing left to build
    device_crc.warm(torch.device(DEVICE), 100)  # a chunk it cannot check: left alone


class _PieceWire:
    """Lands the sent bytes piece by piece, noting how many checks had started when each piece landed."""

    device = None  # the transport moves host bytes (no GPU staging)

    def __init__(self, sent: torch.Tensor, piece: int, started: list) -> None:
        self.sent, self.piece, self.started, self.seen = sent, piece, started, []

    def data(self, out, to, into, frm, in_piece, landed, out_ready=None):
        for a in range(0, into.numel(), self.piece):
            b = min(a + self.piece, into.numel())
            into[a:b].copy_(self.sent[a:b])
            self.seen.append(len(self.started))
            landed(a, b - a)


@pytest.mark.parametrize("flip", [None, 1, 6])
def test_a_copy_is_checked_in_batches_of_whole_chunks_while_later_pieces_arrive(monkeypatch, flip):
    from ckpt.tiers import peer

    monkeypatch.setattr(peer, "_checked_where_it_lands", lambda into: True)
    chunk = 2 * B
    monkeypatch.setattr(peer, "GPU_CHECK_BYTES", 2 * chunk)  # two chunks a batch
    monkeypatch.setattr(peer, "GPU_CHECK_BYTES_TRITON", 2 * chunk)
    started = []
    real = device_crc.chunk_checksums
    monkeypatch.setattr(device_crc, "chunk_checksums", lambda d, c: started.append(d.numel()) or real(d, c))
    n = 7 * chunk + 100  # pieces of 3 blocks: chunks complete across piece boundaries, a short last chunk
    sent = torch.randint(0, 256, (n,), dtype=torch.uint8)
    manifest = types.SimpleNamespace(chunk_bytes=chunk, data_bytes=n, chunks=_host(sent, chunk))
    if flip is not None:
        sent = sent.clone()
        sent[flip * chunk + 11] ^= 0x01
    wire = _PieceWire(sent, 3 * B, started)
    bad = peer.checked_receive(wire, None, None, torch.empty(n, dtype=torch.uint8), 1, 3 * B, manifest)
    assert bad == ([] if flip is None else [flip])
    assert sum(started) == n and all(
        k <= 2 * chunk for k in started
    )  # every byte once, batches of two chunks
    assert wire.seen[-1] >= 1  # checks were under way before the last piece landed


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.gpu
def test_a_batch_the_gpu_has_no_room_to_check_is_checked_through_the_host(monkeypatch):
    from ckpt.tiers import peer

    chunk = 4 * B
    monkeypatch.setattr(peer, "GPU_CHECK_BYTES", 2 * chunk)
    monkeypatch.setattr(peer, "GPU_CHECK_BYTES_TRITON", 2 * chunk)
    real, calls = device_crc.chunk_checksums, []

    def tight(d, c):
        calls.append(d.numel())
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("stand-in: no room")
        return real(d, c)

    monkeypatch.setattr(device_crc, "chunk_checksums", tight)
    n = 6 * chunk + 5
    sent = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    manifest = types.SimpleNamespace(chunk_bytes=chunk, data_bytes=n, chunks=_host(sent, chunk))
    sent[3 * chunk + 1] ^= 0x02  # in the batch checked through the host
    bad = peer.checked_receive(
        _PieceWire(sent, chunk, []),
        None,
        None,
        torch.empty(n, dtype=torch.uint8, device="cuda"),
        1,
        chunk,
        manifest,
    )
    assert bad == [3] and len(calls) == 4


# -- the Triton kernels ------------------------------------------------------------------------------------------


def test_lanes_of_the_triton_kernel_divide_the_chunk():
    assert device_crc._lane_bytes(16 << 20) == 2048  # the format's default chunk: 8192 lanes
    assert device_crc._lane_bytes(64 << 20) == 8192  # longer lanes: at most 8192 a chunk
    assert device_crc._lane_bytes(3 * B) == B  # three blocks: no longer lane divides it
    assert device_crc._lane_bytes(3 * 2048) == 2048
    assert device_crc._lane_bytes(B * 9999) is None  # 9999 lanes of a block: too many
    for chunk in (B, 2 * B, 3 * B, 6144, 16 << 20, 1 << 30, 7 << 20):
        lane = device_crc._lane_bytes(chunk)
        assert lane is None or (
            chunk % lane == 0 and lane % B == 0 and chunk // lane <= device_crc._MAX_LANES
        )


def test_an_engine_it_does_not_have_is_refused():
    with pytest.raises(ValueError):
        device_crc.chunk_checksums(torch.zeros(4 * B, dtype=torch.uint8), B, engine="cuda")


_INTERPRETED = r"""
import json, sys, torch
from ckpt import device_crc
from ckpt.integrity import checksum
for n, chunk in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    want = [checksum(memoryview(data[i:i + chunk].numpy())) for i in range(0, n, chunk)]
    got = device_crc.chunk_checksums(data, chunk, engine="triton")
    assert got == want, (n, chunk, got, want)
    device_crc._kernels_ready["cpu"] = True   # start(): queued, read later; the tail from a host copy or not
    pending = device_crc.start(data, chunk)
    assert pending.values() == want and pending.values(memoryview(data.clone().numpy())) == want, (n, chunk)
    if chunk != 768:
        continue
    data[n // 2] ^= 0x40
    flipped = device_crc.chunk_checksums(data, chunk, engine="triton")
    assert [i for i, (a, b) in enumerate(zip(got, flipped)) if a != b] == [n // 2 // chunk], (n, chunk)
print("same")
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "cases",
    [
        # one lane per chunk with a tail; a chunk short of lanes, with a flipped byte found in its chunk
        pytest.param([(1403, 512), (3337, 768)], id="one-lane-and-short"),
        # lanes of 2 KiB, three lanes a chunk, a tail past the last lane, a state shorter than a chunk
        pytest.param(
            [(8455, 4096), (2 * 6144 + 2048 + 100, 6144), (300, 512)], id="long-lanes", marks=pytest.mark.slow
        ),
    ],
)
def test_the_triton_kernel_gives_the_hosts_values_in_the_interpreter(cases):
    """Lanes of one block to 2 KiB, chunks of 1 to 4 lanes, a chunk short of lanes, a tail
    past the last lane, under Triton's interpreter (its own process: Triton fixes the mode at import)."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, json.dumps(cases)],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0 and out.stdout.split() == ["same"], out.stderr[-3000:]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.gpu
def test_warm_readies_the_triton_kernels_and_checks_then_use_them():
    pytest.importorskip("triton")
    here = torch.device("cuda", torch.cuda.current_device())
    device_crc._kernels_ready.pop(str(here), None)
    assert not device_crc.ready(here)
    device_crc.warm(torch.device("cuda"), 16 << 20)
    assert device_crc.ready(here) and device_crc.ready(torch.device("cuda"))
    n, chunk = (2 << 30) + (48 << 20) + 4093, 16 << 20  # over 2 GiB, a tail
    data = torch.randint(-(2**31), 2**31 - 1, (-(-n // 4),), dtype=torch.int32, device="cuda").view(
        torch.uint8
    )[:n]
    want = _host(data, chunk)
    assert device_crc.chunk_checksums(data, chunk) == want
    assert device_crc.chunk_checksums(data, chunk, engine="triton") == want
    data[(1 << 30) + 12345] ^= 0x10
    assert [i for i, (a, b) in enumerate(zip(want, device_crc.chunk_checksums(data, chunk))) if a != b] == [
        64
    ]


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.gpu
def test_a_triton_kernel_that_disagrees_with_the_tensor_operations_are_not_used(monkeypatch):
    pytest.importorskip("triton")
    here = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setitem(device_crc._kernels_ready, str(here), False)
    real = device_crc._triton_launch
    monkeypatch.setattr(device_crc, "_triton_launch", lambda *a: real(*a) ^ 1)  # a miscompile
    device_crc._tables.cache_clear()
    device_crc.warm(here, 16 << 20)
    assert not device_crc.ready(here)
    assert device_crc._tables.cache_info().currsize >= 5  # the tensor operations were made ready instead
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda")
    assert device_crc.chunk_checksums(data, 1 << 20) == _host(data, 1 << 20)  # the tensor operations


def test_start_refuses_what_the_triton_kernel_cannot_check(monkeypatch):
    """And :func:`startable` says so beforehand, for the same reasons."""
    data = torch.zeros(4 * B, dtype=torch.uint8)
    cpu = torch.device("cpu")
    monkeypatch.setitem(device_crc._kernels_ready, "cpu", False)
    assert not device_crc.startable(cpu, 2 * B)
    with pytest.raises(ValueError):  # not ready on the device
        device_crc.start(data, 2 * B)
    monkeypatch.setitem(device_crc._kernels_ready, "cpu", True)
    assert device_crc.startable(cpu, 2 * B)
    assert not device_crc.startable(cpu, B + 4) and not device_crc.startable(cpu, 0)
    with pytest.raises(ValueError):  # a chunk no lane size divides
        device_crc.start(data, B + 4)
    with pytest.raises(ValueError):  # not a flat uint8 tensor
        device_crc.start(data.view(torch.int32), 2 * B)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.gpu
def test_checks_queued_on_a_stream_read_later_equal_the_hosts_even_once_the_buffer_is_reused():
    pytest.importorskip("triton")
    here = torch.device("cuda", torch.cuda.current_device())
    device_crc.warm(here, 1 << 20)
    assert device_crc.ready(here)
    side = torch.cuda.Stream()
    staging = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    pending, wants, copies = [], [], []
    for i, n in enumerate(((3 << 20), (2 << 20) + 4093, 1000, (1 << 20) + 2048)):  # whole, tail, under a lane
        piece = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            staging[:n].copy_(piece)
            pending.append(device_crc.start(staging[:n], 1 << 20))
            copies.append(staging[:n].cpu())
        wants.append(_host(piece, 1 << 20))
    side.synchronize()  # the staging buffer now holds the last piece only: each value was taken in order
    assert [p.values(memoryview(c.numpy())) for p, c in zip(pending, copies)] == wants


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")
@pytest.mark.multigpu
def test_a_buffer_on_another_gpu_than_the_current_one_is_checked_on_its_own():
    pytest.importorskip("triton")
    device_crc.warm(torch.device("cuda", 1), 1 << 20)
    data = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, device="cuda:1")
    with torch.cuda.device(0):
        assert device_crc.chunk_checksums(data, 1 << 20, engine="triton") == _host(data, 1 << 20)
        assert device_crc.chunk_checksums(data, 1 << 20) == _host(data, 1 << 20)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.gpu
def test_reading_queued_checks_never_waits_for_work_another_stream_queued():
    """The peer tier checks a replica's pieces on a stream of its own while the training's steps are queued on
    the default stream: reading the values must wait for the checks alone (a read through the default stream
    held each piece until the step in flight was done, and an exchange for seconds)."""
    pytest.importorskip("triton")
    here = torch.device("cuda", torch.cuda.current_device())
    device_crc.warm(here, 1 << 20)
    data = torch.randint(0, 256, ((3 << 20) + 100,), dtype=torch.uint8, device="cuda")
    want = _host(data, 1 << 20)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda._sleep(int(4e9))  # a "step" of seconds on the default stream
    import time

    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        pending = device_crc.start(data, 1 << 20)
    got = pending.values()
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert got == want and took < 0.5, took

"""Hostile tests of the checks of a copy received onto a device (``ckpt.tiers.peer.checked_receive`` /
``_checked_on_device``) and of the device CRC they use (``ckpt.device_crc``).

On this CPU-only machine a CPU tensor stands in for a GPU's: ``peer._checked_where_it_lands`` is
monkeypatched to say True, and a fake wire lands the sent bytes in ``into`` piece by piece (the bytes of a
piece are written only when ``landed`` is called for it; ``into`` starts as the complement of what is sent,
so a chunk checked before its bytes landed fails its check). Every value is compared with
``ckpt.integrity.checksum`` of the same bytes; decisions are made on types and values, never on messages.
"""

from __future__ import annotations

import random
import threading
import time
import types

import pytest
import torch

from ckpt import device_crc
from ckpt.integrity import checksum
from ckpt.tiers import peer

B = device_crc.BLOCK
CHECK_THREAD = "ckpt-peer-check"


# --------------------------------------------------------------------------------------------- helpers


def _host(data: torch.Tensor, chunk: int) -> list[int]:
    flat = data.cpu().contiguous()
    return [checksum(memoryview(flat[i : i + chunk].numpy())) for i in range(0, flat.numel(), chunk)]


def _manifest(chunk: int, n: int, chunks: list[int]) -> types.SimpleNamespace:
    return types.SimpleNamespace(chunk_bytes=chunk, data_bytes=n, chunks=list(chunks))


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _poisoned(sent: torch.Tensor) -> torch.Tensor:
    """A receive buffer holding the complement of every sent byte: a range read before it landed fails."""
    return torch.bitwise_not(sent)


def _pieces(n: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(piece, n - a)) for a in range(0, n, piece)]


class _PlanWire:
    """A wire that lands ``sent`` in ``into`` as the (offset, length) calls of ``plan``, in that order: each
    piece's bytes are copied just before ``landed`` is called for it. ``upto`` is how far bytes have landed.
    ``fail_after``: raise ``error`` once that many calls of the plan were made."""

    device = None  # the transport moves host bytes (no GPU staging)

    def __init__(
        self,
        sent: torch.Tensor,
        plan: list[tuple[int, int]],
        fail_after: int | None = None,
        error: BaseException | None = None,
        pause: float = 0.0,
    ) -> None:
        self.sent, self.plan, self.fail_after, self.error, self.pause = sent, plan, fail_after, error, pause
        self.upto = 0
        self.calls = 0

    def data(self, out, to, into, frm, in_piece, landed, out_ready=None):
        for off, k in self.plan:
            if self.fail_after is not None and self.calls == self.fail_after:
                raise self.error
            if k:
                into[off : off + k].copy_(self.sent[off : off + k])
            self.upto = max(self.upto, off + k)
            self.calls += 1
            landed(off, k)
            if self.pause:
                time.sleep(self.pause)
        if self.fail_after is not None and self.calls == self.fail_after:
            raise self.error


class _Recorder:
    """Wraps ``device_crc.chunk_checksums``: notes each check's (offset in ``into``, length, chunk bytes,
    bytes landed when it started, thread name, start and end time) and compares each value it returns with the
    host's checksum of the same bytes at that moment."""

    def __init__(
        self,
        into: torch.Tensor,
        wire: _PlanWire,
        delay: float = 0.0,
        fail_at: int | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.into, self.wire, self.delay, self.fail_at, self.error = into, wire, delay, fail_at, error
        self.real = device_crc.chunk_checksums
        self.calls: list[dict] = []
        self.mismatches: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, d: torch.Tensor, c: int) -> list[int]:
        rec = {
            "off": d.data_ptr() - self.into.data_ptr(),
            "len": d.numel(),
            "chunk": c,
            "landed": self.wire.upto,
            "thread": threading.current_thread().name,
            "start": time.monotonic(),
            "end": None,
        }
        with self.lock:
            self.calls.append(rec)
            k = len(self.calls)
        try:
            if self.fail_at is not None and k == self.fail_at:
                raise self.error
            if self.delay:
                time.sleep(self.delay)
            got = self.real(d, c)
            want = _host(d, c)
            if got != want:
                self.mismatches.append((rec["off"], rec["len"]))
            return got
        finally:
            rec["end"] = time.monotonic()


def _check_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(CHECK_THREAD) and t.is_alive()]


def _receive(
    monkeypatch, sent: torch.Tensor, chunk: int, manifest, plan, gpu_check_bytes: int | None, **recorder_kw
):
    """checked_receive of ``sent`` landing per ``plan`` into a poisoned buffer, on the device path."""
    monkeypatch.setattr(peer, "_checked_where_it_lands", lambda into: True)
    if gpu_check_bytes is not None:
        monkeypatch.setattr(peer, "GPU_CHECK_BYTES", gpu_check_bytes)
        monkeypatch.setattr(peer, "GPU_CHECK_BYTES_TRITON", gpu_check_bytes)
    into = _poisoned(sent)
    wire = _PlanWire(sent, plan)
    rec = _Recorder(into, wire, **recorder_kw)
    monkeypatch.setattr(device_crc, "chunk_checksums", rec)
    bad = peer.checked_receive(
        wire, None, None, into, 1, max(1, max((k for _, k in plan), default=1)), manifest
    )
    return bad, rec, into


def _assert_tiled_once(rec: _Recorder, n: int, chunk: int, gpu_check_bytes: int) -> None:
    """Every byte of [0, n) checked by exactly one check, in order, each in whole chunks (the last may end at
    n), none larger than a batch, none started before its bytes landed, every value equal to the host's."""
    batch = max(chunk, gpu_check_bytes // chunk * chunk)
    pos = 0
    for r in rec.calls:  # one checking thread: the checks run in the order submitted
        assert r["chunk"] == chunk
        assert r["off"] == pos, (r, pos)
        assert r["off"] % chunk == 0
        assert 0 < r["len"] <= batch
        end = r["off"] + r["len"]
        assert end % chunk == 0 or end == n
        assert end <= r["landed"], ("checked before its bytes landed", r)
        assert r["thread"].startswith(CHECK_THREAD)
        pos = end
    assert pos == n
    assert rec.mismatches == []


def _flip(sent: torch.Tensor, chunk: int, which: list[int], rng: random.Random) -> torch.Tensor:
    """A copy of ``sent`` with one byte changed (to any other value) in each chunk of ``which``."""
    bad = sent.clone()
    n = sent.numel()
    for i in which:
        at = rng.randrange(i * chunk, min((i + 1) * chunk, n))
        bad[at] ^= rng.randrange(1, 256)
    return bad


# --------------------------------------------------------------------------------------------- (1)


def _random_case(rng: random.Random) -> tuple[int, int, int, int]:
    chunk = B * rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
    kind = rng.choice(["short", "odd", "blocks", "chunks", "chunks+4", "any"])
    if kind == "short":
        n = rng.randrange(1, chunk)  # shorter than a chunk (maybe than a block)
    elif kind == "odd":
        n = rng.randrange(chunk, 12 * chunk) | 1  # not a multiple of 2, 4 or 256
    elif kind == "blocks":
        n = B * rng.randrange(1, 12 * chunk // B + 1)  # whole blocks, maybe not whole chunks
    elif kind == "chunks":
        n = chunk * rng.randrange(1, 12)  # whole chunks
    elif kind == "chunks+4":
        n = chunk * rng.randrange(1, 12) + rng.choice([1, 2, 3, 4, 255, 257])
    else:
        n = rng.randrange(1, 12 * chunk)
    piece = rng.choice(
        [
            1 + rng.randrange(chunk - 1),
            chunk,
            chunk + 1 + rng.randrange(3 * chunk),
            chunk // 2 + 3,
            3 * chunk,
            2 * chunk - 7,
            n,
            n + 5,
            97,
        ]
    )
    if piece < 64 and n > 4096:
        piece = 64 + piece  # keep the number of landed calls bounded; pieces of 1 byte have their own test
    gcb = rng.choice([0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk + B, 5 * chunk - 1, 1 << 40])
    return n, chunk, piece, gcb


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes_every_byte_checked_once_and_each_changed_byte_names_its_chunk(monkeypatch, seed):
    rng = random.Random(1000 + seed)
    for case in range(8):
        n, chunk, piece, gcb = _random_case(rng)
        sent = _random_bytes(n, seed * 100 + case)
        sums = _host(sent, chunk)
        nchunks = len(sums)
        which = sorted(rng.sample(range(nchunks), rng.randrange(0, min(nchunks, 4) + 1)))
        received = _flip(sent, chunk, which, rng)
        what = dict(n=n, chunk=chunk, piece=piece, gcb=gcb, which=which)
        with monkeypatch.context() as m:
            bad, rec, into = _receive(m, received, chunk, _manifest(chunk, n, sums), _pieces(n, piece), gcb)
        assert bad == which, what
        _assert_tiled_once(rec, n, chunk, gcb)
        assert torch.equal(into, received), what
        assert _check_threads() == []


@pytest.mark.parametrize("seed", range(4))
def test_random_chunk_checksums_equal_the_hosts_and_a_flip_moves_only_its_chunk(monkeypatch, seed):
    """chunk_checksums alone, with the first stage's slab made small (several passes, a short last one)."""
    rng = random.Random(2000 + seed)
    for case in range(6):
        chunk = B * rng.choice([1, 2, 3, 5, 8, 11, 16, 32])
        n = rng.choice(
            [
                rng.randrange(1, B),
                rng.randrange(1, chunk + 1),
                rng.randrange(chunk, 9 * chunk),
                chunk * rng.randrange(1, 9),
                rng.randrange(1, 9) * chunk + 3,
            ]
        )
        slab = rng.choice([None, B, 3 * B, 7 * B, chunk, 2 * chunk + B])
        with monkeypatch.context() as m:
            if slab is not None:
                m.setattr(device_crc, "_SLAB", slab)
            data = _random_bytes(n, 5000 + 10 * seed + case)
            before = device_crc.chunk_checksums(data, chunk)
            assert before == _host(data, chunk), dict(n=n, chunk=chunk, slab=slab)
            i = rng.randrange(len(before))
            at = rng.randrange(i * chunk, min((i + 1) * chunk, n))
            data[at] ^= rng.randrange(1, 256)
            after = device_crc.chunk_checksums(data, chunk)
        assert after == _host(data, chunk), dict(n=n, chunk=chunk, slab=slab, at=at)
        assert [j for j, (a, b) in enumerate(zip(before, after)) if a != b] == [i]


# --------------------------------------------------------------------------------------------- (2)


def _plan(name: str, n: int, chunk: int) -> list[tuple[int, int]]:
    rng = random.Random(name)
    if name == "one-call":
        return [(0, n)]
    if name == "one-byte-pieces":
        return _pieces(n, 1)
    if name == "zero-length-final":
        return _pieces(n, chunk + 3) + [(n, 0)]
    if name == "zero-length-final-at-chunk-edge":
        return _pieces(n, chunk) + [(n, 0)]
    if name == "zero-length-first-and-between":
        out = [(0, 0)]
        for off, k in _pieces(n, 2 * chunk - 1):
            out += [(off, k), (off + k, 0)]
        return out
    if name == "one-call-then-zero-length":
        return [(0, n), (n, 0)]
    if name == "uneven-pieces":
        out, off = [], 0
        while off < n:
            k = min(n - off, rng.choice([1, 3, 255, 256, chunk - 1, chunk, chunk + 1, 3 * chunk + 17]))
            out.append((off, k))
            off += k
        return out
    if name == "all-but-the-last-byte-then-it":
        return [(0, n - 1), (n - 1, 1)]
    raise AssertionError(name)


PLANS = [
    "one-call",
    "one-byte-pieces",
    "zero-length-final",
    "zero-length-final-at-chunk-edge",
    "zero-length-first-and-between",
    "one-call-then-zero-length",
    "uneven-pieces",
    "all-but-the-last-byte-then-it",
]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("n_kind", ["chunks", "tail"])
def test_wires_landing_pieces_in_unusual_but_allowed_ways(monkeypatch, plan, n_kind):
    chunk = 3 * B
    n = 9 * chunk if n_kind == "chunks" else 9 * chunk + 131
    sent = _random_bytes(n, 77)
    sums = _host(sent, chunk)
    rng = random.Random(plan + n_kind)
    for gcb in (chunk - 1, chunk, 4 * chunk):
        which = sorted(rng.sample(range(len(sums)), 2))
        received = _flip(sent, chunk, which, rng)
        with monkeypatch.context() as m:
            bad, rec, into = _receive(
                m, received, chunk, _manifest(chunk, n, sums), _plan(plan, n, chunk), gcb
            )
        assert bad == which, (plan, gcb)
        _assert_tiled_once(rec, n, chunk, gcb)
        assert torch.equal(into, received)
    assert _check_threads() == []


def test_checks_run_while_later_pieces_arrive_not_only_at_the_end(monkeypatch):
    """With a batch of one chunk and pieces of one chunk landing slowly, checks start before the wire is done
    (each batch is submitted as soon as its chunks are complete)."""
    chunk, n = 2 * B, 8 * 2 * B + 5
    sent = _random_bytes(n, 3)
    monkeypatch.setattr(peer, "_checked_where_it_lands", lambda into: True)
    monkeypatch.setattr(peer, "GPU_CHECK_BYTES", chunk)
    monkeypatch.setattr(peer, "GPU_CHECK_BYTES_TRITON", chunk)
    into = _poisoned(sent)
    wire = _PlanWire(sent, _pieces(n, chunk), pause=0.02)
    rec = _Recorder(into, wire)
    monkeypatch.setattr(device_crc, "chunk_checksums", rec)
    assert (
        peer.checked_receive(wire, None, None, into, 1, chunk, _manifest(chunk, n, _host(sent, chunk))) == []
    )
    assert min(r["landed"] for r in rec.calls) < n  # at least one check started before the last piece
    _assert_tiled_once(rec, n, chunk, chunk)


class _HostStandIn:
    """Stands in for ``peer._DeviceChecks`` on this CPU (it needs pinned memory): CRC-32C of a range of the
    buffer, noting each range it was asked for."""

    ranges: list[tuple[int, int]] = []

    def __init__(self, data: torch.Tensor, buffers: int) -> None:
        self.data = data
        assert buffers >= 1

    def __call__(self, a: int, b: int) -> int:
        _HostStandIn.ranges.append((a, b))
        return checksum(memoryview(self.data[a:b].numpy()))


@pytest.mark.parametrize("seed", range(3))
def test_batches_the_device_has_no_room_for_are_checked_through_the_host_in_place(monkeypatch, seed):
    """Random batches fail with the device's out-of-memory error and go through ``_host_checks``: their values
    land at their own chunks (a changed byte there still names exactly its chunk), each of their chunks is
    checked once through the host, and the other batches stay on the device."""
    rng = random.Random(3000 + seed)
    monkeypatch.setattr(peer, "_DeviceChecks", _HostStandIn)
    for case in range(4):
        chunk = B * rng.choice([1, 2, 3, 4])
        n = rng.randrange(3 * chunk, 14 * chunk) + rng.choice([0, 1, 3, chunk - 1])
        gcb = rng.choice([chunk, 2 * chunk, 3 * chunk + 5])
        sent = _random_bytes(n, 300 + 10 * seed + case)
        sums = _host(sent, chunk)
        which = sorted(rng.sample(range(len(sums)), min(3, len(sums))))
        received = _flip(sent, chunk, which, rng)
        oom = {rng.choice([1, 2]), rng.choice([3, 4])}  # which checks (1-based) find no room
        _HostStandIn.ranges = []
        with monkeypatch.context() as m:
            m.setattr(peer, "_checked_where_it_lands", lambda into: True)
            m.setattr(peer, "GPU_CHECK_BYTES", gcb)
            m.setattr(peer, "GPU_CHECK_BYTES_TRITON", gcb)
            into = _poisoned(received)
            wire = _PlanWire(received, _pieces(n, chunk + 1))
            rec = _Recorder(into, wire)
            calls = []

            def tight(d, c):
                calls.append(d.numel())
                if len(calls) in oom:
                    rec.calls.append(
                        {
                            "off": d.data_ptr() - into.data_ptr(),
                            "len": d.numel(),
                            "chunk": c,
                            "landed": wire.upto,
                            "thread": threading.current_thread().name,
                        }
                    )
                    raise torch.cuda.OutOfMemoryError("stand-in: no room")
                return rec(d, c)

            m.setattr(device_crc, "chunk_checksums", tight)
            bad = peer.checked_receive(
                wire, None, None, into, 1, chunk + 1, _manifest(chunk, n, sums), threads=2
            )
        what = dict(n=n, chunk=chunk, gcb=gcb, oom=oom, which=which)
        assert bad == which, what
        _assert_tiled_once(rec, n, chunk, gcb)  # device and host batches together: every byte once
        through_host = [r for k, r in enumerate(rec.calls, 1) if k in oom]
        assert through_host, what
        want = sorted(
            (x, min(x + chunk, r["off"] + r["len"]))
            for r in through_host
            for x in range(r["off"], r["off"] + r["len"], chunk)
        )
        assert sorted(_HostStandIn.ranges) == want, what


# --------------------------------------------------------------------------------------------- (3)


class _WireBroke(ConnectionResetError):
    """The transport failing midway (a type of its own: the caller must see exactly it)."""


class _CheckBroke(RuntimeError):
    """A check failing on the checking thread."""


@pytest.mark.parametrize("who", ["wire", "check", "both"])
def test_a_failure_midway_propagates_and_no_check_outlives_the_call(monkeypatch, who):
    chunk = 2 * B
    n = 12 * chunk + 9
    sent = _random_bytes(n, 11)
    monkeypatch.setattr(peer, "_checked_where_it_lands", lambda into: True)
    monkeypatch.setattr(
        peer, "GPU_CHECK_BYTES", chunk
    )  # a batch per chunk: several submitted before the failure
    monkeypatch.setattr(peer, "GPU_CHECK_BYTES_TRITON", chunk)
    into = _poisoned(sent)
    wire_error, check_error = _WireBroke("stand-in: peer went away"), _CheckBroke("stand-in: check failed")
    plan = _pieces(n, chunk)
    wire = _PlanWire(sent, plan, fail_after=7 if who in ("wire", "both") else None, error=wire_error)
    rec = _Recorder(
        into, wire, delay=0.03, fail_at=2 if who in ("check", "both") else None, error=check_error
    )
    monkeypatch.setattr(device_crc, "chunk_checksums", rec)
    expected = check_error if who == "check" else wire_error
    before = len(rec.calls)
    with pytest.raises(type(expected)) as got:
        peer.checked_receive(wire, None, None, into, 1, chunk, _manifest(chunk, n, _host(sent, chunk)))
    returned = time.monotonic()
    assert type(got.value) is type(expected) and got.value is expected
    assert _check_threads() == []  # the checking thread is gone once the call is back
    ran = list(rec.calls)
    assert len(ran) - before >= 2  # batches had been submitted (and ran) before the failure
    assert all(r["end"] is not None and r["end"] <= returned for r in ran)  # none was still reading `into`
    if who != "check":
        assert all(r["off"] + r["len"] <= wire.upto for r in ran)  # nothing past what landed was checked
    time.sleep(0.15)
    assert len(rec.calls) == len(ran)  # and none starts later
    assert _check_threads() == []


# --------------------------------------------------------------------------------------------- (4)


def _listed(sums: list[int], how: str) -> list[int]:
    return {
        "one-short": sums[:-1],
        "three-short": sums[:-3],
        "none-listed": [],
        "one-extra-zero": sums + [0],  # 0: the CRC-32C of no bytes
        "one-extra-copy": sums + [sums[-1]],
        "three-extra": sums + [0, sums[0], 0xFFFFFFFF],
    }[how]


HOWS = ["one-short", "three-short", "none-listed", "one-extra-zero", "one-extra-copy", "three-extra"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("n_kind", ["chunks", "tail"])
@pytest.mark.parametrize("flip", [None, 1])
def test_device_path_a_manifest_with_fewer_or_more_chunks_names_exactly_those(monkeypatch, how, n_kind, flip):
    chunk = 2 * B
    n = 6 * chunk if n_kind == "chunks" else 6 * chunk + 77
    sent = _random_bytes(n, 21)
    sums = _host(sent, chunk)
    listed = _listed(sums, how)
    received = _flip(sent, chunk, [flip], random.Random(5)) if flip is not None else sent
    want = sorted(
        set(range(min(len(sums), len(listed)), max(len(sums), len(listed))))
        | ({flip} if flip is not None and flip < len(listed) else set())
    )
    for gcb in (1, 3 * chunk):
        with monkeypatch.context() as m:
            bad, rec, _ = _receive(
                m, received, chunk, _manifest(chunk, n, listed), _pieces(n, chunk + 5), gcb
            )
        assert bad == want, (how, gcb)
        _assert_tiled_once(rec, n, chunk, gcb)  # the data's chunks are what is checked, whatever is listed


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("path", ["host", "on the way"])
def test_host_copies_a_manifest_with_fewer_or_more_chunks_names_exactly_those(monkeypatch, how, path):
    """The same for a copy into host memory (a CPU buffer, checked on the host, or on the GPU as it passes the
    staging buffers: see below): the result must not depend on the path."""
    chunk = 2 * B
    n = 6 * chunk + 77
    sent = _random_bytes(n, 22)
    sums = _host(sent, chunk)
    listed = _listed(sums, how)
    want = list(range(min(len(sums), len(listed)), max(len(sums), len(listed))))
    if path == "on the way":
        assert _on_the_way(monkeypatch, sent, chunk, 2 * chunk, listed=listed)[0] == want
        return
    into = _poisoned(sent)
    wire = _PlanWire(sent, _pieces(n, chunk + 5))
    assert (
        peer.checked_receive(wire, None, None, into, 1, chunk + 5, _manifest(chunk, n, listed), threads=2)
        == want
    )


# --------------------------------------------------------------------------------------------- (5)


def _candidates():
    """Tensors and chunk sizes around every condition of ``usable``."""
    base = _random_bytes(64 * B + 64, 31)  # the allocator's memory: 64-byte aligned
    assert base.data_ptr() % 64 == 0
    out = []
    for off in range(0, 9):
        for length in (0, 1, 3, B - 1, B, B + 1, 4 * B, 4 * B + 2, 13 * B + 7):
            t = base[off : off + length]
            for chunk in (B, 3 * B, 4 * B, 64 * B):
                out.append((f"off{off}-len{length}-c{chunk}", t, chunk))
    t = base[: 9 * B]
    for chunk in (0, -B, 1, 4, 64, B - 4, B + 4, 2 * B - 1, 3 * B + 128, 1000):
        out.append((f"chunk{chunk}", t, chunk))
    out += [
        ("strided", base[: 8 * B : 2], B),
        ("strided-offset", base[4 : 8 * B + 4 : 2], B),
        ("strided-one-element", base[0:8:8], B),  # one element: contiguous whatever its stride
        ("int8", base[: 8 * B].view(torch.int8), B),
        ("int32", base[: 8 * B].view(torch.int32), B),
        ("float32", base[: 8 * B].view(torch.float32), B),
        ("bool", base[: 8 * B].view(torch.bool), B),
        ("2d", base[: 8 * B].view(8, B), B),
        ("2d-one-row", base[: 8 * B].view(1, 8 * B), B),
        ("2d-transposed", base[: 8 * B].view(B, 8).t(), B),
        ("0d", base[0], B),
        ("clone-of-misaligned", base[1 : 1 + 5 * B + 3].clone(), B),  # fresh memory: aligned again
        ("expanded", base[:1].expand(4 * B), B),
    ]
    return out


def test_chunk_checksums_refuses_exactly_what_usable_rejects():
    accepted = rejected = 0
    for name, t, chunk in _candidates():
        ok = device_crc.usable(t, chunk)
        assert type(ok) is bool, name
        if ok:
            accepted += 1
            assert device_crc.chunk_checksums(t, chunk) == _host(t, chunk), name
        else:
            rejected += 1
            with pytest.raises(ValueError):
                device_crc.chunk_checksums(t, chunk)
    # the conditions themselves, one at a time
    base = _random_bytes(8 * B, 32)
    assert device_crc.usable(base, B)
    assert not device_crc.usable(base[1:], B) and not device_crc.usable(base[2:], B)  # misaligned
    assert device_crc.usable(base[4:], B)
    assert not device_crc.usable(base[::2], B)  # non-contiguous
    assert not device_crc.usable(base.view(2, -1), B)  # 2-D
    assert not device_crc.usable(base.view(torch.int8), B) and not device_crc.usable(
        base.view(torch.int32), B
    )
    assert not device_crc.usable(base, B + 4) and not device_crc.usable(base, 0)
    assert accepted > 50 and rejected > 50


def _misaligned_storage_view(n: int) -> torch.Tensor:
    """A uint8 tensor whose data pointer is 4-byte aligned but whose offset in its storage is 3 (its storage
    starts one byte past an aligned address: ``torch.frombuffer`` of a buffer at an odd address)."""
    raw = bytearray(n + 16)
    probe = torch.frombuffer(raw, dtype=torch.uint8)
    skip = (1 - probe.data_ptr()) % 4
    odd = torch.frombuffer(memoryview(raw)[skip:], dtype=torch.uint8)
    t = odd[3 : 3 + n]
    t.copy_(_random_bytes(n, 33))
    return t


def test_an_aligned_view_of_an_odd_storage_is_refused_as_usable_says():
    """A view whose pointer is 4-byte aligned but whose storage offset is not cannot be viewed as int32
    words: ``usable`` says so and ``chunk_checksums`` raises ValueError (the receive then checks through the
    host), never another error from inside."""
    t = _misaligned_storage_view(5 * B + 3)
    assert t.data_ptr() % 4 == 0 and t.storage_offset() % 4 != 0
    assert not device_crc.usable(t, B)
    with pytest.raises(ValueError):
        device_crc.chunk_checksums(t, B)


# --------------------------------------------------------------------------------------------- (6)


def test_warm_from_many_threads_at_once_is_safe_and_checks_stay_right(monkeypatch):
    device_crc._tables.cache_clear()
    device_crc._zeros.cache_clear()
    device_crc._one_zero_byte.cache_clear()
    chunks = [B, 2 * B, 3 * B, 8 * B, 16 * B, 0, 100, B + 4]  # the last three: left alone
    threads = 8
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []
    wrong: list[tuple] = []

    def work(k: int) -> None:
        try:
            barrier.wait()
            for r in range(3):
                chunk = chunks[(k + r) % len(chunks)]
                device_crc.warm(torch.device("cpu"), chunk)
                if chunk > 0 and chunk % B == 0:
                    data = _random_bytes(5 * chunk + 7 * k + 1, 100 * k + r)
                    if device_crc.chunk_checksums(data, chunk) != _host(data, chunk):
                        wrong.append((k, r, chunk))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert not any(t.is_alive() for t in pool)
    assert errors == [] and wrong == []
    # and afterwards, on this thread, every size still right
    for chunk in (B, 3 * B, 16 * B):
        data = _random_bytes(7 * chunk + 5, chunk)
        assert device_crc.chunk_checksums(data, chunk) == _host(data, chunk)


# ------------------------------------------------------------------ checks on the GPU staging (a replica)
#
# A replica received into host memory through the GPU's staging buffers is checked where each piece lands on
# the GPU (``peer._checked_on_the_way``). Here a fake wire hands each piece to ``on_gpu`` in a staging tensor
# of its own (what came over the wire), then copies it into ``into`` (the copy down) and calls ``landed``;
# ``device_crc.start`` is stood in for by the host's checksum of the staging bytes at that moment.


class _StagingWire:
    def __init__(self, sent: torch.Tensor, piece: int, on_wire=None, after_check=None) -> None:
        self.sent, self.piece = sent, piece
        self.on_wire = on_wire or (lambda staging, off: None)  # corrupts what arrives (before the check)
        self.after_check = after_check or (lambda into, off, k: None)  # changes the host copy after it
        self.device = torch.device("cuda", 0)
        self.calls: list[tuple[int, int]] = []

    def data(self, out, to, into, frm, in_piece, landed, out_ready=None, on_gpu=None):
        assert on_gpu is not None and in_piece == self.piece
        n = into.numel()
        for off in range(0, n, in_piece):
            k = min(in_piece, n - off)
            staging = self.sent[off : off + k].clone()
            self.on_wire(staging, off)
            on_gpu(staging, off)
            into[off : off + k].copy_(staging)
            self.after_check(into, off, k)
            staging.fill_(0)  # the staging buffer is reused: a check must not read it later
            self.calls.append((off, k))
            landed(off, k)


class _HostPending:
    def __init__(self, piece: torch.Tensor, chunk: int, fail: bool = False) -> None:
        self.sums, self.fail = _host(piece, chunk), fail

    def values(self, tail=None):
        if self.fail:
            raise RuntimeError("the GPU went away")
        return list(self.sums)


def _on_the_way(monkeypatch, sent, chunk, piece, listed=None, fail_start=(), fail_values=(), **wire_kw):
    starts = []

    def start(data, c):
        assert c == chunk
        starts.append(data.numel())
        if len(starts) - 1 in fail_start:
            raise torch.cuda.OutOfMemoryError("no room")
        return _HostPending(data, c, fail=len(starts) - 1 in fail_values)

    monkeypatch.setattr(device_crc, "start", start)
    wire = _StagingWire(sent, piece, **wire_kw)
    into = _poisoned(sent)
    m = _manifest(chunk, sent.numel(), _host(sent, chunk) if listed is None else listed)
    bad = peer._checked_on_the_way(wire, None, None, into, 1, piece, m, None)
    return bad, into, starts


@pytest.mark.parametrize("seed", range(6))
def test_on_the_way_every_chunk_is_checked_and_a_byte_changed_on_the_wire_names_its_chunk(monkeypatch, seed):
    rng = random.Random(seed)
    chunk = rng.choice([B, 4 * B, 8 * B])
    piece = chunk * rng.randint(1, 4)
    n = rng.choice([0, 1, chunk - 3, piece, 3 * piece + rng.randrange(1, chunk), 5 * piece])
    sent = _random_bytes(n, seed)
    bad, into, starts = _on_the_way(monkeypatch, sent, chunk, piece)
    assert bad == [] and torch.equal(into, sent)
    assert sum(starts) == n  # every piece checked on the "GPU", nothing on the host
    if not n:
        return
    at = rng.randrange(n)

    def flip(staging, off):
        if off <= at < off + staging.numel():
            staging[at - off] ^= 0x08

    bad, _, _ = _on_the_way(monkeypatch, sent, chunk, piece, on_wire=flip)
    assert bad == [at // chunk]
    wrong = [s ^ 1 for s in _host(sent, chunk)]
    assert _on_the_way(monkeypatch, sent, chunk, piece, listed=wrong)[0] == list(range(len(wrong)))


@pytest.mark.parametrize("fail", ["start", "values"])
def test_on_the_way_a_piece_the_gpu_cannot_check_is_checked_on_the_host(monkeypatch, fail):
    chunk, piece = 2 * B, 6 * B
    n = 5 * piece + 100
    sent = _random_bytes(n, 77)
    which = {1, 5}  # the second piece and the last (short) one
    kw = {"fail_start": which} if fail == "start" else {"fail_values": which}
    assert _on_the_way(monkeypatch, sent, chunk, piece, **kw)[0] == []
    at = piece + 3  # in the second piece: found by the host's check of the copy there

    def flip(staging, off):
        if off <= at < off + staging.numel():
            staging[at - off] ^= 0x01

    assert _on_the_way(monkeypatch, sent, chunk, piece, on_wire=flip, **kw)[0] == [at // chunk]
    at = n - 1  # the last byte, in the tail of the last piece
    assert _on_the_way(monkeypatch, sent, chunk, piece, on_wire=flip, **kw)[0] == [at // chunk]


def test_copies_into_host_memory_are_checked_on_the_way_only_where_the_gpu_can(monkeypatch):
    chunk, piece = 4 * B, 8 * B
    into = torch.zeros(3 * piece, dtype=torch.uint8)
    wire = _StagingWire(_random_bytes(3 * piece, 1), piece)
    monkeypatch.setattr(device_crc, "ready", lambda d: d.type == "cuda")
    assert peer._checked_in_staging(wire, into, piece, chunk)
    assert not peer._checked_in_staging(wire, into, piece + B, chunk)  # a chunk across two pieces
    assert not peer._checked_in_staging(wire, into, piece, chunk + 4)  # no lane size divides it
    assert not peer._checked_in_staging(
        wire, torch.zeros(3 * piece, dtype=torch.uint8, device="meta"), piece, chunk
    )  # not into host memory: a restore's copy, checked where it lands
    wire.device = None  # gloo: no staging on a GPU
    assert not peer._checked_in_staging(wire, into, piece, chunk)
    wire.device = torch.device("cuda", 0)
    monkeypatch.setattr(device_crc, "ready", lambda d: False)  # Triton not ready there
    assert not peer._checked_in_staging(wire, into, piece, chunk)
    # and checked_receive routes a host copy there exactly when it says so
    monkeypatch.setattr(device_crc, "ready", lambda d: d.type == "cuda")
    routed = []
    monkeypatch.setattr(peer, "_checked_on_the_way", lambda *a: routed.append(a[4]) or [])
    sent = wire.sent
    m = _manifest(chunk, sent.numel(), _host(sent, chunk))
    assert peer.checked_receive(wire, None, None, into, 1, piece, m) == [] and len(routed) == 1

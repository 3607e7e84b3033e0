"""CRC-32C of a buffer's chunks computed where the buffer is (its GPU).

A restore that receives a snapshot straight onto its GPU (the peer tier over NCCL) must check every
chunk against the checksums the snapshot was saved with before it uses a byte. Copying the bytes back
to the host to checksum them there costs a pass over the host link and the host's cores (0.26 s for
3.7 GB on an H100 node, four times the transfer); here the GPU computes the same values (bit for bit
those of :func:`ckpt.integrity.checksum`), by one of two engines:

- **Triton** (:mod:`ckpt._crc_kernels`): one kernel, a thread per lane of 2 KiB computing its CRC a bit at a
  time, carrying it to its chunk's end and XORing it into the chunk's value: 3.7 GB in 9 ms on an H100
  (~410 GB/s, one launch per call). Compiled and checked against the host by :func:`warm`; used where that
  succeeded (:func:`ready`).
- **Tensor operations** (nothing to compile, ~600 launches per call, ~60 GB/s): everywhere else.

How the tensor operations do it: CRC-32C is linear over GF(2). Carrying a CRC state over ``n`` zero bytes is a
32 x 32 bit matrix, applied as two lookups in tables of 65536 entries (one per half of the state). Each block of
``BLOCK`` bytes gets its CRC from a zero start, all blocks at once, four bytes a step (the step's operator is the
one over four zero bytes), reading word ``k`` of every block from one row of a transposed copy; then per chunk the
blocks are combined pairwise, ``left`` carried over the bytes of ``right`` and XORed with it, until one value per
chunk is left (a chunk short of blocks is padded in front with zero blocks, which add nothing). Either engine
leaves the standard CRC's start value and final inversion to the host, and bytes past the last whole block (or
lane) of the buffer are folded in on the host from a small copy.

:func:`usable` says whether a buffer can be checked this way; :func:`chunk_checksums` computes the values;
:func:`warm` makes an engine ready ahead; :func:`ready` says whether Triton is.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from .integrity import checksum

__all__ = ["BLOCK", "usable", "chunk_checksums", "startable", "start", "Pending", "ready", "warm"]

log = logging.getLogger(__name__)

#: bytes per block of the first stage (a multiple of 4; chunks must be a multiple of it)
BLOCK = 256
_WORDS = BLOCK // 4
_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_MASK = 0xFFFFFFFF
#: data handled per pass of the first stage, bounding its temporaries (a few times SLAB / BLOCK * 4 bytes)
_SLAB = 1 << 30


@functools.lru_cache(maxsize=1)
def _one_zero_byte() -> tuple[int, ...]:
    """Columns (images of the 32 unit vectors) of the operator over one zero byte."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        table.append(c)
    return tuple(table[(1 << b) & 0xFF] ^ ((1 << b) >> 8) for b in range(32))


def _apply(cols: tuple[int, ...], v: int) -> int:
    r, b = 0, 0
    while v:
        if v & 1:
            r ^= cols[b]
        v >>= 1
        b += 1
    return r


@functools.lru_cache(maxsize=None)
def _zeros(n: int) -> tuple[int, ...]:
    """Columns of the operator that carries a raw CRC state over ``n`` zero bytes."""
    if n == 0:
        return tuple(1 << b for b in range(32))
    if n == 1:
        return _one_zero_byte()
    half = _zeros(n // 2)
    twice = tuple(_apply(half, c) for c in half)
    return tuple(_apply(_one_zero_byte(), c) for c in twice) if n % 2 else twice


@functools.lru_cache(maxsize=64)
def _tables(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator over ``n`` zero bytes as two tables of 65536 int32 on ``device``: entry ``x`` of the first
    is the image of ``x`` as the state's low 16 bits, of the second as its high 16 bits."""
    cols = _zeros(n)
    x = torch.arange(1 << 16, dtype=torch.int64, device="cpu")
    out = []
    for half in (cols[:16], cols[16:]):
        t = torch.zeros(1 << 16, dtype=torch.int64, device="cpu")
        for b, col in enumerate(half):
            t ^= ((x >> b) & 1) * col
        t -= (t >> 31) << 32  # as signed 32-bit values, the bits unchanged
        out.append(t.to(torch.int32).to(device))
    return out[0], out[1]


class _Carry:
    """Applies the operator over ``n`` zero bytes (:func:`_tables`) to int32 states, two lookups a state, into
    reused buffers of one length (the shifts are arithmetic, hence the masks)."""

    def __init__(self, n: int, length: int, device: torch.device) -> None:
        self.lo, self.hi = _tables(n, device)
        self.index = torch.empty(length, dtype=torch.int32, device=device)
        self.high = torch.empty(length, dtype=torch.int32, device=device)

    def __call__(self, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` = the operator applied to ``v`` (both of the buffers' length; ``out`` may not be ``v``)."""
        index, high = self.index[: v.numel()], self.high[: v.numel()]
        torch.bitwise_and(v, 0xFFFF, out=index)
        torch.index_select(self.lo, 0, index, out=out)
        torch.bitwise_right_shift(v, 16, out=index)
        index.bitwise_and_(0xFFFF)
        torch.index_select(self.hi, 0, index, out=high)
        return out.bitwise_xor_(high)


#: bytes a Triton lane checks when the chunk allows (a power of two of blocks); larger chunks get longer lanes, so
#: that a chunk has at most :data:`_MAX_LANES` (a lane's state is carried to its chunk's end in as many steps as
#: that count has bits)
_LANE = 2048
_MAX_LANES = 8192
#: devices (``str(device)``) where :func:`warm` compiled the Triton kernel and checked it against the tensor
#: operations: :func:`chunk_checksums` uses them there unless told otherwise
_kernels_ready: dict[str, bool] = {}


def _lane_bytes(chunk_bytes: int) -> int | None:
    """Bytes per lane of the Triton kernel for chunks of ``chunk_bytes``: a power-of-two multiple of
    :data:`BLOCK` dividing the chunk, :data:`_LANE` or more where the chunk needs it to have at most
    :data:`_MAX_LANES` lanes (``None``: no such size; the tensor operations check it)."""
    lane = BLOCK
    while chunk_bytes % (2 * lane) == 0 and (lane < _LANE or chunk_bytes // lane > _MAX_LANES):
        lane *= 2
    return lane if chunk_bytes // lane <= _MAX_LANES else None


@functools.lru_cache(maxsize=16)
def _fold_columns(lane: int, levels: int, device: torch.device) -> torch.Tensor:
    """The columns of the operators over ``lane << level`` zero bytes, level by level: int32, ``levels * 32``."""
    cols = [c for level in range(levels) for c in _zeros(lane << level)]
    return torch.tensor([c - ((c >> 31) << 32) for c in cols] or [0], dtype=torch.int32).to(device)


def _triton_launch(data: torch.Tensor, nblocks: int, lane: int, per_chunk: int) -> torch.Tensor:
    """Queue the Triton kernel on ``data``'s GPU (its current stream there): the raw CRC states (zero start)
    of the whole lanes of each chunk holding one, as an int32 tensor on that GPU (read it once the stream
    reached it)."""
    from . import _crc_kernels as k

    dev = data.device
    levels = (per_chunk - 1).bit_length()
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # launched on data's GPU
        out = torch.zeros(-(-nblocks // per_chunk), dtype=torch.int32, device=dev)
        k.chunk_crcs[(-(-nblocks // k.LANES),)](
            data[: nblocks * lane].view(torch.int32),
            _fold_columns(lane, levels, dev),
            out,
            nblocks,
            WORDS=lane // 4,
            PER_CHUNK=per_chunk,
            LEVELS=levels,
            LANES=k.LANES,
            POLY=k.POLY,
            num_warps=4,
        )
    return out


class Pending:
    """Chunk checksums queued on a GPU by :func:`start`, not yet read: :meth:`values` reads them. Everything it
    needs from the GPU (the chunks' raw states, the bytes past the last whole lane) is copied to pinned host
    memory on the stream the kernel was queued on, so reading them waits for that stream alone, never for work
    another stream has queued (a training step on the default stream)."""

    def __init__(
        self, raw: torch.Tensor | None, n: int, chunk_bytes: int, block: int, nblocks: int, data: torch.Tensor
    ) -> None:
        self.n, self.chunk_bytes, self._block, self._nblocks = n, chunk_bytes, block, nblocks
        rest = data[nblocks * block :]
        self._done = None
        if data.device.type == "cuda":
            self._raw = _to_host(raw) if raw is not None else None
            self._tail = _to_host(rest) if rest.numel() else None
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(data.device))
        else:
            self._raw = raw
            self._tail = rest.clone() if rest.numel() else None

    def values(self, tail: memoryview | None = None) -> list[int]:
        """CRC-32C of each chunk (as :func:`chunk_checksums`). ``tail``: the same bytes as the checked tensor,
        on the host (a copy made of it): the bytes past the last whole lane are folded in from it (otherwise
        from the copy :func:`start` queued)."""
        if self._done is not None:
            self._done.synchronize()
        raw = [0] * -(-self.n // self.chunk_bytes)
        if self._raw is not None:
            raw[: self._raw.numel()] = [v & _MASK for v in self._raw.tolist()]
        if tail is not None:
            return _finish(raw, self.n, self.chunk_bytes, self._block, self._nblocks, tail, 0)
        src = memoryview(self._tail.numpy()) if self._tail is not None else None
        return _finish(
            raw, self.n, self.chunk_bytes, self._block, self._nblocks, src, self._nblocks * self._block
        )


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``t`` (on a GPU), queued on the current stream (read it once that stream got there)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def startable(device: torch.device, chunk_bytes: int) -> bool:
    """Whether :func:`start` can check chunks of ``chunk_bytes`` on ``device``: one where :func:`warm` made the
    Triton kernel :func:`ready`, and a chunk size that is a multiple of :data:`BLOCK` the kernel's lanes divide."""
    return (
        chunk_bytes > 0
        and chunk_bytes % BLOCK == 0
        and ready(device)
        and _lane_bytes(chunk_bytes) is not None
    )


def start(data: torch.Tensor, chunk_bytes: int) -> Pending:
    """Queue the CRC-32C of each chunk of ``data`` (a tensor :func:`usable` accepts, on a GPU where
    :func:`ready`) on its current stream and return at once, without waiting for the GPU; read the values
    with :meth:`Pending.values`. Raises ``ValueError`` where the Triton kernel cannot check ``data`` (not
    ready there, or a chunk size it cannot take): :func:`chunk_checksums` takes any."""
    if not (usable(data, chunk_bytes) and startable(data.device, chunk_bytes)):
        raise ValueError(
            f"device_crc.start: the Triton kernel cannot check this tensor ({data.dtype}, shape "
            f"{tuple(data.shape)}, on {data.device}, ready there: {ready(data.device)}) in chunks of "
            f"{chunk_bytes} bytes; use chunk_checksums"
        )
    lane = _lane_bytes(chunk_bytes)
    nblocks = data.numel() // lane
    raw = _triton_launch(data, nblocks, lane, chunk_bytes // lane) if nblocks else None
    return Pending(raw, data.numel(), chunk_bytes, lane, nblocks, data)


def _finish(
    raw: list[int], n: int, chunk_bytes: int, block: int, nblocks: int, tail: memoryview | None, tail_at: int
) -> list[int]:
    """The chunks' CRC-32C from the raw states of their whole blocks (``raw``, zero start): the standard start
    value and final inversion applied, and the bytes past the last whole block folded in from ``tail`` (bytes
    ``[tail_at, n)`` of the buffer, or the whole buffer where ``tail_at`` is 0)."""
    per_chunk = chunk_bytes // block
    out = []
    for i in range(-(-n // chunk_bytes)):
        whole = min(per_chunk, max(0, nblocks - i * per_chunk)) * block  # bytes of the chunk summed above
        crc = (_apply(_zeros(whole), _MASK) ^ raw[i] ^ _MASK) if whole else 0
        end = min((i + 1) * chunk_bytes, n)
        rest = end - (i * chunk_bytes + whole)
        if rest:
            crc = checksum(tail[end - rest - tail_at : end - tail_at], crc)
        out.append(crc)
    return out


def ready(device: torch.device) -> bool:
    """Whether :func:`warm` made the Triton kernel ready on ``device`` (a check there then costs one kernel
    launch and runs at hundreds of GB/s, rather than ~600 tensor operations at ~60 GB/s)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return bool(_kernels_ready.get(str(device)))


def usable(data: torch.Tensor, chunk_bytes: int) -> bool:
    """Whether :func:`chunk_checksums` can check ``data`` in chunks of ``chunk_bytes``: a flat, contiguous
    uint8 tensor, four-byte aligned, and chunks a multiple of :data:`BLOCK` bytes (the format's default
    chunk is)."""
    return (
        data.dtype == torch.uint8
        and data.dim() == 1
        and data.is_contiguous()
        and data.data_ptr() % 4 == 0
        and data.storage_offset() % 4 == 0  # viewed as int32 words
        and chunk_bytes > 0
        and chunk_bytes % BLOCK == 0
    )


def chunk_checksums(data: torch.Tensor, chunk_bytes: int, engine: str | None = None) -> list[int]:
    """CRC-32C of each chunk ``data[i * chunk_bytes:(i + 1) * chunk_bytes]`` (the last may be shorter), equal
    to :func:`ckpt.integrity.checksum` of the same bytes, computed on ``data``'s device (on its current
    stream; returns once the values are on the host). ``data``: a tensor :func:`usable` accepts.

    ``engine``: ``"triton"`` (one kernel: :func:`warm` compiles it), ``"torch"`` (tensor operations, nothing
    to compile), or ``None``: Triton where :func:`warm` made it ready for ``data``'s device, else torch."""
    if not usable(data, chunk_bytes):
        raise ValueError(
            f"chunk_checksums: a flat, contiguous, 4-byte aligned uint8 tensor and chunks a multiple "
            f"of {BLOCK} bytes are needed (got {data.dtype}, shape {tuple(data.shape)}, "
            f"chunk_bytes={chunk_bytes})"
        )
    if engine is None:
        engine = "triton" if ready(data.device) else "torch"
    if engine not in ("triton", "torch"):
        raise ValueError(f"chunk_checksums: engine must be 'triton', 'torch' or None, got {engine!r}")
    n = data.numel()
    nchunks = -(-n // chunk_bytes)
    lane = _lane_bytes(chunk_bytes) if engine == "triton" else None  # None: the tensor operations
    block = lane or BLOCK
    nblocks = n // block  # whole blocks; the rest of the last chunk is folded in on the host
    per_chunk = chunk_bytes // block
    raw = [0] * nchunks
    if nblocks and lane is not None:
        raw[: -(-nblocks // per_chunk)] = [
            v & _MASK for v in _triton_launch(data, nblocks, lane, per_chunk).tolist()
        ]
    elif nblocks:
        dev = data.device
        words = data[: nblocks * BLOCK].view(torch.int32).view(nblocks, _WORDS)
        crcs = torch.empty(nblocks, dtype=torch.int32, device=dev)
        slab = max(1, min(nblocks, _SLAB // BLOCK))
        step = _Carry(4, slab, dev)
        x = torch.empty(slab, dtype=torch.int32, device=dev)
        for a in range(0, nblocks, slab):  # every block at once, four bytes a step
            # word k of every block side by side (one pass over the slab), so each step reads one row
            rows = words[a : a + slab].t().contiguous()
            crc = crcs[a : a + rows.shape[1]]
            step(rows[0], crc)
            for k in range(1, _WORDS):
                torch.bitwise_xor(crc, rows[k], out=x[: crc.numel()])
                step(x[: crc.numel()], crc)
            del rows
        with_blocks = -(-nblocks // per_chunk)  # chunks holding a whole block
        width = 1 << (per_chunk - 1).bit_length()  # blocks per chunk, padded in front to a power of two
        grid = torch.zeros(with_blocks, width, dtype=torch.int32, device=dev)
        full = nblocks // per_chunk
        grid[:full, width - per_chunk :] = crcs[: full * per_chunk].view(full, per_chunk)
        if full < with_blocks:
            rest = nblocks - full * per_chunk
            grid[full, width - rest :] = crcs[full * per_chunk :]
        del crcs
        span = BLOCK  # bytes each value of the grid stands for
        while grid.shape[1] > 1:  # pairwise: left carried over right's bytes, XORed with right
            left = grid[:, 0::2].reshape(-1)
            carried = _Carry(span, left.numel(), dev)(left, torch.empty_like(left))
            grid = carried.view(with_blocks, -1).bitwise_xor_(grid[:, 1::2])
            span *= 2
        raw[:with_blocks] = [v & _MASK for v in grid[:, 0].tolist()]
    if n > nblocks * block:  # bytes past the last whole block: one small copy down
        return _finish(
            raw,
            n,
            chunk_bytes,
            block,
            nblocks,
            memoryview(data[nblocks * block :].cpu().numpy()),
            nblocks * block,
        )
    return _finish(raw, n, chunk_bytes, block, nblocks, None, 0)


def warm(device: torch.device, chunk_bytes: int) -> None:
    """Make :func:`chunk_checksums` for chunks of ``chunk_bytes`` on ``device`` ready, once per process: on a GPU
    with Triton, compile the Triton kernel (about 2 s with a cold Triton cache, 0.3-1 s from it) and check its
    values against the host's on random bytes; only a kernel that gave the same values is used from then on.
    Otherwise (no Triton, a failed compile, a chunk size it cannot take) build the tables and load the GPU
    kernels of the tensor operations (0.1-0.5 s). Safe from any thread (a check meanwhile uses the tensor
    operations); chunk sizes no engine can check are left alone."""
    if chunk_bytes <= 0 or chunk_bytes % BLOCK:
        return
    if device.type != "cuda":
        chunk_checksums(
            torch.zeros(chunk_bytes, dtype=torch.uint8, device=device), chunk_bytes, engine="torch"
        )
        return
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        here = torch.device("cuda", torch.cuda.current_device())
        if _kernels_ready.get(str(here)):
            return
        if _lane_bytes(chunk_bytes) is not None:
            try:
                # two chunks and a tail: whole chunks, a chunk short of lanes, bytes past the last lane
                probe = torch.randint(
                    0, 256, (2 * chunk_bytes + chunk_bytes // 2 + 5,), dtype=torch.uint8, device=here
                )
                got = chunk_checksums(probe, chunk_bytes, "triton")
                flat = memoryview(probe.cpu().numpy())
                same = got == [checksum(flat[a : a + chunk_bytes]) for a in range(0, len(flat), chunk_bytes)]
            except Exception as e:  # noqa: BLE001 - no Triton, no compiler, no room: the tensor operations check
                log.info(
                    "the Triton checks are not used on %s (%s: %s); tensor operations check there",
                    here,
                    type(e).__name__,
                    e,
                )
            else:
                if same:
                    _kernels_ready[str(here)] = True
                    return
                log.warning("the Triton checks on %s gave other values than the host's: not used", here)
        chunk_checksums(torch.zeros(chunk_bytes, dtype=torch.uint8, device=here), chunk_bytes, engine="torch")

"""CRC-32C of a buffer's chunks computed where the buffer is (its GPU), with plain tensor operations.

A restore that receives a snapshot straight onto its GPU (the peer tier over NCCL) must check every
chunk against the checksums the snapshot was saved with before it uses a byte. Copying the bytes back
to the host to checksum them there costs a pass over the host link and the host's cores (0.26 s for
3.7 GB on an H100 node, four times the transfer); here the GPU computes the same values (bit for bit
those of :func:`ckpt.integrity.checksum`) with a few hundred tensor operations, nothing to compile: a
replaced node's first restore has no compiler on its path.

How: CRC-32C is linear over GF(2). Carrying a CRC state over ``n`` zero bytes is a 32 x 32 bit matrix,
applied as two lookups in tables of 65536 entries (one per half of the state). Each block of ``BLOCK``
bytes gets its CRC from a zero start, all blocks at once, four bytes a step (the step's operator is the
one over four zero bytes), reading word ``k`` of every block from one row of a transposed copy; then per chunk the blocks are combined pairwise,
``left`` carried over the bytes of ``right`` and XORed with it, until one value per chunk is left (a
chunk short of blocks is padded in front with zero blocks, which add nothing). The standard CRC's start
value and final inversion are applied on the host, and bytes past the last whole block of the buffer
are folded in on the host from a small copy.

:func:`usable` says whether a buffer can be checked this way; :func:`chunk_checksums` computes the values;
:func:`warm` builds the tables and loads the kernels ahead (0.1-0.2 s a process pays once).
"""

from __future__ import annotations

import functools

import torch

from .integrity import checksum

__all__ = ["BLOCK", "usable", "chunk_checksums", "warm"]

#: bytes per block of the first stage (a multiple of 4; chunks must be a multiple of it)
BLOCK = 256
_WORDS = BLOCK // 4
_POLY = 0x82F63B78   # CRC-32C (Castagnoli), reflected
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
        t -= (t >> 31) << 32   # as signed 32-bit values, the bits unchanged
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
        index, high = self.index[:v.numel()], self.high[:v.numel()]
        torch.bitwise_and(v, 0xFFFF, out=index)
        torch.index_select(self.lo, 0, index, out=out)
        torch.bitwise_right_shift(v, 16, out=index)
        index.bitwise_and_(0xFFFF)
        torch.index_select(self.hi, 0, index, out=high)
        return out.bitwise_xor_(high)


def usable(data: torch.Tensor, chunk_bytes: int) -> bool:
    """Whether :func:`chunk_checksums` can check ``data`` in chunks of ``chunk_bytes``: a flat, contiguous
    uint8 tensor, four-byte aligned, and chunks a multiple of :data:`BLOCK` bytes (the format's default
    chunk is)."""
    return (data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous()
            and data.data_ptr() % 4 == 0 and data.storage_offset() % 4 == 0   # viewed as int32 words
            and chunk_bytes > 0 and chunk_bytes % BLOCK == 0)


def chunk_checksums(data: torch.Tensor, chunk_bytes: int) -> list[int]:
    """CRC-32C of each chunk ``data[i * chunk_bytes:(i + 1) * chunk_bytes]`` (the last may be shorter), equal
    to :func:`ckpt.integrity.checksum` of the same bytes, computed on ``data``'s device (on its current
    stream; returns once the values are on the host). ``data``: a tensor :func:`usable` accepts."""
    if not usable(data, chunk_bytes):
        raise ValueError(f"chunk_checksums: a flat, contiguous, 4-byte aligned uint8 tensor and chunks a multiple "
                         f"of {BLOCK} bytes are needed (got {data.dtype}, shape {tuple(data.shape)}, "
                         f"chunk_bytes={chunk_bytes})")
    n = data.numel()
    nchunks = -(-n // chunk_bytes)
    nblocks = n // BLOCK   # whole blocks; the rest of the last chunk is folded in on the host
    per_chunk = chunk_bytes // BLOCK
    raw = [0] * nchunks
    if nblocks:
        dev = data.device
        words = data[:nblocks * BLOCK].view(torch.int32).view(nblocks, _WORDS)
        crcs = torch.empty(nblocks, dtype=torch.int32, device=dev)
        slab = max(1, min(nblocks, _SLAB // BLOCK))
        step = _Carry(4, slab, dev)
        x = torch.empty(slab, dtype=torch.int32, device=dev)
        for a in range(0, nblocks, slab):   # every block at once, four bytes a step
            # word k of every block side by side (one pass over the slab), so each step reads one row
            rows = words[a:a + slab].t().contiguous()
            crc = crcs[a:a + rows.shape[1]]
            step(rows[0], crc)
            for k in range(1, _WORDS):
                torch.bitwise_xor(crc, rows[k], out=x[:crc.numel()])
                step(x[:crc.numel()], crc)
            del rows
        with_blocks = -(-nblocks // per_chunk)   # chunks holding a whole block
        width = 1 << (per_chunk - 1).bit_length()   # blocks per chunk, padded in front to a power of two
        grid = torch.zeros(with_blocks, width, dtype=torch.int32, device=dev)
        full = nblocks // per_chunk
        grid[:full, width - per_chunk:] = crcs[:full * per_chunk].view(full, per_chunk)
        if full < with_blocks:
            rest = nblocks - full * per_chunk
            grid[full, width - rest:] = crcs[full * per_chunk:]
        del crcs
        span = BLOCK   # bytes each value of the grid stands for
        while grid.shape[1] > 1:   # pairwise: left carried over right's bytes, XORed with right
            left = grid[:, 0::2].reshape(-1)
            carried = _Carry(span, left.numel(), dev)(left, torch.empty_like(left))
            grid = carried.view(with_blocks, -1).bitwise_xor_(grid[:, 1::2])
            span *= 2
        raw[:with_blocks] = [v & _MASK for v in grid[:, 0].tolist()]
    out = []
    for i in range(nchunks):
        whole = min(per_chunk, max(0, nblocks - i * per_chunk)) * BLOCK   # bytes of the chunk summed above
        crc = (_apply(_zeros(whole), _MASK) ^ raw[i] ^ _MASK) if whole else 0
        end = min((i + 1) * chunk_bytes, n)
        tail = end - (i * chunk_bytes + whole)
        if tail:
            crc = checksum(memoryview(data[end - tail:end].cpu().numpy()), crc)
        out.append(crc)
    return out


def warm(device: torch.device, chunk_bytes: int) -> None:
    """Build the tables and load the GPU kernels :func:`chunk_checksums` uses for chunks of ``chunk_bytes`` on
    ``device`` (one check of a zero buffer of one chunk, on a stream of its own), so that the first check of a
    restore pays neither (0.1-0.2 s). Safe from any thread; chunk sizes it cannot check are left alone."""
    if chunk_bytes <= 0 or chunk_bytes % BLOCK:
        return
    if device.type == "cuda":
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            chunk_checksums(torch.zeros(chunk_bytes, dtype=torch.uint8, device=device), chunk_bytes)
    else:
        chunk_checksums(torch.zeros(chunk_bytes, dtype=torch.uint8, device=device), chunk_bytes)

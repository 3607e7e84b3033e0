"""The Triton kernel of :mod:`ckpt.device_crc` (imported by it only when a check runs on Triton: ``import ckpt``
does not import Triton).

:func:`chunk_crcs`: one lane (thread) per ``WORDS`` int32 words computes their raw CRC-32C state (zero start, no
final inversion) a bit at a time (five integer operations a bit, no tables: bound by the GPU's integer rate,
hundreds of GB/s, each byte read once), carries it over the zero bytes of the lanes after it in its chunk
(the operators over ``lane << level`` zero bytes, given as their 32 columns a level, applied for the bits set
in that count: they are powers of one operator, so the order does not matter) and XORs it into its chunk's
state (CRC is linear: a chunk's state is the XOR of its lanes' states carried to its end).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["chunk_crcs", "LANES", "POLY"]

#: lanes (threads) of one program
LANES = 128
#: CRC-32C (Castagnoli), reflected
POLY = 0x82F63B78


@triton.jit(do_not_specialize=["nblocks"])
def chunk_crcs(
    words,
    cols,
    out,
    nblocks,
    WORDS: tl.constexpr,
    PER_CHUNK: tl.constexpr,
    LEVELS: tl.constexpr,
    LANES: tl.constexpr,
    POLY: tl.constexpr,
):
    lanes = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    live = lanes < nblocks
    at = words + lanes * WORDS
    poly = tl.full([LANES], POLY, tl.uint32)
    zero = tl.zeros([LANES], dtype=tl.uint32)
    crc = tl.zeros([LANES], dtype=tl.uint32)
    for k in range(WORDS):
        crc ^= tl.load(at + k, mask=live, other=0).to(tl.uint32, bitcast=True)
        for _ in tl.static_range(32):
            crc = (crc >> 1) ^ tl.where((crc & 1) != 0, poly, zero)
    chunk = lanes // PER_CHUNK
    first = chunk * PER_CHUNK
    after = tl.minimum(nblocks - first, PER_CHUNK) - 1 - (lanes - first)  # lanes after this one in its chunk
    for level in range(LEVELS):
        carried = zero
        for b in tl.static_range(32):
            col = tl.load(cols + level * 32 + b).to(tl.uint32, bitcast=True)
            carried ^= tl.where(((crc >> b) & 1) != 0, col, zero)
        crc = tl.where(((after >> level) & 1) != 0, carried, crc)
    tl.atomic_xor(out + chunk, crc.to(tl.int32, bitcast=True), mask=live)

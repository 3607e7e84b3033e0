"""Chunk codecs for the remote tier: raw, or zstd after a byte shuffle.

Floating-point tensors compress poorly as they are, because the bytes of one
value (sign/exponent next to noisy mantissa bits) are interleaved. Grouping
byte 0 of every element, then byte 1, and so on (the "shuffle" filter of
HDF5/Blosc) puts the slowly varying exponent bytes together, where zstd finds
redundancy. The element size used is that of the tensor that covers most of
the chunk; the codec string records it (``"zstd:shuffle2"``), so decoding needs
nothing else. Codecs work on whole chunks; checksums are always of the
decoded bytes, so a chunk verifies the same on every tier.
"""

from __future__ import annotations

import zstandard

import torch

__all__ = ["encode", "decode", "RAW"]

RAW = "raw"
_LEVEL = 3


def _shuffle(data: memoryview, k: int) -> bytes:
    n = len(data) // k * k
    t = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    body = t[:n].view(-1, k).t().contiguous()
    return body.numpy().tobytes() + bytes(data[n:])


def _unshuffle(data: bytes, k: int) -> bytes:
    n = len(data) // k * k
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    body = t[:n].view(k, -1).t().contiguous()
    return body.numpy().tobytes() + data[n:]


def encode(data: memoryview, codec: str | None, elem_size: int) -> tuple[bytes | memoryview, str]:
    """Encode one chunk; returns the stored bytes and the codec string to record."""
    if codec is None:
        return data, RAW
    if codec != "zstd":
        raise ValueError(f"compression must be None or 'zstd', got {codec!r}")
    if elem_size > 1:
        payload, name = _shuffle(data, elem_size), f"zstd:shuffle{elem_size}"
    else:
        payload, name = bytes(data), "zstd"
    out = zstandard.ZstdCompressor(level=_LEVEL).compress(payload)
    if len(out) >= len(data):
        return data, RAW   # incompressible (random data, say): store it as it is
    return out, name


def decode(stored: bytes, codec: str, size: int, where: str) -> bytes:
    """Decode one stored chunk back to its ``size`` raw bytes."""
    from .errors import CorruptCheckpointError

    if codec == RAW:
        return stored
    try:
        base, _, shuffle = codec.partition(":")
        if base != "zstd":
            raise ValueError(f"unknown codec {codec!r}")
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=size)
        if len(raw) != size:
            raise ValueError(f"decoded {len(raw)} bytes, expected {size}")
        if shuffle:
            raw = _unshuffle(raw, int(shuffle.removeprefix("shuffle")))
        return raw
    except (zstandard.ZstdError, ValueError, RuntimeError) as e:
        raise CorruptCheckpointError(f"{where}: cannot decode ({e})") from None

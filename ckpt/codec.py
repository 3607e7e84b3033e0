"""Chunk codecs for the remote tier: raw, or zstd after a byte shuffle.

Floating-point tensors compress poorly as they are, because the bytes of one
value (sign/exponent next to noisy mantissa bits) are interleaved. Grouping
byte 0 of every element, then byte 1, and so on (the "shuffle" filter of
HDF5/Blosc) puts the slowly varying exponent bytes together, where zstd finds
redundancy. The element size used is that of the tensor that covers most of
the chunk; the codec string records it (``"zstd:shuffle2"``), so decoding needs
nothing else. Codecs work on whole chunks; checksums are always of the
decoded bytes, so a chunk verifies the same on every tier.

Decoding trusts nothing it reads: the codec must be one of :data:`CODECS`, a
raw part must be exactly its chunk, and a zstd part is decoded into a buffer of
the chunk's size and no more (its frame header's declared size must agree, and
the chunk's size must be one the stored bytes can hold at all, see
:func:`max_decoded`), so no stored object can make a reader allocate more.
"""

from __future__ import annotations

import numpy as np
import zstandard

__all__ = ["encode", "decode", "check_codec", "max_decoded", "RAW", "CODECS"]

RAW = "raw"
_LEVEL = 3
#: the element sizes a shuffle uses: those of the dtypes a checkpoint stores (1-byte ones are not shuffled)
_SHUFFLES = (2, 4, 8, 16)
#: every codec string :func:`encode` records
CODECS = frozenset({RAW, "zstd", *(f"zstd:shuffle{k}" for k in _SHUFFLES)})
#: a zstd block decodes to at most 128 KiB and takes at least 4 stored bytes (an RLE block: a 3-byte
#: header and the byte repeated), so a frame never decodes to more than 32768 times its own size
_ZSTD_MAX_RATIO = (128 << 10) // 4


def _shuffle(data: memoryview, k: int) -> bytes:
    """Byte ``i`` of every ``k``-byte element together. Through numpy, which reads a read-only buffer (a
    mapped file, ``bytes``) as it is: no copy to make it writable, and no warning (``torch.frombuffer`` warns
    on one); measured 3-5x faster than torch's transposed copy of a 16 MiB chunk on the 2-core machine."""
    n = len(data) // k * k
    body = np.frombuffer(data, dtype=np.uint8, count=n).reshape(-1, k).T.copy()
    return body.tobytes() + bytes(data[n:])


def _unshuffle(data: bytearray, k: int) -> bytes:
    n = len(data) // k * k
    body = np.frombuffer(data, dtype=np.uint8, count=n).reshape(k, -1).T.copy()
    return body.tobytes() + bytes(data[n:])


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
        return data, RAW  # incompressible (random data, say): store it as it is
    return out, name


def check_codec(codec: object, where: str) -> None:
    """Raise :class:`~ckpt.errors.CorruptCheckpointError` naming ``where`` unless ``codec`` is one
    that :func:`encode` writes."""
    from .errors import CorruptCheckpointError

    if not isinstance(codec, str) or codec not in CODECS:
        raise CorruptCheckpointError(
            f"{where}: unknown codec {codec!r} (this library writes {sorted(CODECS)})"
        )


def max_decoded(codec: str, stored: int) -> int:
    """The most bytes ``stored`` bytes in ``codec`` can decode to (``codec`` already checked)."""
    return stored if codec == RAW else stored * _ZSTD_MAX_RATIO


def decode(stored: bytes, codec: str, size: int, where: str) -> bytes | bytearray:
    """Decode one stored chunk back to its ``size`` raw bytes, allocating at most ``size`` bytes
    (and nothing for a part that cannot hold them)."""
    from .errors import CorruptCheckpointError

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: cannot decode ({why})")

    check_codec(codec, where)
    if codec == RAW:
        if len(stored) != size:
            raise bad(f"a raw part of {len(stored)} bytes, the chunk has {size}")
        return stored
    if size > max_decoded(codec, len(stored)):
        raise bad(f"{len(stored)} zstd bytes cannot hold a {size}-byte chunk")
    try:
        declared = zstandard.frame_content_size(stored)  # -1: the header states no size
    except zstandard.ZstdError as e:
        raise bad(f"not a zstd frame: {e}") from None
    if declared not in (-1, size):
        raise bad(f"the zstd frame declares {declared} bytes, the chunk has {size}")
    # A one-shot decompress() allocates whatever the frame header declares; the streaming reader
    # fills this buffer and no more.
    out = bytearray(size)
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored) as reader:
            view = memoryview(out)
            while got < size:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
            excess = reader.read(1)
    except zstandard.ZstdError as e:
        raise bad(str(e)) from None
    if got != size or excess:
        raise bad(f"decodes to {'more than ' if excess else ''}{got} bytes, the chunk has {size}")
    _, _, shuffle = codec.partition(":")
    return _unshuffle(out, int(shuffle.removeprefix("shuffle"))) if shuffle else out

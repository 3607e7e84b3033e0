"""Finish a weight-gradient reduction: column sums of fp32 partial rows, cast once.

The norms' backward kernels leave ``splits`` partial rows per weight (``dw``, and ``db``
for LayerNorm) in one fp32 buffer ``(outputs * splits, N)``. One launch of
:func:`sum_partials` adds each weight's partial rows in a fixed order (deterministic, no
atomics) and writes the result straight into the parameter's dtype: it replaces a
``sum(0)``, a ``to(dtype)`` and an ``unbind``, three host round trips that on the GPU
machine's host cost more than the whole reduction takes on the GPU.

Shapes: ``part`` ``(len(outs) * splits, N)`` fp32, contiguous; each of ``outs`` ``(N,)``.
"""

from __future__ import annotations

import functools

import torch

from ._utils import LazyKernel, next_power_of_2, num_programs, tl

__all__ = ["sum_partials", "split_rows", "DW_BLOCK_R", "DW_BLOCK_C"]

#: tile of the column-parallel weight-gradient kernels: rows x columns per step
DW_BLOCK_R, DW_BLOCK_C = 32, 128


def _sum_partials_kernel(PART, OUT0, OUT1, splits, N, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    which = tl.program_id(1)
    base = PART + which.to(tl.int64) * splits * N
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        m = (rows < splits)[:, None] & cmask[None, :]
        acc += tl.load(base + rows[:, None] * N + cols[None, :], mask=m, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=cmask)
    else:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=cmask)


_sum = LazyKernel(_sum_partials_kernel)


@functools.lru_cache(maxsize=256)
def split_rows(n_rows: int, n: int, device: torch.device) -> tuple[int, int]:
    """(row splits, rows per split) for a column-parallel weight-gradient kernel: about
    four programs per SM in total, each over a multiple of :data:`DW_BLOCK_R` rows."""
    col_blocks = -(-n // DW_BLOCK_C)
    want = max(1, num_programs(device, 1 << 30, per_sm=4) // col_blocks)
    splits = max(1, min(want, -(-n_rows // DW_BLOCK_R)))
    per = -(-n_rows // splits)
    per = -(-per // DW_BLOCK_R) * DW_BLOCK_R
    return -(-n_rows // per), per


def sum_partials(part: torch.Tensor, splits: int, *outs: torch.Tensor) -> None:
    """``outs[i][:] = part[i * splits:(i + 1) * splits].sum(0)`` in ``outs[i]``'s dtype (one launch).

    Args:
        part: ``(len(outs) * splits, N)`` fp32, contiguous (any view of that layout, e.g. ``(2, splits, N)``).
        splits: partial rows per output.
        outs: one or two ``(N,)`` contiguous tensors.
    """
    n = part.shape[-1]
    block_s = min(next_power_of_2(splits), 32)
    _sum[(-(-n // DW_BLOCK_C), len(outs))](
        part, outs[0], outs[-1], splits, n, BLOCK_S=block_s, BLOCK_C=DW_BLOCK_C, num_warps=4,
    )

"""Fused LayerNorm, forward and backward in Triton.

Math, per row ``x`` of length ``N`` (fp32 arithmetic)::

    mean = sum(x) / N
    rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)     # mean and rstd cached: 8 bytes per row
    xhat = (x - mean) * rstd
    y    = xhat * w + b

Backward (``g = dy * w``)::

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)        db = sum_rows(dy)

Memory tricks: ``xhat`` is recomputed from the saved input and the two per-row
statistics rather than stored. The variance uses the two-pass form on the row held in
registers (no ``E[x^2] - E[x]^2`` cancellation).

Launches: one forward; the backward is one pass over ``x`` and ``dy`` (RMSNorm's: the floor,
read both once and write ``dx``): one program per SM walks its own contiguous rows a few at a
time with the next steps' loads in flight (a ``tl.range`` software pipeline), writes each row's
``dx`` and keeps the partial sums of ``dy * xhat`` and ``dy`` over its rows in registers; a
small second launch adds the per-program partial rows in program order into ``dw`` and ``db``
in their own dtypes (deterministic, no atomics). Measured on an H100 (8192 x 4096 bf16,
forward + backward, CUDA-graph replay): 0.130 ms, 106% of the device's copy rate by the bytes a
LayerNorm must move, against 0.175 ms (79%) for the earlier single-launch backward that re-read
``x`` and ``dy`` for the weight gradients. Rows wider than ``_ONE_PASS_MAX_N`` (whose partial
rows and tiles would spill out of one program's registers) keep that single launch: (column block
x row split) programs that keep ``[32, 128]`` fp32 tiles of ``dy * xhat`` and ``dy`` over their
rows and store partial rows, placed first so that these longer programs start first, then one
program per row for ``dx``; the last weight-gradient program of each column block to finish (an
atomic ticket, ``_reduce.py``) sums that block's partial rows in split order.

Shapes: ``x`` ``(..., N)``; ``weight`` and ``bias`` ``(N,)`` (``bias`` may be ``None``).

Dtypes follow ``torch.nn.functional.layer_norm``: the output has ``x``'s dtype, and fp32 under
CUDA autocast (layer_norm is on its fp32 list; the kernel reads bf16/fp16 ``x`` and writes fp32
directly, no cast pass); CPU autocast leaves layer_norm alone. Gradients come back in each
input's own dtype.

References:
    Ba, Kiros & Hinton, "Layer Normalization", 2016.
    Triton tutorial "Layer Normalization" (fused backward, staged weight-gradient reduction).
    CUTLASS's serial split-K semaphore (the last arriving program finishes the reduction).
"""

from __future__ import annotations

import torch
from torch import nn

from ._reduce import (
    DW_BLOCK_C,
    DW_BLOCK_R,
    last_to_arrive,
    load_rows,
    one_pass_plan,
    split_rows,
    sum_split_rows,
    tickets,
)
from ._utils import (
    LazyKernel,
    as_rows,
    check_runnable_device,
    check_same_device,
    check_tensor,
    dense_vector,
    empty_rows_like,
    jit_helper,
    next_power_of_2,
    op_def,
    rows_of,
    row_warps,
    tl,
)

__all__ = ["layer_norm", "LayerNorm", "LayerNormFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: device types whose autocast runs layer_norm in fp32 (its fp32 op list); CPU autocast does not
_AUTOCAST_FP32 = ("cuda",)


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """What ``F.layer_norm`` returns for ``x`` here and now: fp32 under autocast on a device type
    whose autocast lists layer_norm as an fp32 op, else ``x``'s dtype."""
    kind = x.device.type
    if kind in _AUTOCAST_FP32 and torch.is_autocast_enabled(kind):
        return torch.float32
    return x.dtype


def _layer_norm_fwd_kernel(
    X,
    Y,
    W,
    B,
    STATS,
    stride_x,
    stride_y,
    n_rows,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # STATS is (2, n_rows) fp32: mean then rstd
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(STATS + row, mean)
    tl.store(STATS + n_rows + row, rstd)


@jit_helper
def _store_parts(
    PART, part, n_parts, N, cols, cmask, acc_w, acc_b, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr
):
    """Partial row ``part`` of ``dw`` and of ``db`` (column sums of the fp32 tiles ``acc_w``, ``acc_b``) into
    ``PART``, ``(2, n_parts, N)``: dw's rows, then db's."""
    if COMPUTE_DW:
        tl.store(PART + part * N + cols, tl.sum(acc_w, axis=0), mask=cmask)
    if COMPUTE_DB:
        tl.store(PART + (n_parts + part) * N + cols, tl.sum(acc_b, axis=0), mask=cmask)


def _layer_norm_bwd_kernel(
    DY,
    X,
    W,
    STATS,
    DX,
    PART,
    DW,
    DB,
    TICKETS,
    stride_dy,
    stride_x,
    n_rows,
    N,
    rows_per_split,
    n_splits,
    n_col_blocks,
    n_weight_programs,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
):
    # One launch, two kinds of program (horizontal fusion). The first n_weight_programs are
    # (column block, row split) weight-gradient programs, first so that the long ones start
    # first; the rest compute one row of dx each. STATS is (2, n_rows) fp32: mean, rstd.
    # PART is (2, n_splits, N) fp32 partial rows for dw and db.
    pid = tl.program_id(0)
    if pid < n_weight_programs:
        cb = pid % n_col_blocks
        split = pid // n_col_blocks
        wcols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        wcmask = wcols < N
        r0 = split.to(tl.int64) * rows_per_split
        r_end = tl.minimum(r0 + rows_per_split, n_rows)
        acc_w = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for start in range(r0, r_end, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            rmask = rows < r_end
            m = rmask[:, None] & wcmask[None, :]
            dy_t = tl.load(DY + rows[:, None] * stride_dy + wcols[None, :], mask=m, other=0.0).to(tl.float32)
            if COMPUTE_DW:
                x_t = tl.load(X + rows[:, None] * stride_x + wcols[None, :], mask=m, other=0.0).to(tl.float32)
                mean_r = tl.load(STATS + rows, mask=rmask, other=0.0)
                rstd_r = tl.load(STATS + n_rows + rows, mask=rmask, other=0.0)
                acc_w += dy_t * ((x_t - mean_r[:, None]) * rstd_r[:, None])
            if COMPUTE_DB:
                acc_b += dy_t
        _store_parts(PART, split, n_splits, N, wcols, wcmask, acc_w, acc_b, COMPUTE_DW, COMPUTE_DB)
        # The last program of this column block to finish sums its partial rows into dw
        # and db in their own dtypes, then re-arms the ticket for the next launch.
        if last_to_arrive(TICKETS + cb, n_splits):
            if COMPUTE_DW:
                sum_split_rows(PART, DW, wcols, wcmask, n_splits, N, BLOCK_S, BLOCK_C)
            if COMPUTE_DB:
                sum_split_rows(PART + n_splits * N, DB, wcols, wcmask, n_splits, N, BLOCK_S, BLOCK_C)
            tl.atomic_xchg(TICKETS + cb, 0, sem="relaxed", scope="gpu")
    else:
        row = (pid - n_weight_programs).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(STATS + row)
        rstd = tl.load(STATS + n_rows + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        c1 = tl.sum(g * xhat, axis=0) / N
        c2 = tl.sum(g, axis=0) / N
        dx = rstd * (g - c2 - xhat * c1)
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _layer_norm_bwd_one_pass_kernel(
    DY,
    X,
    W,
    STATS,
    DX,
    PART,
    stride_dy,
    stride_x,
    n_rows,
    N,
    rows_per_program,
    n_programs,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
):
    # One pass (RMSNorm's): each program walks its own contiguous rows BLOCK_R at a time, writes
    # their dx and keeps dw's and db's partial sums over them in [BLOCK_R, BLOCK_N] fp32 tiles; at the
    # end it stores one partial row of each into PART ((2, n_programs, N) fp32: dw, then db).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    r0 = pid.to(tl.int64) * rows_per_program
    r_end = tl.minimum(r0 + rows_per_program, n_rows)
    acc_w = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for start in tl.range(r0, r_end, BLOCK_R, num_stages=STAGES):
        rows, m, dy, x, rstd = load_rows(
            DY, X, STATS + n_rows, start, r_end, cols, cmask, stride_dy, stride_x, BLOCK_R
        )
        mean = tl.load(STATS + rows, mask=rows < r_end, other=0.0)
        xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = rstd[:, None] * (g - c2[:, None] - xhat * c1[:, None])
        tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
        if COMPUTE_DW:
            acc_w += dy * xhat
        if COMPUTE_DB:
            acc_b += dy
    _store_parts(PART, pid, n_programs, N, cols, cmask, acc_w, acc_b, COMPUTE_DW, COMPUTE_DB)


def _layer_norm_part_sum_kernel(
    PART,
    DW,
    DB,
    n_parts,
    N,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # dw[cols], db[cols] = the one-pass programs' partial rows summed in program order (deterministic)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    if COMPUTE_DW:
        sum_split_rows(PART, DW, cols, cols < N, n_parts, N, BLOCK_S, BLOCK_C)
    if COMPUTE_DB:
        sum_split_rows(PART + n_parts * N, DB, cols, cols < N, n_parts, N, BLOCK_S, BLOCK_C)


_fwd = LazyKernel(_layer_norm_fwd_kernel)
_bwd = LazyKernel(_layer_norm_bwd_kernel)
_bwd_one_pass = LazyKernel(_layer_norm_bwd_one_pass_kernel)
_part_sum = LazyKernel(_layer_norm_part_sum_kernel)

#: widest row the one-pass backward keeps in one program's registers (x, dy and two partial tiles);
#: wider rows take the single-launch backward of column-parallel weight-gradient programs beside dx rows
_ONE_PASS_MAX_N = 8192
#: columns per program of the partial rows' sum
_SUM_BLOCK_C = 16


def _forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, dtype: torch.dtype
):
    """``(y, rows, stats)``: the output (in ``dtype``), :func:`as_rows` of ``x`` (what backward
    reads), per-row (mean, rstd)."""
    rows = x2, n_rows, stride_x = as_rows(x)
    n = x.shape[-1]
    y = empty_rows_like(x, x2, dtype)
    stats = torch.empty((2, n_rows), dtype=torch.float32, device=x.device)  # mean, rstd: one allocation
    block = next_power_of_2(n)
    if n_rows > 0:
        _fwd[(n_rows,)](
            x2,
            y,
            weight,
            bias if bias is not None else weight,
            stats,
            stride_x,
            n,
            n_rows,
            n,
            float(eps),
            BLOCK_N=block,
            HAS_BIAS=bias is not None,
            num_warps=row_warps(block),
        )
    return y, rows, stats


def _backward(
    dy: torch.Tensor,
    rows: tuple[torch.Tensor, int, int],
    weight: torch.Tensor,
    stats: torch.Tensor,
    need_dw: bool,
    bias_dtype: torch.dtype | None,
):
    """``(dx, dw, db)`` in the dtypes of ``x``, the weight and the bias; ``db`` only when
    ``bias_dtype`` is given, ``None`` where not needed."""
    x2, n_rows, stride_x = rows
    n = dy.shape[-1]
    dy2, _, stride_dy = as_rows(dy)
    dx = empty_rows_like(dy, dy2, x2.dtype)
    need_db = bias_dtype is not None
    if n_rows == 0:
        return (
            dx,
            torch.zeros_like(weight) if need_dw else None,
            torch.zeros(n, dtype=bias_dtype, device=dy.device) if need_db else None,
        )
    block = next_power_of_2(n)
    if block <= _ONE_PASS_MAX_N:
        # one pass over x and dy (the floor: read both once, write dx), then a small launch for the sums
        programs, per, step, stages, warps = one_pass_plan(
            n_rows, block, x2.element_size(), dy2.element_size(), dy.device
        )
        wprog = need_dw or need_db
        part = torch.empty((2, programs, n), dtype=torch.float32, device=dy.device) if wprog else stats
        _bwd_one_pass[(programs,)](
            dy2,
            x2,
            weight,
            stats,
            dx,
            part,
            stride_dy,
            stride_x,
            n_rows,
            n,
            per,
            programs,
            BLOCK_R=step,
            BLOCK_N=block,
            STAGES=stages,
            COMPUTE_DW=need_dw,
            COMPUTE_DB=need_db,
            num_warps=warps,
        )
        dw = torch.empty_like(weight) if need_dw else None
        db = torch.empty(n, dtype=bias_dtype, device=dy.device) if need_db else None
        if wprog:
            _part_sum[(-(-n // _SUM_BLOCK_C),)](
                part,
                dw if need_dw else part,
                db if need_db else part,
                programs,
                n,
                COMPUTE_DW=need_dw,
                COMPUTE_DB=need_db,
                BLOCK_S=min(next_power_of_2(programs), 2048 // _SUM_BLOCK_C),
                BLOCK_C=_SUM_BLOCK_C,
                num_warps=4,
            )
        return dx, dw, db
    # Rows too wide for that: one launch, weight-gradient programs and dx rows side by side (kernel comment).
    wprog = need_dw or need_db
    splits, per = split_rows(n_rows, n, dy.device) if wprog else (1, n_rows)
    col_blocks = -(-n // DW_BLOCK_C)
    part = torch.empty((2, splits, n), dtype=torch.float32, device=dy.device) if wprog else stats
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty(n, dtype=bias_dtype, device=dy.device) if need_db else None
    n_wprog = col_blocks * splits if wprog else 0
    _bwd[(n_wprog + n_rows,)](
        dy2,
        x2,
        weight,
        stats,
        dx,
        part,
        dw if need_dw else part,
        db if need_db else part,
        tickets(dy, col_blocks),
        stride_dy,
        stride_x,
        n_rows,
        n,
        per,
        splits,
        col_blocks,
        n_wprog,
        BLOCK_N=block,
        BLOCK_R=DW_BLOCK_R,
        BLOCK_C=DW_BLOCK_C,
        BLOCK_S=min(next_power_of_2(splits), 32),
        COMPUTE_DW=need_dw,
        COMPUTE_DB=need_db,
        num_warps=row_warps(block),
    )
    return dx, dw, db


class LayerNormFunction(torch.autograd.Function):
    """Autograd glue: saves ``x``, per-row mean and rstd; recomputes ``xhat`` in backward.

    Host time bounds this op at LLM sizes (module docstring), so each pass does only its
    allocations and one launch.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, dtype: torch.dtype
    ) -> torch.Tensor:
        y, rows, stats = _forward(x, weight, bias, eps, dtype)
        ctx.save_for_backward(rows[0], weight, stats)
        ctx.rows = rows[1:]
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, stats = ctx.saved_tensors
        _, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = _backward(
            dy, (x2, *ctx.rows), weight, stats, need_dw, ctx.bias_dtype if need_db else None
        )
        return dx, dw, db, None, None


# -- torch.compile: the same two passes as custom operators (``op_def``) --------------------------


@op_def(
    "layer_norm",
    "(Tensor x, Tensor weight, Tensor? bias, float eps, ScalarType? dtype=None) -> (Tensor, Tensor)",
)
def _layer_norm_op(x, weight, bias, eps, dtype=None):
    y, _, stats = _forward(x, weight, bias, eps, dtype or x.dtype)
    return y, stats


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, dtype=None):
    return x.new_empty(x.shape, dtype=dtype or x.dtype), x.new_empty((2, rows_of(x)), dtype=torch.float32)


@op_def(
    "layer_norm_backward",
    "(Tensor dy, Tensor x, Tensor weight, Tensor stats, bool need_dw, "
    "Tensor? bias, bool need_db) -> (Tensor, Tensor, Tensor)",
)
def _layer_norm_backward_op(dy, x, weight, stats, need_dw, bias, need_db):
    dx, dw, db = _backward(
        dy, as_rows(x), weight, stats, need_dw, bias.dtype if need_db and bias is not None else None
    )
    none = weight.new_empty(0)
    return dx, dw if dw is not None else none, db if db is not None else none


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, stats, need_dw, bias, need_db):
    db = bias.new_empty(bias.shape) if need_db and bias is not None else weight.new_empty(0)
    return dy.new_empty(dy.shape, dtype=x.dtype), weight.new_empty(weight.shape if need_dw else (0,)), db


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    ctx.save_for_backward(x, weight, output[1], bias)


def _layer_norm_grad(ctx, dy, _dstats):
    x, weight, stats, bias = ctx.saved_tensors
    _, need_dw, need_db = ctx.needs_input_grad[:3]
    need_db = need_db and bias is not None
    dx, dw, db = torch.ops.ckpt.layer_norm_backward(dy, x, weight, stats, need_dw, bias, need_db)
    return dx, dw if need_dw else None, db if need_db else None, None, None


_layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Fused LayerNorm over the last dimension, fp32 statistics.

    Args:
        x: ``(..., N)`` fp32/fp16/bf16; any strides.
        weight: ``(N,)``.
        bias: ``(N,)`` or ``None``.
        eps: added to the variance.

    Returns:
        ``(..., N)`` with ``x``'s dtype, or fp32 under CUDA autocast (as ``F.layer_norm``).
        Gradients come back in the dtypes of ``x``, ``weight`` and ``bias``.
    """
    check_tensor(x, "x", dtypes=_FLOATS, min_ndim=1)
    check_tensor(weight, "weight", dtypes=_FLOATS, ndim=1)
    if bias is not None:
        check_tensor(bias, "bias", dtypes=_FLOATS, ndim=1)
    check_runnable_device(x, "x")
    check_same_device(x, "x", weight=weight, bias=bias)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}")
    if bias is not None and bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias has shape {tuple(bias.shape)} but x's last dim is {x.shape[-1]}")
    dtype = out_dtype(x)
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        return torch.ops.ckpt.layer_norm(x, dense_vector(weight), dense_vector(bias), float(eps), dtype)[0]
    return LayerNormFunction.apply(x, dense_vector(weight), dense_vector(bias), eps, dtype)


class LayerNorm(nn.Module):
    """``nn.Module`` form of :func:`layer_norm` with ``weight`` (ones) and optional ``bias`` (zeros).

    Shapes: input ``(..., hidden_size)`` -> output of the same shape and dtype (fp32 under CUDA
    autocast, as ``nn.LayerNorm``).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"

"""Fused RMSNorm (Llama / Gemma style), forward and backward in Triton.

Math, per row ``x`` of length ``N`` (all arithmetic in fp32 whatever the storage dtype)::

    rstd = 1 / sqrt(mean(x^2) + eps)          # cached per row: 4 bytes per token
    xhat = x * rstd
    y    = xhat * (offset + w)                # offset=0: Llama weights, offset=1: Gemma weights

Llama rounds ``xhat`` to the input dtype *before* multiplying by the weight
(``weight * hidden.to(input_dtype)``); with ``offset=0`` the kernel reproduces that
rounding so bf16 outputs match Hugging Face bit-for-bit in most elements. Gemma
(``offset=1``) multiplies in fp32 and rounds once.

Backward (``g = dy * (offset + w)``)::

    dx = rstd * (g - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)

Residual add fused in (:func:`fused_add_rms_norm`, the step between a pre-norm block's
sublayers)::

    h  = x + r                                # stored in x's dtype, then normalised as above
    dh = rstd * (g - hhat * mean(g * hhat)) + dh_out    # dh_out: h's gradient from later layers
    dx = dr = dh

One forward kernel reads ``x`` and ``r`` once and writes ``h`` and ``y``; the backward is the
one-pass (or wide-row) backward below with ``dh_out`` added to each row before it is stored.

Memory tricks:

* Only ``x`` (an input that is alive anyway) and the per-row ``rstd`` are saved; ``xhat``
  is recomputed in backward (the kernel is bandwidth bound, recomputation is free).
* ``dx`` may be written over ``dy`` in place (``in_place=True``): each program reads a row
  of ``dy`` before writing the same row of ``dx``. This is safe when the incoming
  gradient is private to this node, which holds when the norm output feeds only linear
  layers (every norm of a Llama block); it is *not* safe when the output also feeds an
  addition whose other branch still needs the same gradient tensor, hence opt-in.
* Backward is one pass over ``x`` and ``dy`` (the floor: read both, write ``dx``): one
  program per SM walks its own contiguous rows a few at a time, with the loads of the next
  steps in flight while it computes (``tl.range(num_stages=...)``, a software pipeline
  through shared memory), writes each row's ``dx`` and keeps ``dw``'s partial sum over its
  rows in registers; a small second launch adds the per-program partial rows in program
  order into ``dw`` in the weight's dtype (deterministic, no atomics). Measured on an H200
  (8192 x 4096 and 16384 x 2048 bf16, GPU time): 56-57 us, down from 90 us for the earlier
  two-pass backward (weight-gradient programs re-reading ``x`` and ``dy``, then ``dx``); a
  one-row-per-step loop without the pipeline, as in Liger-Kernel, is latency-bound
  (68-100 us in the same sweep). Rows wider than 16384 do not fit one program's registers
  (the partial ``dw`` row included) and spill, so they keep the two-pass backward of
  earlier versions: a column-parallel launch of ``dw``'s partial rows (re-reading ``x`` and
  ``dy``, a third more bytes), then ``dx`` one row per program with the sum of the partial
  rows in side-by-side programs of the same launch.
* Host time counts as much as GPU time at these sizes (a norm over 8192 x 4096 bf16 takes
  about 0.1 ms on an H200, less than the host needs to dispatch it through Python):
  backward makes two launches and three allocations and no other tensor operations.

Shapes: ``x`` is ``(..., N)``, ``weight`` is ``(N,)``, output has ``x``'s shape and dtype (the
promoted dtype for a Llama-style norm whose weight has another dtype: :func:`out_dtype`).

References:
    Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.
    Touvron et al., "LLaMA", 2023 (fp32 norm, cast before weight).
    Gemma team, "Gemma", 2024 (``1 + w`` parameterisation).
    Triton tutorial "Layer Normalization" (two-stage weight-gradient reduction).
"""

from __future__ import annotations

import torch
from torch import nn

from ._reduce import DW_BLOCK_C, DW_BLOCK_R, load_rows, one_pass_plan, split_rows, sum_split_rows
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

__all__ = [
    "rms_norm",
    "RMSNorm",
    "RMSNormFunction",
    "fused_add_rms_norm",
    "FusedAddRMSNorm",
    "FusedAddRMSNormFunction",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _rms_norm_fwd_kernel(
    X,
    Y,
    W,
    RSTD,
    stride_x,
    stride_y,
    N,
    eps,
    offset,
    BLOCK_N: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _normalize_row(x, X.dtype.element_ty, W, Y, RSTD, row, stride_y, cols, mask, N, eps, offset, LLAMA_CAST)


@jit_helper
def _normalize_row(
    x, x_dtype: tl.constexpr, W, Y, RSTD, row, stride_y, cols, mask, N, eps, offset, LLAMA_CAST: tl.constexpr
):
    """The norm of one fp32 row ``x`` (its storage dtype ``x_dtype``) into row ``row`` of ``Y``, its rstd
    into ``RSTD``."""
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    xhat = x * rstd
    if LLAMA_CAST:
        # Llama rounds the normalised activations to the input dtype before the weight.
        xhat = xhat.to(x_dtype).to(tl.float32)
    y = xhat * (w + offset)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


def _fused_add_rms_norm_fwd_kernel(
    X,
    R,
    H,
    Y,
    W,
    RSTD,
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    N,
    eps,
    offset,
    BLOCK_N: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
):
    # h = x + r rounded to h's dtype, as the unfused ``residual + hidden`` rounds it, then the
    # norm of that rounded h: one read of x and r, one write of h and y.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(H.dtype.element_ty)
    tl.store(H + row * stride_h + cols, h, mask=mask)
    _normalize_row(
        h.to(tl.float32),
        H.dtype.element_ty,
        W,
        Y,
        RSTD,
        row,
        stride_y,
        cols,
        mask,
        N,
        eps,
        offset,
        LLAMA_CAST,
    )


def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PART,
    DH_OUT,
    stride_dy,
    stride_x,
    stride_dx,
    stride_dho,
    n_rows,
    N,
    offset,
    rows_per_program,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NEED_DW: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
    STAGES: tl.constexpr,
    ADD_DH: tl.constexpr,
):
    # One pass: each program walks its own contiguous rows BLOCK_R at a time, writes their dx
    # and keeps dw's partial sum over them in a [BLOCK_R, BLOCK_N] fp32 tile; at the end it
    # stores one partial row. dx may alias dy: every row of dy is read by the program that
    # then overwrites it, before it does. ADD_DH (the fused residual add): the gradient that
    # reached the sum h from later layers, DH_OUT, is added to each row of dx.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    r0 = pid.to(tl.int64) * rows_per_program
    r_end = tl.minimum(r0 + rows_per_program, n_rows)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for start in tl.range(r0, r_end, BLOCK_R, num_stages=STAGES):
        rows, m, dy, x, rstd = load_rows(DY, X, RSTD, start, r_end, cols, cmask, stride_dy, stride_x, BLOCK_R)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])
        if ADD_DH:
            dx += tl.load(DH_OUT + rows[:, None] * stride_dho + cols[None, :], mask=m, other=0.0).to(
                tl.float32
            )
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=m)
        if NEED_DW:
            if LLAMA_CAST:  # the forward multiplied the weight by xhat rounded to x's dtype
                xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
            acc += dy * xhat
    if NEED_DW:
        tl.store(DW_PART + pid * N + cols, tl.sum(acc, axis=0), mask=cmask)


def _rms_norm_dw_sum_kernel(DW_PART, DW, n_parts, N, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # dw[cols] = sum of the backward programs' partial rows, in program order (deterministic)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    sum_split_rows(DW_PART, DW, cols, cols < N, n_parts, N, BLOCK_S, BLOCK_C)


def _rms_norm_bwd_dw_kernel(
    DY,
    X,
    RSTD,
    DW_PART,
    stride_dy,
    stride_x,
    n_rows,
    N,
    rows_per_split,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
):
    # Rows too wide for one program's registers (N > _ONE_PASS_MAX_N): dw's partial rows from a
    # grid of (column block x row split) programs, each accumulating a [BLOCK_R, BLOCK_C] fp32
    # tile over its rows. Runs before the dx launch, which may overwrite dy.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    r0 = tl.program_id(1).to(tl.int64) * rows_per_split
    r_end = tl.minimum(r0 + rows_per_split, n_rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(r0, r_end, BLOCK_R):
        _, _, dy, x, rstd = load_rows(DY, X, RSTD, start, r_end, cols, cmask, stride_dy, stride_x, BLOCK_R)
        xhat = x * rstd[:, None]
        if LLAMA_CAST:
            xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
        acc += dy * xhat
    tl.store(DW_PART + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=cmask)


def _rms_norm_bwd_dx_wide_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PART,
    DW,
    DH_OUT,
    stride_dy,
    stride_x,
    stride_dx,
    stride_dho,
    N,
    offset,
    n_splits,
    n_sum_programs,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ADD_DH: tl.constexpr,
):
    # Rows wider than _ONE_PASS_MAX_N, after _rms_norm_bwd_dw_kernel: the first n_sum_programs
    # programs finish dw (each sums one column block's partial rows in split order into dw in
    # the weight's dtype); the rest compute one row of dx each.
    pid = tl.program_id(0)
    if pid < n_sum_programs:
        scols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        sum_split_rows(DW_PART, DW, scols, scols < N, n_splits, N, BLOCK_S, BLOCK_C)
    else:
        row = (pid - n_sum_programs).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
        if ADD_DH:
            dx += tl.load(DH_OUT + row * stride_dho + cols, mask=mask, other=0.0).to(tl.float32)
        # dx may alias dy: this row of dy was fully read above (and dw's partial rows were
        # made by the previous launch).
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


_fwd = LazyKernel(_rms_norm_fwd_kernel)
_fwd_add = LazyKernel(_fused_add_rms_norm_fwd_kernel)
_bwd = LazyKernel(_rms_norm_bwd_kernel)
_dw_sum = LazyKernel(_rms_norm_dw_sum_kernel)
_bwd_dw_wide = LazyKernel(_rms_norm_bwd_dw_kernel)
_bwd_dx_wide = LazyKernel(_rms_norm_bwd_dx_wide_kernel)

#: the partial rows are summed 16 columns per program
_SUM_BLOCK_C = 16
#: widest row the one-pass backward keeps in one program's registers (x, dy and the dw partial);
#: wider rows spill (4096 x 32768 bf16 took 1.2-2.9 ms on the H200 against 0.35 ms for the
#: column-parallel pass below), so they take a column-parallel dw pass, then dx one row per program
_ONE_PASS_MAX_N = 16384


def out_dtype(x: torch.Tensor, weight: torch.Tensor, offset: float) -> torch.dtype:
    """The output's dtype, as the Hugging Face norm it replaces gives it (autocast changes neither:
    they compute in fp32 by hand, with ops autocast leaves alone): Llama-style norms (``offset=0``)
    return ``weight * xhat.to(x.dtype)``, i.e. the promoted dtype, fp32 for bf16 ``x`` with an fp32
    weight; Gemma-style norms (``offset=1``) return ``x``'s dtype."""
    if offset == 0.0 and weight.dtype != x.dtype:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """``(y, rows, rstd)``: the output, :func:`as_rows` of ``x`` (what backward reads) and the per-row rstd."""
    rows = x2, n_rows, stride_x = as_rows(x)
    n = x.shape[-1]
    y = empty_rows_like(x, x2, out_dtype(x, weight, offset))
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = next_power_of_2(n)
    if n_rows > 0:
        _fwd[(n_rows,)](
            x2,
            y,
            weight,
            rstd,
            stride_x,
            n,
            n,
            float(eps),
            float(offset),
            BLOCK_N=block,
            LLAMA_CAST=(offset == 0.0),
            num_warps=row_warps(block),
        )
    return y, rows, rstd


def _forward_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """``(y, h, rstd)`` of the fused residual add: ``h = x + residual`` (contiguous, ``x``'s dtype),
    ``y`` the norm of ``h`` and the per-row rstd."""
    x2, n_rows, stride_x = as_rows(x)
    r2, _, stride_r = as_rows(residual)
    n = x.shape[-1]
    h = empty_rows_like(x, x2)
    y = empty_rows_like(x, x2, out_dtype(x, weight, offset))
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = next_power_of_2(n)
    if n_rows > 0:
        _fwd_add[(n_rows,)](
            x2,
            r2,
            h,
            y,
            weight,
            rstd,
            stride_x,
            stride_r,
            n,
            n,
            n,
            float(eps),
            float(offset),
            BLOCK_N=block,
            LLAMA_CAST=(offset == 0.0),
            num_warps=row_warps(block),
        )
    return y, h, rstd


def _backward(
    dy: torch.Tensor,
    rows: tuple[torch.Tensor, int, int],
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    need_dw: bool,
    in_place: bool,
    dh_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dw)`` (``dw`` is ``None`` unless ``need_dw``); ``rows`` as returned by :func:`_forward`.
    ``dx`` has ``x``'s dtype, ``dw`` the weight's; ``dy`` (the output's dtype) may differ from both.
    ``dh_out`` (the fused residual add: the gradient of its returned sum from later layers, ``x``'s
    shape) is added to ``dx`` in the same pass."""
    x2, n_rows, stride_x = rows
    n = dy.shape[-1]
    dy2, _, stride_dy = as_rows(dy)
    dho2, _, stride_dho = as_rows(dh_out) if dh_out is not None else (dy2, 0, stride_dy)
    if in_place and dy2 is dy and dy.dtype == x2.dtype:
        # a new tensor object over dy's memory: when x is a leaf, AccumulateGrad adopts an
        # object nobody else holds as x.grad, but copies one the caller still holds (dy)
        dx = dy.view(dy.shape)
    else:
        dx = empty_rows_like(dy, dy2, x2.dtype)
    if n_rows == 0:
        return dx, torch.zeros_like(weight) if need_dw else None
    block = next_power_of_2(n)
    if block > _ONE_PASS_MAX_N:
        return _backward_wide(
            dy2,
            stride_dy,
            x2,
            n_rows,
            stride_x,
            weight,
            rstd,
            offset,
            need_dw,
            dx,
            block,
            dho2,
            stride_dho,
            dh_out is not None,
        )
    # dh_out is one more tile per step in the pipeline's shared memory: plan for it with dy's
    grad_bytes = dy2.element_size() + (dho2.element_size() if dh_out is not None else 0)
    programs, per, step, stages, warps = one_pass_plan(
        n_rows, block, x2.element_size(), grad_bytes, dy.device
    )
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=dy.device) if need_dw else rstd
    _bwd[(programs,)](
        dy2,
        x2,
        weight,
        rstd,
        dx,
        dw_part,
        dho2,
        stride_dy,
        stride_x,
        n,
        stride_dho,
        n_rows,
        n,
        offset,
        per,
        BLOCK_R=step,
        BLOCK_N=block,
        NEED_DW=need_dw,
        LLAMA_CAST=(offset == 0.0),
        STAGES=stages,
        ADD_DH=dh_out is not None,
        num_warps=warps,
    )
    return dx, _sum_parts(dw_part, programs, weight) if need_dw else None


def _sum_parts(part: torch.Tensor, n_parts: int, weight: torch.Tensor) -> torch.Tensor:
    """``dw``: the ``(n_parts, N)`` fp32 partial rows summed in order, in the weight's dtype."""
    n = weight.shape[0]
    dw = torch.empty_like(weight)
    _dw_sum[(-(-n // _SUM_BLOCK_C),)](
        part,
        dw,
        n_parts,
        n,
        BLOCK_S=min(next_power_of_2(n_parts), 2048 // _SUM_BLOCK_C),
        BLOCK_C=_SUM_BLOCK_C,
        num_warps=4,
    )
    return dw


def _backward_wide(
    dy2: torch.Tensor,
    stride_dy: int,
    x2: torch.Tensor,
    n_rows: int,
    stride_x: int,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    need_dw: bool,
    dx: torch.Tensor,
    block: int,
    dho2: torch.Tensor,
    stride_dho: int,
    add_dh: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward for rows wider than ``_ONE_PASS_MAX_N``: dw's partial rows first (dx may overwrite
    dy), then one launch with a program per row for dx and a program per column block for the sum."""
    n = weight.shape[0]
    dw, dw_part, splits, col_blocks = None, rstd, 0, 0
    if need_dw:
        splits, per = split_rows(n_rows, n, dy2.device)
        col_blocks = -(-n // DW_BLOCK_C)
        dw_part = torch.empty((splits, n), dtype=torch.float32, device=dy2.device)
        dw = torch.empty_like(weight)
        _bwd_dw_wide[(col_blocks, splits)](
            dy2,
            x2,
            rstd,
            dw_part,
            stride_dy,
            stride_x,
            n_rows,
            n,
            per,
            BLOCK_R=DW_BLOCK_R,
            BLOCK_C=DW_BLOCK_C,
            LLAMA_CAST=(offset == 0.0),
            num_warps=4,
        )
    _bwd_dx_wide[(col_blocks + n_rows,)](
        dy2,
        x2,
        weight,
        rstd,
        dx,
        dw_part,
        dw if need_dw else dw_part,
        dho2,
        stride_dy,
        stride_x,
        n,
        stride_dho,
        n,
        offset,
        splits,
        col_blocks,
        BLOCK_N=block,
        BLOCK_S=min(next_power_of_2(max(splits, 1)), 32),
        BLOCK_C=DW_BLOCK_C,
        ADD_DH=add_dh,
        num_warps=row_warps(block),
    )
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd glue: saves ``x`` and the per-row ``rstd``; backward recomputes ``xhat``."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, in_place: bool
    ) -> torch.Tensor:
        y, rows, rstd = _forward(x, weight, eps, offset)
        ctx.save_for_backward(rows[0], weight, rstd)
        ctx.rows = rows[1:]
        ctx.offset = float(offset)
        ctx.in_place = in_place
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(
            dy, (x2, *ctx.rows), weight, rstd, ctx.offset, ctx.needs_input_grad[1], ctx.in_place
        )
        return dx, dw, None, None, None


# -- torch.compile: the same two passes as custom operators (``op_def``) --------------------------


@op_def("rms_norm", "(Tensor x, Tensor weight, float eps, float offset) -> (Tensor, Tensor)")
def _rms_norm_op(x, weight, eps, offset):
    y, _, rstd = _forward(x, weight, eps, offset)
    return y, rstd


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return x.new_empty(x.shape, dtype=out_dtype(x, weight, offset)), x.new_empty(
        rows_of(x), dtype=torch.float32
    )


@op_def(
    "rms_norm_backward",
    "(Tensor dy, Tensor x, Tensor weight, Tensor rstd, float offset, bool need_dw) -> (Tensor, Tensor)",
)
def _rms_norm_backward_op(dy, x, weight, rstd, offset, need_dw):
    dx, dw = _backward(dy, as_rows(x), weight, rstd, offset, need_dw, False)
    return dx, dw if dw is not None else weight.new_empty(0)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, offset, need_dw):
    return dy.new_empty(dy.shape, dtype=x.dtype), weight.new_empty(weight.shape if need_dw else (0,))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset = offset


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    dx, dw = torch.ops.ckpt.rms_norm_backward(dy, x, weight, rstd, ctx.offset, need_dw)
    return dx, dw if need_dw else None, None, None


_rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, *, in_place: bool = False
) -> torch.Tensor:
    """Fused RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (offset + weight)`` computed in fp32.

    Args:
        x: ``(..., N)`` fp32/fp16/bf16 activations; any strides.
        weight: ``(N,)`` scale, any float dtype, same device as ``x``.
        eps: added to the mean square.
        offset: ``0.0`` for Llama-style weights, ``1.0`` for Gemma-style ``(1 + w)`` weights.
        in_place: write the input gradient over the incoming output gradient (saves one
            activation-sized buffer in backward; safe when the output feeds only linear layers).
            Ignored under ``torch.compile``, where the kernel is a custom operator.

    Returns:
        ``(..., N)`` tensor: ``x``'s dtype, except that with ``offset=0`` a weight of another dtype
        gives the promoted one (fp32 for bf16 ``x`` and an fp32 weight), as Llama's norm does.
        Autocast changes nothing (Hugging Face's norms compute in fp32 by hand); ``x``'s gradient
        comes back in ``x``'s dtype, the weight's in the weight's.
    """
    check_tensor(x, "x", dtypes=_FLOATS, min_ndim=1)
    check_tensor(weight, "weight", dtypes=_FLOATS, ndim=1)
    check_runnable_device(x, "x")
    check_same_device(x, "x", weight=weight)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}")
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        return torch.ops.ckpt.rms_norm(x, dense_vector(weight), float(eps), float(offset))[0]
    return RMSNormFunction.apply(x, dense_vector(weight), eps, offset, in_place)


class _NormWeight(nn.Module):
    """The parameter and arguments :class:`RMSNorm` and :class:`FusedAddRMSNorm` share: ``weight`` of
    ``(hidden_size,)``, ones (zeros with ``offset``, Gemma's ``1 + w``), ``eps``, ``offset``, ``in_place``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        in_place: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.offset = offset
        self.in_place = in_place

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, in_place={self.in_place}"


class RMSNorm(_NormWeight):
    """``nn.Module`` form of :func:`rms_norm`; drop-in for ``LlamaRMSNorm`` (parameter ``weight``).

    Shapes: input ``(..., hidden_size)`` -> output of the same shape and dtype (the promoted dtype
    when ``offset=0`` and the weight's dtype differs, as ``LlamaRMSNorm``).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, in_place=self.in_place)


# -- the residual add fused in: h = x + residual, y = rms_norm(h) ---------------------------------


def _check_add_inputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor(x, "x", dtypes=_FLOATS, min_ndim=1)
    check_tensor(residual, "residual", dtypes=_FLOATS, min_ndim=1)
    check_tensor(weight, "weight", dtypes=_FLOATS, ndim=1)
    check_runnable_device(x, "x")
    check_same_device(x, "x", residual=residual, weight=weight)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they are added "
            "elementwise (no broadcasting)"
        )
    if residual.dtype != x.dtype:
        raise ValueError(
            f"residual has dtype {str(residual.dtype).replace('torch.', '')} but x has "
            f"{str(x.dtype).replace('torch.', '')}; cast one so that both match (h = x + residual "
            "is stored in that dtype)"
        )
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}")


class FusedAddRMSNormFunction(torch.autograd.Function):
    """Autograd glue of :func:`fused_add_rms_norm`: saves ``h`` (an output, alive anyway: it is the
    next block's residual) and the per-row ``rstd``; backward recomputes ``hhat``. The gradients of
    ``x`` and ``residual`` are the same tensor ``dh`` (``h = x + residual``)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
        in_place: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, h, rstd = _forward_add(x, residual, weight, eps, offset)
        ctx.save_for_backward(h, weight, rstd)
        ctx.offset = float(offset)
        ctx.in_place = in_place
        ctx.set_materialize_grads(False)  # an unused output costs no tensor of zeros
        return y, h

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, dh_out: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[2]
        if dy is None:  # only h was used: as unfused, the weight gets no gradient and x, residual h's
            return dh_out, dh_out, None, None, None, None
        dh, dw = _backward(dy, as_rows(h), weight, rstd, ctx.offset, need_dw, ctx.in_place, dh_out)
        return dh, dh, dw, None, None, None


@op_def(
    "fused_add_rms_norm",
    "(Tensor x, Tensor residual, Tensor weight, float eps, float offset) -> (Tensor, Tensor, Tensor)",
)
def _fused_add_rms_norm_op(x, residual, weight, eps, offset):
    return _forward_add(x, residual, weight, eps, offset)


@_fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset):
    return (
        x.new_empty(x.shape, dtype=out_dtype(x, weight, offset)),
        x.new_empty(x.shape),
        x.new_empty(rows_of(x), dtype=torch.float32),
    )


@op_def(
    "fused_add_rms_norm_backward",
    "(Tensor dy, Tensor? dh_out, Tensor h, Tensor weight, Tensor rstd, float offset, bool need_dw) "
    "-> (Tensor, Tensor)",
)
def _fused_add_rms_norm_backward_op(dy, dh_out, h, weight, rstd, offset, need_dw):
    dh, dw = _backward(dy, as_rows(h), weight, rstd, offset, need_dw, False, dh_out)
    return dh, dw if dw is not None else weight.new_empty(0)


@_fused_add_rms_norm_backward_op.register_fake
def _(dy, dh_out, h, weight, rstd, offset, need_dw):
    return dy.new_empty(dy.shape, dtype=h.dtype), weight.new_empty(weight.shape if need_dw else (0,))


def _fused_add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _, offset = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.offset = offset


def _fused_add_rms_norm_grad(ctx, dy, dh_out, _drstd):
    h, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[2]
    if dy is None:  # only h was used (where the grads are not materialised as zeros)
        return dh_out, dh_out, None, None, None
    dh, dw = torch.ops.ckpt.fused_add_rms_norm_backward(dy, dh_out, h, weight, rstd, ctx.offset, need_dw)
    return dh, dh, dw if need_dw else None, None, None


_fused_add_rms_norm_op.register_autograd(_fused_add_rms_norm_grad, setup_context=_fused_add_rms_norm_setup)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with RMSNorm, the step between the sublayers of a pre-norm block::

        h = x + residual                                      # stored in x's dtype
        y = h * rsqrt(mean(h^2) + eps) * (offset + weight)    # computed in fp32, as rms_norm(h)

    One kernel reads ``x`` and ``residual`` once and writes ``h`` and ``y``; the backward is one pass
    that adds the gradient reaching ``h`` from later layers to the norm's input gradient, ``dh``,
    which is the gradient of both ``x`` and ``residual``. Replaces ``h = residual + x; y =
    norm(h)`` with the same values: ``h`` is rounded to its dtype before the norm reads it, as there.

    Args:
        x: ``(..., N)`` fp32/fp16/bf16 activations (a sublayer's output); any strides.
        residual: the residual stream, ``x``'s shape and dtype; any strides.
        weight: as :func:`rms_norm`.
        eps: as :func:`rms_norm`.
        offset: as :func:`rms_norm` (``offset=1.0`` for Gemma's ``1 + w``).
        in_place: write ``dh`` over the gradient of ``y`` (as :func:`rms_norm`'s ``in_place``: safe
            when ``y`` feeds only linear layers, as every pre-norm block's norm does). Ignored under
            ``torch.compile``.

    Returns:
        ``(y, h)``: ``y`` as :func:`rms_norm` of ``h`` gives it (dtype included), ``h`` contiguous in
        ``x``'s dtype: the next block's residual. Autocast changes nothing.
    """
    _check_add_inputs(x, residual, weight)
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        y, h, _ = torch.ops.ckpt.fused_add_rms_norm(
            x, residual, dense_vector(weight), float(eps), float(offset)
        )
        return y, h
    return FusedAddRMSNormFunction.apply(x, residual, dense_vector(weight), eps, offset, in_place)


class FusedAddRMSNorm(_NormWeight):
    """``nn.Module`` form of :func:`fused_add_rms_norm`: ``forward(x, residual) -> (y, h)``.

    Same parameter (``weight``) and arguments as :class:`RMSNorm`, so a decoder layer's
    ``post_attention_layernorm`` can be swapped for it with its state dict unchanged; the layer's
    forward must then call it with the residual (nothing rewrites decoder layers automatically).
    A sibling of :class:`RMSNorm`, not a subclass: its forward takes and returns two tensors.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, in_place=self.in_place)

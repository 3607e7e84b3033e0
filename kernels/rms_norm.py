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

Memory tricks:

* Only ``x`` (an input that is alive anyway) and the per-row ``rstd`` are saved; ``xhat``
  is recomputed in backward (the kernel is bandwidth bound, recomputation is free).
* ``dx`` may be written over ``dy`` in place (``in_place=True``): each program reads a row
  of ``dy`` before writing the same row of ``dx``. This is safe when the incoming
  gradient is private to this node, which holds when the norm output feeds only linear
  layers (every norm of a Llama block); it is *not* safe when the output also feeds an
  addition whose other branch still needs the same gradient tensor, hence opt-in.
* Backward is two fully parallel launches instead of one persistent loop over rows
  (whose serial row-by-row latency, measured on an H200, cost more than the bytes):
  first ``dw``'s partial rows from a grid of (column block x row split) programs, each
  accumulating a ``[32, 128]`` fp32 tile over its rows; then one launch holding, side by
  side, one program per column block that sums that block's partial rows in split order
  into ``dw`` in the weight's dtype (deterministic, no atomics), and one program per row
  for ``dx``. ``dw`` re-reads ``x`` and ``dy`` (a third more bytes) but keeps every SM
  busy; it runs first so that ``dx`` may then overwrite ``dy``.
* Host time counts as much as GPU time at these sizes (a norm over 8192 x 4096 bf16 takes
  about 0.1 ms on an H200, less than the host needs to dispatch it through Python):
  backward makes two launches and three allocations and no other tensor operations.

Shapes: ``x`` is ``(..., N)``, ``weight`` is ``(N,)``, output has ``x``'s shape and dtype.

References:
    Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.
    Touvron et al., "LLaMA", 2023 (fp32 norm, cast before weight).
    Gemma team, "Gemma", 2024 (``1 + w`` parameterisation).
    Triton tutorial "Layer Normalization" (two-stage weight-gradient reduction).
"""

from __future__ import annotations

import torch
from torch import nn

from ._reduce import DW_BLOCK_C, DW_BLOCK_R, split_rows, sum_split_rows
from ._utils import (
    LazyKernel,
    as_rows,
    check_runnable_device,
    check_same_device,
    check_tensor,
    dense_vector,
    empty_rows_like,
    next_power_of_2,
    op_def,
    rows_of,
    row_warps,
    tl,
)

__all__ = ["rms_norm", "RMSNorm", "RMSNormFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _rms_norm_fwd_kernel(
    X, Y, W, RSTD,
    stride_x, stride_y, N, eps, offset,
    BLOCK_N: tl.constexpr, LLAMA_CAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    xhat = x * rstd
    if LLAMA_CAST:
        # Llama rounds the normalised activations to the input dtype before the weight.
        xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
    y = xhat * (w + offset)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


def _rms_norm_bwd_dx_kernel(
    DY, X, W, RSTD, DX, DW_PART, DW,
    stride_dy, stride_x, stride_dx, N, offset, n_splits, n_sum_programs,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # The first n_sum_programs programs finish dw: each sums the partial rows (left by the
    # weight-gradient launch, which ran before this one) of one column block in split order
    # into dw in the weight's dtype. The rest compute one row of dx each.
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
        # dx may alias dy: this row of dy was fully read above (and dw's partial rows were
        # made by the previous launch).
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _rms_norm_bwd_dw_kernel(
    DY, X, RSTD, DW_PART,
    stride_dy, stride_x, n_rows, N, rows_per_split,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, LLAMA_CAST: tl.constexpr,
):
    # program (column block, row split): a [BLOCK_R, BLOCK_C] fp32 accumulator over its rows
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    r0 = tl.program_id(1).to(tl.int64) * rows_per_split
    r_end = tl.minimum(r0 + rows_per_split, n_rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(r0, r_end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        rmask = rows < r_end
        m = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        if LLAMA_CAST:
            xhat = xhat.to(X.dtype.element_ty).to(tl.float32)
        acc += dy * xhat
    tl.store(DW_PART + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=cmask)


_fwd = LazyKernel(_rms_norm_fwd_kernel)
_bwd_dx = LazyKernel(_rms_norm_bwd_dx_kernel)
_bwd_dw = LazyKernel(_rms_norm_bwd_dw_kernel)

def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """``(y, rows, rstd)``: the output, :func:`as_rows` of ``x`` (what backward reads) and the per-row rstd."""
    rows = x2, n_rows, stride_x = as_rows(x)
    n = x.shape[-1]
    y = empty_rows_like(x, x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = next_power_of_2(n)
    if n_rows > 0:
        _fwd[(n_rows,)](
            x2, y, weight, rstd, stride_x, n, n, float(eps), float(offset),
            BLOCK_N=block, LLAMA_CAST=(offset == 0.0), num_warps=row_warps(block),
        )
    return y, rows, rstd


def _backward(dy: torch.Tensor, rows: tuple[torch.Tensor, int, int], weight: torch.Tensor, rstd: torch.Tensor,
              offset: float, need_dw: bool, in_place: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dw)`` (``dw`` is ``None`` unless ``need_dw``); ``rows`` as returned by :func:`_forward`."""
    x2, n_rows, stride_x = rows
    n = dy.shape[-1]
    dy2, _, stride_dy = as_rows(dy)
    if in_place and dy2 is dy and dy.dtype == x2.dtype:
        # a new tensor object over dy's memory: when x is a leaf, AccumulateGrad adopts an
        # object nobody else holds as x.grad, but copies one the caller still holds (dy)
        dx = dy.view(dy.shape)
    else:
        dx = empty_rows_like(dy, dy2)
    if n_rows == 0:
        return dx, torch.zeros_like(weight) if need_dw else None
    block = next_power_of_2(n)
    dw, dw_part, splits, col_blocks = None, rstd, 0, 0
    if need_dw:
        # dw's partial rows first: dx may overwrite dy. The dx launch then also sums them.
        splits, per = split_rows(n_rows, n, dy.device)
        col_blocks = -(-n // DW_BLOCK_C)
        dw_part = torch.empty((splits, n), dtype=torch.float32, device=dy.device)
        dw = torch.empty_like(weight)
        _bwd_dw[(col_blocks, splits)](
            dy2, x2, rstd, dw_part, stride_dy, stride_x, n_rows, n, per,
            BLOCK_R=DW_BLOCK_R, BLOCK_C=DW_BLOCK_C, LLAMA_CAST=(offset == 0.0), num_warps=4,
        )
    _bwd_dx[(col_blocks + n_rows,)](
        dy2, x2, weight, rstd, dx, dw_part, dw if need_dw else dw_part,
        stride_dy, stride_x, n, n, offset, splits, col_blocks,
        BLOCK_N=block, BLOCK_S=min(next_power_of_2(max(splits, 1)), 32), BLOCK_C=DW_BLOCK_C,
        num_warps=row_warps(block),
    )
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd glue: saves ``x`` and the per-row ``rstd``; backward recomputes ``xhat``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, in_place: bool) -> torch.Tensor:
        y, rows, rstd = _forward(x, weight, eps, offset)
        ctx.save_for_backward(rows[0], weight, rstd)
        ctx.rows = rows[1:]
        ctx.offset = float(offset)
        ctx.in_place = in_place
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, (x2, *ctx.rows), weight, rstd, ctx.offset, ctx.needs_input_grad[1], ctx.in_place)
        return dx, dw, None, None, None


# -- torch.compile: the same two passes as custom operators (``op_def``) --------------------------

@op_def("rms_norm", "(Tensor x, Tensor weight, float eps, float offset) -> (Tensor, Tensor)")
def _rms_norm_op(x, weight, eps, offset):
    y, _, rstd = _forward(x, weight, eps, offset)
    return y, rstd


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return x.new_empty(x.shape), x.new_empty(rows_of(x), dtype=torch.float32)


@op_def("rms_norm_backward",
        "(Tensor dy, Tensor x, Tensor weight, Tensor rstd, float offset, bool need_dw) -> (Tensor, Tensor)")
def _rms_norm_backward_op(dy, x, weight, rstd, offset, need_dw):
    dx, dw = _backward(dy, as_rows(x), weight, rstd, offset, need_dw, False)
    return dx, dw if dw is not None else weight.new_empty(0)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, offset, need_dw):
    return dy.new_empty(dy.shape), weight.new_empty(weight.shape if need_dw else (0,))


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
        ``(..., N)`` tensor with ``x``'s dtype.
    """
    check_tensor(x, "x", dtypes=_FLOATS, min_ndim=1)
    check_tensor(weight, "weight", dtypes=_FLOATS, ndim=1)
    check_runnable_device(x, "x")
    check_same_device(x, "x", weight=weight)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}")
    if torch.compiler.is_compiling():   # traced: one opaque operator node, no graph break
        return torch.ops.ckpt.rms_norm(x, dense_vector(weight), float(eps), float(offset))[0]
    return RMSNormFunction.apply(x, dense_vector(weight), eps, offset, in_place)


class RMSNorm(nn.Module):
    """``nn.Module`` form of :func:`rms_norm`; drop-in for ``LlamaRMSNorm`` (parameter ``weight``).

    Shapes: input ``(..., hidden_size)`` -> output of the same shape and dtype.
    """

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, in_place=self.in_place)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, in_place={self.in_place}"

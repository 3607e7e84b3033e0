"""Fused LM head + cross-entropy that never materialises the full ``(tokens, vocab)`` logits.

For ``hidden`` ``(N, H)``, ``weight`` ``(V, H)``, optional ``bias`` ``(V,)``::

    logits = hidden @ weight.T + bias                      # (N, V), never built whole
    loss   = cross_entropy(logits, target, ...)            # see cross_entropy.py (softcap there too)
    G      = dloss/dlogits                                 # (N, V), never built whole
    d_hidden = G @ weight      d_weight = G.T @ hidden      d_bias = sum_rows(G)

Algorithm (all in the forward pass, for ``reduction`` ``"mean"``/``"sum"``): walk the
tokens in chunks of ``C`` rows; for each chunk

1. ``logits_c = hidden_c @ weight.T`` (one GEMM, ``C x V`` in the activation dtype),
2. the cross-entropy row kernel turns ``logits_c`` into its gradient *in place* (and the
   per-row losses), already multiplied by ``1/n_valid`` read from the device,
3. ``d_weight += G_c.T @ hidden_c`` (the first chunk writes with ``beta=0``: no zero fill),
4. ``d_hidden_c = G_c @ weight``, written over ``hidden_c`` when ``hidden`` is a private
   autograd intermediate (the output of the final norm): ``hidden_c`` is not read again.

So the peak extra memory is ``d_weight`` + one ``C x V`` chunk (+ ``d_hidden`` when it
cannot reuse ``hidden``). The chunk size trades the memory of the chunk against the
traffic of step 3, which reads and writes the whole ``V x H`` weight gradient once per
chunk: ``C`` defaults to the largest multiple of 64 for which the chunk is no larger than
``hidden`` (twice that when ``d_hidden`` reuses ``hidden``'s memory, since that budget is
then free), and to no fewer than 512 tokens (:data:`MIN_CHUNK`: shorter chunks make that update
memory-bound). Backward only rescales the three stored gradients by the incoming scalar
gradient (skipped on the device, without a host sync, when it is 1).

``reduction="none"`` cannot fold the incoming per-row gradients into ``d_weight`` before
they are known, so in that mode the forward only computes the losses (same chunking,
no gradients) and backward recomputes the chunks with the per-row scales.

The three GEMMs (``6 N V H`` flops) are the floor; everything else is one streaming
pass over each chunk. Accumulation of ``d_weight`` across chunks happens in the weight's
dtype (the GEMM itself accumulates in fp32).

Dtypes. The GEMMs run in one dtype: autocast's (``torch.autocast`` puts ``linear`` on its
lower-precision list) when autocast is enabled on the inputs' device, else ``hidden``'s. A
weight, bias or ``hidden`` of another dtype is cast to it once per call (``weight``: one
``V x H`` copy, as autocast makes; ``hidden``: one chunk at a time). The cross-entropy is fp32
(autocast's fp32 list) and the loss fp32. Gradients come back in each input's own dtype:
with an fp32 weight under bf16 autocast, ``d_weight`` is accumulated in fp32 straight from the
bf16 GEMMs (cuBLAS with an fp32 output), and an fp32 ``hidden`` gets an fp32 ``d_hidden``,
still written over ``hidden`` when that is a private intermediate. Inside the call autocast
is switched off, so the GEMMs' dtypes are the ones chosen here also when backward runs under
autocast.

Under ``torch.compile`` the loss is one custom operator (``torch.ops.ckpt.fused_linear_cross_entropy``,
its gradient for ``reduction="none"`` a second one): no graph break. The operator runs the same
chunk loop, but writes ``d_hidden`` into a new buffer (an operator may not write over its inputs).

Shapes: ``hidden`` ``(..., H)``; ``target`` ``hidden.shape[:-1]`` or flattened ``(N,)``.

References:
    Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024
    (losses without materialised logits; the gradient needs only the log-sum-exp).
    Rabe & Staats, "Self-attention Does Not Need O(n^2) Memory", 2021 (chunked recomputation).
    Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ._utils import (
    autocast_dtype,
    bump_version,
    check_runnable_device,
    check_same_device,
    check_tensor,
    op_def,
    owns_storage,
)
from .cross_entropy import (
    ClassWeights,
    _check_class_weight,
    _z_rows_for,
    check_loss_args,
    class_weights,
    check_target_range,
    launch_ce,
    reduce_rows,
    reduce_z,
    reduction_scale,
    scale_rows_,
    scaled_by,
)

__all__ = ["fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss", "FusedLinearCrossEntropyFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


#: fewest tokens per chunk: the weight-gradient GEMM's inner dimension is the chunk, so it does C/2 flops per
#: byte of ``d_weight`` it reads and writes; below ~500 that update is bound by memory on H100/H200-class GPUs
#: (250-330 flop per byte of HBM), and its traffic, the whole ``V x H`` gradient twice per chunk, grows as
#: the chunks shrink
MIN_CHUNK = 512


def default_chunk_size(
    n: int, h: int, v: int, reuse_hidden: bool, hidden_bytes: int = 2, logit_bytes: int = 2
) -> int:
    """Tokens per chunk: the chunk of logits is at most the size of ``hidden`` in bytes (x2 if
    reused), but never fewer than :data:`MIN_CHUNK` tokens (a model whose hidden size is small beside
    its vocabulary, e.g. H 1024 and V 151936, would otherwise run chunks of 64 tokens: 256 updates of
    ``d_weight`` per 16k tokens); ``hidden_bytes``/``logit_bytes`` are the element sizes of ``hidden``
    and of the GEMMs."""
    budget = n * h * hidden_bytes * (2 if reuse_hidden else 1)
    c = max(MIN_CHUNK, (budget // max(v * logit_bytes, 1)) // 64 * 64)
    return max(1, min(n, c))


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device``'s type while the chunk loop runs (its GEMMs' dtypes are chosen
    by hand); nothing to enter when it is off already."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``out += a @ b`` when ``accumulate``). ``a`` and ``b`` share a dtype;
    ``out`` may have a wider one (fp32 gradients of bf16 GEMMs): on the GPU cuBLAS then writes
    the fp32 result directly (``out_dtype``), elsewhere (the CPU, for tests) the product is made
    in the GEMM dtype and added."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda and out.dtype == torch.float32:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out += torch.mm(a, b)
    else:
        out.copy_(torch.mm(a, b))


def _chunk_loop(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    loss_rows: torch.Tensor,
    scale: torch.Tensor,
    opts: tuple[int, float, float, float],
    chunk: int,
    grads: tuple[bool, bool, bool] | None,
    d_hidden_out: torch.Tensor | None,
    dtype: torch.dtype,
    weights: ClassWeights | None = None,
    z_rows: torch.Tensor | None = None,
    zscale: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One pass over token chunks with the GEMMs in ``dtype`` (inputs of other dtypes are cast).
    ``grads=None``: losses only. Otherwise ``(dh, dw, db)`` flags; ``scale`` (the cross-entropy
    part's) and ``zscale`` (the z-loss part's, ``scale`` when ``None``) are 1-element or ``(N,)``
    per-row. ``z_rows`` (optional) takes each row's z-loss; ``weights`` are the class weights.
    ``d_hidden_out`` (``hidden``'s dtype) may be ``hidden``. The gradients come back in the dtypes
    of ``hidden``, ``weight`` and ``bias``."""
    ignore_index, label_smoothing, z_loss, softcap = opts
    n = hidden.shape[0]
    want_dh, want_dw, want_db = grads if grads is not None else (False, False, False)
    dw = torch.empty_like(weight) if want_dw else None
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_db else None
    w = weight if weight.dtype == dtype else weight.to(dtype)  # one copy per call, as autocast makes
    b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
    wt = w.t()
    for i, start in enumerate(range(0, n, chunk)):
        end = min(start + chunk, n)
        h_c = hidden[start:end]
        if h_c.dtype != dtype:
            h_c = h_c.to(dtype)  # a copy: d_hidden may then go over hidden's chunk before dw reads it
        logits = torch.addmm(b, h_c, wt) if b is not None else torch.mm(h_c, wt)
        sc = scale if scale.numel() == 1 else scale[start:end]
        zs = sc if zscale is None else (zscale if zscale.numel() == 1 else zscale[start:end])
        launch_ce(
            logits,
            target[start:end],
            loss_rows[start:end],
            logits if grads is not None else None,
            sc,
            ignore_index,
            label_smoothing,
            z_loss,
            softcap,
            weights,
            z_rows[start:end] if z_rows is not None else None,
            zs,
        )
        if grads is None:
            continue
        if dw is not None:  # before d_hidden: it may overwrite h_c
            _mm_into(dw, logits.t(), h_c, accumulate=i > 0)
        if db is not None:
            db += logits.sum(0, dtype=torch.float32)
        if want_dh:
            _mm_into(d_hidden_out[start:end], logits, w, accumulate=False)
        del logits
    if db is not None:
        db = db.to(bias.dtype)
    return (d_hidden_out if want_dh else None), dw, db


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd glue: gradients made in the forward (mean/sum) or recomputed in backward (none)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
        z_loss: float,
        chunk_size: int | None,
        inplace: bool | None,
        dtype: torch.dtype,
        softcap: float = 0.0,
        ce_weight: torch.Tensor | None = None,
        return_z_loss: bool = False,
    ):
        shape = hidden.shape
        h2 = hidden.reshape(-1, shape[-1])
        if not h2.is_contiguous():
            h2 = h2.contiguous()
        copied = h2.data_ptr() != hidden.data_ptr()
        n, hdim = h2.shape
        v = weight.shape[0]
        want = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[3],
        )
        reuse = (
            want[0]
            and reduction != "none"
            and (copied or (inplace if inplace is not None else owns_storage(hidden)))
        )
        chunk = chunk_size or default_chunk_size(n, hdim, v, reuse, h2.element_size(), dtype.itemsize)
        opts = (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap))
        loss_rows = torch.empty(n, dtype=torch.float32, device=h2.device)
        weights = class_weights(ce_weight)
        z_rows = _z_rows_for(n, h2.device, weights, return_z_loss)
        scale, zscale, n_valid, w_valid = reduction_scale(target, ignore_index, reduction, weights)
        ctx.shape, ctx.reduction, ctx.opts, ctx.chunk, ctx.dtype = shape, reduction, opts, chunk, dtype
        ctx.want, ctx.weights = want, weights
        if reduction == "none" or not any(want):
            with _no_autocast(h2.device):
                _chunk_loop(
                    h2,
                    weight,
                    bias,
                    target,
                    loss_rows,
                    scale,
                    opts,
                    chunk,
                    None,
                    None,
                    dtype,
                    weights,
                    z_rows,
                    zscale,
                )
            ctx.save_for_backward(h2, weight, bias, target)
        else:
            dh_out = (h2 if reuse else torch.empty_like(h2)) if want[0] else None
            with _no_autocast(h2.device):
                dh, dw, db = _chunk_loop(
                    h2,
                    weight,
                    bias,
                    target,
                    loss_rows,
                    scale,
                    opts,
                    chunk,
                    want,
                    dh_out,
                    dtype,
                    weights,
                    z_rows,
                    zscale,
                )
            if reuse and dh is not None and not copied:
                bump_version(hidden)
            # kept on ctx, not save_for_backward: dh may be a view of `hidden`, whose version we
            # just bumped, and these are results rather than inputs autograd must check.
            ctx.grads = (dh, dw, db)
        loss = reduce_rows(
            loss_rows, n_valid, reduction, shape[:-1], z_rows, w_valid if weights is not None else None
        )
        if not return_z_loss:
            return loss
        z = reduce_z(z_rows, n_valid, reduction, shape[:-1])
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_):
        if ctx.reduction == "none":
            h2, weight, bias, target = ctx.saved_tensors
            scale = grad_out.reshape(-1).to(torch.float32).contiguous()
            n = h2.shape[0]
            loss_rows = torch.empty(n, dtype=torch.float32, device=h2.device)
            dh_out = torch.empty_like(h2) if ctx.want[0] else None
            with _no_autocast(h2.device):
                dh, dw, db = _chunk_loop(
                    h2,
                    weight,
                    bias,
                    target,
                    loss_rows,
                    scale,
                    ctx.opts,
                    ctx.chunk,
                    ctx.want,
                    dh_out,
                    ctx.dtype,
                    ctx.weights,
                )
        else:
            if not hasattr(ctx, "grads"):
                raise RuntimeError(
                    "fused_linear_cross_entropy computes its gradients once, in the forward pass; "
                    "it cannot be backpropagated twice (retain_graph)"
                )
            dh, dw, db = ctx.grads
            del ctx.grads
            g = grad_out.reshape(1)
            for t in (dh, dw):
                if t is not None:
                    scale_rows_(t, g)
            if db is not None:
                scale_rows_(db.view(1, -1), g)
        if dh is not None:
            dh = dh.view(ctx.shape)
        return (dh, dw, None, db) + (None,) * 10


# -- torch.compile: the loss as custom operators (``op_def``). mean/sum: the forward makes the loss
# and the three gradients (d_hidden in a new buffer), the backward scales them; none: the forward
# makes the losses and the backward recomputes the chunks with the per-row scales, as in eager.

_FLCE_ARGS = (
    "Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float label_smoothing, "
    "float z_loss, float softcap, int chunk_size, ScalarType dtype, Tensor? ce_weight"
)


def _flce_prepare(hidden, weight, target, ignore_index):
    check_target_range(target, weight.shape[0], ignore_index, "weight")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    return h2 if h2.is_contiguous() else h2.contiguous()


def _chunk_of(chunk_size, h2, weight, dtype, reuse):
    return chunk_size or default_chunk_size(
        h2.shape[0], h2.shape[1], weight.shape[0], reuse, h2.element_size(), dtype.itemsize
    )


@op_def(
    "fused_linear_cross_entropy",
    f"({_FLCE_ARGS}, str reduction, bool[3] need) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _flce_op(
    hidden,
    weight,
    target,
    bias,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    chunk_size,
    dtype,
    ce_weight,
    reduction,
    need,
):
    h2 = _flce_prepare(hidden, weight, target, ignore_index)
    want = (need[0], need[1], bias is not None and need[2])
    opts = (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap))
    chunk = _chunk_of(chunk_size, h2, weight, dtype, False)
    loss_rows = torch.empty(h2.shape[0], dtype=torch.float32, device=h2.device)
    z_rows = torch.empty(h2.shape[0], dtype=torch.float32, device=h2.device)
    weights = class_weights(ce_weight)
    scale, zscale, n_valid, w_valid = reduction_scale(target, ignore_index, reduction, weights)
    grads = None if reduction == "none" or not any(want) else want
    dh_out = torch.empty_like(h2) if want[0] and grads is not None else None
    with _no_autocast(h2.device):
        dh, dw, db = _chunk_loop(
            h2,
            weight,
            bias,
            target,
            loss_rows,
            scale,
            opts,
            chunk,
            grads,
            dh_out,
            dtype,
            weights,
            z_rows,
            zscale,
        )
    shape = hidden.shape[:-1]
    return (
        reduce_rows(loss_rows, n_valid, reduction, shape, z_rows, w_valid if weights is not None else None),
        dh.view(hidden.shape) if dh is not None else hidden.new_empty(0),
        dw if dw is not None else hidden.new_empty(0),
        db if db is not None else hidden.new_empty(0),
        reduce_z(z_rows, n_valid, reduction, shape).clone(),
    )


@_flce_op.register_fake
def _(
    hidden,
    weight,
    target,
    bias,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    chunk_size,
    dtype,
    ce_weight,
    reduction,
    need,
):
    made = reduction != "none"
    loss = hidden.new_empty(hidden.shape[:-1] if reduction == "none" else (), dtype=torch.float32)
    return (
        loss,
        hidden.new_empty(hidden.shape) if made and need[0] else hidden.new_empty(0),
        weight.new_empty(weight.shape) if made and need[1] else hidden.new_empty(0),
        bias.new_empty(bias.shape) if made and need[2] and bias is not None else hidden.new_empty(0),
        torch.empty_like(loss),
    )


@op_def(
    "fused_linear_cross_entropy_backward",
    f"(Tensor grad_rows, {_FLCE_ARGS}, bool[3] need) -> (Tensor, Tensor, Tensor)",
)
def _flce_backward_op(
    grad_rows,
    hidden,
    weight,
    target,
    bias,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    chunk_size,
    dtype,
    ce_weight,
    need,
):
    h2 = _flce_prepare(hidden, weight, target, ignore_index)
    want = (need[0], need[1], bias is not None and need[2])
    opts = (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap))
    scale = grad_rows.reshape(-1).to(torch.float32).contiguous()
    loss_rows = torch.empty(h2.shape[0], dtype=torch.float32, device=h2.device)
    dh_out = torch.empty_like(h2) if want[0] else None
    with _no_autocast(h2.device):
        dh, dw, db = _chunk_loop(
            h2,
            weight,
            bias,
            target,
            loss_rows,
            scale,
            opts,
            _chunk_of(chunk_size, h2, weight, dtype, False),
            want,
            dh_out,
            dtype,
            class_weights(ce_weight),
        )
    return (
        dh.view(hidden.shape) if dh is not None else hidden.new_empty(0),
        dw if dw is not None else hidden.new_empty(0),
        db if db is not None else hidden.new_empty(0),
    )


@_flce_backward_op.register_fake
def _(
    grad_rows,
    hidden,
    weight,
    target,
    bias,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    chunk_size,
    dtype,
    ce_weight,
    need,
):
    return (
        hidden.new_empty(hidden.shape) if need[0] else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need[1] else hidden.new_empty(0),
        bias.new_empty(bias.shape) if need[2] and bias is not None else hidden.new_empty(0),
    )


def _flce_setup(ctx, inputs, output):
    hidden, weight, target, bias, *opts, reduction, need = inputs
    ctx.reduction, ctx.need, ctx.opts, ctx.has_bias = reduction, need, opts, bias is not None
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias)
    else:
        ctx.save_for_backward(*output[1:4])


def _flce_grad(ctx, grad_out, *_):
    if ctx.reduction == "none":
        hidden, weight, target, bias = ctx.saved_tensors
        grads = torch.ops.ckpt.fused_linear_cross_entropy_backward(
            grad_out, hidden, weight, target, bias, *ctx.opts, ctx.need
        )
    else:
        grads = [scaled_by(g, grad_out) for g in ctx.saved_tensors]
    dh, dw, db = (
        g if flag else None
        for g, flag in zip(grads, (ctx.need[0], ctx.need[1], ctx.need[2] and ctx.has_bias))
    )
    return (dh, dw, None, db) + (None,) * 9


_flce_op.register_autograd(_flce_grad, setup_context=_flce_setup)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    *,
    chunk_size: int | None = None,
    inplace: bool | None = None,
    softcap: float | None = None,
    ce_weight: torch.Tensor | None = None,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without building the logits.

    Args:
        hidden: ``(N, H)`` or ``(..., H)`` activations (fp32/fp16/bf16).
        weight: ``(V, H)`` LM-head weight (fp32/fp16/bf16).
        target: ``hidden.shape[:-1]`` (or flattened) int64/int32 class indices.
        bias: optional ``(V,)``.
        ignore_index, label_smoothing, reduction, z_loss: as :func:`ckpt.kernels.cross_entropy`
            (a target outside ``[0, V)`` that is not ``ignore_index`` is an error there too).
        chunk_size: tokens per chunk (default: see module docstring).
        inplace: write ``d_hidden`` over ``hidden`` during the forward; ``None`` (default)
            does so when ``hidden`` is a private autograd intermediate. Ignored under
            ``torch.compile``, where the loss is a custom operator.
        softcap: ``c > 0`` caps the logits to ``c * tanh(logits / c)`` before the loss (Gemma 2's
            ``final_logit_softcapping``), as :func:`ckpt.kernels.cross_entropy`; ``None``: no cap.
        ce_weight: optional ``(V,)`` per-class loss weights, :func:`ckpt.kernels.cross_entropy`'s
            ``weight`` (named apart from the LM head's ``weight``).
        return_z_loss: also return the z-loss part, as :func:`ckpt.kernels.cross_entropy`.

    Returns:
        fp32 scalar, or fp32 ``hidden.shape[:-1]`` for ``reduction="none"``; ``(loss, z_loss)``
        with ``return_z_loss``.

    The GEMMs run in autocast's dtype when autocast is enabled on ``hidden``'s device (as
    ``F.linear`` would), else in ``hidden``'s dtype; inputs of another dtype are cast, and
    each gradient comes back in its input's dtype (module docstring).
    """
    check_tensor(hidden, "hidden", dtypes=_FLOATS, min_ndim=1)
    check_tensor(weight, "weight", dtypes=_FLOATS, ndim=2)
    check_runnable_device(hidden, "hidden")
    check_same_device(hidden, "hidden", weight=weight, bias=bias)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}; expected (V, {hidden.shape[-1]}) "
            "to match hidden's last dim"
        )
    if bias is not None:
        check_tensor(bias, "bias", dtypes=_FLOATS, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n_rows = hidden.numel() // max(hidden.shape[-1], 1)
    target = check_loss_args(target, n_rows, hidden, "hidden", label_smoothing, reduction, z_loss, softcap)
    _check_class_weight(ce_weight, weight.shape[0], hidden, "hidden")
    dtype = autocast_dtype(hidden.device) or hidden.dtype
    cap = float(softcap) if softcap is not None else 0.0
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        grad_on = torch.is_grad_enabled()
        need = [
            grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        ]
        out = torch.ops.ckpt.fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            int(ignore_index),
            float(label_smoothing),
            float(z_loss),
            cap,
            int(chunk_size or 0),
            dtype,
            ce_weight,
            reduction,
            need,
        )
        return (out[0], out[4].detach()) if return_z_loss else out[0]
    check_target_range(target, weight.shape[0], ignore_index, "weight")
    return FusedLinearCrossEntropyFunction.apply(
        hidden,
        weight,
        target,
        bias,
        ignore_index,
        label_smoothing,
        reduction,
        z_loss,
        chunk_size,
        inplace,
        dtype,
        cap,
        ce_weight,
        bool(return_z_loss),
    )


class FusedLinearCrossEntropyLoss(nn.Module):
    """``nn.Module`` form: ``loss(hidden (N, H), weight (V, H), target (N,), bias=None)``.

    ``ce_weight`` (optional ``(V,)`` class weights) is a non-persistent buffer; ``return_z_loss=True``
    makes the call return ``(loss, z_loss)``.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        z_loss: float = 0.0,
        chunk_size: int | None = None,
        softcap: float | None = None,
        ce_weight: torch.Tensor | None = None,
        return_z_loss: bool = False,
    ) -> None:
        super().__init__()
        self.register_buffer("ce_weight", ce_weight, persistent=False)
        self.return_z_loss = return_z_loss
        self.softcap = softcap
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.z_loss = z_loss
        self.chunk_size = chunk_size

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            self.ignore_index,
            self.label_smoothing,
            self.reduction,
            self.z_loss,
            chunk_size=self.chunk_size,
            softcap=self.softcap,
            ce_weight=self.ce_weight,
            return_z_loss=self.return_z_loss,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
            f"reduction={self.reduction!r}, z_loss={self.z_loss}, softcap={self.softcap}"
        )

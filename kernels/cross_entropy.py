"""Fused softmax cross-entropy with label smoothing, z-loss and logit softcapping; gradient made
in the forward pass.

Math, per row of logits ``r`` (length ``V``), target ``t``, smoothing ``eps``, z-loss ``z``,
softcap ``c`` (all arithmetic in fp32 whatever the logits dtype)::

    x_j  = c tanh(r_j / c)      (c > 0: Gemma 2's final-logit softcapping; x = r when c = 0)
    lse  = log(sum_j exp(x_j))                          # online max/sum, one streaming pass
    loss = (1 - eps) (lse - x_t) + eps (lse - mean_j x_j) + z lse^2
    dloss/dx_j = p_j (1 + 2 z lse) - eps / V - (1 - eps) [j == t],     p_j = exp(x_j - lse)
    dloss/dr_j = dloss/dx_j (1 - tanh^2(r_j / c))      (softcap only)

With per-class weights ``W`` (``weight=``, torch's definition), ``w = W_t``, ``S = sum_j W_j``::

    ce   = (1 - eps) w (lse - x_t) + eps (S lse - sum_j W_j x_j) / V
    loss = ce + z lse^2
    dloss/dx_j = p_j ((1 - eps) w + eps S / V + 2 z lse) - eps W_j / V - (1 - eps) w [j == t]

and ``reduction="mean"`` divides the ``ce`` parts by the summed weight of the non-ignored targets and
the z-loss parts by their count (the kernel takes a scale for each part). Without weights ``W = 1``.
The z-loss part of each row can be stored too, for ``return_z_loss``.

``tanh(u)`` is evaluated from ``e = exp(-2|u|)`` as ``sign(u) (1 - e) / (1 + e)`` and its derivative as
``4 e / (1 + e)^2`` (not ``1 - tanh^2``, which cancels to nothing where ``tanh`` saturates): one ``exp`` and one
division per logit, for both; the capped logits are recomputed from ``r`` in every pass, never stored.

Rows whose target is ``ignore_index`` contribute zero loss and a zero gradient;
``reduction="mean"`` divides by the number of non-ignored rows (0 if there are none,
where PyTorch returns NaN). Any other target outside ``[0, V)`` is an error, found without a
host sync (:func:`check_target_range`): on the CPU an ``IndexError`` naming the value, its
position and the range; on the GPU a device-side assert in a small check kernel, launched
before the loss.

Memory and time tricks:

* The loss needs ``lse`` and the gradient needs only ``lse`` and ``x``, so the kernel
  computes both in the forward pass: pass 1 streams the row once (online softmax
  normaliser, Milakov & Gimelshein), pass 2 streams it again and writes the gradient.
  The second read is meant to hit L2 (a row is ``V`` x 2 bytes, 250 KB for a 128k
  vocabulary): pass 2 walks the row from its last block, the one pass 1 read last; pass 1's
  loads ask L2 to keep their lines (``evict_last``), and pass 2's loads and gradient stores,
  each touched once, to drop theirs first (``evict_first``), so a write of the gradient does
  not push out logits still to be read; each block of pass 2 is loaded one step ahead. HBM traffic
  is then close to one read and one write: 100% of the device copy rate at 8192 x 128256 bf16 on an
  H100 (79-81% reading both passes front to back without the hints).
* A program streams its row with few loads in flight, so the rate depends on how many programs an SM
  holds: the launch caps the kernel at 64 registers per thread, two programs of 16 warps per SM
  (``ptxas`` left alone spends 74-104 and fits one: 86%).
* Rows off the 16-byte grid (an odd vocabulary such as GPT-2's 50257, or a row stride that is not a
  multiple of 16) are walked as whole 16-byte vectors from their first aligned column, their few edge
  columns element by element: 87% of the copy rate at 8192 x 50257 bf16 instead of 45%.
* Softcapping costs one ``exp`` and one division per logit per pass, which the special-function unit
  cannot issue at the memory's rate: 62% of the copy rate at 128256 classes.
* The gradient is written over the logits in place when the logits are a private
  autograd intermediate (e.g. the output of the LM head), so the loss allocates nothing
  of size ``tokens x V``: backward only rescales the stored gradient by the incoming
  gradient, and skips even that (on the device, without a host sync) when the incoming
  gradient is exactly 1, the usual ``loss.backward()`` case.
* The ``1/n_valid`` of the mean is counted on the device and read by the kernel through
  a pointer, so nothing synchronises with the host.

Under ``torch.compile`` the loss is one custom operator (``torch.ops.ckpt.cross_entropy``): no graph
break. It computes the same loss and gradient in its forward but, as an operator may not write
over its inputs, into a new buffer rather than over the logits.

Shapes: ``logits`` ``(N, V)`` (or ``(..., V)``), ``target`` ``(N,)`` integer.

References:
    Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018.
    Szegedy et al., "Rethinking the Inception Architecture", 2016 (label smoothing).
    Chowdhery et al., "PaLM", 2022 (z-loss ``z * lse^2``).
    Gemma Team, "Gemma 2", 2024 (final-logit softcapping ``c tanh(x / c)``).
    Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024
    (the observation that the loss gradient needs only ``lse``).
"""

from __future__ import annotations

import torch
from torch import nn

from ._utils import (
    LazyKernel,
    bump_version,
    jit_helper,
    check_runnable_device,
    check_same_device,
    check_tensor,
    op_def,
    next_power_of_2,
    owns_storage,
    register_cap,
    tl,
)

__all__ = ["cross_entropy", "CrossEntropyLoss", "CrossEntropyFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int64, torch.int32)
_REDUCTIONS = ("mean", "sum", "none")


@jit_helper
def _softcap_parts(r, softcap):
    """``(softcap * tanh(r / softcap), 1 - tanh^2(r / softcap))`` in fp32 from one ``exp`` and one division.

    With ``e = exp(-2|u|)`` (in ``(0, 1]``: never overflows) and ``d = 1 / (1 + e)``: ``tanh |u| = (1 - e) d``
    and ``1 - tanh^2 u = 4 e d^2``, which keeps its relative precision where ``tanh`` saturates (``1 - th * th``
    cancels to nothing there). That is two special-function operations per logit and pass (the sigmoid forms
    took two in pass 1 and six in pass 2); the softcapped loss is still bound by its instructions, not by
    memory."""
    u = r * (1.0 / softcap)
    e = tl.exp(-2.0 * tl.abs(u))
    d = 1.0 / (1.0 + e)
    th = (1.0 - e) * d
    return softcap * tl.where(u < 0.0, -th, th), 4.0 * e * d * d


@jit_helper
def _softcapped(r, softcap, HAS_SOFTCAP: tl.constexpr):
    """``softcap * tanh(r / softcap)`` (``r`` itself without softcap), fp32."""
    if HAS_SOFTCAP:
        x, _ = _softcap_parts(r, softcap)
        return x
    return r


@jit_helper
def _stats_block(
    ptrs,
    cols,
    mask,
    CW,
    m,
    s,
    sum_x,
    softcap,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """Pass 1 over the logits at ``ptrs`` (the row's columns ``cols``, those under ``mask``): the online
    max / sum-exp update, and the running sum of the logits (class-weighted with ``HAS_WEIGHT``) when
    label smoothing needs it."""
    # kept in L2 for pass 2 as long as it can be (pass 2 reads the row's last blocks first)
    x = _softcapped(
        tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32), softcap, HAS_SOFTCAP
    )
    if HAS_SMOOTHING:  # masked columns load as 0 and weigh 0
        if HAS_WEIGHT:
            sum_x += tl.sum(x * tl.load(CW + cols, mask=mask, other=0.0), axis=0)
        else:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
    x = tl.where(mask, x, -float("inf"))
    m_new = tl.maximum(m, tl.max(x, axis=0))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
    return m_new, s, sum_x


@jit_helper
def _row_loss(
    base,
    t,
    valid,
    m,
    s,
    sum_x,
    V,
    label_smoothing,
    softcap,
    w_t,
    sum_w,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """``(lse, ce)`` of a row from pass 1's statistics: the cross-entropy part of its loss (class
    weight ``w_t``, total class weight ``sum_w``; both 1 and ``V`` without weights), 0 where the
    target is ignored."""
    lse = m + tl.log(s)
    in_range = valid & (t >= 0) & (t < V)
    x_t = _softcapped(tl.load(base + t, mask=in_range, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
    loss = (1.0 - label_smoothing) * w_t * (lse - x_t)
    if HAS_SMOOTHING:
        loss += label_smoothing * (lse * sum_w - sum_x) / V
    return lse, tl.where(valid, loss, 0.0)


@jit_helper
def _grad_block(
    r,
    gptrs,
    cols,
    mask,
    CW,
    t,
    lse,
    p_coef,
    smooth,
    t_coef,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """Pass 2 over the logits ``r`` already loaded (the row's columns ``cols``, those under ``mask``):
    ``p_j p_coef - smooth W_j - t_coef [j == t]``, through the softcap's ``tanh``, stored at ``gptrs``
    (which may be the logits); the coefficients carry the row's scales. The gradient is not read again
    here: it leaves L2 first."""
    r = r.to(tl.float32)
    if HAS_SOFTCAP:
        x, slope = _softcap_parts(r, softcap)
    else:
        x = r
    if HAS_WEIGHT:
        g = tl.exp(x - lse) * p_coef - smooth * tl.load(CW + cols, mask=mask, other=0.0)
    else:
        g = tl.exp(x - lse) * p_coef - smooth
    g = tl.where(cols == t, g - t_coef, g)
    if HAS_SOFTCAP:  # d/dr c tanh(r / c) = 1 - tanh^2(r / c)
        g = g * slope
    tl.store(gptrs, g.to(gptrs.dtype.element_ty), mask=mask, eviction_policy="evict_first")


def _ce_kernel(
    LOGITS,
    GRAD,
    TARGET,
    LOSS,
    ZROWS,
    SCALE,
    ZSCALE,
    CW,
    SUMW,
    stride_l,
    stride_g,
    stride_scale,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    COMPUTE_GRAD: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    STORE_Z: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EDGES: tl.constexpr,
    ALIGN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TARGET + row).to(tl.int64)
    valid = t != ignore_index
    base = LOGITS + row * stride_l
    gbase = GRAD + row * stride_g
    cols0 = tl.arange(0, BLOCK_V)
    # The row's blocks cover its columns [h, h + M): M a multiple of ALIGN (the elements in 16 bytes), and
    # with EDGES their first one on the 16-byte grid, so the blocks load and store whole 16-byte vectors
    # even where rows do not start on it (an odd vocabulary such as GPT-2's 50257: element-wise accesses
    # there ran at 45% of the copy rate). The row's edges, the h < ALIGN columns before the first full
    # vector and the fewer than ALIGN after the last, go element by element. The launcher sets EDGES only
    # where GRAD's rows lie on the grid as the logits' do. Without EDGES: h = 0, M = V.
    if EDGES:
        h = ((ALIGN - (row * stride_l) % ALIGN) % ALIGN).to(tl.int32)
        h = tl.minimum(h, V)
        M = ((V - h) // ALIGN) * ALIGN
        mbase = LOGITS + tl.multiple_of(row * stride_l + h, ALIGN)
        gmbase = GRAD + tl.multiple_of(row * stride_g + h, ALIGN)
        lanes = tl.arange(0, 2 * ALIGN)
        ecols = tl.where(lanes < ALIGN, lanes, h + M + lanes - ALIGN)
        emask = tl.where(lanes < ALIGN, lanes < h, ecols < V)
    else:
        h = 0
        M = V
        mbase = base
        gmbase = gbase

    # pass 1: online max / sum-exp (and the (weighted) sum of logits for label smoothing)
    m = -float("inf")
    s = 0.0
    sum_x = 0.0
    for off in range(0, M, BLOCK_V):
        j = off + cols0
        m, s, sum_x = _stats_block(
            mbase + j, h + j, j < M, CW, m, s, sum_x, softcap, HAS_SMOOTHING, HAS_SOFTCAP, HAS_WEIGHT
        )
    if EDGES:
        m, s, sum_x = _stats_block(
            base + ecols, ecols, emask, CW, m, s, sum_x, softcap, HAS_SMOOTHING, HAS_SOFTCAP, HAS_WEIGHT
        )
    if HAS_WEIGHT:
        w_t = tl.load(CW + t, mask=valid & (t >= 0) & (t < V), other=0.0).to(tl.float32)
        sum_w = tl.load(SUMW).to(tl.float32)
    else:
        w_t = 1.0
        sum_w = V * 1.0
    lse, ce = _row_loss(
        base, t, valid, m, s, sum_x, V, label_smoothing, softcap, w_t, sum_w, HAS_SMOOTHING, HAS_SOFTCAP
    )
    z = tl.where(valid, z_loss * lse * lse, 0.0)
    tl.store(LOSS + row, ce + z)
    if STORE_Z:
        tl.store(ZROWS + row, z)

    if COMPUTE_GRAD:
        # Every warp has read the target's logit before any warp writes a gradient: where GRAD is
        # LOGITS, a warp that ran ahead into pass 2 would otherwise write over it (the target's
        # column is any warp's) while a slower warp still has to read it for the loss.
        tl.debug_barrier()
        # pass 2: gradient, written over the logits when GRAD aliases LOGITS. The cross-entropy part
        # is scaled by SCALE (1/sum of target weights for a weighted mean), the z-loss by ZSCALE.
        cs = tl.where(valid, tl.load(SCALE + row * stride_scale).to(tl.float32), 0.0)
        zs = tl.where(valid, tl.load(ZSCALE + row * stride_scale).to(tl.float32), 0.0)
        p_coef = cs * ((1.0 - label_smoothing) * w_t + label_smoothing * sum_w / V) + zs * 2.0 * z_loss * lse
        smooth = cs * label_smoothing / V
        t_coef = cs * (1.0 - label_smoothing) * w_t
        # Last block first: what pass 1 read last is what L2 most likely still holds. Each block's
        # logits are loaded one step ahead, before the block before them is stored, so a load is always
        # in flight whatever order the compiler keeps loads and stores in (GRAD may alias LOGITS; the
        # blocks never overlap). Pass 2's loads are the logits' last: they leave L2 first, so the blocks
        # still to be read stay. The target as a 32-bit column (-1, no column, when it is ignored or out
        # of range): no 64-bit compare per column.
        t32 = tl.where(valid & (t >= 0) & (t < V), t, -1).to(tl.int32)
        off = (tl.cdiv(M, BLOCK_V) - 1) * BLOCK_V
        j = off + cols0
        r = tl.load(mbase + j, mask=(j >= 0) & (j < M), other=0.0, eviction_policy="evict_first")
        for _ in range(0, tl.cdiv(M, BLOCK_V)):
            j_next = off - BLOCK_V + cols0
            r_next = tl.load(
                mbase + j_next, mask=(j_next >= 0) & (j_next < M), other=0.0, eviction_policy="evict_first"
            )
            j = off + cols0
            _grad_block(
                r,
                gmbase + j,
                h + j,
                j < M,
                CW,
                t32,
                lse,
                p_coef,
                smooth,
                t_coef,
                softcap,
                HAS_SOFTCAP,
                HAS_WEIGHT,
            )
            r = r_next
            off -= BLOCK_V
        if EDGES:  # at most two 16-byte lines per row, after the blocks: nothing held through the loop
            r_edge = tl.load(base + ecols, mask=emask, other=0.0, eviction_policy="evict_first")
            _grad_block(
                r_edge,
                gbase + ecols,
                ecols,
                emask,
                CW,
                t32,
                lse,
                p_coef,
                smooth,
                t_coef,
                softcap,
                HAS_SOFTCAP,
                HAS_WEIGHT,
            )


def _scale_rows_kernel(G, SCALE, stride_g, stride_scale, n_cols, BLOCK: tl.constexpr):
    """``G[row] *= SCALE[row * stride_scale]``; a no-op, reading nothing, when the scale is 1."""
    row = tl.program_id(0).to(tl.int64)
    sc = tl.load(SCALE + row * stride_scale).to(tl.float32)
    if sc != 1.0:
        cols0 = tl.arange(0, BLOCK)
        base = G + row * stride_g
        for off in range(0, n_cols, BLOCK):
            cols = off + cols0
            mask = cols < n_cols
            g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(base + cols, (g * sc).to(G.dtype.element_ty), mask=mask)


def _target_check_kernel(TARGET, n, V, ignore_index, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(TARGET + offs, mask=offs < n, other=0).to(tl.int64)
    ok = (t == ignore_index) | ((t >= 0) & (t < V)) | (offs >= n)
    tl.device_assert(ok, "cross-entropy target outside [0, V) and not ignore_index")


_ce = LazyKernel(_ce_kernel)
_scale = LazyKernel(_scale_rows_kernel)
#: compiled in Triton's debug mode, which is what makes tl.device_assert do anything; nothing
#: else runs in it, so the loss kernels keep their normal code
_target_check = LazyKernel(_target_check_kernel, debug=True)
_CHECK_BLOCK = 1024


#: vocabularies above this stream their rows in blocks of 16384 columns with 16 warps, smaller ones in
#: blocks of up to 8192 with 8 (bench_ce_schedules.py; the figures in ``_ce_config``)
_WIDE_VOCAB = 32768
#: registers per thread the row kernel is capped at: two programs of 16 warps (or four of 8) per SM
_CE_REGS = 64


def _ce_config(v: int, edges: bool = False, has_softcap: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_V, num_warps, register cap)`` of the row kernel for ``v`` classes; ``edges``: rows walked
    as aligned vectors plus edge columns (:func:`_row_layout`).

    The kernel is bound by the loads its SM keeps in flight, so by how many programs the register file
    holds: left alone, ``ptxas`` gives it 74-104 registers per thread at 16 warps (one program per SM: 86%
    of the copy rate for the plain loss at 128256 classes); capped at 64 it keeps two (99.8%). Measured
    on an H100 (2026-11-27, 8192 rows, bf16, % of the copy rate), blocks of 16384 with 16 warps against
    8192 with 8, both capped: plain loss 113 / 98 at 65536 classes, 99.8 / 88 at 128256, 89 / 84 at
    262144, 106 / 114 at 32000; class weights 83 / 76 at 128256; softcap 58 / 62 (bound by its ``exp``
    and division, not by memory); rows off the 16-byte grid 74 / 86 at 50257 and 84 / 97 at 32003.
    """
    if v > _WIDE_VOCAB and not edges and not has_softcap:
        return 16384, 16, _CE_REGS
    block = min(next_power_of_2(v), 8192)
    return block, 8 if block >= 4096 else 4, _CE_REGS


def launch_ce(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss_rows: torch.Tensor,
    grad: torch.Tensor | None,
    scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float = 0.0,
    weights: "ClassWeights | None" = None,
    z_rows: torch.Tensor | None = None,
    zscale: torch.Tensor | None = None,
) -> object:
    """Run the row kernel on ``logits`` ``(N, V)``: per-row losses into ``loss_rows`` (and their
    z-loss part into ``z_rows`` when given) and, when ``grad`` is given, the scaled ``dloss/dlogits``
    into ``grad`` (may be ``logits``): the cross-entropy part times ``scale[row]``, the z-loss part
    times ``zscale[row]`` (``scale`` when not given). Scales are 1-element (broadcast) or ``(N,)``
    fp32 tensors of one stride; ``softcap`` 0 means none; ``weights`` the class weights, if any.
    Returns Triton's compiled kernel (``n_regs``, ``n_spills``), or ``None`` (interpreter, no rows)."""
    n, v = logits.shape
    if n == 0:
        return None
    edges, align = _row_layout(logits, grad)
    block, warps, regs = _ce_config(v, edges, softcap > 0.0)
    zscale = scale if zscale is None else zscale
    cw, sum_w = (
        (weights.w, weights.sum) if weights is not None else (loss_rows, loss_rows)
    )  # dummies when unused
    return _ce[(n,)](
        logits,
        grad if grad is not None else logits,
        target,
        loss_rows,
        z_rows if z_rows is not None else loss_rows,
        scale,
        zscale,
        cw,
        sum_w,
        logits.stride(0),
        grad.stride(0) if grad is not None else logits.stride(0),
        0 if scale.numel() == 1 else scale.stride(0),
        v,
        int(ignore_index),
        float(label_smoothing),
        float(z_loss),
        float(softcap),
        COMPUTE_GRAD=grad is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_SOFTCAP=softcap > 0.0,
        HAS_WEIGHT=weights is not None,
        STORE_Z=z_rows is not None,
        BLOCK_V=block,
        EDGES=edges,
        ALIGN=align,
        num_warps=warps,
        **register_cap(regs),
    )


def _grad_rows(x: torch.Tensor) -> torch.Tensor:
    """A new gradient buffer for the ``(N, V)`` logits ``x`` (unit column stride), its rows on the 16-byte grid
    as ``x``'s are: row stride ``V`` plus the fewest columns (under 16 bytes' worth) that make it equal to
    ``x``'s modulo 16 bytes, so the kernel walks both as whole vectors (:func:`_row_layout`). Logits sliced
    from a padded vocabulary (``logits[..., :50257]`` of 50304 columns) would otherwise get a gradient
    whose rows lie off the grid, and the element-wise walk (53% of the copy rate instead of 90% at 8192
    x 50257 bf16 on an H100). An
    ``(N, V)`` view; contiguous where ``x``'s row stride is ``V`` modulo 16 bytes."""
    n, v = x.shape
    pad = (x.stride(0) - v) % (16 // x.element_size())
    if pad == 0 or n < 2:
        return torch.empty((n, v), dtype=x.dtype, device=x.device)
    return torch.empty((n, v + pad), dtype=x.dtype, device=x.device)[:, :v]


def _row_layout(logits: torch.Tensor, grad: torch.Tensor | None) -> tuple[bool, int]:
    """The kernel's ``(EDGES, ALIGN)``: ``ALIGN`` the elements in 16 bytes; ``EDGES`` where rows must be
    walked as whole 16-byte vectors plus up to ``2 (ALIGN - 1)`` edge columns element by element.

    That is where the row length or row stride is off the 16-byte grid (the kernel's blocks can then only
    prove element-wise accesses: 45% of the copy rate at 8192 x 50257 bf16 on an H100, against 90-100% for
    aligned rows), and needs 16-byte aligned tensors whose gradient rows lie on the grid as the logits' do
    (the same row stride modulo ``ALIGN``). Elsewhere the rows are walked as they are.
    """
    align = 16 // logits.element_size()
    stride, v = logits.stride(0), logits.shape[1]
    if stride % 16 == 0 and v % 16 == 0:  # Triton specializes on 16-divisible integers: vectors proven
        return False, align
    if logits.data_ptr() % 16:
        return False, align
    if grad is not None and (
        grad.data_ptr() % 16
        or grad.element_size() != logits.element_size()
        or grad.stride(0) % align != stride % align
    ):
        return False, align
    return True, align


def scale_rows_(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Multiply each row of the 2-D, unit-stride ``g`` in place by ``scale`` (1-element or per row).

    Skipped on the device, without a host sync, where the scale is exactly 1.
    """
    if g.numel() == 0:
        return g
    scale = scale.to(torch.float32)
    n, c = g.shape
    block = min(next_power_of_2(c), 4096)
    _scale[(n,)](
        g, scale, g.stride(0), 0 if scale.numel() == 1 else scale.stride(0), c, BLOCK=block, num_warps=4
    )
    return g


class ClassWeights:
    """Per-class loss weights as the kernel reads them: ``w`` fp32 ``(V,)`` contiguous, ``sum`` its
    total as a 1-element device tensor (label smoothing spreads ``eps`` over the weighted classes)."""

    __slots__ = ("w", "sum")

    def __init__(self, weight: torch.Tensor) -> None:
        self.w = weight.detach().to(torch.float32).contiguous()
        self.sum = self.w.sum().reshape(1)


def class_weights(weight: torch.Tensor | None) -> ClassWeights | None:
    return ClassWeights(weight) if weight is not None else None


def reduction_scale(
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    weights: ClassWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-loss scales on the device, and the two denominators of the mean.

    Returns ``(scale, zscale, n_valid, w_valid)``: ``scale`` multiplies the cross-entropy part of each
    row (``1/w_valid`` for mean, 1 for sum/none), ``zscale`` its z-loss part (``1/n_valid`` for mean);
    ``n_valid`` counts the non-ignored rows, ``w_valid`` sums their target's class weight (``n_valid``
    without weights), as ``torch.nn.functional.cross_entropy`` divides a weighted mean.
    """
    valid = target != ignore_index
    n_valid = valid.sum().to(torch.float32)
    if weights is None:
        w_valid = n_valid
    else:
        t = torch.where(valid, target, 0).clamp(0, weights.w.shape[0] - 1)
        w_valid = torch.where(valid, weights.w[t], 0.0).sum()
    if reduction == "mean":
        zscale = (1.0 / n_valid.clamp(min=1.0)).reshape(1)
        scale = zscale if weights is None else (1.0 / _nonzero(w_valid)).reshape(1)
        return scale, zscale, n_valid, w_valid
    ones = torch.ones(1, dtype=torch.float32, device=target.device)
    return ones, ones, n_valid, w_valid


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """A denominator with 0 replaced by 1 (no non-ignored rows, or only zero-weight targets: loss 0)."""
    return torch.where(d == 0, torch.ones_like(d), d)


def reduce_rows(
    loss_rows: torch.Tensor,
    n_valid: torch.Tensor,
    reduction: str,
    shape: torch.Size,
    z_rows: torch.Tensor | None = None,
    w_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss from the per-row losses: their mean over non-ignored rows, sum, or the rows themselves.

    With class weights (``w_valid`` given, and ``z_rows`` the rows' z-loss part) the mean divides the
    cross-entropy part by ``w_valid`` and the z-loss part by ``n_valid``.
    """
    if reduction == "none":
        return loss_rows.view(shape)
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    if w_valid is None:
        return total / n_valid.clamp(min=1.0)
    z = z_rows.sum()
    return (total - z) / _nonzero(w_valid) + z / n_valid.clamp(min=1.0)


def reduce_z(z_rows: torch.Tensor, n_valid: torch.Tensor, reduction: str, shape: torch.Size) -> torch.Tensor:
    """The z-loss part of the loss, reduced as the loss (mean over non-ignored rows, sum, or per row)."""
    return reduce_rows(z_rows, n_valid, reduction, shape).detach()


def scaled_by(grad: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``grad * grad_out`` in ``grad``'s dtype, fp32 math (one rounding): the backward of the compiled
    losses, whose gradients were made in the forward. ``grad_out`` is a scalar or one value per row
    of ``grad`` (``reduction="none"``)."""
    g = grad_out.to(torch.float32)
    if g.dim():
        g = g.reshape(g.shape + (1,) * (grad.dim() - g.dim()))
    return (grad.to(torch.float32) * g).to(grad.dtype)


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int, ref_name: str) -> None:
    """Make a target outside ``[0, n_classes)`` that is not ``ignore_index`` an error, as in torch.

    CPU tensors are checked here and raise ``IndexError`` naming the first bad value, its
    position and the valid range. On the GPU that check would synchronise with the host on
    every call, so a one-launch check kernel (a few microseconds, no sync) asserts on the device
    instead: a bad target stops the process's CUDA work with a device-side assert, as torch's
    own CUDA cross-entropy does (the CUDA context is unusable afterwards).
    ``target`` is flat and contiguous.
    """
    n = target.numel()
    if n == 0:
        return
    if target.is_cuda:
        _target_check[(-(-n // _CHECK_BLOCK),)](
            target, n, n_classes, int(ignore_index), BLOCK=_CHECK_BLOCK, num_warps=4
        )
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"target[{i}] is {int(target[i])}, outside the class range [0, {n_classes}) of {ref_name} "
            f"and not ignore_index ({ignore_index})"
        )


def check_loss_args(
    target: torch.Tensor,
    n_rows: int,
    ref: torch.Tensor,
    ref_name: str,
    label_smoothing: float,
    reduction: str,
    z_loss: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Validate the options shared by both losses; return ``target`` flattened to ``(N,)``."""
    check_tensor(target, "target", dtypes=_INTS)
    check_same_device(ref, ref_name, target=target)
    if target.numel() != n_rows:
        raise ValueError(
            f"target has {target.numel()} elements (shape {tuple(target.shape)}) but "
            f"{ref_name} has {n_rows} rows"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss < 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0.0:  # also rejects NaN
        raise ValueError(f"softcap must be > 0 (or None for no softcapping), got {softcap}")
    return target.reshape(-1).contiguous()


def _check_class_weight(
    weight: torch.Tensor | None, n_classes: int, ref: torch.Tensor, ref_name: str
) -> None:
    if weight is None:
        return
    check_tensor(weight, "weight", dtypes=_FLOATS, ndim=1)
    check_same_device(ref, ref_name, weight=weight)
    if weight.shape[0] != n_classes:
        raise ValueError(
            f"class weight has shape {tuple(weight.shape)}; expected ({n_classes},), one per class"
        )


def _z_rows_for(
    n: int, device: torch.device, weights: ClassWeights | None, return_z_loss: bool
) -> torch.Tensor | None:
    """The per-row z-loss buffer: needed for a weighted mean and for ``return_z_loss``."""
    return (
        torch.empty(n, dtype=torch.float32, device=device) if weights is not None or return_z_loss else None
    )


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd glue: the forward computes loss and (scaled) gradient; backward rescales it.

    Returns the loss, or ``(loss, z_loss)`` with ``return_z_loss`` (``z_loss`` non-differentiable: it
    is part of the loss, reported separately)."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
        z_loss: float,
        inplace: bool | None,
        softcap: float = 0.0,
        class_weight: torch.Tensor | None = None,
        return_z_loss: bool = False,
    ):
        v = logits.shape[-1]
        private = inplace if inplace is not None else owns_storage(logits)
        x = logits.reshape(-1, v)
        if x.stride(-1) != 1:
            x = x.contiguous()
        private = private or x.data_ptr() != logits.data_ptr()  # our own copy
        n = x.shape[0]
        loss_rows = torch.empty(n, dtype=torch.float32, device=x.device)
        weights = class_weights(class_weight)
        z_rows = _z_rows_for(n, x.device, weights, return_z_loss)
        scale, zscale, n_valid, w_valid = reduction_scale(target, ignore_index, reduction, weights)
        need_grad = ctx.needs_input_grad[0]
        grad = None
        if need_grad:
            grad = x if private and x.is_contiguous() else _grad_rows(x)
        launch_ce(
            x,
            target,
            loss_rows,
            grad,
            scale,
            ignore_index,
            label_smoothing,
            z_loss,
            softcap,
            weights,
            z_rows,
            zscale,
        )
        if grad is not None:
            if grad.data_ptr() == logits.data_ptr():
                bump_version(logits)
            ctx.grad = grad  # not save_for_backward: it may be a view of the (bumped) logits
        ctx.shape = logits.shape
        ctx.reduction = reduction
        loss = reduce_rows(
            loss_rows, n_valid, reduction, logits.shape[:-1], z_rows, w_valid if weights is not None else None
        )
        if not return_z_loss:
            return loss
        z = reduce_z(z_rows, n_valid, reduction, logits.shape[:-1])
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_):
        if not hasattr(ctx, "grad"):
            raise RuntimeError(
                "cross_entropy computes its gradient once, in the forward pass; "
                "it cannot be backpropagated twice (retain_graph)"
            )
        grad = ctx.grad
        del ctx.grad
        scale = grad_out.reshape(-1)
        if scale.numel() != 1 and scale.stride(0) != 1:
            scale = scale.contiguous()
        scale_rows_(grad, scale)
        return (grad.view(ctx.shape),) + (None,) * 9


# -- torch.compile: the loss as one custom operator (``op_def``). Its forward makes the loss and the
# gradient (in a new buffer: an operator may not write over its inputs); its backward only scales
# that gradient, as the eager Function does. The target check runs inside it, where data-dependent
# checks cost Dynamo nothing. Its third output, the z-loss part reduced as the loss, is only reported.


@op_def(
    "cross_entropy",
    "(Tensor logits, Tensor target, int ignore_index, float label_smoothing, str reduction, "
    "float z_loss, float softcap, bool need_grad, Tensor? class_weight) -> (Tensor, Tensor, Tensor)",
)
def _cross_entropy_op(
    logits, target, ignore_index, label_smoothing, reduction, z_loss, softcap, need_grad, class_weight
):
    v = logits.shape[-1]
    check_target_range(target, v, ignore_index, "logits")
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = x.shape[0]
    loss_rows = torch.empty(n, dtype=torch.float32, device=x.device)
    weights = class_weights(class_weight)
    z_rows = torch.empty(n, dtype=torch.float32, device=x.device)
    scale, zscale, n_valid, w_valid = reduction_scale(target, ignore_index, reduction, weights)
    grad = (
        torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        if need_grad
        else logits.new_empty(0)
    )
    launch_ce(
        x,
        target,
        loss_rows,
        grad.view(-1, v) if need_grad else None,
        scale,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        weights,
        z_rows,
        zscale,
    )
    shape = logits.shape[:-1]
    loss = reduce_rows(loss_rows, n_valid, reduction, shape, z_rows, w_valid if weights is not None else None)
    return loss, grad, reduce_z(z_rows, n_valid, reduction, shape).clone()


@_cross_entropy_op.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction, z_loss, softcap, need_grad, class_weight):
    shape = logits.shape[:-1] if reduction == "none" else ()
    grad = logits.new_empty(logits.shape) if need_grad else logits.new_empty(0)
    return logits.new_empty(shape, dtype=torch.float32), grad, logits.new_empty(shape, dtype=torch.float32)


def _cross_entropy_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _cross_entropy_grad(ctx, grad_out, _dgrad, _dz):
    (grad,) = ctx.saved_tensors
    return (scaled_by(grad, grad_out),) + (None,) * 8


_cross_entropy_op.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    *,
    inplace: bool | None = None,
    softcap: float | None = None,
    weight: torch.Tensor | None = None,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused cross-entropy over the last dim of ``logits``, fp32 accumulation.

    Args:
        logits: ``(N, V)`` or ``(..., V)`` fp32/fp16/bf16.
        target: ``(N,)`` (or ``logits.shape[:-1]``) int64/int32 class indices.
        ignore_index: rows with this target get zero loss and zero gradient. Any other target
            outside ``[0, V)`` is an error: ``IndexError`` on the CPU, a device-side assert on
            the GPU (:func:`check_target_range`).
        label_smoothing: ``eps`` in ``[0, 1]``, as in :func:`torch.nn.functional.cross_entropy`.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"``.
        z_loss: weight of ``lse^2`` added to each row's loss (PaLM).
        inplace: write the gradient over ``logits`` during the forward. ``None`` (default)
            does so when ``logits`` is a private autograd intermediate (then its values are
            gone after the call; read them before, or pass ``inplace=False``). Ignored under
            ``torch.compile``, where the loss is a custom operator.
        softcap: ``c > 0`` caps the logits to ``c * tanh(logits / c)`` before the loss (Gemma 2's
            ``final_logit_softcapping``); the gradient goes through the ``tanh``. ``None``: no cap.
        weight: optional ``(V,)`` per-class weights, as ``torch.nn.functional.cross_entropy``'s
            ``weight`` (label smoothing included; ``"mean"`` divides by the summed weight of the
            non-ignored targets, 0 when that is 0). The z-loss term is not weighted. A constant:
            it gets no gradient.
        return_z_loss: also return the z-loss part of the loss, reduced as the loss (for logging;
            non-differentiable, its gradient is in the loss's).

    Returns:
        fp32 scalar, or fp32 ``logits.shape[:-1]`` for ``reduction="none"``; ``(loss, z_loss)``
        with ``return_z_loss``.
    """
    check_tensor(logits, "logits", dtypes=_FLOATS, min_ndim=1)
    check_runnable_device(logits, "logits")
    n_rows = logits.numel() // max(logits.shape[-1], 1)
    target = check_loss_args(target, n_rows, logits, "logits", label_smoothing, reduction, z_loss, softcap)
    _check_class_weight(weight, logits.shape[-1], logits, "logits")
    cap = float(softcap) if softcap is not None else 0.0
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        need_grad = logits.requires_grad and torch.is_grad_enabled()
        loss, _, z = torch.ops.ckpt.cross_entropy(
            logits,
            target,
            int(ignore_index),
            float(label_smoothing),
            reduction,
            float(z_loss),
            cap,
            need_grad,
            weight,
        )
        return (loss, z.detach()) if return_z_loss else loss
    check_target_range(target, logits.shape[-1], ignore_index, "logits")
    return CrossEntropyFunction.apply(
        logits,
        target,
        ignore_index,
        label_smoothing,
        reduction,
        z_loss,
        inplace,
        cap,
        weight,
        bool(return_z_loss),
    )


class CrossEntropyLoss(nn.Module):
    """``nn.Module`` form of :func:`cross_entropy`: ``loss(logits (N, V), target (N,))``.

    ``weight`` (optional ``(V,)`` class weights) is kept as a non-persistent buffer, so ``.to()``
    moves it and state dicts leave it out; ``return_z_loss=True`` makes the call return
    ``(loss, z_loss)``.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        z_loss: float = 0.0,
        softcap: float | None = None,
        weight: torch.Tensor | None = None,
        return_z_loss: bool = False,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.return_z_loss = return_z_loss
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.z_loss = z_loss
        self.softcap = softcap

    def forward(
        self, logits: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy(
            logits,
            target,
            self.ignore_index,
            self.label_smoothing,
            self.reduction,
            self.z_loss,
            softcap=self.softcap,
            weight=self.weight,
            return_z_loss=self.return_z_loss,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
            f"reduction={self.reduction!r}, z_loss={self.z_loss}, softcap={self.softcap}"
        )

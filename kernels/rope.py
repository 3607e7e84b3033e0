"""Fused rotary position embedding (RoPE) for q and k in one launch, forward and backward.

Math, Hugging Face "rotate-half" convention: split the head dimension ``D`` into halves
``x = [x1, x2]`` and ``cos = [c1, c2]``, ``sin = [s1, s2]`` (HF builds ``cos`` as
``cat(freqs, freqs).cos()``, so ``c1 == c2``; the kernel does not rely on it)::

    y1 = x1 c1 - x2 s1
    y2 = x2 c2 + x1 s2

The map is linear in ``x``, so the backward is its transpose::

    dx1 =  dy1 c1 + dy2 s2
    dx2 =  dy2 c2 - dy1 s1

which is the forward with ``(s1, s2) -> (-s2, -s1)``: one kernel serves both directions.

Layout and memory tricks:

* One program per token ``(batch, position)`` rotates *all* heads of q and of k: the
  token's ``cos``/``sin`` row is loaded once and reused for ``Hq + Hk`` heads, and grouped
  query attention (``Hq != Hk``) costs nothing extra.
* Inputs are addressed through their strides, so HF's ``(batch, heads, seq, head_dim)``
  tensors, which are *transposed views* of the projection outputs, are read without a
  copy; ``(batch, seq, heads, head_dim)`` works too (pass ``unsqueeze_dim=2``).
* Nothing is saved for backward but ``cos``/``sin`` (inputs that are alive anyway).
* Arithmetic is fp32; ``cos``/``sin`` may be bf16 (HF) or fp32.
* Dtypes as Hugging Face's elementwise ``q * cos + rotate_half(q) * sin``, which autocast leaves
  alone: ``q``'s output takes the promoted dtype of ``q``, ``cos`` and ``sin`` (fp32 for a bf16
  ``q`` from an autocast projection with HF's fp32 ``cos``), ``k``'s likewise; gradients come
  back in ``q``'s and ``k``'s own dtypes. The kernel loads any dtype and stores the output's, so
  mixed dtypes cost no cast pass.

Shapes: ``q`` ``(B, Hq, S, D)``, ``k`` ``(B, Hk, S, D)``; ``cos``/``sin`` ``(S, D)``,
``(1 or B, S, D)`` or already unsqueezed ``(1 or B, 1, S, D)``.

References:
    Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
    Hugging Face Transformers, ``apply_rotary_pos_emb`` (the rotate-half convention).
"""

from __future__ import annotations

import torch

from ._utils import (
    LazyKernel,
    check_runnable_device,
    check_same_device,
    check_tensor,
    next_power_of_2,
    op_def,
    tl,
)

__all__ = ["rope", "RoPEFunction"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _rope_kernel(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    S,
    n_qh,
    n_kh,
    half,
    sq_b,
    sq_h,
    sq_s,
    sqo_b,
    sqo_h,
    sqo_s,
    sk_b,
    sk_h,
    sk_s,
    sko_b,
    sko_h,
    sko_s,
    sc_b,
    sc_s,
    BACKWARD: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    cs = COS + b * sc_b + s * sc_s
    ss = SIN + b * sc_b + s * sc_s
    c1 = tl.load(cs + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cs + half + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(ss + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(ss + half + d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:
        # transpose of the rotation: (s1, s2) -> (-s2, -s1)
        t1 = -s2
        s2 = -s1
        s1 = t1
    c1 = c1[None, :]
    c2 = c2[None, :]
    s1 = s1[None, :]
    s2 = s2[None, :]

    hq = tl.arange(0, BLOCK_QH)[:, None]
    qmask = (hq < n_qh) & dmask[None, :]
    q_in = Q + b * sq_b + s * sq_s + hq * sq_h + d[None, :]
    q_out = QO + b * sqo_b + s * sqo_s + hq * sqo_h + d[None, :]
    x1 = tl.load(q_in, mask=qmask, other=0.0).to(tl.float32)
    x2 = tl.load(q_in + half, mask=qmask, other=0.0).to(tl.float32)
    tl.store(q_out, (x1 * c1 - x2 * s1).to(QO.dtype.element_ty), mask=qmask)
    tl.store(q_out + half, (x2 * c2 + x1 * s2).to(QO.dtype.element_ty), mask=qmask)

    hk = tl.arange(0, BLOCK_KH)[:, None]
    kmask = (hk < n_kh) & dmask[None, :]
    k_in = K + b * sk_b + s * sk_s + hk * sk_h + d[None, :]
    k_out = KO + b * sko_b + s * sko_s + hk * sko_h + d[None, :]
    y1 = tl.load(k_in, mask=kmask, other=0.0).to(tl.float32)
    y2 = tl.load(k_in + half, mask=kmask, other=0.0).to(tl.float32)
    tl.store(k_out, (y1 * c1 - y2 * s1).to(KO.dtype.element_ty), mask=kmask)
    tl.store(k_out + half, (y2 * c2 + y1 * s2).to(KO.dtype.element_ty), mask=kmask)


_kernel = LazyKernel(_rope_kernel)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _out_dtypes(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.dtype, ...]:
    """The dtypes of HF's ``q * cos + rotate_half(q) * sin`` and of the same for ``k``."""
    if q.dtype == k.dtype == cos.dtype == sin.dtype:
        return q.dtype, q.dtype
    cs = torch.promote_types(cos.dtype, sin.dtype)
    return torch.promote_types(q.dtype, cs), torch.promote_types(k.dtype, cs)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backward: bool,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
):
    """Rotate (``backward``: rotate back) ``q`` and ``k`` into new tensors of ``q_dtype``/``k_dtype``."""
    q, k = _unit_last(q), _unit_last(k)
    qo = torch.empty_like(q, dtype=q_dtype)  # keeps q's (possibly transposed) layout when dense
    ko = torch.empty_like(k, dtype=k_dtype)
    bsz, n_qh, seq, dim = q.shape
    n_kh = k.shape[1]
    half = dim // 2
    grid = (bsz * seq,)
    if bsz * seq:
        qs, qos, ks, kos = q.stride(), qo.stride(), k.stride(), ko.stride()
        block_half = next_power_of_2(half)
        warps = 8 if (n_qh + n_kh) * block_half >= 4096 else 4
        _kernel[grid](
            q,
            k,
            qo,
            ko,
            cos,
            sin,
            seq,
            n_qh,
            n_kh,
            half,
            *qs[:3],
            *qos[:3],
            *ks[:3],
            *kos[:3],
            *cos.stride()[:2],
            BACKWARD=backward,
            BLOCK_QH=next_power_of_2(n_qh),
            BLOCK_KH=next_power_of_2(n_kh),
            BLOCK_HALF=block_half,
            num_warps=warps,
        )
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    """Autograd glue: saves only ``cos``/``sin``; backward is the transposed rotation."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = q.dtype, k.dtype
        return _launch(q, k, cos, sin, False, *_out_dtypes(q, k, cos, sin))

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = _launch(dq, dk, cos, sin, True, *ctx.dtypes)
        return dq_in, dk_in, None, None


# -- torch.compile: one custom operator; its gradient is the same operator with ``backward`` flipped --


@op_def(
    "rope",
    "(Tensor q, Tensor k, Tensor cos, Tensor sin, bool backward, ScalarType? q_dtype=None, "
    "ScalarType? k_dtype=None) -> (Tensor, Tensor)",
)
def _rope_op(q, k, cos, sin, backward, q_dtype=None, k_dtype=None):
    return _launch(q, k, cos, sin, backward, q_dtype or q.dtype, k_dtype or k.dtype)


@_rope_op.register_fake
def _(q, k, cos, sin, backward, q_dtype=None, k_dtype=None):
    return (
        torch.empty_like(_unit_last(q), dtype=q_dtype or q.dtype),
        torch.empty_like(_unit_last(k), dtype=k_dtype or k.dtype),
    )


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])
    ctx.backward = inputs[4]
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype


def _rope_grad(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = torch.ops.ckpt.rope(dq, dk, cos, sin, not ctx.backward, *ctx.dtypes)
    return dq_in, dk_in, None, None, None, None, None


_rope_op.register_autograd(_rope_grad, setup_context=_rope_setup)


def _normalise_cos(t: torch.Tensor, name: str, bsz: int, seq: int, dim: int) -> torch.Tensor:
    """Bring ``cos``/``sin`` to ``(1 or B, S, D)`` with a zero batch stride when broadcast."""
    if t.dim() == 4:
        if t.shape[1] != 1:
            raise ValueError(f"{name} with 4 dims must be (B, 1, S, D), got shape {tuple(t.shape)}")
        t = t[:, 0]
    elif t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[-2] != seq or t.shape[-1] != dim or t.shape[0] not in (1, bsz):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected (S, D), (1|B, S, D) or (1|B, 1, S, D) "
            f"with B={bsz}, S={seq}, D={dim}"
        )
    t = _unit_last(t)
    return t.expand(bsz, seq, dim)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` by the rotary embedding in one fused launch.

    Args:
        q: ``(B, Hq, S, D)`` (or ``(B, S, Hq, D)`` with ``unsqueeze_dim=2``), any strides.
        k: ``(B, Hk, S, D)`` likewise; ``Hk`` may differ from ``Hq`` (GQA/MQA), and so may its dtype.
        cos, sin: HF tensors ``(1|B, S, D)``, or ``(S, D)``.
        unsqueeze_dim: 1 for the heads-first layout (HF default), 2 for sequence-first.

    Returns:
        ``(q_rot, k_rot)`` with the input shapes and (dense) layouts; dtypes as HF's function
        gives them: ``q``'s promoted with ``cos``/``sin``'s (so fp32 for a bf16 ``q`` with fp32
        ``cos``), ``k``'s likewise. Gradients come back in ``q``'s and ``k``'s dtypes.
    """
    check_tensor(q, "q", dtypes=_FLOATS, ndim=4)
    check_tensor(k, "k", dtypes=_FLOATS, ndim=4)
    check_tensor(cos, "cos", dtypes=_FLOATS, ndim=(2, 3, 4))
    check_tensor(sin, "sin", dtypes=_FLOATS, ndim=(2, 3, 4))
    check_runnable_device(q, "q")
    check_same_device(q, "q", k=k, cos=cos, sin=sin)
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 (B, H, S, D) or 2 (B, S, H, D), got {unsqueeze_dim}")
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    bsz, _, seq, dim = q.shape
    if dim % 2:
        raise ValueError(f"q's head_dim must be even, got {dim}")
    if k.shape[0] != bsz or k.shape[2] != seq or k.shape[3] != dim:
        raise ValueError(
            f"k has shape {tuple(k.shape)}, incompatible with q's {tuple(q.shape)} "
            "(batch, sequence and head_dim must match)"
        )
    cos = _normalise_cos(cos, "cos", bsz, seq, dim)
    sin = _normalise_cos(sin, "sin", bsz, seq, dim)
    if cos.stride() != sin.stride():  # the kernel addresses both with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        qo, ko = torch.ops.ckpt.rope(q, k, cos, sin, False, *_out_dtypes(q, k, cos, sin))
    else:
        qo, ko = RoPEFunction.apply(q, k, cos, sin)
    if unsqueeze_dim == 2:
        qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
    return qo, ko

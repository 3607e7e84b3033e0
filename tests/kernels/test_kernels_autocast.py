"""Every kernel under ``torch.autocast`` and with mixed input dtypes, against the PyTorch (or
Hugging Face) code it replaces, run under the same autocast.

What must match: the output's dtype exactly (the dtype torch's autocast rules give the replaced
op), its values, and every gradient, each in its own input's dtype. The small shapes run on
``DEVICE`` (the CPU interpreter under CPU autocast here, CUDA autocast on a GPU machine); the
``gpu`` parametrisations repeat them at real sizes under CUDA autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ckpt.kernels as K
from kernel_helpers import DEVICE, assert_close, gpu_param

BF16, FP32 = torch.bfloat16, torch.float32
#: bf16 arithmetic on both sides (rounded at different points): loose, as the suite's bf16 tolerance
ATOL, RTOL = 2e-2, 2e-2


def autocast(device: str, enabled: bool = True):
    return torch.autocast(device_type=device, dtype=BF16, enabled=enabled)


def compare(
    ours_fn, ref_fn, inputs, names, device, *, enabled=True, atol=ATOL, rtol=RTOL, backward_in_autocast=False
):
    """Run ``ours_fn`` and ``ref_fn`` under the same autocast on fresh leaf copies of ``inputs``
    (floating tensors get gradients, in their own dtype), backpropagate the same output gradients,
    and compare output dtypes and values and every gradient (dtype and values)."""

    def leaves():
        return [
            t.detach().clone().requires_grad_(True)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
            for t in inputs
        ]

    ours_in, ref_in = leaves(), leaves()
    with autocast(device, enabled):
        out, exp = ours_fn(*ours_in), ref_fn(*ref_in)
    out = out if isinstance(out, tuple) else (out,)
    exp = exp if isinstance(exp, tuple) else (exp,)
    for i, (o, e) in enumerate(zip(out, exp)):
        assert o.dtype == e.dtype, f"output {i}: dtype {o.dtype}, the replaced PyTorch code gives {e.dtype}"
        assert_close(f"output[{i}]", o, e, atol, rtol)
    grads = [torch.randn(e.shape, device=e.device).to(e.dtype) for e in exp]
    with autocast(device, enabled and backward_in_autocast):
        torch.autograd.backward(list(out), grads)
        torch.autograd.backward(list(exp), grads)
    for name, o, r in zip(names, ours_in, ref_in):
        if isinstance(o, torch.Tensor) and o.requires_grad:
            assert o.grad is not None and o.grad.dtype == o.dtype, (
                f"grad of {name}: {o.grad and o.grad.dtype}"
            )
            assert_close(f"grad of {name}", o.grad, r.grad, atol, rtol)


def rnd(*shape, device, dtype=FP32, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=device) * scale + shift).to(dtype)


# -- what each kernel replaces, written as Hugging Face / PyTorch write it (no upcasts of our own) --


def llama_rms_norm(x, w, eps=1e-6):
    """LlamaRMSNorm.forward (also Mistral's, Qwen2's, Qwen3's)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def gemma_rms_norm(x, w, eps=1e-6):
    """GemmaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_cos_sin(seq, dim, device):
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    emb = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv
    emb = torch.cat([emb, emb], -1)[None]
    return emb.cos(), emb.sin()


# -- parametrisations: (dtype of the activations, dtype of the weights) ----------------------------

MIXES = [
    pytest.param(FP32, FP32, id="x32-w32"),  # fp32 model under autocast (HF Trainer bf16=True)
    pytest.param(BF16, FP32, id="x16-w32"),  # bf16 activations, fp32 master weights
    pytest.param(BF16, BF16, id="x16-w16"),
    pytest.param(FP32, BF16, id="x32-w16"),
]
AUTOCAST = [pytest.param(True, id="autocast"), pytest.param(False, id="no-autocast")]

NORM_SHAPES = [pytest.param((3, 5, 37), DEVICE, id="3x5x37"), gpu_param((4096, 4096), "cuda", id="4096x4096")]


@pytest.mark.parametrize("shape,device", NORM_SHAPES)
@pytest.mark.parametrize("x_dtype,w_dtype", MIXES)
@pytest.mark.parametrize("enabled", AUTOCAST)
@pytest.mark.parametrize(
    "ours,ref,shift",
    [
        pytest.param(lambda x, w: K.rms_norm(x, w), llama_rms_norm, 1.0, id="llama"),
        pytest.param(lambda x, w: K.rms_norm(x, w, offset=1.0), gemma_rms_norm, 0.0, id="gemma"),
    ],
)
def test_rms_norm_matches_hf_norm(shape, device, x_dtype, w_dtype, enabled, ours, ref, shift):
    """Llama's norm returns ``weight * xhat.to(x.dtype)`` (so an fp32 weight makes an fp32 output
    from bf16 input), Gemma's returns x's dtype; autocast changes neither."""
    x = rnd(*shape, device=device, dtype=x_dtype)
    w = rnd(shape[-1], device=device, dtype=w_dtype, scale=0.3, shift=shift)
    compare(ours, ref, [x, w], ["x", "weight"], device, enabled=enabled)


def test_rms_norm_in_place_with_mixed_dtypes():
    """With an fp32 weight the output (and so dy) is fp32 while x is bf16: dx cannot go over dy."""
    x = rnd(6, 40, device=DEVICE, dtype=BF16)
    w = rnd(40, device=DEVICE, scale=0.3, shift=1.0)
    compare(
        lambda x, w: K.rms_norm(x, w, in_place=True) * 1.0,
        lambda x, w: llama_rms_norm(x, w) * 1.0,
        [x, w],
        ["x", "weight"],
        DEVICE,
    )


def hf_add_then_norm(norm):
    """A decoder layer's ``hidden = residual + hidden; normed = norm(hidden)``, as ``(normed, hidden)``."""

    def ref(x, r, w):
        h = r + x
        return norm(h, w), h

    return ref


@pytest.mark.parametrize("shape,device", NORM_SHAPES)
@pytest.mark.parametrize("x_dtype,w_dtype", MIXES)
@pytest.mark.parametrize("enabled", AUTOCAST)
@pytest.mark.parametrize(
    "offset,ref,shift",
    [
        pytest.param(0.0, llama_rms_norm, 1.0, id="llama"),
        pytest.param(1.0, gemma_rms_norm, 0.0, id="gemma"),
    ],
)
def test_fused_add_rms_norm_matches_hf_add_and_norm(
    shape, device, x_dtype, w_dtype, enabled, offset, ref, shift
):
    """The residual add and the norm after it: ``h`` in x's dtype, ``y`` in the dtype the Hugging Face
    norm gives (promoted for Llama with an fp32 weight), autocast changing neither; every gradient
    in its input's dtype."""
    x = rnd(*shape, device=device, dtype=x_dtype)
    r = rnd(*shape, device=device, dtype=x_dtype, scale=2.0)
    w = rnd(shape[-1], device=device, dtype=w_dtype, scale=0.3, shift=shift)
    compare(
        lambda x, r, w: K.fused_add_rms_norm(x, r, w, offset=offset),
        hf_add_then_norm(ref),
        [x, r, w],
        ["x", "residual", "weight"],
        device,
        enabled=enabled,
    )


LN_MIXES = [m for m in MIXES if m.id != "x32-w16"]  # torch's layer_norm rejects fp32 x with bf16 parameters


@pytest.mark.parametrize("shape,device", NORM_SHAPES)
@pytest.mark.parametrize("x_dtype,w_dtype", LN_MIXES)
@pytest.mark.parametrize("enabled", AUTOCAST)
def test_layer_norm_matches_torch(shape, device, x_dtype, w_dtype, enabled):
    """torch's layer_norm: x's dtype, and fp32 under CUDA autocast (its fp32 op list; not on the CPU)."""
    x = rnd(*shape, device=device, dtype=x_dtype, scale=2.0, shift=0.5)
    w = rnd(shape[-1], device=device, dtype=w_dtype)
    b = rnd(shape[-1], device=device, dtype=w_dtype)
    compare(
        lambda x, w, b: K.layer_norm(x, w, b),
        layer_norm_ref,
        [x, w, b],
        ["x", "weight", "bias"],
        device,
        enabled=enabled,
    )


def layer_norm_ref(x, w, b):
    """torch's layer_norm; outside autocast CUDA's refuses mixed dtypes, so there the CPU's answer
    (fp32 math, x's dtype out) is the reference, which is what the kernel gives on both devices."""
    if x.is_cuda and x.dtype != w.dtype and not torch.is_autocast_enabled("cuda"):
        return F.layer_norm(x.float(), x.shape[-1:], w.float(), b.float(), 1e-5).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def test_layer_norm_fp32_input_with_bf16_parameters():
    """A combination torch's layer_norm rejects: fp32 math, x's dtype out, gradients in each dtype."""
    x, w, b = (
        rnd(7, 33, device=DEVICE),
        rnd(33, device=DEVICE, dtype=BF16),
        rnd(33, device=DEVICE, dtype=BF16),
    )
    compare(
        lambda x, w, b: K.layer_norm(x, w, b),
        lambda x, w, b: F.layer_norm(x, (33,), w.float(), b.float()),
        [x, w, b],
        ["x", "weight", "bias"],
        DEVICE,
        enabled=False,
    )


ROPE_SHAPES = [
    pytest.param((2, 4, 2, 5, 12), DEVICE, id="gqa-small"),
    gpu_param((2, 32, 8, 2048, 128), "cuda", id="llama3-8b"),
]


@pytest.mark.parametrize("shape,device", ROPE_SHAPES)
@pytest.mark.parametrize("q_dtype,cos_dtype", MIXES)
@pytest.mark.parametrize("enabled", AUTOCAST)
def test_rope_matches_hf(shape, device, q_dtype, cos_dtype, enabled):
    """HF multiplies q by cos elementwise: the output takes the promoted dtype (bf16 q from an
    autocast projection with HF's fp32 cos/sin gives fp32), autocast leaves it alone."""
    b, hq, hk, s, d = shape
    cos, sin = (t.to(cos_dtype) for t in hf_cos_sin(s, d, device))
    # HF's (B, H, S, D) views of the (B, S, H, D) projection outputs
    q = rnd(b, s, hq, d, device=device, dtype=q_dtype).transpose(1, 2)
    k = rnd(b, s, hk, d, device=device, dtype=q_dtype).transpose(1, 2)
    compare(
        lambda q, k: K.rope(q, k, cos, sin),
        lambda q, k: hf_apply_rotary_pos_emb(q, k, cos, sin),
        [q, k],
        ["q", "k"],
        device,
        enabled=enabled,
    )


def test_rope_q_and_k_of_different_dtypes():
    cos, sin = hf_cos_sin(5, 8, DEVICE)
    q, k = rnd(1, 2, 5, 8, device=DEVICE, dtype=BF16), rnd(1, 2, 5, 8, device=DEVICE)
    compare(
        lambda q, k: K.rope(q, k, cos.to(BF16), sin.to(BF16)),
        lambda q, k: hf_apply_rotary_pos_emb(q, k, cos.to(BF16), sin.to(BF16)),
        [q, k],
        ["q", "k"],
        DEVICE,
        enabled=False,
    )


GLU_SHAPES = [
    pytest.param((3, 5, 37), DEVICE, id="3x5x37"),
    gpu_param((4096, 14336), "cuda", id="4096x14336"),
]


@pytest.mark.parametrize("shape,device", GLU_SHAPES)
@pytest.mark.parametrize("a_dtype,b_dtype", MIXES)
@pytest.mark.parametrize("enabled", AUTOCAST)
@pytest.mark.parametrize(
    "ours,ref",
    [
        pytest.param(K.swiglu, lambda a, b: F.silu(a) * b, id="swiglu"),
        pytest.param(K.geglu, lambda a, b: F.gelu(a, approximate="tanh") * b, id="geglu"),
    ],
)
def test_glu_matches_torch(shape, device, a_dtype, b_dtype, enabled, ours, ref):
    a = rnd(*shape, device=device, dtype=a_dtype, scale=3.0)
    b = rnd(*shape, device=device, dtype=b_dtype)
    compare(ours, ref, [a, b], ["a", "b"], device, enabled=enabled)


def test_mlp_module_under_autocast():
    """The patched MLP block: fp32 Linears under autocast feed bf16 gate/up into the fused GLU."""
    mlp = K.SwiGLUMLP(24, 40, device=DEVICE)
    ref = copy.deepcopy(mlp)
    x = rnd(3, 5, 24, device=DEVICE)
    compare(
        lambda x: mlp(x),
        lambda x: ref.down_proj(F.silu(ref.gate_proj(x)) * ref.up_proj(x)),
        [x],
        ["x"],
        DEVICE,
    )
    for (name, p), q in zip(mlp.named_parameters(), ref.parameters()):
        assert p.grad.dtype == FP32, name
        assert_close(f"grad of {name}", p.grad, q.grad, ATOL, RTOL)


CE_SHAPES = [pytest.param((13, 97), DEVICE, id="13x97"), gpu_param((4096, 128256), "cuda", id="4096x128256")]


def _targets(n, v, device):
    t = torch.randint(0, v, (n,), device=device)
    t[::5] = -100
    return t


@pytest.mark.parametrize("shape,device", CE_SHAPES)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["logits32", "logits16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_under_autocast(shape, device, dtype, reduction):
    """torch's cross_entropy is on autocast's fp32 list: fp32 loss; the gradient in the logits' dtype."""
    n, v = shape
    x, t = rnd(n, v, device=device, dtype=dtype, scale=3.0), _targets(n, v, device)
    opts = dict(reduction=reduction, label_smoothing=0.1)
    compare(
        lambda x: K.cross_entropy(x, t, **opts),
        lambda x: F.cross_entropy(x, t, **opts),
        [x],
        ["logits"],
        device,
    )


def test_cross_entropy_of_autocast_linear():
    """Logits from a Linear under autocast (a private bf16 intermediate: gradient made in place)."""
    h, w = rnd(10, 16, device=DEVICE), rnd(29, 16, device=DEVICE, scale=0.5)
    t = _targets(10, 29, DEVICE)
    compare(
        lambda h, w: K.cross_entropy(F.linear(h, w), t),
        lambda h, w: F.cross_entropy(F.linear(h, w), t),
        [h, w],
        ["hidden", "weight"],
        DEVICE,
    )


FLCE_SHAPES = [
    pytest.param((37, 24, 97), DEVICE, id="37x24x97"),
    gpu_param((4096, 4096, 128256), "cuda", id="llama3-8b-4k"),
]


def flce_ref(h, w, t, b=None, **opts):
    """The unpatched LM head and loss: a Linear (autocast's bf16 list), then cross-entropy in fp32.
    Outside autocast the weights are cast to the activations' dtype, as documented."""
    if not torch.is_autocast_enabled(h.device.type):
        w, b = w.to(h.dtype), None if b is None else b.to(h.dtype)
    return F.cross_entropy(F.linear(h, w, b).float(), t, **opts)


@pytest.mark.parametrize("shape,device", FLCE_SHAPES)
@pytest.mark.parametrize("h_dtype,w_dtype", MIXES)
@pytest.mark.parametrize("enabled", AUTOCAST)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fused_linear_cross_entropy_mixed(shape, device, h_dtype, w_dtype, enabled, reduction, with_bias):
    """Under autocast the GEMMs run in bf16 (as F.linear does); outside it in hidden's dtype. The
    gradients come back in hidden's, weight's and bias's own dtypes."""
    n, hd, v = shape
    if device == "cuda" and (with_bias or reduction != "mean" or not enabled):
        pytest.skip("real-size case run for the autocast mean without bias only, to bound the GPU run's time")
    h = rnd(n, hd, device=device, dtype=h_dtype)
    w = rnd(v, hd, device=device, dtype=w_dtype, scale=2 / hd**0.5)
    b = rnd(v, device=device, dtype=w_dtype) if with_bias else None
    t = _targets(n, v, device)
    chunk = 8 if device == "cpu" else None  # several chunks at small sizes
    compare(
        lambda h, w, b: K.fused_linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=chunk),
        lambda h, w, b: flce_ref(h, w, t, b, reduction=reduction),
        [h, w, b],
        ["hidden", "weight", "bias"],
        device,
        enabled=enabled,
        atol=5e-2,
        rtol=5e-2,
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_backward_inside_autocast(reduction):
    """backward() called inside the autocast region (the CPU runs it on this thread, autocast on):
    reduction="none" recomputes the chunks in backward with the forward's GEMM dtype."""
    h, w = rnd(21, 16, device=DEVICE), rnd(53, 16, device=DEVICE, scale=0.5)
    t = _targets(21, 53, DEVICE)
    compare(
        lambda h, w: K.fused_linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=5),
        lambda h, w: flce_ref(h, w, t, reduction=reduction),
        [h, w],
        ["hidden", "weight"],
        DEVICE,
        atol=5e-2,
        rtol=5e-2,
        backward_in_autocast=True,
    )


def test_fused_linear_cross_entropy_reuses_fp32_hidden_under_autocast():
    """hidden an fp32 intermediate, GEMMs in bf16: d_hidden (fp32) still goes over hidden's memory."""
    x, p, w = rnd(2, 9, 12, device=DEVICE), rnd(12, 12, device=DEVICE), rnd(41, 12, device=DEVICE)
    t = _targets(18, 41, DEVICE).reshape(2, 9)
    with autocast(DEVICE):
        hidden = (x * 1.0).requires_grad_()
        mid = hidden * 2.0  # fp32 private intermediate (mul is not autocast)
        loss = K.fused_linear_cross_entropy(mid, w, t, chunk_size=4)
        assert mid._version > 0  # overwritten with d_hidden
    loss.backward()
    ref = hidden.detach().clone().requires_grad_()
    with autocast(DEVICE):
        want = flce_ref((ref * 2.0).reshape(-1, 12), w, t.reshape(-1))
    want.backward()
    assert_close("loss", loss, want, 5e-2, 5e-2)
    assert_close("grad of hidden", hidden.grad, ref.grad, 5e-2, 5e-2)

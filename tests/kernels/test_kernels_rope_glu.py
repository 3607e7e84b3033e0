"""RoPE, SwiGLU and GeGLU (separate and packed halves) against plain PyTorch references: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ckpt.kernels import GeGLUMLP, PackedGLUMLP, SwiGLUMLP, geglu, geglu_packed, rope, swiglu, swiglu_packed
from kernel_helpers import DEVICE, DTYPES, gpu_param, run_and_compare


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's apply_rotary_pos_emb, in fp32."""
    cos, sin = cos.float().unsqueeze(unsqueeze_dim), sin.float().unsqueeze(unsqueeze_dim)
    q, k = q.float(), k.float()
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_cos_sin(batch, seq, dim, base=10000.0, offset=0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    pos = torch.arange(offset, offset + seq, dtype=torch.float32)[None, :].expand(batch, -1)
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos(), emb.sin()


ROPE_SHAPES = [  # (batch, q heads, kv heads, seq, head_dim)
    pytest.param((1, 2, 2, 3, 4), DEVICE, id="mha-tiny"),
    pytest.param((2, 6, 2, 5, 10), DEVICE, id="gqa-odd-hd10"),
    pytest.param((3, 5, 1, 7, 18), DEVICE, id="mqa-hd18"),
    gpu_param((2, 32, 8, 4096, 128), "cuda", id="llama3-8b"),
    gpu_param((1, 28, 4, 1000, 128), "cuda", id="qwen2-7b-odd-seq"),
]


@pytest.mark.parametrize("shape,device", ROPE_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd-view", "contiguous"])
def test_rope(shape, device, dtype, atol, rtol, layout):
    b, hq, hk, s, d = shape
    cos, sin = hf_cos_sin(1, s, d)
    if layout == "bhsd-view":  # HF: projection output (b, s, h, d) viewed as (b, h, s, d)
        fn = lambda q, k, c, si: rope(q.transpose(1, 2), k.transpose(1, 2), c, si)  # noqa: E731
        ref = lambda q, k, c, si: rope_ref(q.transpose(1, 2), k.transpose(1, 2), c, si)  # noqa: E731
        q, k = torch.randn(b, s, hq, d, device=device), torch.randn(b, s, hk, d, device=device)
    else:
        fn, ref = rope, rope_ref
        q, k = torch.randn(b, hq, s, d, device=device), torch.randn(b, hk, s, d, device=device)
    # cos/sin are HF buffers without gradients: pass them as non-float-like constants
    run_and_compare(
        lambda q, k: fn(q, k, cos.to(device, dtype), sin.to(device, dtype)),
        lambda q, k: ref(q, k, cos.to(device, dtype), sin.to(device, dtype)),
        [q, k],
        ["q", "k"],
        dtype,
        atol,
        rtol,
        device,
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_rope_general_cos_sin_and_layouts(dtype, atol, rtol):
    """Random (non-HF) cos/sin with a per-batch dim, (S, D) cos, and sequence-first layout."""
    b, hq, hk, s, d = 2, 4, 2, 6, 8
    cos, sin = torch.randn(b, s, d).to(DEVICE, dtype), torch.randn(b, s, d).to(DEVICE, dtype)
    run_and_compare(
        lambda q, k: rope(q, k, cos, sin),
        lambda q, k: rope_ref(q, k, cos, sin),
        [torch.randn(b, hq, s, d), torch.randn(b, hk, s, d)],
        ["q", "k"],
        dtype,
        atol,
        rtol,
    )
    c2, s2 = cos[0], sin[0]
    run_and_compare(
        lambda q, k: rope(q, k, c2, s2),
        lambda q, k: rope_ref(q, k, c2[None], s2[None]),
        [torch.randn(b, hq, s, d), torch.randn(b, hk, s, d)],
        ["q", "k"],
        dtype,
        atol,
        rtol,
    )
    run_and_compare(
        lambda q, k: rope(q, k, cos, sin, unsqueeze_dim=2),
        lambda q, k: rope_ref(q, k, cos, sin, unsqueeze_dim=2),
        [torch.randn(b, s, hq, d), torch.randn(b, s, hk, d)],
        ["q", "k"],
        dtype,
        atol,
        rtol,
    )


def test_rope_keeps_layout():
    q = torch.randn(2, 5, 4, 8, device=DEVICE).transpose(1, 2)
    k = torch.randn(2, 5, 2, 8, device=DEVICE).transpose(1, 2)
    cos, sin = hf_cos_sin(1, 5, 8)
    qo, ko = rope(q, k, cos.to(DEVICE), sin.to(DEVICE))
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


GLU_SHAPES = [
    pytest.param((1, 1), DEVICE, id="1x1"),
    pytest.param((3, 5, 37), DEVICE, id="3x5x37"),
    pytest.param((7, 1100), DEVICE, id="7x1100"),
    gpu_param((8192, 14336), "cuda", id="8192x14336"),
    gpu_param((3, 777, 11008), "cuda", id="3x777x11008"),
]

GLUS = [
    pytest.param(swiglu, lambda a, b: F.silu(a) * b, id="swiglu"),
    pytest.param(geglu, lambda a, b: F.gelu(a, approximate="tanh") * b, id="geglu"),
]


@pytest.mark.parametrize("shape,device", GLU_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("fn,ref", GLUS)
def test_glu(shape, device, dtype, atol, rtol, fn, ref):
    a, b = torch.randn(shape, device=device) * 3, torch.randn(shape, device=device)
    run_and_compare(fn, lambda a, b: ref(a.float(), b.float()), [a, b], ["a", "b"], dtype, atol, rtol, device)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("fn,ref", GLUS)
def test_glu_in_place_gradient_on_intermediates(dtype, atol, rtol, fn, ref):
    """When a and b are private intermediates the gradients overwrite them; results must not change."""
    x = torch.randn(5, 16)
    w1, w2 = torch.randn(16, 24), torch.randn(16, 24)
    run_and_compare(
        lambda x, w1, w2: fn(x @ w1, x @ w2),
        lambda x, w1, w2: ref(x @ w1, x @ w2),
        [x, w1, w2],
        ["x", "w1", "w2"],
        dtype,
        atol,
        rtol,
    )


def test_glu_non_contiguous_and_aliased():
    a = torch.randn(6, 20, device=DEVICE).t()
    b = torch.randn(20, 6, device=DEVICE)
    torch.testing.assert_close(swiglu(a, b), F.silu(a) * b)
    x = torch.randn(4, 9, device=DEVICE, requires_grad=True)
    y = x * 1.0
    swiglu(y, y).sum().backward()  # one buffer for a and b: must not take both gradients in place
    xr = x.detach().clone().requires_grad_()
    (F.silu(xr) * xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize(
    "cls,act", [(SwiGLUMLP, F.silu), (GeGLUMLP, lambda t: F.gelu(t, approximate="tanh"))]
)
def test_mlp_modules(cls, act):
    mlp = cls(24, 40, device=DEVICE)
    x = torch.randn(3, 5, 24, device=DEVICE)
    want = mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), want)


PACKED_SHAPES = [  # (..., 2I)
    pytest.param((1, 2), DEVICE, id="1x2"),
    pytest.param((3, 5, 74), DEVICE, id="3x5x74"),
    pytest.param((7, 2 * 1100), DEVICE, id="7x2200"),  # I > one column block: two programs per row
    gpu_param((8192, 2 * 14336), "cuda", id="8192x28672"),
    gpu_param((3, 777, 2 * 11008), "cuda", id="3x777x22016"),
]

PACKED = [
    pytest.param(swiglu_packed, F.silu, id="swiglu_packed"),
    pytest.param(geglu_packed, lambda a: F.gelu(a, approximate="tanh"), id="geglu_packed"),
]


def packed_ref(act):
    def ref(x):
        gate, up = x.float().chunk(2, dim=-1)  # as Phi-3's MLP and transformers' experts split it
        return act(gate) * up

    return ref


@pytest.mark.parametrize("shape,device", PACKED_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("fn,act", PACKED)
def test_glu_packed(shape, device, dtype, atol, rtol, fn, act):
    x = torch.randn(shape, device=device) * 3
    run_and_compare(fn, packed_ref(act), [x], ["gate_up"], dtype, atol, rtol, device)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("fn,act", PACKED)
def test_glu_packed_in_place_gradient_on_intermediates(dtype, atol, rtol, fn, act):
    """The output of a gate_up projection (a private intermediate) takes [da, db] in place."""
    x, w = torch.randn(2, 5, 16), torch.randn(16, 2 * 24)
    run_and_compare(
        lambda x, w: fn(x @ w), lambda x, w: packed_ref(act)(x @ w), [x, w], ["x", "w"], dtype, atol, rtol
    )


def test_glu_packed_in_place_clobbers_and_flags():
    """The in-place gradient bumps the version counter: another node that saved the input fails
    loudly instead of reading a gradient; a strided view of a bigger buffer is never written."""
    x = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    y = x * 2.0
    z = y.exp()  # saves its output, not y ... but this one saves y:
    w = y * y
    swiglu_packed(y).sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (z.sum() + w.sum()).backward()
    base = torch.randn(4, 20, device=DEVICE)
    view = base[:, ::2].requires_grad_()  # strided leaf-like view: gradient in a new buffer
    before = base.clone()
    swiglu_packed(view).sum().backward()
    assert torch.equal(base, before)
    ref = view.detach().clone().requires_grad_()
    packed_ref(F.silu)(ref).sum().backward()
    torch.testing.assert_close(view.grad, ref.grad)


def test_glu_packed_rejects_odd_width():
    with pytest.raises(ValueError, match="gate_up"):
        swiglu_packed(torch.randn(3, 7, device=DEVICE))


@pytest.mark.parametrize(
    "activation,act", [("silu", F.silu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))]
)
def test_packed_mlp_module(activation, act):
    gate_up, down = (
        torch.nn.Linear(24, 80, bias=False, device=DEVICE),
        torch.nn.Linear(40, 24, bias=False, device=DEVICE),
    )
    mlp = PackedGLUMLP(gate_up, down, activation)
    x = torch.randn(3, 5, 24, device=DEVICE)
    gate, up = gate_up(x).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), down(act(gate) * up))
    assert set(mlp.state_dict()) == {"gate_up_proj.weight", "down_proj.weight"}
    with pytest.raises(ValueError, match="activation"):
        PackedGLUMLP(gate_up, down, "relu")


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_geglu_keeps_its_relative_precision_where_tanh_saturates(packed):
    """For a gate of -3 to -9, gelu_tanh and its derivative are tiny differences ``1 + tanh(u)`` and
    ``1 - tanh(u)^2`` of numbers near 1; evaluated as such in fp32 they kept ~6e-8 of absolute error (0.2%
    of the value at -4, all of it past -6). In fp32 each element must be within 1e-4 of its float64 value
    relative to itself (what is left is the rounding of u itself, ~1e-5)."""
    a = torch.linspace(-9.0, -3.0, 4096, device=DEVICE)
    b = torch.full_like(a, 1.5)
    k = (2.0 / torch.pi) ** 0.5
    a64 = a.double()
    # float64 cancels too past -6 (1 + tanh(-33) is 0 there): 0.5 (1 + tanh u) and 1 - tanh^2 u written
    # as the sigmoids they equal
    u2 = 2.0 * k * (a64 + 0.044715 * a64**3)
    half_1p_t, one_m_t2 = torch.sigmoid(u2), 4.0 * torch.sigmoid(u2) * torch.sigmoid(-u2)
    want = a64 * half_1p_t * 1.5
    want_da = (half_1p_t + 0.5 * a64 * one_m_t2 * k * (1.0 + 3 * 0.044715 * a64**2)) * 1.5
    x = a.clone().requires_grad_(True)
    y = b.clone().requires_grad_(True)
    if packed:  # gate and up are the two halves of the last dimension
        xy = torch.cat([a, b]).reshape(1, -1).clone().requires_grad_(True)
        out = geglu_packed(xy)
        out.backward(torch.ones_like(out))
        da = xy.grad[0, :4096]
    else:
        out = geglu(x, y)
        out.backward(torch.ones_like(out))
        da = x.grad
    for name, got, ref in (("gelu_tanh(a) * b", out.reshape(-1), want), ("d/da", da, want_da)):
        rel = ((got.double() - ref).abs() / ref.abs()).max().item()
        assert rel < 1e-4, f"{name}: largest relative error {rel:.2e}"

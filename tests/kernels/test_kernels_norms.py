"""RMSNorm and LayerNorm against plain PyTorch references: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch

from ckpt.kernels import LayerNorm, RMSNorm, layer_norm, rms_norm
from kernel_helpers import DEVICE, DTYPES, gpu_param, run_and_compare


def rms_norm_ref(x, w, eps=1e-6, offset=0.0):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.float())


def layer_norm_ref(x, w, b, eps=1e-5):
    return torch.nn.functional.layer_norm(
        x.float(), (x.shape[-1],), w.float(), None if b is None else b.float(), eps
    )


SHAPES = [
    pytest.param((1, 7), DEVICE, id="1x7"),
    pytest.param((3, 5, 37), DEVICE, id="3x5x37"),
    pytest.param((13, 130), DEVICE, id="13x130"),
    pytest.param((70, 20), DEVICE, id="70x20-split-reduction"),
    gpu_param((8192, 4096), "cuda", id="8192x4096"),
    gpu_param((4, 1000, 5120), "cuda", id="4x1000x5120"),
    gpu_param((300, 16384), "cuda", id="300x16384-wide-rows"),  # RMSNorm: one row per backward step, no
    # pipeline; LayerNorm: its column-parallel backward
    gpu_param((64, 32768), "cuda", id="64x32768-widest-rows"),  # RMSNorm's column-parallel backward
]


@pytest.mark.parametrize("shape,device", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_rms_norm(shape, device, dtype, atol, rtol, offset):
    x = torch.randn(shape, device=device)
    w = torch.randn(shape[-1], device=device) * 0.5 + (0.0 if offset else 1.0)
    run_and_compare(
        lambda x, w: rms_norm(x, w, 1e-6, offset),
        lambda x, w: rms_norm_ref(x, w, 1e-6, offset),
        [x, w],
        ["x", "weight"],
        dtype,
        atol,
        rtol,
        device,
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_rms_norm_wide_row_backward(dtype, atol, rtol, in_place, monkeypatch):
    """Rows wider than the one-pass backward takes (lowered here so small shapes reach it) go
    through the column-parallel weight-gradient pass, then dx one row per program."""
    import importlib

    monkeypatch.setattr(importlib.import_module("ckpt.kernels.rms_norm"), "_ONE_PASS_MAX_N", 16)
    x = torch.randn(37, 40, device=DEVICE)
    w = torch.randn(40, device=DEVICE) * 0.5 + 1.0
    run_and_compare(
        lambda x, w: rms_norm(x, w, in_place=in_place) * 1.0,
        lambda x, w: rms_norm_ref(x, w),
        [x, w],
        ["x", "weight"],
        dtype,
        atol,
        rtol,
        DEVICE,
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_layer_norm_wide_row_backward(dtype, atol, rtol, with_bias, monkeypatch):
    """Rows wider than LayerNorm's one-pass backward takes (lowered here so small shapes reach it) go
    through the single launch of column-parallel weight-gradient programs beside the dx rows."""
    import importlib

    monkeypatch.setattr(importlib.import_module("ckpt.kernels.layer_norm"), "_ONE_PASS_MAX_N", 16)
    x = torch.randn(37, 40, device=DEVICE)
    w = torch.randn(40, device=DEVICE) * 0.5 + 1.0
    b = torch.randn(40, device=DEVICE) if with_bias else None
    run_and_compare(
        lambda x, w, b: layer_norm(x, w, b),
        layer_norm_ref,
        [x, w, b],
        ["x", "weight", "bias"],
        dtype,
        atol,
        rtol,
        DEVICE,
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_rms_norm_in_place_grad(dtype, atol, rtol):
    """in_place=True writes dx over dy; the result must not change."""
    x = torch.randn(6, 40)
    w = torch.randn(40)
    # the multiply makes dy a private intermediate of the graph, as in a Llama block
    run_and_compare(
        lambda x, w: rms_norm(x, w, in_place=True) * 1.0,
        lambda x, w: rms_norm_ref(x, w),
        [x, w],
        ["x", "weight"],
        dtype,
        atol,
        rtol,
    )


def test_rms_norm_matches_llama_rounding():
    """offset=0 rounds xhat to the input dtype before the weight, like Hugging Face Llama."""
    x = torch.randn(9, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(64, device=DEVICE, dtype=torch.bfloat16)
    h = x.float()
    hf = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    ours = rms_norm(x, w)
    assert (ours.float() - hf.float()).abs().max().item() <= 2**-6 * hf.float().abs().max().item()


@pytest.mark.parametrize("shape,device", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm(shape, device, dtype, atol, rtol, with_bias):
    x = torch.randn(shape, device=device) * 2 + 0.5
    w = torch.randn(shape[-1], device=device)
    b = torch.randn(shape[-1], device=device) if with_bias else None
    run_and_compare(
        lambda x, w, b: layer_norm(x, w, b),
        layer_norm_ref,
        [x, w, b],
        ["x", "weight", "bias"],
        dtype,
        atol,
        rtol,
        device,
    )


def test_modules_match_functional():
    x = torch.randn(4, 3, 24, device=DEVICE)
    rn = RMSNorm(24, eps=1e-5).to(DEVICE)
    ln = LayerNorm(24).to(DEVICE)
    with torch.no_grad():
        rn.weight.uniform_(0.5, 1.5)
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    torch.testing.assert_close(rn(x), rms_norm(x, rn.weight, 1e-5))
    torch.testing.assert_close(ln(x), layer_norm(x, ln.weight, ln.bias))
    assert "eps=1e-05" in repr(rn)


def test_norms_non_contiguous_input():
    base = torch.randn(5, 2 * 33, device=DEVICE)
    x = base[:, ::2]  # last-dim stride 2
    w = torch.rand(33, device=DEVICE) + 0.5
    torch.testing.assert_close(rms_norm(x, w), rms_norm_ref(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer_norm(x, w, None), layer_norm_ref(x, w, None), atol=1e-5, rtol=1e-5)
    xt = torch.randn(33, 7, device=DEVICE).t()  # rows not contiguous
    torch.testing.assert_close(rms_norm(xt, w), rms_norm_ref(xt, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("need", ["weight", "bias", "neither"])
def test_layer_norm_partial_parameter_grads(need):
    """Frozen weight or bias: the reduction writes only what is asked, the rest stays None."""
    x = torch.randn(70, 20, device=DEVICE, requires_grad=True)
    w = (torch.rand(20, device=DEVICE) + 0.5).requires_grad_(need == "weight")
    b = torch.randn(20, device=DEVICE).requires_grad_(need == "bias")
    xr, wr, br = (t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, b))
    dy = torch.randn(70, 20, device=DEVICE)
    layer_norm(x, w, b).backward(dy)
    layer_norm_ref(xr, wr, br).backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
    for ours, ref in ((w, wr), (b, br)):
        if ours.requires_grad:
            torch.testing.assert_close(ours.grad, ref.grad, atol=1e-4, rtol=1e-5)
        else:
            assert ours.grad is None


def test_norms_mixed_parameter_dtypes():
    """bf16 activations with fp32 weight and bf16 bias: each gradient comes back in its own dtype."""
    x = torch.randn(13, 130, device=DEVICE).to(torch.bfloat16).requires_grad_()
    w = (torch.rand(130, device=DEVICE) + 0.5).requires_grad_()
    b = torch.randn(130, device=DEVICE).to(torch.bfloat16).requires_grad_()
    layer_norm(x, w, b).float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.bfloat16
    ref_w, ref_b = w.detach().clone().requires_grad_(), b.detach().float().requires_grad_()
    layer_norm_ref(x.detach(), ref_w, ref_b).sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(b.grad.float(), ref_b.grad, atol=2e-2, rtol=2e-2)


def test_norms_empty_input_gives_zero_parameter_grads():
    x = torch.randn(0, 24, device=DEVICE, requires_grad=True)
    w = torch.ones(24, device=DEVICE, requires_grad=True)
    b = torch.zeros(24, device=DEVICE, requires_grad=True)
    (layer_norm(x, w, b).sum() + rms_norm(x, w).sum()).backward()
    assert x.grad.shape == (0, 24)
    assert torch.equal(w.grad, torch.zeros(24, device=DEVICE)) and torch.equal(
        b.grad, torch.zeros(24, device=DEVICE)
    )


def test_norms_strided_weight():
    """A weight that is a strided view (e.g. one of several stacked norms) is read correctly."""
    stacked = (torch.rand(24, 2, device=DEVICE) + 0.5).requires_grad_()
    w = stacked[:, 1]
    x = torch.randn(6, 24, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_ref(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer_norm(x, w, None), layer_norm_ref(x, w, None), atol=1e-5, rtol=1e-5)
    (rms_norm(x, w).sum() + layer_norm(x, w, None).sum()).backward()
    ref = stacked.detach().clone().requires_grad_()
    (rms_norm_ref(x, ref[:, 1]).sum() + layer_norm_ref(x, ref[:, 1], None).sum()).backward()
    torch.testing.assert_close(stacked.grad, ref.grad, atol=1e-4, rtol=1e-5)


def test_rms_norm_in_place_grad_is_adopted_without_copy():
    """With in_place=True the input gradient lives in dy's memory; for a leaf input autograd must
    adopt it as ``x.grad`` rather than copy it (a copy costs a whole activation of memory)."""
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.ones(64, requires_grad=True)
    dy = torch.randn(4, 64)
    expected = torch.autograd.grad(rms_norm_ref(x, w), x, dy)[0]
    torch.autograd.backward([rms_norm(x, w, in_place=True)], [dy])
    assert x.grad.data_ptr() == dy.data_ptr()
    torch.testing.assert_close(x.grad, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wide", [False, True], ids=["one-pass", "wide-rows"])
@pytest.mark.parametrize(
    "shape,device",
    [
        pytest.param((300, 260), DEVICE, id="300x260"),
        gpu_param((8192, 4096), "cuda", id="8192x4096"),
    ],
)
def test_norm_weight_grads_are_deterministic_and_leave_tickets_armed(shape, device, wide, monkeypatch):
    """The weight gradients are partial rows summed in program order: after the one-pass backward by a
    second launch, and for rows too wide for it (LayerNorm's limit lowered here) in-launch by the last
    program of each column block (an atomic ticket). Repeated calls must give bit-identical gradients,
    and every ticket must be back at zero afterwards (a ticket left raised would corrupt the next call)."""
    import importlib

    from ckpt.kernels._reduce import _tickets

    if wide:
        monkeypatch.setattr(importlib.import_module("ckpt.kernels.layer_norm"), "_ONE_PASS_MAX_N", 16)

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(shape[-1], device=device, generator=g, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(shape[-1], device=device, generator=g, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        layer_norm(x, w, b).backward(dy)
        rms_norm(x, w).backward(dy)
        runs.append([t.grad.clone() for t in (x, w, b)])
        x.grad = w.grad = b.grad = None
    for later in runs[1:]:
        for name, first, again in zip(("x", "weight", "bias"), runs[0], later):
            assert torch.equal(first, again), f"{name} gradient differs between identical calls"
    assert all(int(t.abs().sum()) == 0 for t in _tickets.values())
    if wide:
        assert _tickets

"""The residual add fused with RMSNorm (``fused_add_rms_norm``) against plain PyTorch: both outputs
(``y``, ``h``) and the gradients of ``x``, ``residual`` and the weight, then a small pre-norm block
rewritten with it against the same block written unfused."""

from __future__ import annotations

import importlib

import pytest
import torch

from ckpt.kernels import FusedAddRMSNorm, RMSNorm, fused_add_rms_norm, rms_norm
from kernel_helpers import DEVICE, DTYPES, assert_close, gpu_param, run_and_compare

FUSED_DTYPES = DTYPES + [pytest.param(torch.float16, 5e-3, 5e-3, id="fp16")]


def fused_add_rms_norm_ref(x, r, w, eps=1e-6, offset=0.0):
    """``h = x + r; y = h * rsqrt(mean(h^2) + eps) * (offset + w)``, all in fp32."""
    h = x.float() + r.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.float()), h


SHAPES = [
    pytest.param((1, 7), DEVICE, id="1x7-one-row"),
    pytest.param((3, 5, 37), DEVICE, id="3x5x37"),
    pytest.param((13, 130), DEVICE, id="13x130"),
    pytest.param((70, 20), DEVICE, id="70x20-many-rows"),
    gpu_param((8192, 4096), "cuda", id="8192x4096"),
    gpu_param((2, 1000, 5120), "cuda", id="2x1000x5120"),
    gpu_param((64, 32768), "cuda", id="64x32768-widest-rows"),  # the column-parallel backward
]


def weight(n, offset, device=DEVICE):
    return torch.randn(n, device=device) * 0.5 + (0.0 if offset else 1.0)


@pytest.mark.parametrize("shape,device", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", FUSED_DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_fused_add_rms_norm(shape, device, dtype, atol, rtol, offset):
    """Both outputs and every gradient, with random gradients flowing into both y and h."""
    x, r = torch.randn(shape, device=device), torch.randn(shape, device=device)
    run_and_compare(
        lambda x, r, w: fused_add_rms_norm(x, r, w, 1e-6, offset),
        lambda x, r, w: fused_add_rms_norm_ref(x, r, w, 1e-6, offset),
        [x, r, weight(shape[-1], offset, device)],
        ["x", "residual", "weight"],
        dtype,
        atol,
        rtol,
        device,
    )


@pytest.mark.parametrize(
    "dtype,device",
    [
        pytest.param(torch.float32, DEVICE, id="fp32"),
        pytest.param(torch.float16, DEVICE, id="fp16"),
        # Triton's interpreter rounds fp32 to bf16 toward zero, the GPU (and PyTorch) to nearest even
        gpu_param(torch.bfloat16, "cuda", id="bf16"),
    ],
)
def test_h_is_the_rounded_sum_and_y_its_norm(dtype, device):
    """``h`` is exactly ``x + residual`` as PyTorch adds them in that dtype, and ``y`` is
    :func:`rms_norm` of that ``h``: the unfused pair gives the same values, bit for bit."""
    x, r = (torch.randn(9, 100, device=device).to(dtype) for _ in range(2))
    w = weight(100, 0.0, device).to(dtype)
    y, h = fused_add_rms_norm(x, r, w)
    assert h.dtype == dtype and h.is_contiguous()
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, rms_norm(x + r, w), atol=0, rtol=0)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("used", ["y", "h"])
def test_only_one_output_used(dtype, atol, rtol, used):
    """A gradient into one output only (the other's is None): ``y`` alone is a plain norm of the sum,
    ``h`` alone passes its gradient straight to ``x`` and ``residual`` and gives the weight none."""
    i = 0 if used == "y" else 1
    x, r = torch.randn(6, 40, device=DEVICE), torch.randn(6, 40, device=DEVICE)
    run_and_compare(
        lambda x, r, w: fused_add_rms_norm(x, r, w)[i] * 1.0,
        lambda x, r, w: fused_add_rms_norm_ref(x, r, w)[i] * 1.0,
        [x, r, weight(40, 0.0)],
        ["x", "residual", "weight"],
        dtype,
        atol,
        rtol,
    )


def test_weight_gets_no_grad_when_only_h_is_used():
    """As with ``h = x + r`` and a norm whose output is unused, the weight's gradient stays None."""
    x, r = torch.randn(6, 40, device=DEVICE, requires_grad=True), torch.randn(6, 40, device=DEVICE)
    w = weight(40, 0.0).requires_grad_()
    fused_add_rms_norm(x, r, w)[1].sum().backward()
    assert w.grad is None and torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_residual_without_grad(dtype, atol, rtol):
    """A residual that does not require grad (e.g. a frozen embedding) gets none; x and the weight do."""
    x = torch.randn(3, 5, 37, device=DEVICE).to(dtype).requires_grad_()
    r = torch.randn(3, 5, 37, device=DEVICE).to(dtype)
    w = weight(37, 0.0).requires_grad_()
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    dy, dh = torch.randn(3, 5, 37, device=DEVICE), torch.randn(3, 5, 37, device=DEVICE)
    y, h = fused_add_rms_norm(x, r, w)
    torch.autograd.backward([y, h], [dy.to(y.dtype), dh.to(h.dtype)])
    yr, hr = fused_add_rms_norm_ref(xr, r, wr)
    torch.autograd.backward([yr, hr], [dy.to(y.dtype).float(), dh.to(h.dtype).float()])
    assert r.grad is None
    assert_close("grad of x", x.grad, xr.grad, atol, rtol)
    assert_close("grad of weight", w.grad, wr.grad, atol, rtol)


def test_x_and_residual_grads_are_separate_tensors():
    """x and residual get the same gradient, ``dh``, but as leaves they must not share memory: a
    second backward accumulates into each separately."""
    x, r = (
        torch.randn(4, 24, device=DEVICE, requires_grad=True),
        torch.randn(4, 24, device=DEVICE, requires_grad=True),
    )
    w = weight(24, 0.0)
    for _ in range(2):
        y, h = fused_add_rms_norm(x, r, w)
        (y.square().sum() + h.sum()).backward()
    xr = x.detach().clone().requires_grad_()
    yr, hr = fused_add_rms_norm_ref(xr, r.detach(), w)
    (yr.square().sum() + hr.sum()).backward()
    assert x.grad.data_ptr() != r.grad.data_ptr()
    assert_close("grad of x", x.grad, 2 * xr.grad, 1e-5, 1e-5)
    assert_close("grad of residual", r.grad, 2 * xr.grad, 1e-5, 1e-5)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_wide_row_backward(dtype, atol, rtol, in_place, monkeypatch):
    """Rows too wide for the one-pass backward (the limit lowered here) add ``dh_out`` in the dx
    launch of the column-parallel path."""
    monkeypatch.setattr(importlib.import_module("ckpt.kernels.rms_norm"), "_ONE_PASS_MAX_N", 16)
    x, r = torch.randn(37, 40, device=DEVICE), torch.randn(37, 40, device=DEVICE)
    run_and_compare(
        lambda x, r, w: tuple(t * 1.0 for t in fused_add_rms_norm(x, r, w, in_place=in_place)),
        lambda x, r, w: fused_add_rms_norm_ref(x, r, w),
        [x, r, weight(40, 0.0)],
        ["x", "residual", "weight"],
        dtype,
        atol,
        rtol,
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_in_place_grad(dtype, atol, rtol):
    """in_place=True writes dh over y's gradient; the gradients must not change."""
    x, r = torch.randn(6, 40, device=DEVICE), torch.randn(6, 40, device=DEVICE)
    # the multiply makes dy a private intermediate, as a linear layer's input gradient is
    run_and_compare(
        lambda x, r, w: tuple(t * 1.0 for t in fused_add_rms_norm(x, r, w, in_place=True)),
        lambda x, r, w: fused_add_rms_norm_ref(x, r, w),
        [x, r, weight(40, 0.0)],
        ["x", "residual", "weight"],
        dtype,
        atol,
        rtol,
    )


@pytest.mark.parametrize("layout", ["row-slices", "strided-columns"])
def test_non_contiguous_inputs_and_output_grads(layout):
    """Inputs and output gradients that are views: ``row-slices`` are read in place with their
    own row strides (x, residual and h's gradient each different), ``strided-columns`` (a last-dim
    stride other than 1, a transpose, an expanded gradient) are copied first."""
    rows = lambda width: torch.randn(5, width, device=DEVICE)[:, 3:36]  # noqa: E731
    if layout == "row-slices":
        x, r, dy, dh = rows(40).requires_grad_(), rows(48).requires_grad_(), rows(44), rows(52)
    else:
        x = torch.randn(5, 2 * 33, device=DEVICE)[:, ::2].requires_grad_()
        r = torch.randn(33, 5, device=DEVICE).t().requires_grad_()
        dy = torch.randn(1, 33, device=DEVICE).expand(5, 33)
        dh = torch.randn(33, 5, device=DEVICE).t()
    w = (torch.rand(33, 2, device=DEVICE) + 0.5)[:, 1].detach().requires_grad_()
    xr, rr, wr = (t.detach().clone().requires_grad_() for t in (x, r, w))
    y, h = fused_add_rms_norm(x, r, w)
    yr, hr = fused_add_rms_norm_ref(xr, rr, wr)
    assert_close("y", y, yr, 1e-5, 1e-5)
    assert_close("h", h, hr, 1e-5, 1e-5)
    torch.autograd.backward([y, h], [dy, dh])
    torch.autograd.backward([yr, hr], [dy, dh])
    for name, a, e in (("x", x, xr), ("residual", r, rr), ("weight", w, wr)):
        assert_close(f"grad of {name}", a.grad, e.grad, 1e-5, 1e-5)


def test_empty_input():
    x = torch.randn(0, 24, device=DEVICE, requires_grad=True)
    w = torch.ones(24, device=DEVICE, requires_grad=True)
    y, h = fused_add_rms_norm(x, torch.zeros(0, 24, device=DEVICE), w)
    (y.sum() + h.sum()).backward()
    assert x.grad.shape == (0, 24) and torch.equal(w.grad, torch.zeros(24, device=DEVICE))


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 8).bfloat16(), torch.ones(8)),
            "residual has dtype",
        ),
        (
            lambda: fused_add_rms_norm(torch.randn(3, 8), torch.randn(1, 8), torch.ones(8)),
            "residual has shape",
        ),
        (lambda: fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 8).long(), torch.ones(8)), "residual"),
        (lambda: fused_add_rms_norm(torch.randn(3, 8), torch.randn(3, 8), torch.ones(9)), "weight has shape"),
    ],
    ids=["dtype", "shape", "integer", "weight"],
)
def test_bad_arguments_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_module_matches_functional_and_loads_an_rms_norm_state_dict():
    norm = RMSNorm(24, eps=1e-5, offset=1.0).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    fused = FusedAddRMSNorm(24, eps=1e-5, offset=1.0).to(DEVICE)
    fused.load_state_dict(norm.state_dict())
    x, r = torch.randn(4, 3, 24, device=DEVICE), torch.randn(4, 3, 24, device=DEVICE)
    y, h = fused(x, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, norm(x + r))
    assert "eps=1e-05" in repr(fused) and "offset=1.0" in repr(fused)


# -- a pre-norm block: two attention-free layers x = x + mlp(norm(x)), then the final norm ---------


def make_block(hidden, dtype, offset):
    torch.manual_seed(1)
    mlps = torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(hidden, 2 * hidden), torch.nn.SiLU(), torch.nn.Linear(2 * hidden, hidden)
        )
        for _ in range(2)
    )
    norms = torch.nn.ParameterList(
        weight(hidden, offset) for _ in range(3)
    )  # two layers', then the final one
    head = torch.nn.Linear(hidden, 11)
    return torch.nn.ModuleDict({"mlps": mlps, "norms": norms, "head": head}).to(DEVICE, dtype)


def unfused_block(m, h, offset, in_place):
    for mlp, w in zip(m["mlps"], m["norms"]):
        h = h + mlp(rms_norm(h, w, offset=offset, in_place=in_place))
    return m["head"](rms_norm(h, m["norms"][2], offset=offset, in_place=in_place))


def fused_block(m, h, offset, in_place):
    # the norm of each layer after the first takes the previous layer's residual add with it; the
    # final norm takes the last one (its h is then unused)
    y = rms_norm(h, m["norms"][0], offset=offset, in_place=in_place)
    for mlp, w in zip(m["mlps"], m["norms"][1:]):
        y, h = fused_add_rms_norm(mlp(y), h, w, offset=offset, in_place=in_place)
    return m["head"](y)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_pre_norm_block_matches_unfused(dtype, atol, rtol, offset, in_place):
    """Loss and every gradient (embedding input, norms, MLPs, head) of the block written with
    fused_add_rms_norm equal those of the same block written with rms_norm and ``+``."""
    hidden = 48
    emb = torch.randn(3, 7, hidden, device=DEVICE).to(dtype)
    target = torch.randint(0, 11, (21,), device=DEVICE)
    results = []
    for block in (unfused_block, fused_block):
        m = make_block(hidden, dtype, offset)
        h0 = emb.clone().requires_grad_()
        logits = block(m, h0, offset, in_place)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target)
        loss.backward()
        results.append(
            [("loss", loss.detach()), ("embedding", h0.grad)] + [(n, p.grad) for n, p in m.named_parameters()]
        )
    for (name, a), (_, e) in zip(results[1], results[0]):
        assert_close(f"{name} (fused block vs unfused)", a, e, atol, rtol)

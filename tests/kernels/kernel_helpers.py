"""Helpers shared by the kernel tests: devices, tolerances and a reporting comparison."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
#: where the small-shape tests run: the GPU when there is one, else the CPU interpreter
DEVICE = "cuda" if HAS_CUDA else "cpu"

#: (dtype, atol, rtol); atol is relative to the reference's largest magnitude
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]


def gpu_param(*values, id: str):
    """A parametrisation that runs only on the device machine (``-m gpu``)."""
    return pytest.param(*values, id=id, marks=pytest.mark.gpu)


def assert_close(
    name: str, actual: torch.Tensor | None, expected: torch.Tensor | None, atol: float, rtol: float
) -> None:
    """Compare ``actual`` with ``expected`` (fp32); on failure say where the largest difference is.

    Passes where ``|a - e| <= atol * max|e| + rtol * |e|`` elementwise, and never on NaN.
    """
    assert (actual is None) == (expected is None), f"{name}: one of actual/expected is None"
    if actual is None:
        return
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float32).cpu()
    e = expected.detach().to(torch.float32).cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN in result at {torch.isnan(a).nonzero()[0].tolist()}"
    scale = e.abs().max().item() if e.numel() else 0.0
    diff = (a - e).abs()
    bound = atol * max(scale, 1e-30) + rtol * e.abs()
    bad = diff > bound
    if bad.any():
        flat = int(torch.argmax(diff - bound))
        where = list(torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else []
        where = [int(w) for w in where]
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{diff.numel()} elements out of tolerance; largest difference "
            f"{diff.max().item():.3g} (max|ref| {scale:.3g}); worst at index {where}: "
            f"got {a.flatten()[flat].item():.6g}, expected {e.flatten()[flat].item():.6g} "
            f"(atol {atol} x max|ref|, rtol {rtol})"
        )


def leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh leaf copy of ``t`` that requires grad."""
    return t.detach().clone().to(dtype or t.dtype).requires_grad_(True)


def run_and_compare(fn, ref, inputs, names, dtype, atol, rtol, device=DEVICE, grad_outputs=None):
    """Run ``fn`` (ours, in ``dtype``) and ``ref`` (fp32 PyTorch on the same rounded inputs),
    backpropagate the same random output gradients, and compare outputs and every gradient.

    ``inputs`` are fp32 CPU tensors (floating ones get gradients), integer tensors, or ``None``.
    ``grad_outputs`` (optional) fixes the output gradients (e.g. ``1.0`` for a loss).
    """
    ours, refs = [], []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            rounded = t.to(device=device, dtype=dtype)
            ours.append(leaf(rounded))
            refs.append(leaf(rounded.to(torch.float32)))
        elif isinstance(t, torch.Tensor):
            ours.append(t.to(device))
            refs.append(t.to(device))
        else:
            ours.append(t)
            refs.append(t)
    out = fn(*ours)
    exp = ref(*refs)
    out = out if isinstance(out, tuple) else (out,)
    exp = exp if isinstance(exp, tuple) else (exp,)
    if grad_outputs is None:
        grad_outputs = [torch.randn_like(e) for e in exp]
    else:
        grad_outputs = [
            torch.full_like(e, g) if not isinstance(g, torch.Tensor) else g.to(e)
            for g, e in zip(grad_outputs, exp)
        ]
    for i, (o, e) in enumerate(zip(out, exp)):
        assert o.dtype in (dtype, torch.float32), f"output {i} has dtype {o.dtype}"
        assert_close(f"output[{i}]", o, e, atol, rtol)
    torch.autograd.backward(list(out), [g.to(o.dtype) for g, o in zip(grad_outputs, out)])
    torch.autograd.backward(list(exp), [g.to(o.dtype).to(torch.float32) for g, o in zip(grad_outputs, out)])
    for name, o, r in zip(names, ours, refs):
        if isinstance(o, torch.Tensor) and o.requires_grad:
            assert_close(f"grad of {name}", o.grad, r.grad, atol, rtol)
    return out, exp

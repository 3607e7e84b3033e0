"""Cross-entropy's split kernel (a row over cooperating programs) against its row kernel.

The split kernel runs only on a GPU: its programs wait for each other, which the interpreter, running
programs one after another, cannot do (the launch keeps the row kernel there; tested on the CPU). On the
GPU both kernels must give the same losses and gradients for every option, in place or not, under CUDA
graphs, with thousands of rows in flight, and whatever the segment count.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from ckpt.kernels.cross_entropy import class_weights, launch_ce
from kernel_helpers import HAS_CUDA

#: the module (``ckpt.kernels.cross_entropy`` as an attribute is the loss function)
ce_mod = importlib.import_module("ckpt.kernels.cross_entropy")

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _run(x, t, *, split, grad_into=None, weights=None, per_row_scale=False, smoothing=0.0, z_loss=0.0,
         softcap=0.0, ignore_index=-100, store_z=True):
    n = x.shape[0]
    torch.manual_seed(1)   # the same per-row scales in every run
    loss = torch.full((n,), float("nan"), device=x.device)
    z_rows = torch.full((n,), float("nan"), device=x.device) if store_z else None
    grad = torch.empty_like(x) if grad_into is None else grad_into
    if per_row_scale:
        scale = torch.rand(n, device=x.device) + 0.5
        zscale = torch.rand(n, device=x.device) + 0.5
    else:
        scale = torch.full((1,), 0.25, device=x.device)
        zscale = torch.full((1,), 0.5, device=x.device)
    launch_ce(x, t, loss, grad, scale, ignore_index, smoothing, z_loss, softcap, weights, z_rows, zscale,
              split=split)
    return loss, z_rows, grad


CASES = [
    # (rows, vocabulary, (columns per program, warps)): segment counts 1, 2, 4, 8 and 63, a last segment
    # of one column, a vocabulary one short of a whole segment
    pytest.param(64, 1000, (1024, 4), id="1seg"),
    pytest.param(64, 1000, (512, 4), id="2seg"),
    pytest.param(300, 32001, (8192, 8), id="4seg-last-of-1"),
    pytest.param(257, 65535, (8192, 16), id="8seg"),
    pytest.param(33, 128256, (2048, 4), id="63seg"),
]
OPTS = [
    pytest.param({}, id="plain"),
    pytest.param(dict(smoothing=0.1, z_loss=1e-3), id="smooth-z"),
    pytest.param(dict(softcap=30.0, per_row_scale=True), id="softcap-per-row"),
    pytest.param(dict(weights=True, smoothing=0.05, ignore_index=7, store_z=False), id="weights-smooth"),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("n,v,split", CASES)
@pytest.mark.parametrize("opts", OPTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_split_kernel_matches_the_row_kernel(n, v, split, opts, dtype):
    opts = dict(opts)
    torch.manual_seed(0)
    x = (torch.randn(n, v, device="cuda") * 4).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda")
    ignore = opts.get("ignore_index", -100)
    t[::5] = ignore
    t[1] = v - 1      # the last column: the last segment's owner
    t[2] = 0
    if opts.get("weights"):
        opts["weights"] = class_weights(torch.rand(v, device="cuda") + 0.1)
    rows = [_run(x, t, split=False, **opts)]
    for split_ in (split, True):
        rows.append(_run(x, t, split=split_, **opts))
    ref_loss, ref_z, ref_grad = rows[0]
    for loss, z, grad in rows[1:]:
        assert not loss.isnan().any() and not grad.float().isnan().any()
        # the same fp32 arithmetic but summed in another order: equal to fp32 rounding
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        if ref_z is not None:
            torch.testing.assert_close(z, ref_z, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2e-2 if dtype != torch.float32 else 1e-4,
                                   atol=1e-6)
        assert (grad[t == ignore] == 0).all()


@gpu
@needs_cuda
def test_split_kernel_in_place_and_deterministic():
    """Gradient over the logits (each program reads its columns before any program writes them, and the
    target's owner reads the target's logit before writing it); two runs are identical bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(2048, 128256, device="cuda", dtype=torch.bfloat16) * 4
    t = torch.randint(0, 128256, (2048,), device="cuda")
    ref_loss, _, ref_grad = _run(x, t, split=False)
    y = x.clone()
    loss, _, grad = _run(y, t, split=True, grad_into=y)
    assert grad.data_ptr() == y.data_ptr()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2e-2, atol=1e-6)
    again = _run(x, t, split=True)
    first = _run(x, t, split=True)
    assert torch.equal(again[0], first[0]) and torch.equal(again[2], first[2])


@gpu
@needs_cuda
def test_split_kernel_under_cuda_graphs_and_many_rows():
    """Captured once, replayed: the ticket and row counters are zeroed inside the graph each replay. 16384
    rows of 16 segments: far more programs than the GPU runs at once, so rows wait on programs that start
    later."""
    torch.manual_seed(0)
    x = torch.randn(16384, 65536, device="cuda", dtype=torch.bfloat16) * 4
    t = torch.randint(0, 65536, (16384,), device="cuda")
    ref_loss, _, ref_grad = _run(x, t, split=False)
    loss = torch.empty(16384, device="cuda")
    grad = torch.empty_like(x)
    scale = torch.full((1,), 0.25, device="cuda")
    zscale = torch.full((1,), 0.5, device="cuda")
    z_rows = torch.empty(16384, device="cuda")

    def go():
        launch_ce(x, t, loss, grad, scale, -100, 0.0, 0.0, 0.0, None, z_rows, zscale, split=(4096, 4))
    go()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        go()
    for _ in range(3):
        loss.fill_(float("nan"))
        grad.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2e-2, atol=1e-6)


@gpu
@needs_cuda
def test_the_loss_takes_the_split_kernel_at_large_vocabularies(monkeypatch):
    """The public loss reaches the split kernel at 128k classes and not at 32k, and keeps the row kernel
    when the GPU has fewer SMs than a row has segments (a small MIG slice)."""
    seen = []
    real = ce_mod._split_plan

    def spy(logits, split):
        plan = real(logits, split)
        seen.append(plan)
        return plan
    monkeypatch.setattr(ce_mod, "_split_plan", spy)
    for v in (128256, 32000):
        x = torch.randn(64, v, device="cuda", requires_grad=True)
        ce_mod.cross_entropy(x, torch.randint(0, v, (64,), device="cuda")).backward()
    assert seen[0] is not None and seen[1] is None
    monkeypatch.setattr(ce_mod, "_sm_count", lambda index: 4)
    x = torch.randn(8, 128256, device="cuda")
    assert real(x, None) is None


def test_split_kernel_never_runs_in_the_interpreter_or_on_the_cpu():
    """Its programs wait for each other: run one after another (the interpreter), they would wait forever."""
    x = torch.randn(4, 65536)
    assert ce_mod._split_plan(x, None) is None
    assert ce_mod._split_plan(x, True) is None
    assert ce_mod._split_plan(x, (1024, 4)) is None
    t = torch.randint(0, 65536, (4,))
    loss = torch.empty(4)
    grad = torch.empty_like(x)
    launch_ce(x, t, loss, grad, torch.ones(1), -100, 0.0, 0.0, split=True)
    ref = torch.nn.functional.cross_entropy(x, t, reduction="none")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, torch.softmax(x, -1) - torch.nn.functional.one_hot(t, 65536).float())

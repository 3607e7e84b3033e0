"""Cross-entropy and fused linear cross-entropy against plain PyTorch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ckpt.kernels import (
    CrossEntropyLoss,
    FusedLinearCrossEntropyLoss,
    cross_entropy,
    fused_linear_cross_entropy,
)
from kernel_helpers import DEVICE, DTYPES, gpu_param, run_and_compare


def ce_ref(
    logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss=0.0, softcap=None
):
    """torch's cross-entropy computed in float64, returned in fp32 (its gradient too). In fp32 the
    reference is the less exact side: over 33000 classes autograd's fp32 ``log_softmax`` backward is off
    by up to 1.2x the fp32 tolerance (the kernel by 0.03x), and where the softcap's ``tanh`` saturates
    fp32's ``1 - tanh^2`` loses every digit."""
    x = logits.reshape(-1, logits.shape[-1]).double()
    if softcap is not None:  # Gemma 2's final-logit softcapping, as its modeling code writes it
        x = torch.tanh(x / softcap) * softcap
    t = target.reshape(-1)
    valid = t != ignore_index
    loss = F.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    loss = loss + z_loss * torch.logsumexp(x, -1).pow(2) * valid
    if reduction == "none":
        return loss.reshape(target.shape).float()
    return (loss.sum() / valid.sum() if reduction == "mean" else loss.sum()).float()


def flce_ref(hidden, weight, target, bias=None, **opts):
    return ce_ref(
        F.linear(hidden.double(), weight.double(), None if bias is None else bias.double()), target, **opts
    )


OPTIONS = [
    pytest.param(dict(reduction="mean"), id="mean"),
    pytest.param(dict(reduction="sum", label_smoothing=0.1), id="sum-smooth"),
    pytest.param(dict(reduction="none", z_loss=1e-3), id="none-z"),
    pytest.param(dict(reduction="mean", label_smoothing=0.05, z_loss=1e-4, ignore_index=3), id="mean-all"),
]


def targets(n, v, ignore_index=-100):
    t = torch.randint(0, v, (n,))
    t[::4] = ignore_index  # some ignored rows (every 4th)
    return t


CE_SHAPES = [
    pytest.param((1, 5), DEVICE, id="1x5"),
    pytest.param((9, 37), DEVICE, id="9x37"),
    pytest.param((17, 1000), DEVICE, id="17x1000"),
    # five blocks of 8192 columns, the last of 232: pass 2 walks them last first
    pytest.param((3, 33000), DEVICE, id="3x33000"),
    # a vocabulary wide enough for blocks of 16384 columns: five, the last of 64
    pytest.param((2, 65600), DEVICE, id="2x65600"),
    gpu_param((8192, 128256), "cuda", id="8192x128256"),
    gpu_param((1000, 32001), "cuda", id="1000x32001"),
]


@pytest.mark.parametrize("shape,device", CE_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("opts", OPTIONS)
def test_cross_entropy(shape, device, dtype, atol, rtol, opts):
    n, v = shape
    x = torch.randn(n, v, device=device) * 4
    t = targets(n, v, opts.get("ignore_index", -100))
    run_and_compare(
        lambda x, t: cross_entropy(x, t, **opts),
        lambda x, t: ce_ref(x, t, **opts),
        [x, t],
        ["logits", "target"],
        dtype,
        atol,
        rtol,
        device,
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("grad", [1.0, 0.37])
def test_cross_entropy_in_place_on_intermediate(dtype, atol, rtol, grad):
    """Logits from a matmul (a private intermediate) take the gradient in place; grad 1 skips the rescale."""
    h, w = torch.randn(10, 16), torch.randn(16, 29)
    t = targets(10, 29)
    run_and_compare(
        lambda h, w, t: cross_entropy((h @ w).reshape(2, 5, 29), t.reshape(2, 5)),
        lambda h, w, t: ce_ref(h @ w, t),
        [h, w, t],
        ["h", "w", "t"],
        dtype,
        atol,
        rtol,
        grad_outputs=[grad],
    )


def test_cross_entropy_in_place_clobbers_and_flags():
    x = torch.randn(4, 11, device=DEVICE, requires_grad=True)
    logits = x * 2.0
    before = logits.detach().clone()
    t = torch.tensor([1, 2, -100, 10], device=DEVICE)
    loss = cross_entropy(logits, t)
    assert not torch.equal(logits.detach(), before)  # now holds the gradient
    loss.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = x * 2.0
        z = y.exp()  # exp saves its output ... and this one saves its input:
        w = y * y
        cross_entropy(y, t).backward(retain_graph=True)
        (z.sum() + w.sum()).backward()
    logits2 = x * 2.0
    cross_entropy(logits2, t, inplace=False)
    assert torch.equal(logits2.detach(), before)


def test_cross_entropy_all_ignored_is_zero():
    x = torch.randn(3, 7, device=DEVICE, requires_grad=True)
    t = torch.full((3,), -100, device=DEVICE)
    loss = cross_entropy(x, t)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0


FLCE_SHAPES = [  # (tokens, hidden, vocab)
    pytest.param((1, 8, 5), DEVICE, id="1x8x5"),
    pytest.param((19, 24, 53), DEVICE, id="19x24x53"),
    pytest.param((70, 32, 301), DEVICE, id="70x32x301"),
    gpu_param((8192, 4096, 128256), "cuda", id="llama3-8b"),
    gpu_param((3000, 2048, 32003), "cuda", id="odd-3000x2048x32003"),
]

BF16_LOOSE = [DTYPES[0], pytest.param(torch.bfloat16, 5e-2, 5e-2, id="bf16")]


@pytest.mark.parametrize("shape,device", FLCE_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", BF16_LOOSE)
@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fused_linear_cross_entropy(shape, device, dtype, atol, rtol, opts, with_bias):
    n, h, v = shape
    if device == "cuda" and n * v > 10**8 and (with_bias or opts.get("reduction") != "mean"):
        pytest.skip("real-size case run once (mean, no bias) to bound the GPU run's time")
    x = torch.randn(n, h, device=device)
    w = torch.randn(v, h, device=device) / h**0.5 * 2
    b = torch.randn(v, device=device) if with_bias else None
    t = targets(n, v, opts.get("ignore_index", -100))
    chunk = None if n > 64 else 7  # force several chunks at small sizes
    run_and_compare(
        lambda x, w, t, b: fused_linear_cross_entropy(x, w, t, b, chunk_size=chunk, **opts),
        lambda x, w, t, b: flce_ref(x, w, t, b, **opts),
        [x, w, t, b],
        ["hidden", "weight", "target", "bias"],
        dtype,
        atol,
        rtol,
        device,
    )


@pytest.mark.parametrize("dtype,atol,rtol", BF16_LOOSE)
@pytest.mark.parametrize("grad", [1.0, 2.5])
def test_fused_linear_cross_entropy_reuses_hidden(dtype, atol, rtol, grad):
    """hidden from a matmul (private intermediate, 3-D) takes d_hidden in place."""
    x, p, w = torch.randn(2, 9, 12), torch.randn(12, 12), torch.randn(41, 12)
    t = targets(18, 41).reshape(2, 9)
    run_and_compare(
        lambda x, p, w, t: fused_linear_cross_entropy(x @ p, w, t, chunk_size=4),
        lambda x, p, w, t: flce_ref(x @ p, w, t),
        [x, p, w, t],
        ["x", "p", "w", "t"],
        dtype,
        atol,
        rtol,
        grad_outputs=[grad],
    )


def test_loss_modules():
    x = torch.randn(6, 10, device=DEVICE)
    w = torch.randn(13, 10, device=DEVICE)
    t = torch.randint(0, 13, (6,), device=DEVICE)
    ce = CrossEntropyLoss(label_smoothing=0.1)
    fl = FusedLinearCrossEntropyLoss(label_smoothing=0.1, chunk_size=4)
    want = ce_ref(x @ w.t(), t, label_smoothing=0.1)
    torch.testing.assert_close(ce((x @ w.t()).clone(), t), want)
    torch.testing.assert_close(fl(x, w, t), want)
    assert "label_smoothing=0.1" in repr(fl)


def test_frozen_weight_and_no_grad_paths():
    """A frozen LM head (e.g. LoRA) gets no weight gradient; no-grad calls compute only the loss."""
    x = torch.randn(12, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(23, 16, device=DEVICE)
    t = targets(12, 23)
    loss = fused_linear_cross_entropy(x, w, t.to(DEVICE), chunk_size=5)
    loss.backward()
    xr = x.detach().clone().requires_grad_()
    flce_ref(xr, w, t.to(DEVICE)).backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        logits = x @ w.t()
        before = logits.clone()
        torch.testing.assert_close(cross_entropy(logits, t.to(DEVICE)), ce_ref(before, t.to(DEVICE)))
        assert torch.equal(logits, before)  # nothing written without autograd
        torch.testing.assert_close(
            fused_linear_cross_entropy(x, w, t.to(DEVICE)), ce_ref(before, t.to(DEVICE))
        )


LOSSES = {
    "cross_entropy": lambda x, w, t, **kw: cross_entropy(x @ w.t(), t, **kw),
    "CrossEntropyLoss": lambda x, w, t, **kw: CrossEntropyLoss(**kw)(x @ w.t(), t),
    "fused_linear_cross_entropy": lambda x, w, t, **kw: fused_linear_cross_entropy(
        x, w, t, chunk_size=2, **kw
    ),
    "FusedLinearCrossEntropyLoss": lambda x, w, t, **kw: FusedLinearCrossEntropyLoss(chunk_size=2, **kw)(
        x, w, t
    ),
}


@pytest.mark.skipif(
    DEVICE != "cpu",
    reason="the host check is the CPU path's (the interpreter); on a GPU "
    "machine the kernels take CUDA tensors and check with a device assert (the test below)",
)
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("bad", [7, 100, -1, -100], ids=["V", "above-V", "minus-1", "ignore-index-of-others"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_target_outside_the_classes_is_an_index_error(loss, bad, reduction):
    """A target outside [0, V) that is not ignore_index raises IndexError naming the value, its
    position and the valid range, as torch's cross_entropy does on the CPU (it used to give the
    row's log-sum-exp as its loss). -100 is only ignored when it is the ignore_index. The host check
    is the CPU path's (on the GPU a device-side assert stops the process: the test below)."""
    v = 7
    x = torch.randn(5, 6, device="cpu", requires_grad=True)
    w = torch.randn(v, 6, device="cpu")
    t = torch.tensor([0, v - 1, 3, 3, 2], device="cpu")
    t[3] = bad
    kw = dict(reduction=reduction, ignore_index=-100 if bad != -100 else 2)
    named = rf"target\[3\] is {bad}, .*\[0, {v}\)"  # the position, the value, the valid range
    with pytest.raises(IndexError, match=named):
        LOSSES[loss](x, w, t, **kw)
    with torch.no_grad(), pytest.raises(IndexError, match=named):
        LOSSES[loss](x, w, t, **kw)
    if bad != -100:  # the same rows with the bad target ignored are fine
        t[3] = -100
        LOSSES[loss](x, w, t, **kw)


@pytest.mark.parametrize("ignore_index", [-100, 3], ids=["ignore-minus-100", "ignore-a-class"])
def test_ignore_index_inside_the_classes_is_still_ignored(ignore_index):
    x = torch.randn(4, 7, device=DEVICE)
    t = torch.tensor([1, ignore_index, 6, 0], device=DEVICE)
    torch.testing.assert_close(
        cross_entropy(x, t, ignore_index=ignore_index), F.cross_entropy(x, t, ignore_index=ignore_index)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["cross_entropy", "fused_linear_cross_entropy"])
def test_target_outside_the_classes_on_the_gpu_stops_at_a_device_assert(loss):
    """On the GPU a host check would synchronise every call: a device-side assert (Triton's,
    compiled in debug mode into a small check kernel) stops the process instead, as torch's own
    CUDA cross_entropy does. Run in a subprocess: the CUDA context is unusable afterwards."""
    import subprocess
    import sys

    code = (
        "import torch, ckpt.kernels as K\n"
        "x = torch.randn(5, 6, device='cuda'); w = torch.randn(7, 6, device='cuda')\n"
        "t = torch.tensor([0, 6, 3, 7, -100], device='cuda')\n"
        f"loss = K.{loss}(x @ w.t(), t) if '{loss}' == 'cross_entropy' else K.{loss}(x, w, t)\n"
        "torch.cuda.synchronize()\n"
        "print('NO ERROR', loss.item())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "NO ERROR" not in out.stdout, out.stdout + out.stderr
    assert "target outside [0, V)" in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("v", [32000, 128256, 262144])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}], ids=["plain", "smoothing"])
def test_cross_entropy_row_kernel_fits_its_register_cap(v, opts):
    """The row kernel's speed rests on the SM holding two programs of 16 warps (four of 8): its launch
    caps it at 64 registers per thread. Code that needs more spills to local memory (correct, slower):
    the compiled kernel at each capped configuration must fit without spilling."""
    import importlib

    ce_mod = importlib.import_module("ckpt.kernels.cross_entropy")
    _, _, cap = ce_mod._ce_config(v)
    x = torch.randn(4, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (4,), device="cuda")
    loss_rows = torch.empty(4, device="cuda")
    kernel = ce_mod.launch_ce(
        x,
        t,
        loss_rows,
        torch.empty_like(x),
        torch.ones(1, device="cuda"),
        -100,
        opts.get("label_smoothing", 0.0),
        0.0,
    )
    torch.cuda.synchronize()
    assert kernel.n_spills == 0 and kernel.n_regs <= cap, (kernel.n_regs, kernel.n_spills)


SOFTCAP_OPTIONS = [
    pytest.param(dict(softcap=30.0), id="cap30-mean"),  # Gemma 2's value: most logits far below it
    pytest.param(dict(softcap=2.0, reduction="sum", label_smoothing=0.1), id="cap2-sum-smooth"),  # saturating
    pytest.param(dict(softcap=0.7, reduction="none", z_loss=1e-3), id="cap0.7-none-z"),
    pytest.param(dict(softcap=5.0, ignore_index=3, label_smoothing=0.05, z_loss=1e-4), id="cap5-mean-all"),
]


@pytest.mark.parametrize("shape,device", CE_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("opts", SOFTCAP_OPTIONS)
def test_cross_entropy_softcap(shape, device, dtype, atol, rtol, opts):
    """Logits capped to c * tanh(x / c) before the loss, the gradient through the tanh; logits
    scaled so that some rows saturate the cap (|x| >> c) and some do not."""
    n, v = shape
    x = torch.randn(n, v, device=device) * 8
    t = targets(n, v, opts.get("ignore_index", -100))
    run_and_compare(
        lambda x, t: cross_entropy(x, t, **opts),
        lambda x, t: ce_ref(x, t, **opts),
        [x, t],
        ["logits", "target"],
        dtype,
        atol,
        rtol,
        device,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "v,dtype", [(32003, torch.float32), (128256, torch.bfloat16)], ids=["32003-fp32", "128256-bf16"]
)
def test_cross_entropy_in_place_reads_the_target_before_any_gradient_goes_over_it(v, dtype):
    """With the gradient written over the logits, pass 2 starts at the row's last block: a warp there must
    not write over the target's logit before every warp has read it for the loss (that race made a loss
    1e-4 too large in 2 of 10 runs of the 3000 x 32003 fp32 test). Every target in the last block, every
    row's loss against torch's, 20 times."""
    n = 4096
    for _ in range(20):
        x = torch.randn(n, v, device="cuda", dtype=dtype) * 2
        t = torch.randint(v - 4000, v, (n,), device="cuda")
        want = F.cross_entropy(x.float(), t, reduction="none")
        got = cross_entropy(x.requires_grad_(True), t, reduction="none", inplace=True)
        bad = ((got - want).abs() > 1e-3).nonzero().flatten()
        assert bad.numel() == 0, (
            f"rows {bad[:8].tolist()} (of {bad.numel()}): {got[bad[:4]].tolist()} != {want[bad[:4]].tolist()}"
        )


ROW_LAYOUTS = [
    # (buffer width, logits columns [start, stop), gradient in place, rows walked as aligned vectors + edges)
    pytest.param(53, (0, 53), True, True, id="odd-width-in-place"),
    pytest.param(53, (0, 53), False, True, id="odd-width-separate-grad"),
    pytest.param(62, (0, 53), False, False, id="slice-of-wider-rows-grad-off-by-other-amount"),
    pytest.param(61, (8, 61), True, True, id="slice-at-aligned-offset-in-place"),
    pytest.param(54, (1, 54), True, False, id="storage-offset-one-element"),
    pytest.param(64, (0, 64), True, False, id="aligned-rows"),
    pytest.param(64, (0, 56), True, True, id="aligned-stride-rows-of-56"),
    pytest.param(5, (0, 5), False, True, id="rows-shorter-than-a-vector"),
]


@pytest.mark.parametrize("width,cols,inplace,shifted", ROW_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_rows_off_the_16_byte_grid(width, cols, inplace, shifted, dtype):
    """Rows off the 16-byte grid (an odd vocabulary) are walked as whole 16-byte vectors plus their edge
    columns one by one: loss and gradient as torch's for every layout, nothing outside the rows written,
    and that walk used exactly where its conditions hold (else the rows as they are)."""
    import importlib

    ce_mod = importlib.import_module("ckpt.kernels.cross_entropy")
    n = 13
    buf = (torch.randn(n, width, device=DEVICE) * 3).to(dtype)
    x = buf[:, cols[0] : cols[1]]
    v = x.shape[1]
    t = torch.randint(0, v, (n,), device=DEVICE)
    t[4] = -100
    t[5], t[6] = 0, v - 1  # the first column (masked-in after the shift) and the last
    want = torch.nn.functional.cross_entropy(x.float(), t, reduction="none")
    ref = x.float().requires_grad_(True)
    torch.nn.functional.cross_entropy(ref, t, reduction="sum").backward()
    before, buf_before = x.clone(), buf.clone()
    grad = x if inplace else torch.empty(n, v, device=DEVICE, dtype=dtype)  # rows of stride v
    assert ce_mod._row_layout(x, grad)[0] == shifted
    loss = torch.empty(n, device=DEVICE)
    ce_mod.launch_ce(x, t, loss, grad, torch.ones(1, device=DEVICE), -100, 0.0, 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, want, atol=tol, rtol=tol)
    torch.testing.assert_close(grad.float(), ref.grad, atol=tol, rtol=tol)
    if not inplace:
        assert torch.equal(x, before)
    rest = torch.ones(width, dtype=torch.bool, device=DEVICE)
    rest[cols[0] : cols[1]] = False  # the buffer's columns outside the logits: never written
    assert torch.equal(buf[:, rest], buf_before[:, rest])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "width,v", [(64, 53), (61, 53), (56, 56)], ids=["padded-64", "padded-61", "unpadded"]
)
def test_cross_entropy_of_logits_sliced_from_a_padded_vocabulary(dtype, width, v):
    """``logits[..., :V]`` of a padded vocabulary: the gradient comes out right, in a buffer whose rows lie
    on the 16-byte grid as the logits' do (so both are walked as whole vectors), no wider than needed."""
    import importlib

    ce_mod = importlib.import_module("ckpt.kernels.cross_entropy")
    padded = (torch.randn(2, 5, width, device=DEVICE) * 3).to(dtype)
    t = torch.randint(0, v, (2, 5), device=DEVICE)
    t[0, 1] = -100
    ours = padded.clone().requires_grad_(True)
    ref = padded.float().requires_grad_(True)
    loss = cross_entropy(ours[..., :v], t, reduction="sum")
    want = F.cross_entropy(ref[..., :v].reshape(-1, v), t.reshape(-1), reduction="sum")
    loss.backward()
    want.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(ours.grad.float(), ref.grad, atol=tol, rtol=tol)
    x = padded[..., :v].reshape(-1, v)
    g = ce_mod._grad_rows(x)
    align = 16 // x.element_size()
    assert g.shape == x.shape and v <= g.stride(0) < v + align
    assert g.stride(0) % align == x.stride(0) % align
    assert ce_mod._row_layout(x, g)[0] == (x.stride(0) % 16 != 0 or v % 16 != 0)


@pytest.mark.parametrize("seed", range(8))
def test_cross_entropy_row_walks_against_float64_on_random_layouts(seed):
    """Random small layouts (rows 1-5, 1-70 classes, slices of wider buffers at any element offset, fp32 /
    bf16 / fp16, the gradient in place or not) with random options (label smoothing, softcap, class weights,
    z-loss, an ignored row): every row's loss and every gradient element against float64 math, and nothing
    outside the rows written. Whatever walk the launcher picks for a layout must agree with it (the seeds
    cover both walks, in place and not)."""
    import importlib

    ce_mod = importlib.import_module("ckpt.kernels.cross_entropy")
    gen = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for _ in range(12):
        dtype = pick(torch.float32, torch.bfloat16, torch.float16)
        n = int(torch.randint(1, 6, (1,), generator=gen))
        v = int(torch.randint(1, 71, (1,), generator=gen))
        start = int(torch.randint(0, 9, (1,), generator=gen))
        width = start + v + int(torch.randint(0, 9, (1,), generator=gen))
        buf = (torch.randn(n, width, generator=gen) * 3).to(dtype).to(DEVICE)
        x = buf[:, start : start + v]
        t = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
        if n > 1:
            t[0] = -100
        eps = pick(0.0, 0.1)
        cap = pick(0.0, 2.0)
        z = pick(0.0, 1e-3)
        w = pick(None, torch.rand(v, generator=gen).to(DEVICE) + 0.5)
        weights = ce_mod.class_weights(w)
        inplace = pick(True, False)
        xd = x.double()
        r = torch.tanh(xd / cap) * cap if cap else xd
        lse = torch.logsumexp(r, -1)
        p_ = torch.softmax(r, -1)
        wd = w.double() if w is not None else torch.ones(v, dtype=torch.float64, device=DEVICE)
        valid = t != -100
        tt = torch.where(valid, t, 0)
        w_t = wd[tt]
        loss_want = (1 - eps) * w_t * (lse - r.gather(1, tt[:, None])[:, 0]) + eps * (
            wd.sum() * lse - r @ wd
        ) / v
        loss_want = torch.where(valid, loss_want + z * lse * lse, 0.0)
        onehot = torch.nn.functional.one_hot(tt, v).double()
        g = (
            p_ * ((1 - eps) * w_t + eps * wd.sum() / v + 2 * z * lse)[:, None]
            - eps * wd / v
            - (1 - eps) * w_t[:, None] * onehot
        )
        if cap:
            g = g * (1 - torch.tanh(xd / cap) ** 2)
        g = torch.where(valid[:, None], g, 0.0)
        before = buf.clone()
        grad = x if inplace else ce_mod._grad_rows(x)
        loss = torch.empty(n, device=DEVICE)
        z_rows = torch.empty(n, device=DEVICE)
        ce_mod.launch_ce(x, t, loss, grad, torch.ones(1, device=DEVICE), -100, eps, z, cap, weights, z_rows)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        case = (dtype, n, v, start, width, eps, cap, z, w is not None, inplace, ce_mod._row_layout(x, grad))
        torch.testing.assert_close(
            loss.double(), loss_want, atol=tol * 10, rtol=tol, msg=lambda m: f"{case}: {m}"
        )
        torch.testing.assert_close(grad.double(), g, atol=tol, rtol=tol, msg=lambda m: f"{case}: {m}")
        outside = torch.ones(width, dtype=torch.bool, device=DEVICE)
        outside[start : start + v] = False
        assert torch.equal(buf[:, outside], before[:, outside]), case


def test_cross_entropy_softcap_gradient_keeps_its_precision_where_tanh_saturates():
    """Every gradient element within 1e-4 (relative to itself) of float64, for capped logits from -9c to 9c:
    where ``tanh`` saturates its derivative is ``1 - tanh^2``, which fp32 evaluated that way cancels to
    nothing (2x off near 8c)."""
    c = 3.0
    x = torch.linspace(-9 * c, 9 * c, 4001, device=DEVICE).reshape(1, -1).repeat(2, 1)
    t = torch.tensor([2000, 3999], device=DEVICE)
    ours = x.clone().requires_grad_(True)
    cross_entropy(ours, t, softcap=c, reduction="sum").backward()
    ref = x.double().requires_grad_(True)
    F.cross_entropy(torch.tanh(ref / c) * c, t, reduction="sum").backward()
    rel = ((ours.grad.double() - ref.grad) / ref.grad.abs()).abs()
    assert rel.max().item() < 1e-4, (rel.max().item(), x.reshape(-1)[rel.argmax()].item())


@pytest.mark.parametrize("shape,device", FLCE_SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", BF16_LOOSE)
@pytest.mark.parametrize("opts", SOFTCAP_OPTIONS)
def test_fused_linear_cross_entropy_softcap(shape, device, dtype, atol, rtol, opts):
    n, h, v = shape
    if device == "cuda" and n * v > 10**8 and opts.get("reduction", "mean") != "mean":
        pytest.skip("real-size case run for the mean reductions only, to bound the GPU run's time")
    x = torch.randn(n, h, device=device)
    w = torch.randn(v, h, device=device) / h**0.5 * 6
    b = torch.randn(v, device=device)
    t = targets(n, v, opts.get("ignore_index", -100))
    chunk = None if n > 64 else 7
    run_and_compare(
        lambda x, w, t, b: fused_linear_cross_entropy(x, w, t, b, chunk_size=chunk, **opts),
        lambda x, w, t, b: flce_ref(x, w, t, b, **opts),
        [x, w, t, b],
        ["hidden", "weight", "target", "bias"],
        dtype,
        atol,
        rtol,
        device,
    )


def test_softcap_changes_the_loss_and_rejects_non_positive_caps():
    """The cap is applied (a small cap moves the loss), and a cap <= 0 or NaN is a ValueError
    naming the argument rather than a silent division by zero."""
    x = torch.randn(4, 9, device=DEVICE) * 10
    w = torch.randn(9, 6, device=DEVICE)
    t = torch.tensor([1, 2, 3, 4], device=DEVICE)
    assert not torch.allclose(cross_entropy(x, t, softcap=1.0), cross_entropy(x, t))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            cross_entropy(x, t, softcap=bad)
        with pytest.raises(ValueError, match="softcap"):
            fused_linear_cross_entropy(x[:, :6], w, t, softcap=bad)
    assert "softcap=3.0" in repr(CrossEntropyLoss(softcap=3.0))
    torch.testing.assert_close(
        FusedLinearCrossEntropyLoss(softcap=3.0)(x[:, :6], w, t), ce_ref(x[:, :6] @ w.t(), t, softcap=3.0)
    )


@pytest.mark.parametrize(
    "n,h,v,reuse,want",
    [
        (8192, 4096, 128256, True, 512),  # Llama-3-8B head, hidden reused for d_hidden: the memory rule's 512
        (8192, 4096, 128256, False, 512),  # a leaf hidden: the memory rule alone would say 256
        (16384, 1024, 151936, True, 512),  # Qwen3-MoE-sized head (H small beside V): 128 by the memory rule
        (65536, 8192, 32000, True, 33536),  # a small vocabulary: the memory rule, far above the floor
        (300, 4096, 128256, True, 300),  # fewer tokens than the floor: one chunk
    ],
)
def test_default_chunk_keeps_the_weight_gradient_update_off_the_memory_bound(n, h, v, reuse, want):
    from ckpt.kernels.fused_linear_cross_entropy import MIN_CHUNK, default_chunk_size

    c = default_chunk_size(n, h, v, reuse)
    assert c == want and (c >= MIN_CHUNK or c == n)

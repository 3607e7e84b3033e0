"""ckpt.kernels.moe.fused_experts against the eager experts loop, and its use by patch()."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import ckpt.kernels.moe as moe
from kernel_helpers import DEVICE, DTYPES, assert_close, run_and_compare

# the module (``ckpt.kernels.patch`` as an attribute is the function of that name)
kpatch = importlib.import_module("ckpt.kernels.patch")

T, H, I, E = 37, 40, 24, 6   # H and I not multiples of the interpreter's tiles: masked edges


def eager_experts(x, top_k_weights, gate_up, down, top_k_index):
    """transformers' ``<Arch>Experts`` eager loop (Mixtral, Qwen3-MoE), in the inputs' dtype."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, pos = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e])
        out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
    return out


def routing(k: int, kind: str, seed: int = 0):
    """``(top_k_weights, top_k_index)`` for ``T`` tokens: ``uneven`` sends no token to experts 1 and 4 and
    most to expert 0; ``uniform`` draws the logits at random."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if kind == "uneven":
        logits[:, [1, 4]] = -1e4
        logits[:, 0] += 2.0
    w, idx = torch.softmax(logits, -1).topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), idx


def weights(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
            torch.randn(E, H, I, generator=g) / I ** 0.5)


def fused(x, top_k_weights, gate_up, down, top_k_index, recompute=False):
    return moe.fused_experts(x, top_k_index, top_k_weights, gate_up, down, recompute=recompute)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", ["uneven", "uniform"])
def test_fused_experts_matches_eager(dtype, atol, rtol, k, kind):
    """Output and the gradients of the input, both expert weights and the routing weights equal the
    eager loop's (fp32 reference on the same rounded inputs), with experts that get no token,
    uneven counts spanning several row tiles, and top_k 1 to 3."""
    w, idx = routing(k, kind)
    if kind == "uneven":
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        assert counts[1] == counts[4] == 0
        assert DEVICE != "cpu" or counts.max() > moe.experts_configs("cpu")["block_m"]   # several row tiles
    x, gu, dn = weights()
    run_and_compare(fused, eager_experts, [x, w, gu, dn, idx], ["x", "top_k_weights", "gate_up", "down", "idx"],
                    dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_fused_experts_recompute(dtype, atol, rtol):
    """``recompute=True`` (nothing of size (T K, 2I) kept for backward) computes the same gradients."""
    w, idx = routing(2, "uneven")
    x, gu, dn = weights()
    run_and_compare(lambda *a: fused(*a, recompute=True), eager_experts, [x, w, gu, dn, idx],
                    ["x", "top_k_weights", "gate_up", "down", "idx"], dtype, atol, rtol)


def test_fused_experts_partial_gradients():
    """Only some inputs need gradients (frozen experts, a detached router): those get theirs, the others none."""
    w, idx = routing(2, "uneven")
    x, gu, dn = (t.to(DEVICE) for t in weights())
    w, idx = w.to(DEVICE), idx.to(DEVICE)
    xr = x.clone().requires_grad_()
    out = moe.fused_experts(xr, idx, w, gu, dn)
    out.backward(torch.ones_like(out))
    ref = x.clone().requires_grad_()
    eager_experts(ref, w, gu, dn, idx).backward(torch.ones_like(out))
    assert_close("grad of x", xr.grad, ref.grad, 1e-5, 1e-5)
    with torch.no_grad():
        assert_close("no_grad output", moe.fused_experts(x, idx, w, gu, dn), eager_experts(x, w, gu, dn, idx),
                     1e-5, 1e-5)


def test_fused_experts_under_autocast():
    """fp32 weights under bf16 autocast: the GEMMs run in bf16, gradients come back in fp32."""
    w, idx = routing(2, "uniform")
    x, gu, dn = (t.to(DEVICE).requires_grad_() for t in weights())
    w, idx = w.to(DEVICE), idx.to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = moe.fused_experts(x, idx, w, gu, dn)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    xr, gur, dnr = (t.detach().to(torch.bfloat16).float().requires_grad_() for t in (x, gu, dn))
    ref = eager_experts(xr, w, gur, dnr, idx)
    ref.sum().backward()
    assert_close("output", out, ref, 2e-2, 2e-2)
    for name, a, b in (("x", x, xr), ("gate_up", gu, gur), ("down", dn, dnr)):
        assert a.grad.dtype == torch.float32
        assert_close(f"grad of {name}", a.grad, b.grad, 2e-2, 2e-2)


def test_fused_experts_inside_torch_compile():
    """Called from a compiled function, fused_experts runs eagerly between graphs, with the same values
    and gradients."""
    w, idx = routing(2, "uneven")
    x, gu, dn = (t.to(DEVICE) for t in weights())
    w, idx = w.to(DEVICE), idx.to(DEVICE)

    def block(x, w, gu, dn):
        return (moe.fused_experts(x * 2.0, idx, w, gu, dn) + 1.0).square().sum()

    compiled = torch.compile(block, backend="aot_eager")
    ins = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    refs = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    out, ref = compiled(*ins), block(*refs)
    out.backward()
    ref.backward()
    assert_close("output", out, ref, 1e-6, 1e-6)
    for name, a, b in zip(("x", "top_k_weights", "gate_up", "down"), ins, refs):
        assert_close(f"grad of {name}", a.grad, b.grad, 1e-6, 1e-6)


@pytest.mark.parametrize("bad", ["gate_up", "down", "index", "dtype"])
def test_fused_experts_rejects_bad_arguments(bad):
    w, idx = routing(2, "uniform")
    x, gu, dn = weights()
    if bad == "gate_up":
        gu = gu[:, :-1]
    elif bad == "down":
        dn = dn[:, :, :-1]
    elif bad == "index":
        idx = idx[:-1]
    else:
        dn = dn.double()
    with pytest.raises(ValueError):
        moe.fused_experts(x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE))


# -- patch(): the fused path serves the experts, the packed-SwiGLU path is the fallback --

def tiny_moe(model_type: str):
    transformers = pytest.importorskip("transformers")
    if model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=40, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
                                          num_experts=8, num_experts_per_tok=3, output_router_logits=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                         num_local_experts=4, num_experts_per_tok=1, output_router_logits=True)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    return cls(cfg).to(DEVICE).train()


@pytest.fixture
def count_fused(monkeypatch):
    calls = []
    real = kpatch.fused_experts

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kpatch, "fused_experts", counting)
    yield calls
    for t in ("mixtral", "qwen3_moe"):
        kpatch.unpatch_rope(t)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_patch_experts_use_the_fused_path(model_type, expert_parallel, count_fused):
    """Each sparse layer's experts go through fused_experts (top_k 3 and 1 here), with the loss and every
    gradient of the unpatched model; experts marked expert-parallel (sentinel ids possible) fall back to
    transformers' implementation with the packed SwiGLU, with the same results."""
    ref = tiny_moe(model_type)
    ours = copy.deepcopy(ref)
    changed = kpatch.patch(ours)
    assert len(changed["experts"]) == 2
    if expert_parallel:   # the flag transformers' expert parallelism sets on the experts (5.2x)
        for m in ours.modules():
            if type(m).__name__.endswith("Experts"):
                m._is_expert_parallel = True
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 13), generator=g).to(DEVICE)
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out = ours(input_ids=ids, labels=ids)
    out.loss.backward()
    assert len(count_fused) == (0 if expert_parallel else 2)
    assert_close("loss", out.loss, out_ref.loss, 1e-5, 1e-4)
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"grad of {name}", p.grad, named[name].grad, 1e-5, 1e-4)

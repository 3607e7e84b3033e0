"""ckpt.kernels.moe.fused_experts against the eager experts loop, and its use by patch()."""

from __future__ import annotations

import contextlib
import copy
import importlib
from pathlib import Path

import pytest
import torch

import ckpt.kernels.moe as moe
from helpers import assert_ok, run_ranks
from kernel_helpers import DEVICE, DTYPES, assert_close, run_and_compare

# the module (``ckpt.kernels.patch`` as an attribute is the function of that name)
kpatch = importlib.import_module("ckpt.kernels.patch")

T, H, I, E = 37, 40, 24, 6  # H and I not multiples of the interpreter's tiles: masked edges


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
    return (
        torch.randn(T, H, generator=g),
        torch.randn(E, 2 * I, H, generator=g) / H**0.5,
        torch.randn(E, H, I, generator=g) / I**0.5,
    )


def fused(x, top_k_weights, gate_up, down, top_k_index, recompute=False, expert_parallel=False):
    return moe.fused_experts(
        x, top_k_index, top_k_weights, gate_up, down, recompute=recompute, expert_parallel=expert_parallel
    )


def masked_experts(x, top_k_weights, gate_up, down, top_k_index):
    """Every slot through its expert's weights (an index outside [0, E) through expert 0's), each slot's
    output times its routing weight and a 0/1 mask of "index in [0, E)": the slots of experts on other
    ranks add nothing and their weights get a zero gradient."""
    e = gate_up.shape[0]
    valid = (top_k_index >= 0) & (top_k_index < e)
    idx = torch.where(valid, top_k_index, 0)
    gate, up = torch.einsum("th,tknh->tkn", x, gate_up[idx]).chunk(2, dim=-1)
    y = torch.einsum("tki,tkhi->tkh", torch.nn.functional.silu(gate) * up, down[idx])
    return (y * (top_k_weights * valid)[..., None]).sum(1)


def off_rank(top_k_index, share: float, seed: int = 3):
    """``top_k_index`` with about ``share`` of its slots replaced by indices outside [0, E): ``E`` (what
    transformers' expert parallelism writes), -1, and further out on both sides."""
    g = torch.Generator().manual_seed(seed)
    sentinels = torch.tensor([E, -1, E + 5, -7])[torch.randint(0, 4, top_k_index.shape, generator=g)]
    return torch.where(torch.rand(top_k_index.shape, generator=g) < share, sentinels, top_k_index)


@contextlib.contextmanager
def poisoned_memory():
    """``torch.empty`` returns NaN (integers: their maximum) instead of whatever memory held: a slot no
    kernel writes then shows up in the result instead of passing by luck. (torch's deterministic mode,
    warn-only: ops without a deterministic algorithm, cuBLAS among them, warn instead of failing; a few
    pick other algorithms, so transformers' code, which checks for the mode, stays outside.)"""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@pytest.fixture
def poisoned_empty():
    with poisoned_memory():
        yield


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
        assert DEVICE != "cpu" or counts.max() > moe.experts_configs("cpu")["block_m"]  # several row tiles
    x, gu, dn = weights()
    run_and_compare(
        fused,
        eager_experts,
        [x, w, gu, dn, idx],
        ["x", "top_k_weights", "gate_up", "down", "idx"],
        dtype,
        atol,
        rtol,
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_fused_experts_recompute(dtype, atol, rtol):
    """``recompute=True`` (nothing of size (T K, 2I) kept for backward) computes the same gradients."""
    w, idx = routing(2, "uneven")
    x, gu, dn = weights()
    run_and_compare(
        lambda *a: fused(*a, recompute=True),
        eager_experts,
        [x, w, gu, dn, idx],
        ["x", "top_k_weights", "gate_up", "down", "idx"],
        dtype,
        atol,
        rtol,
    )


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
        assert_close(
            "no_grad output",
            moe.fused_experts(x, idx, w, gu, dn),
            eager_experts(x, w, gu, dn, idx),
            1e-5,
            1e-5,
        )


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


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("case", ["mixed", "top1", "all-off-rank"])
def test_fused_experts_expert_parallel_slots_add_nothing(dtype, atol, rtol, case, poisoned_empty):
    """With ``expert_parallel=True`` a slot whose index is outside [0, E) (``E``, -1, further out) adds
    nothing to the output and to any gradient, and its routing weight's gradient is zero; checked against
    the masked reference with uninitialised memory poisoned, with experts that get no token (``mixed``:
    top_k 3, uneven routing), top_k 1 (no slot sum) and no slot on this rank at all."""
    k, share = {"mixed": (3, 0.4), "top1": (1, 0.5), "all-off-rank": (2, 1.0)}[case]
    w, idx = routing(k, "uneven")
    idx = off_rank(idx, share)
    x, gu, dn = weights()
    out, _ = run_and_compare(
        lambda *a: fused(*a, expert_parallel=True),
        masked_experts,
        [x, w, gu, dn, idx],
        ["x", "top_k_weights", "gate_up", "down", "idx"],
        dtype,
        atol,
        rtol,
    )
    if case == "all-off-rank":
        assert not out[0].any()


def test_fused_experts_expert_parallel_recompute_and_frozen_router(poisoned_empty):
    """The off-rank slots stay out of the recomputed pre-activation, and out of backward when only the
    experts train (no routing-weight gradient asked for)."""
    w, idx = routing(2, "uneven")
    idx = off_rank(idx, 0.5).to(DEVICE)
    x, gu, dn = (t.to(DEVICE).requires_grad_() for t in weights())
    w = w.to(DEVICE)
    moe.fused_experts(x, idx, w, gu, dn, recompute=True, expert_parallel=True).square().sum().backward()
    refs = [t.detach().clone().requires_grad_() for t in (x, gu, dn)]
    masked_experts(refs[0], w, refs[1], refs[2], idx).square().sum().backward()
    for name, a, b in zip(("x", "gate_up", "down"), (x, gu, dn), refs):
        assert_close(f"grad of {name}", a.grad, b.grad, 1e-5, 1e-5)


@pytest.mark.parametrize("mode", ["expert-parallel", "recompute-dynamic", "autocast"])
def test_fused_experts_compiles_fullgraph(mode, poisoned_empty):
    """Inside ``torch.compile(fullgraph=True)`` fused_experts is one operator node, and the compiled
    function's value and every gradient equal eager's bit for bit (the same kernels), with their dtypes:
    off-rank slots; ``recompute`` with dynamic shapes (the fake's tile table sized from symbolic shapes);
    fp32 weights under bf16 autocast (the cast traced before the operator)."""
    w, idx = routing(2, "uneven")
    if mode == "expert-parallel":
        idx = off_rank(idx, 0.3)
    x, gu, dn, w, idx = (t.to(DEVICE) for t in (*weights(), w, idx))
    opts = dict(expert_parallel=mode == "expert-parallel", recompute=mode == "recompute-dynamic")

    def block(x, w, gu, dn):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=mode == "autocast"):
            y = moe.fused_experts(x * 2.0, idx, w, gu, dn, **opts)
        return (y.float() + 1.0).square().sum(), y

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=recording, fullgraph=True, dynamic=mode == "recompute-dynamic")
    ins = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    refs = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    (out, y), (ref, y_ref) = compiled(*ins), block(*refs)
    out.backward()
    ref.backward()
    assert len(graphs) == 1 and "torch.ops.ckpt.fused_experts(" in graphs[0], graphs
    assert y.dtype == y_ref.dtype == (torch.bfloat16 if mode == "autocast" else torch.float32)
    assert torch.equal(y, y_ref) and torch.equal(out, ref)
    for name, a, b in zip(("x", "top_k_weights", "gate_up", "down"), ins, refs):
        assert a.grad.dtype == b.grad.dtype == torch.float32, name
        assert torch.equal(a.grad, b.grad), name


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
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=64,
            moe_intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=97,
            num_experts=8,
            num_experts_per_tok=3,
            output_router_logits=True,
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(
            hidden_size=64,
            intermediate_size=88,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=97,
            num_local_experts=4,
            num_experts_per_tok=1,
            output_router_logits=True,
        )
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


def _train_step_matches(ref, ours, count_fused) -> None:
    """One training step of both models on the same tokens: ``ours`` went through fused_experts in each of
    its two sparse layers, with the loss and every gradient of ``ref``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 13), generator=g).to(DEVICE)
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out = ours(input_ids=ids, labels=ids)
    out.loss.backward()
    assert len(count_fused) == 2
    assert_close("loss", out.loss, out_ref.loss, 1e-5, 1e-4)
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"grad of {name}", p.grad, named[name].grad, 1e-5, 1e-4)


# Qwen3-MoE's case runs with -m slow: its default sibling is test_patch_serves_hooked_experts_through_transformers_
# registry[qwen3_moe], the same patched training step with accelerate hooks on the experts besides
@pytest.mark.parametrize("model_type", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "mixtral"])
def test_patch_experts_use_the_fused_path(model_type, count_fused):
    """Each sparse layer's experts go through fused_experts (top_k 3 and 1 here), with the loss and every
    gradient of the unpatched model."""
    ref = tiny_moe(model_type)
    ours = copy.deepcopy(ref)
    changed = kpatch.patch(ours)
    assert len(changed["experts"]) == 2
    _train_step_matches(ref, ours, count_fused)


def test_patch_experts_under_expert_parallelism(count_fused):
    """Qwen3-MoE's 8 experts split over two emulated ranks as transformers' expert parallelism runs them
    when the ranks share a batch (``AllReduceEP``): each rank's patched experts hold 4 experts, are
    flagged ``_is_expert_parallel``, and get the local index with ``4`` for the other rank's slots and
    those slots' weights zeroed. Both ranks go through fused_experts, and the sum over ranks equals the
    unpatched experts over all 8: output, input and routing-weight gradients (summed over ranks, as the
    all-reduce does) and each rank's slice of the weight gradients."""
    model = tiny_moe("qwen3_moe")
    full = copy.deepcopy(model.model.layers[0].mlp.experts)  # unpatched: transformers' implementation
    kpatch.patch(model)
    patched = model.model.layers[0].mlp.experts
    n_local = full.num_experts // 2
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, full.gate_up_proj.shape[-1], generator=g).to(DEVICE).requires_grad_()
    w, idx = torch.softmax(torch.randn(13, full.num_experts, generator=g), -1).topk(3, dim=-1)
    w, idx = w.to(DEVICE).requires_grad_(), idx.to(DEVICE)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = full(xr, idx, wr)
    grad = torch.randn(ref.shape, generator=g).to(DEVICE)
    ref.backward(grad)
    out = 0
    ranks = []
    with poisoned_memory():
        for rank in range(2):
            local = copy.deepcopy(patched)
            for name in ("gate_up_proj", "down_proj"):
                shard = getattr(full, name)[rank * n_local : (rank + 1) * n_local]
                setattr(local, name, torch.nn.Parameter(shard.detach().clone()))
            local.num_experts, local._is_expert_parallel = n_local, True
            # transformers.distributed.expert_parallel.AllReduceEP.__call__ (5.24)
            elsewhere = (idx // n_local) != rank
            local_index = torch.where(elsewhere, n_local, idx % n_local)
            out = out + local(x, local_index, w.masked_fill(elsewhere, 0.0))
            ranks.append(local)
        out.backward(grad)
    assert len(count_fused) == 2
    assert_close("output", out, ref, 1e-5, 1e-5)
    assert_close("grad of x", x.grad, xr.grad, 1e-5, 1e-5)
    assert_close("grad of top_k_weights", w.grad, wr.grad, 1e-5, 1e-5)
    for name in ("gate_up_proj", "down_proj"):
        got = torch.cat([getattr(local, name).grad for local in ranks])
        assert_close(f"grad of {name}", got, getattr(full, name).grad, 1e-5, 1e-5)


@pytest.mark.parametrize("registry", ["transformers-registry", "no-registry"])
def test_patch_keeps_an_experts_forward_installed_on_the_instance(registry, count_fused, caplog, monkeypatch):
    """transformers' expert parallelism (``EpDispatchExpertsParallel.install_forward``, 5.24) and accelerate's
    hooks replace an experts module's ``forward`` on the instance with a wrapper around the class's: the
    ranks' shares are exchanged or all-reduced there. patch() must keep that wrapper (replacing it would
    drop the exchange: each rank's output would be its own experts' share alone). With transformers'
    experts registry the class's forward it calls dispatches to fused_experts (the config names
    ``EXPERTS_IMPLEMENTATION``); without one (transformers before 5) transformers' implementation runs
    inside it with the SwiGLU fused, and the config is left as it was."""
    if registry == "no-registry":
        monkeypatch.setattr(kpatch, "_experts_registry", lambda: None)
    model = tiny_moe("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    reference = copy.deepcopy(experts)
    before = model.config._experts_implementation
    calls = []
    original_forward = experts.forward

    def ep_forward(*args, **kwargs):  # stands for the dispatch: transforms the output after the inner call
        calls.append(1)
        return 2 * original_forward(*args, **kwargs)

    experts.forward = ep_forward
    with caplog.at_level("INFO", logger="ckpt.kernels.patch"):
        kpatch.patch(model)
    assert experts.forward is ep_forward and experts._apply_gate is kpatch.swiglu_packed
    assert any("forward of their own" in r.getMessage() for r in caplog.records)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, experts.gate_up_proj.shape[-1], generator=g).to(DEVICE)
    w, idx = torch.softmax(torch.randn(9, experts.num_experts, generator=g), -1).topk(2, dim=-1)
    out = experts(x, idx.to(DEVICE), w.to(DEVICE))
    assert calls == [1]
    if registry == "no-registry":
        assert not count_fused and model.config._experts_implementation == before
    else:
        assert len(count_fused) == 1 and model.config._experts_implementation == kpatch.EXPERTS_IMPLEMENTATION
    assert_close("output", out, 2 * reference(x, idx.to(DEVICE), w.to(DEVICE)), 1e-5, 1e-5)


def hook_every_experts(model) -> list:
    """An accelerate hook on each experts module, as ``dispatch_model`` / a ``device_map`` installs them: a
    ``forward`` on the instance that calls the class's."""
    hooks = pytest.importorskip("accelerate.hooks")
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    for m in experts:
        hooks.add_hook_to_module(m, hooks.ModelHook())
    return experts


# mixtral's experts take the fused path in the default suite (test_patch_experts_use_the_fused_path); the
# registry's hook is the same code for both families
@pytest.mark.parametrize("model_type", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_patch_serves_hooked_experts_through_transformers_registry(model_type, count_fused):
    """Every experts module behind an accelerate hook: patch() keeps the hooks, names its experts
    implementation in the config, and fused_experts serves every sparse layer through the class's
    forward, with the loss and every gradient of the unpatched model."""
    ref = tiny_moe(model_type)
    ours = copy.deepcopy(ref)
    experts = hook_every_experts(ours)
    hooked = [m.forward for m in experts]
    changed = kpatch.patch(ours)
    assert len(changed["experts"]) == len(experts) == 2
    assert [m.forward for m in experts] == hooked
    assert ours.config._experts_implementation == kpatch.EXPERTS_IMPLEMENTATION
    assert ref.config._experts_implementation == "grouped_mm"
    _train_step_matches(ref, ours, count_fused)


def test_registry_route_falls_back_to_the_implementation_named_before_patch(count_fused):
    """Where fused_experts cannot run (bf16 hidden states, fp32 weights, no autocast) the experts served
    through the registry run the implementation the config named before patch (``grouped_mm``), with the
    packed SwiGLU, not the registry's entry again."""
    model = tiny_moe("qwen3_moe")
    reference = copy.deepcopy(model.model.layers[0].mlp.experts)
    hook_every_experts(model)
    kpatch.patch(model)
    experts = model.model.layers[0].mlp.experts
    assert experts._ckpt_experts_fallback == "grouped_mm"
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, experts.gate_up_proj.shape[-1], generator=g).to(DEVICE, torch.bfloat16)
    w, idx = torch.softmax(torch.randn(11, experts.num_experts, generator=g), -1).topk(3, dim=-1)
    out = experts(x, idx.to(DEVICE), w.to(DEVICE))
    assert not count_fused and out.dtype == torch.bfloat16
    assert_close("output", out, reference(x, idx.to(DEVICE), w.to(DEVICE)), 2e-2, 2e-2)


WORKER = Path(__file__).parent / "experts_parallel_worker.py"


def _parallel_cases():
    """(model, layout, NCCL) of the test below: every case over gloo and, on two GPUs, over NCCL; Mixtral's
    gloo cases but Qwen3-MoE's ep+tp with ``-m slow`` (their default sibling: that one, both layouts at once)."""
    cases = []
    for nccl in (False, True):
        for model_type, layout in (
            ("qwen3_moe", "ep+tp"),
            ("qwen3_moe", "ep+fsdp"),
            ("qwen3_moe", "tp"),
            ("mixtral", "ep+tp"),
        ):
            # over gloo the default suite runs Qwen3-MoE's ep+tp (expert and tensor parallel at once); the other
            # layouts and Mixtral with -m slow
            default = model_type == "qwen3_moe" and layout == "ep+tp"
            marks = [pytest.mark.multigpu] if nccl else [] if default else [pytest.mark.slow]
            cases.append(
                pytest.param(
                    model_type,
                    layout,
                    nccl,
                    marks=marks,
                    id=f"{model_type}-{layout}-{'nccl' if nccl else 'gloo'}",
                )
            )
    return cases


@pytest.mark.parametrize("model_type,layout,nccl", _parallel_cases())
def test_patch_serves_experts_under_transformers_parallelism(model_type, layout, nccl, tmp_path):
    """Two gloo ranks load a tiny model with transformers' own parallelism (``from_pretrained`` with a
    ``DistributedConfig``: expert parallelism with the ranks sharing a batch or each holding its own, or
    the experts tensor-parallel), which installs its dispatch on each experts module's ``forward``.
    patch() keeps that dispatch and fused_experts serves every sparse layer inside it, flagged
    ``expert_parallel`` where transformers split the experts, in training (all-to-all) and at evaluation;
    the loss, the logits and every gradient (each rank's shard) equal the unpatched parallel model's. The same
    over NCCL on two GPUs (``multigpu``), the kernels compiled for them.

    The rest of the model is patched too (``patch(model)``). Under tensor parallelism transformers wraps the
    ``forward`` of Qwen3-MoE's QK-norms (their weight gradients are summed over the ranks there) and of
    ``lm_head`` (its vocabulary shards gathered): those stay as they are, with the fused loss, and are named
    under ``"left"``; the other norms run fused. Under FSDP every norm runs fused in place, and the loss too."""
    tiny_moe(model_type).save_pretrained(tmp_path / "model")
    results = run_ranks(
        WORKER,
        str(tmp_path / "model"),
        layout,
        str(tmp_path),
        timeout=400,
        env={"CKPT_TEST_NCCL": "1" if nccl else "0"},
    )
    assert_ok(results)
    n_layers = 2
    for rank in range(2):
        r = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False)
        assert r["train_calls"] == r["eval_calls"] == [layout.startswith("ep")] * n_layers
        assert r["wrapped"] == r["experts"] and len(r["experts"]) == n_layers and r["forwards_kept"]
        assert r["implementation"] == kpatch.EXPERTS_IMPLEMENTATION
        changed = r["changed"]
        wrapped_norms = [
            f"model.layers.{i}.self_attn.{n}_norm"
            for i in range(n_layers)
            for n in "qk"
            if "tp" in layout and model_type == "qwen3_moe"
        ]
        assert changed["left"] == wrapped_norms + (["lm_head"] if "tp" in layout else [])
        assert (
            not set(wrapped_norms) & set(changed["rms_norm"]) and len(changed["rms_norm"]) >= 2 * n_layers + 1
        )
        assert r["train_norm_calls"] == len(changed["rms_norm"])
        assert bool(changed["loss"]) == ("tp" not in layout) and changed["rope"]
        assert_close(f"rank {rank} loss", r["losses"][1], r["losses"][0], 1e-5, 1e-4)
        assert_close(f"rank {rank} logits", r["logits"][1], r["logits"][0], 1e-5, 1e-4)
        for name, (ref, ours) in r["grads"].items():
            # Mixtral's top-1 routing weight is renormalised to 1, so its router's gradient is what cancels out of
            # that (the aux loss's share, ~1e-5 here): the fused norms' fp32 rounding shows there at ~1e-5 of it
            atol = 1e-4 if model_type == "mixtral" and name.endswith("mlp.gate.weight") else 1e-5
            assert_close(f"rank {rank} grad of {name}", ours, ref, atol, 1e-4)

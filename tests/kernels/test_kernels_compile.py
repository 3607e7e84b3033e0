"""The kernels inside ``torch.compile``.

Every kernel, the losses included, is a custom operator: Dynamo traces it into the graph (no
graph break; checked with ``torch._dynamo.explain``, and ``fullgraph=True`` fails on any break)
and passes ``torch.library.opcheck``. A compiled function gives the eager function's values and
gradients.

CPU (Triton interpreter): Dynamo plus AOTAutograd (``aot_eager``), static and dynamic shapes.
GPU (``-m gpu``): inductor, on a patched tiny Llama, Mixtral and Qwen3-MoE.
"""

from __future__ import annotations

import pytest
import torch

import ckpt.kernels as K
from kernel_helpers import DEVICE, HAS_CUDA, assert_close


def train_step(m, model, ids, labels):
    """One training step of ``m`` (a model or its compiled form): the loss, then the gradient of each of
    ``model``'s parameters."""
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=labels).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def every_kernel(x, w, b, q, k, cos, sin, head, target):
    # every kernel input below is a fresh intermediate that nothing else saves, so the kernels
    # may write gradients over them (their default)
    h = K.rms_norm(x, w) * 1.5
    h = K.layer_norm(h, w, b)
    m = K.swiglu(h * 1.0, h + 1.0) + K.geglu(h * 0.5, h - 1.0)
    m = m + K.swiglu_packed(torch.cat([h, h * 2.0], -1)) + K.geglu_packed(torch.cat([h * 0.3, h], -1))
    qo, ko = K.rope(q, k, cos, sin)
    loss = K.cross_entropy(m @ head.t(), target) + K.fused_linear_cross_entropy(m * 2.0, head, target)
    loss = loss + K.cross_entropy(m @ head.t(), target, softcap=2.0, label_smoothing=0.1, reduction="sum")
    loss = (
        loss
        + K.fused_linear_cross_entropy(m, head, target, reduction="none", softcap=3.0, z_loss=1e-3).mean()
    )
    return loss + qo.square().mean() + ko.square().mean()


def inputs(device):
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    pos = torch.arange(6, device=device, dtype=torch.float32)[:, None] * torch.rand(
        1, 4, device=device, generator=g
    )
    emb = torch.cat([pos, pos], -1)[None]
    leaves = [rnd(6, 32), rnd(32) + 1.0, rnd(32), rnd(1, 4, 6, 8), rnd(1, 2, 6, 8), rnd(40, 32) * 0.2]
    return [t.requires_grad_() for t in leaves], (
        emb.cos(),
        emb.sin(),
        torch.randint(0, 40, (6,), device=device, generator=g),
    )


def run(fn, device):
    (x, w, b, q, k, head), (cos, sin, target) = inputs(device)
    loss = fn(x, w, b, q, k, cos, sin, head, target)
    loss.backward()
    return [loss] + [t.grad for t in (x, w, b, q, k, head)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_kernels_and_losses_fullgraph_match_eager(dynamic):
    torch._dynamo.reset()
    expected = run(every_kernel, DEVICE)
    got = run(torch.compile(every_kernel, backend="aot_eager", fullgraph=True, dynamic=dynamic), DEVICE)
    for name, a, e in zip(["loss", "x", "w", "b", "q", "k", "head"], got, expected):
        assert_close(name, a, e, 1e-5, 1e-5)


def test_every_kernel_and_loss_traces_into_one_graph():
    torch._dynamo.reset()
    (x, w, b, q, k, head), (cos, sin, target) = inputs(DEVICE)
    explained = torch._dynamo.explain(every_kernel)(x, w, b, q, k, cos, sin, head, target)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    code = explained.graphs[0].code
    for op in (
        "rms_norm",
        "layer_norm",
        "glu",
        "glu_packed",
        "rope",
        "cross_entropy",
        "fused_linear_cross_entropy",
    ):
        assert f"torch.ops.ckpt.{op}" in code, code


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
def test_compiled_losses_without_gradients_or_with_a_frozen_head(frozen):
    """Which gradients the compiled loss makes follows requires_grad and no_grad at trace time:
    a frozen head gets none, and under no_grad the loss alone is computed."""
    torch._dynamo.reset()
    (x, _, _, _, _, head), (_, _, target) = inputs(DEVICE)
    head.requires_grad_(not frozen)

    def loss(h, wt, t):
        return K.fused_linear_cross_entropy(h * 1.0, wt, t, softcap=2.0) + K.cross_entropy(h @ wt.t(), t)

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got, want = compiled(x, head, target), loss(x, head, target)
    assert_close("loss", got, want, 1e-5, 1e-5)
    grads = torch.autograd.grad(got, [x] if frozen else [x, head])
    grads_ref = torch.autograd.grad(want, [x] if frozen else [x, head])
    for name, a, e in zip(["x", "head"], grads, grads_ref):
        assert_close(name, a, e, 1e-5, 1e-5)
    with torch.no_grad():
        assert_close("no_grad loss", compiled(x, head, target), loss(x, head, target), 1e-5, 1e-5)


def layers(x, w, b, q, k, cos, sin):
    # the kernels that compile as custom operators; rms_norm's in_place and the GLUs' in-place
    # gradients are ignored under compilation (a custom operator may not write over its inputs)
    h = K.rms_norm(x, w, in_place=True) * 1.5
    h = K.layer_norm(h, w, b) + K.layer_norm(h, w, None)
    m = K.swiglu(h * 1.0, h + 1.0) + K.geglu(h * 0.5, h - 1.0)
    qo, ko = K.rope(q, k, cos, sin)
    return m.square().mean() + qo.square().mean() + ko.square().mean()


def run_layers(fn, device):
    (x, w, b, q, k, _), (cos, sin, _) = inputs(device)
    loss = fn(x, w, b, q, k, cos, sin)
    loss.backward()
    return [loss] + [t.grad for t in (x, w, b, q, k)]


def test_norms_rope_glu_trace_into_one_graph():
    torch._dynamo.reset()
    (x, w, b, q, k, _), (cos, sin, _) = inputs(DEVICE)
    explained = torch._dynamo.explain(layers)(x, w, b, q, k, cos, sin)
    assert explained.graph_break_count == 0, explained.break_reasons
    code = explained.graphs[0].code
    for op in ("rms_norm", "layer_norm", "glu", "rope"):
        assert f"torch.ops.ckpt.{op}" in code, code


@pytest.mark.parametrize("dynamic", [False, True])
def test_norms_rope_glu_fullgraph_match_eager(dynamic):
    torch._dynamo.reset()
    expected = run_layers(layers, DEVICE)
    got = run_layers(torch.compile(layers, backend="aot_eager", fullgraph=True, dynamic=dynamic), DEVICE)
    for name, a, e in zip(["loss", "x", "w", "b", "q", "k"], got, expected):
        assert_close(name, a, e, 1e-5, 1e-5)


def add_norm_layers(x, r, w):
    # two residual adds fused with their norms, the second taking the first's h as its residual;
    # in_place is ignored under compilation
    y, h = K.fused_add_rms_norm(x * 1.0, r, w, in_place=True)
    y2, h2 = K.fused_add_rms_norm(y * 2.0, h, w, offset=1.0)
    return y2.square().mean() + (h2 * h2.detach()).mean()


def run_add_norm(fn, device):
    (x, w, _, _, _, _), _ = inputs(device)
    r = (x.detach().flip(0) * 0.5 + 0.1).requires_grad_()
    loss = fn(x, r, w)
    loss.backward()
    return [loss] + [t.grad for t in (x, r, w)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_fused_add_rms_norm_fullgraph_matches_eager(dynamic):
    torch._dynamo.reset()
    (x, w, _, _, _, _), _ = inputs(DEVICE)
    explained = torch._dynamo.explain(add_norm_layers)(x, torch.randn_like(x), w)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert "torch.ops.ckpt.fused_add_rms_norm" in explained.graphs[0].code
    torch._dynamo.reset()
    expected = run_add_norm(add_norm_layers, DEVICE)
    got = run_add_norm(
        torch.compile(add_norm_layers, backend="aot_eager", fullgraph=True, dynamic=dynamic), DEVICE
    )
    for name, a, e in zip(["loss", "x", "residual", "w"], got, expected):
        assert_close(name, a, e, 1e-5, 1e-5)


def mixed_inputs(device):
    """Activations in bf16, parameters, cos/sin in fp32 (an fp32 model's tensors under autocast)."""
    (x, w, b, q, k, _), (cos, sin, _) = inputs(device)
    x, q, k = (t.detach().bfloat16().requires_grad_() for t in (x, q, k))
    return x, w, b, q, k, cos, sin


@pytest.mark.parametrize("enabled", [False, True], ids=["mixed", "mixed-autocast"])
def test_mixed_dtypes_compiled_match_eager(enabled):
    """The operators' output dtypes (fake implementations) agree with eager, also under autocast."""

    def run_mixed(fn):
        args = mixed_inputs(DEVICE)
        with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16, enabled=enabled):
            loss = fn(*args)
        loss.backward()
        return [loss] + [t.grad for t in args[:5]]

    torch._dynamo.reset()
    expected = run_mixed(layers)
    got = run_mixed(torch.compile(layers, backend="aot_eager", fullgraph=True))
    for name, a, e in zip(["loss", "x", "w", "b", "q", "k"], got, expected):
        assert a.dtype == e.dtype, f"{name}: {a.dtype} compiled, {e.dtype} eager"
        assert_close(name, a, e, 1e-5, 1e-5)


def _op_cases(device):
    (x, w, b, q, k, head), (cos, sin, target) = inputs(device)
    x, w, b, q, k, head = (t.detach().requires_grad_() for t in (x, w, b, q, k, head))
    target = target.clone()
    target[1] = -100
    logits = (torch.randn(x.shape[0], head.shape[0], device=device) * 3).requires_grad_()
    vbias = torch.randn(head.shape[0], device=device, requires_grad=True)
    cw = torch.rand(head.shape[0], device=device)  # per-class loss weights
    rows = x.shape[0]
    stats = torch.rand(2, rows, device=device)
    a, c = torch.randn(5, 33, device=device), torch.randn(5, 33, device=device)
    x16 = x.detach().bfloat16().requires_grad_()
    a16 = a.bfloat16().requires_grad_()
    return {
        "rms_norm": (x, w, 1e-6, 0.0),
        "rms_norm gemma": (x, w, 1e-6, 1.0),
        "rms_norm_backward": (x.detach(), x.detach(), w.detach(), torch.rand(rows, device=device), 0.0, True),
        "fused_add_rms_norm": (x, x.detach().flip(0).requires_grad_(), w, 1e-6, 0.0),
        "fused_add_rms_norm gemma": (x, x.detach().flip(0).requires_grad_(), w, 1e-6, 1.0),
        "fused_add_rms_norm mixed": (x16, x16.detach().flip(0).requires_grad_(), w, 1e-6, 0.0),
        "fused_add_rms_norm_backward": (
            x.detach(),
            x.detach().flip(0),
            x.detach(),
            w.detach(),
            torch.rand(rows, device=device),
            0.0,
            True,
        ),
        "fused_add_rms_norm_backward no-dh": (
            x.detach(),
            None,
            x16.detach(),
            w.detach(),
            torch.rand(rows, device=device),
            1.0,
            False,
        ),
        "layer_norm": (x, w, b, 1e-5),
        "layer_norm no bias": (x, w, None, 1e-5),
        "layer_norm_backward": (x.detach(), x.detach(), w.detach(), stats, True, b.detach(), True),
        "rope": (q, k, cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1), False),
        "glu silu": (a.requires_grad_(), c.requires_grad_(), 0),
        "glu gelu_tanh": (a, c, 1),
        "glu_backward": (torch.randn(5, 33, device=device), a.detach(), c.detach(), 0),
        # mixed dtypes: each output's dtype comes from the inputs or an explicit argument
        "rms_norm mixed": (x16, w, 1e-6, 0.0),
        "rms_norm_backward mixed": (
            x.detach(),
            x16.detach(),
            w.detach(),
            torch.rand(rows, device=device),
            0.0,
            True,
        ),
        "layer_norm fp32-out": (x16, w, b, 1e-5, torch.float32),
        "layer_norm_backward mixed": (x.detach(), x16.detach(), w.detach(), stats, True, b.detach(), True),
        "rope mixed": (
            q.detach().bfloat16().requires_grad_(),
            k,
            cos.expand(q.shape[0], -1, -1),
            sin.expand(q.shape[0], -1, -1),
            False,
            torch.float32,
            torch.float32,
        ),
        "rope backward-dtypes": (
            q.detach(),
            k.detach(),
            cos.expand(q.shape[0], -1, -1),
            sin.expand(q.shape[0], -1, -1),
            True,
            torch.bfloat16,
            torch.float32,
        ),
        "glu mixed": (a16, c, 0),
        "glu_backward mixed": (torch.randn(5, 33, device=device), a16.detach(), c.detach(), 1),
        "glu_packed silu": (torch.randn(5, 3, 66, device=device, requires_grad=True), 0),
        "glu_packed bf16 gelu_tanh": (torch.randn(5, 66, device=device).bfloat16().requires_grad_(), 1),
        "glu_packed_backward": (torch.randn(5, 33, device=device), torch.randn(5, 66, device=device), 0),
        # the losses: (logits, target, ignore_index, label_smoothing, reduction, z_loss, softcap, need_grad,
        #  class_weight)
        "cross_entropy mean": (logits, target, -100, 0.0, "mean", 0.0, 0.0, True, None),
        "cross_entropy softcap none": (logits, target, -100, 0.1, "none", 1e-3, 2.0, True, None),
        "cross_entropy bf16 sum": (
            logits.detach().bfloat16().requires_grad_(),
            target.clamp(min=0),
            3,
            0.0,
            "sum",
            0.0,
            5.0,
            True,
            None,
        ),
        "cross_entropy no-grad": (logits.detach(), target, -100, 0.0, "mean", 0.0, 0.0, False, None),
        "cross_entropy class-weight mean": (logits, target, -100, 0.1, "mean", 1e-3, 0.0, True, cw),
        # (hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, chunk_size, dtype,
        #  ce_weight, reduction, need)
        "fused_linear_cross_entropy mean": (
            x,
            head,
            target,
            None,
            -100,
            0.0,
            0.0,
            0.0,
            0,
            torch.float32,
            None,
            "mean",
            [True, True, False],
        ),
        "fused_linear_cross_entropy bias softcap sum": (
            x,
            head,
            target,
            vbias,
            -100,
            0.1,
            1e-3,
            3.0,
            4,
            torch.float32,
            None,
            "sum",
            [True, True, True],
        ),
        "fused_linear_cross_entropy none": (
            x,
            head,
            target,
            vbias,
            -100,
            0.0,
            0.0,
            2.0,
            5,
            torch.float32,
            None,
            "none",
            [True, True, True],
        ),
        "fused_linear_cross_entropy frozen-head": (
            x,
            head.detach(),
            target,
            None,
            -100,
            0.0,
            0.0,
            0.0,
            0,
            torch.float32,
            None,
            "mean",
            [True, False, False],
        ),
        "fused_linear_cross_entropy class-weight mean": (
            x,
            head,
            target,
            None,
            -100,
            0.1,
            1e-3,
            0.0,
            4,
            torch.float32,
            cw,
            "mean",
            [True, True, False],
        ),
        "fused_linear_cross_entropy_backward": (
            torch.rand(rows, device=device),
            x.detach(),
            head.detach(),
            target,
            vbias.detach(),
            -100,
            0.0,
            0.0,
            2.0,
            4,
            torch.float32,
            cw,
            [True, True, True],
        ),
        # (x, top_k_index, top_k_weights, gate_up, down, store_h, expert_parallel); built when used
        "fused_experts": lambda: (*_experts_inputs(device, 0.0), True, False),
        "fused_experts expert-parallel recompute": lambda: (*_experts_inputs(device, 0.4), False, True),
        "fused_experts_backward": lambda: _experts_backward_inputs(device),
    }


def _experts_inputs(device, off_rank):
    """Tiny experts operands (9 tokens, top-2 of 4 experts); ``off_rank``: the share of slots whose index
    is a sentinel outside [0, 4)."""
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    w, idx = torch.softmax(rnd(9, 4), -1).topk(2, dim=-1)
    idx = torch.where(torch.rand(9, 2, device=device, generator=g) < off_rank, 4, idx)
    leaves = [rnd(9, 20), w, rnd(4, 24, 20) * 0.2, rnd(4, 20, 12) * 0.3]
    x, w, gu, dn = (t.requires_grad_() for t in leaves)
    return x, idx, w, gu, dn


def _experts_backward_inputs(device):
    x, idx, w, gu, dn = (t.detach() for t in _experts_inputs(device, 0.3))
    _, h, w_sorted, *route = torch.ops.ckpt.fused_experts(x, idx, w, gu, dn, True, True)
    dout = torch.randn(x.shape, device=device)
    return (dout, x, gu, dn, w_sorted, h, *route, 2, w.dtype, True, [True, True, True, True], True)


@pytest.mark.parametrize("case", sorted(_op_cases("cpu")))
def test_custom_operators_pass_opcheck(case):
    # schema, fake (meta) implementation vs the real one, autograd registration, AOT dispatch
    args = _op_cases(DEVICE)[case]
    args = args() if callable(args) else args
    op = getattr(torch.ops.ckpt, case.split()[0]).default
    torch.library.opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
def test_patched_llama_under_inductor_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().train()
    K.patch(model)
    try:
        _check_patched_llama_under_inductor(model)
    finally:
        K.unpatch_rope("llama")  # patch swaps HF's module-level RoPE function: later tests expect it back


def _check_patched_llama_under_inductor(model):
    ids = torch.randint(0, 1000, (2, 64), device="cuda")

    def step(m):
        return train_step(m, m, ids, ids)

    expected = step(model)
    torch._dynamo.reset()
    got = step(torch.compile(model, fullgraph=True))  # the fused loss included: one graph
    for i, (a, e) in enumerate(zip(got, expected)):
        assert_close(f"tensor {i}", a, e, 2e-4, 2e-4)
    # without labels the patched model is one inductor graph too
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, fullgraph=True)(input_ids=ids).logits
        assert_close("logits", logits, model(input_ids=ids).logits, 2e-4, 2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_patched_moe_under_inductor_matches_eager(model_type):
    """A patched MoE model under inductor, ``fullgraph=True``: the experts operators between inductor's
    kernels give eager's loss and gradients (the first, eager step also installs transformers'
    output-capturing hooks, whose lock Dynamo cannot trace)."""
    from test_kernels_patch import tiny_model

    model = tiny_model(model_type, device="cuda", vocab_size=1000)
    K.patch(model)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")

    def step(m):
        return train_step(m, model, ids, ids)

    try:
        expected = step(model)
        torch._dynamo.reset()
        got = step(torch.compile(model, fullgraph=True))
        for (name, _), a, e in zip([("loss", None)] + list(model.named_parameters()), got, expected):
            assert_close(name, a, e, 2e-4, 2e-4)
    finally:
        K.unpatch_rope(model_type)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
def test_norms_rope_glu_under_cuda_graphs_match_eager():
    # mode="reduce-overhead": inductor records the graph (kernels included) into CUDA graphs and
    # replays them; LayerNorm's tickets must be back at zero after every replay, and nothing may
    # be allocated outside the graph's pool during capture.
    import torch._inductor.config as inductor_config

    from ckpt.kernels import _reduce

    torch._dynamo.reset()
    expected = run_layers(layers, "cuda")
    # as if the compiled function made the process's first LayerNorm backward: no ticket buffer yet
    _reduce._tickets.clear()
    _reduce._ticket_bufs.clear()
    compiled = torch.compile(layers, mode="reduce-overhead", fullgraph=True)
    # history: a leak report then says which allocation it was
    with inductor_config.patch({"triton.cudagraph_trees_history_recording": True}):
        for _ in range(4):  # warm-up, record, then replays
            got = run_layers(compiled, "cuda")
            for name, a, e in zip(["loss", "x", "w", "b", "q", "k"], got, expected):
                assert_close(name, a, e, 1e-4, 1e-4)
    assert all(int(t.abs().sum()) == 0 for t in _reduce._tickets.values())  # re-armed after the replays


#: Gemma 2's and Qwen3's fused modules are Gemma 3's (offset norms, QK-norms, GeGLU, softcapped loss) and
#: Llama's: their cases run with -m slow
DENSE = ["llama"] + [
    pytest.param(t, marks=pytest.mark.slow) for t in ("gemma2", "gemma3_text", "qwen3", "phi3")
]


def _break_sites(explained) -> set[tuple[str, int]]:
    """Where each graph break of a ``torch._dynamo.explain`` result happened: the innermost user
    frame (file, line) of each break reason."""
    return {
        (r.user_stack[-1].filename, r.user_stack[-1].lineno) for r in explained.break_reasons if r.user_stack
    }


def _explain_unpatched_then_patched(model_type):
    """A tiny model of ``model_type`` explained unpatched, then a copy of it patched and explained.

    The unpatched one is explained first: ``patch`` swaps the modeling module's
    ``apply_rotary_pos_emb`` process-wide, so afterwards the "unpatched" model would run our RoPE.
    Returns ``(patched model, ids, labels, unpatched explanation, patched explanation)``; the
    caller restores the RoPE function (``K.unpatch_rope``)."""
    import copy

    from test_kernels_patch import batch, tiny_model

    ref = tiny_model(model_type)
    model = copy.deepcopy(ref)
    ids, labels = batch(ref.config.vocab_size)
    torch._dynamo.reset()
    ref_explained = torch._dynamo.explain(ref)(input_ids=ids, labels=labels)
    K.patch(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
    return model, ids, labels, ref_explained, explained


@pytest.mark.parametrize("model_type", DENSE)
def test_patched_model_with_labels_compiles_fullgraph(model_type):
    """A patched model's whole training forward (norms, RoPE, GLUs and the fused loss) is one graph:
    ``fullgraph=True`` compiles it, and the compiled loss and every gradient equal eager's.

    Where transformers' own modeling code breaks the graph, which the unpatched model shows
    (Phi-3's ``longrope`` in transformers 5.17 to 5.20.2 at least: ``dynamic_rope_update`` branches
    in Python on ``torch.max(position_ids) + 1`` and re-registers ``inv_freq``; 5.21.1 and later
    pick the frequencies with ``torch.where``), no fullgraph is possible: the
    patched model must then break only where the unpatched one does and no more often, its compiled
    loss and gradients still equal eager's, and the test is reported as skipped for fullgraph.

    Gemma 2 and Qwen3 run with ``-m slow``; their default siblings are the Gemma 3 and Llama cases."""
    try:
        model, ids, labels, ref_explained, explained = _explain_unpatched_then_patched(model_type)
        hf_breaks = ref_explained.graph_break_count
        if hf_breaks == 0:
            assert explained.graph_break_count == 0, explained.break_reasons
        else:
            assert explained.graph_break_count <= hf_breaks, explained.break_reasons
            assert _break_sites(explained) <= _break_sites(ref_explained), explained.break_reasons
        assert any("torch.ops.ckpt.fused_linear_cross_entropy" in g.code for g in explained.graphs)

        def step(m):
            return train_step(m, model, ids, labels)

        expected = step(model)
        torch._dynamo.reset()
        got = step(torch.compile(model, backend="aot_eager", fullgraph=hf_breaks == 0))
        for (name, _), a, e in zip([("loss", None)] + list(model.named_parameters()), got, expected):
            assert_close(name, a, e, 1e-5, 1e-5)
    finally:
        K.unpatch_rope(model_type)
    if hf_breaks:
        import transformers

        sites = ", ".join(
            f"{f.rsplit('site-packages/', 1)[-1]}:{n}" for f, n in sorted(_break_sites(ref_explained))
        )
        pytest.skip(
            f"fullgraph not possible with transformers {transformers.__version__}: the unpatched "
            f"{type(model).__name__} breaks the graph {hf_breaks} times itself (at {sites}); the patch "
            f"adds none, and the compiled model matches eager"
        )


def _recording_aot_eager(graphs):
    """``aot_eager`` that keeps the code of every graph Dynamo hands it in ``graphs``."""
    aot_eager = torch._dynamo.backends.registry.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    return backend


@pytest.mark.parametrize("model_type", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen3_moe"])
def test_patched_moe_model_compiles_fullgraph(model_type):
    """A patched MoE model's training forward (router, ``torch.ops.ckpt.fused_experts`` in every sparse
    layer, the router's auxiliary loss and the fused loss) is one graph: ``fullgraph=True`` compiles it,
    and the compiled loss and every gradient equal eager's.

    The first call of a model with ``output_router_logits`` installs transformers' output-capturing hooks
    under a ``threading.Lock``, which Dynamo cannot enter (a graph break in transformers' code, once); the
    eager step runs first. Where transformers' own code still breaks the graph (its MoE routing in other
    versions), the patched model must break no more often than the unpatched one, every sparse layer's
    experts must still be our operator, the compiled model must match eager, and the test is reported as
    skipped for fullgraph. Mixtral runs with ``-m slow``; its default sibling is the Qwen3-MoE case."""
    import copy

    from test_kernels_patch import batch, tiny_model

    # (Mixtral: every layer sparse; a narrower expert than test_kernels_patch's keeps the interpreter quick)
    model = tiny_model(model_type, **(dict(intermediate_size=40) if model_type == "mixtral" else {}))
    unpatched = copy.deepcopy(model)
    K.patch(model)
    ids, labels = batch(model.config.vocab_size)
    sparse = sum(type(m).__name__.endswith("Experts") for m in model.modules())
    graphs, hf_breaks = [], 0

    def step(m):
        return train_step(m, model, ids, labels)

    try:
        expected = step(model)
        torch._dynamo.reset()
        try:
            got = step(torch.compile(model, backend=_recording_aot_eager(graphs), fullgraph=True))
        except torch._dynamo.exc.Unsupported:
            # Dynamo's break reasons do not reliably name the frame that broke (a break inside a nested
            # call is reported where the resumed frames break next), so count breaks against the
            # unpatched model, explained with HF's own RoPE function
            K.unpatch_rope(model_type)
            unpatched(input_ids=ids, labels=labels)  # its output-capturing hooks
            torch._dynamo.reset()
            hf_breaks = torch._dynamo.explain(unpatched)(input_ids=ids, labels=labels).graph_break_count
            K.patch(model)  # the RoPE function again
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
            assert explained.graph_break_count <= hf_breaks, (explained.graph_break_count, hf_breaks)
            torch._dynamo.reset()
            graphs.clear()
            got = step(torch.compile(model, backend=_recording_aot_eager(graphs)))
        assert sum(code.count("torch.ops.ckpt.fused_experts(") for code in graphs) == sparse, graphs
        for (name, _), a, e in zip([("loss", None)] + list(model.named_parameters()), got, expected):
            assert_close(name, a, e, 1e-5, 1e-5)
    finally:
        K.unpatch_rope(model_type)
    if hf_breaks:
        import transformers

        pytest.skip(
            f"fullgraph not possible with transformers {transformers.__version__}: the unpatched "
            f"{type(model).__name__} breaks the graph {hf_breaks} times itself; the patch adds none, "
            "and the compiled model matches eager"
        )

"""ckpt.kernels.patch on tiny real Hugging Face models built from configs (no download)."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt.kernels as K
from kernel_helpers import DEVICE, assert_close

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=64,
)

#: model_type -> (config class, model class, config arguments beyond TINY)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # QK-norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    # Gemma 2: tanh-GELU, four (1 + w) norms per layer (two feed the residual), attention and
    # final-logit softcapping (0.5: the tiny model's logits are small, so a cap of 30 would be the identity)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=16, final_logit_softcapping=0.5, attn_implementation="eager"),
    ),
    # Gemma 3: Gemma 2's layout plus QK-norms; sliding and full attention layers alternate
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            final_logit_softcapping=0.7,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05
        ),
    ),
    # one sparse layer and one dense MLP layer (mlp_only_layers), QK-norms
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            mlp_only_layers=[1],
            output_router_logits=True,
        ),
    ),
    # fused gate_up_proj; longrope scaling with a partial rotary dimension (the batch is longer than
    # original_max_position_embeddings, so the long factors are in use)
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "factor": 8.0,
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 3.0, 5.0, 8.0],
                "original_max_position_embeddings": 8,
            },
        ),
    ),
}


def tiny_model(model_type: str, device: str = DEVICE, dtype: torch.dtype = torch.float32, **overrides):
    cfg_name, model_name, extra = FAMILIES[model_type]
    kwargs = {**TINY, "attn_implementation": "sdpa", **extra, **overrides}
    cfg = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg).to(device=device, dtype=dtype).train()


def modeling_of(model):
    import sys

    return sys.modules[type(model).__module__]


@pytest.fixture
def restore_rope():
    yield
    for t in K.SUPPORTED_MODEL_TYPES:
        K.unpatch_rope(t)


def batch(vocab: int, device: str = DEVICE, seed: int = 1, length: int = 11, masked: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, length), generator=g)
    labels = ids.clone()
    labels[0, :masked] = -100  # a masked prompt
    return ids.to(device), labels.to(device)


# on the CPU every family but Mixtral (its MoE sibling in the default suite: Qwen3-MoE) in the default suite
CASES = [
    pytest.param(
        t, DEVICE, torch.float32, 1e-5, 1e-4, id=t, marks=[pytest.mark.slow] if t == "mixtral" else []
    )
    for t in FAMILIES
] + [
    pytest.param("llama", "cuda", torch.bfloat16, 3e-2, 5e-2, id="llama-bf16-cuda", marks=pytest.mark.gpu),
    pytest.param("gemma", "cuda", torch.bfloat16, 3e-2, 5e-2, id="gemma-bf16-cuda", marks=pytest.mark.gpu),
    pytest.param("gemma2", "cuda", torch.bfloat16, 3e-2, 5e-2, id="gemma2-bf16-cuda", marks=pytest.mark.gpu),
    pytest.param(
        "gemma3_text", "cuda", torch.bfloat16, 3e-2, 5e-2, id="gemma3-bf16-cuda", marks=pytest.mark.gpu
    ),
    pytest.param(
        "mixtral", "cuda", torch.bfloat16, 3e-2, 5e-2, id="mixtral-bf16-cuda", marks=pytest.mark.gpu
    ),
    pytest.param(
        "qwen3_moe", "cuda", torch.bfloat16, 3e-2, 5e-2, id="qwen3_moe-bf16-cuda", marks=pytest.mark.gpu
    ),
    pytest.param("phi3", "cuda", torch.bfloat16, 3e-2, 5e-2, id="phi3-bf16-cuda", marks=pytest.mark.gpu),
]


def expected_changes(model):
    """What patch must change in ``model``: found by class in its modeling module, independently
    of patch's own table."""
    modeling = modeling_of(model)
    prefix = type(model).__name__[: -len("ForCausalLM")]
    kinds = {"rms_norm": f"{prefix}RMSNorm", "mlp": f"{prefix}MLP", "experts": f"{prefix}Experts"}
    return {
        key: [
            n
            for n, m in model.named_modules()
            if type(m).__name__ == cls and type(m).__module__ == modeling.__name__
        ]
        for key, cls in kinds.items()
    }


def check_matches_unpatched(ref, ours, ids, labels, atol, rtol, **kw):
    out_ref = ref(input_ids=ids, labels=labels, **kw)
    out_ref.loss.backward()
    out = ours(input_ids=ids, labels=labels, **kw)
    assert out.logits is None  # full logits never built in training
    assert_close("loss", out.loss, out_ref.loss, atol, rtol)
    if getattr(out_ref, "aux_loss", None) is not None:
        assert_close("aux_loss", out.aux_loss, out_ref.aux_loss, atol, rtol)
    out.loss.backward()
    named_ref = dict(ref.named_parameters())
    assert set(dict(ours.named_parameters())) == set(named_ref)
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert_close(f"grad of {name}", p.grad, named_ref[name].grad, atol, rtol)


@pytest.mark.parametrize("model_type,device,dtype,atol,rtol", CASES)
def test_patch_matches_unpatched(model_type, device, dtype, atol, rtol, restore_rope):
    """The patched model's loss and every parameter gradient equal the unpatched model's."""
    ref = tiny_model(model_type, device, dtype)
    ours = copy.deepcopy(ref)
    ids, labels = batch(ref.config.vocab_size, device)
    want = expected_changes(ref)

    changed = K.patch(ours)
    assert changed["rms_norm"] == want["rms_norm"] and len(want["rms_norm"]) >= 2 * 2 + 1
    assert changed["mlp"] == want["mlp"] and changed["experts"] == want["experts"]
    assert len(changed["mlp"]) + len(changed["experts"]) == ref.config.num_hidden_layers
    assert changed["loss"] == [f"{type(ours).__name__}.forward"]
    assert changed["rope"] == [f"{modeling_of(ref).__name__}.apply_rotary_pos_emb"]
    assert isinstance(ours.model.norm, K.RMSNorm)
    assert ours.model.norm.offset == (1.0 if model_type.startswith("gemma") else 0.0)
    assert set(ours.state_dict()) == set(ref.state_dict())

    check_matches_unpatched(ref, ours, ids, labels, atol, rtol)

    # second patch is a no-op; eval mode still returns logits identical in meaning
    assert changed["layer_norm"] == []  # no vision tower
    assert K.patch(ours) == {
        "rms_norm": [],
        "layer_norm": [],
        "mlp": [],
        "experts": [],
        "rope": [],
        "loss": [],
        "left": [],
    }
    ours.eval()
    ref.eval()
    with torch.no_grad():
        assert_close("eval logits", ours(input_ids=ids).logits, ref(input_ids=ids).logits, atol, rtol)


def test_patch_gemma_norm_details(restore_rope):
    """Gemma 2/3: each norm keeps its own eps and (1 + w) weights; the norms whose output joins the
    residual stream do not write their input gradient over their output gradient (that gradient is
    also the residual's)."""
    for model_type in ("gemma2", "gemma3_text"):
        model = tiny_model(model_type, rms_norm_eps=3e-5)
        model.model.layers[0].input_layernorm.eps = 1e-3  # one norm with another eps
        K.patch(model)
        layer = model.model.layers[0]
        assert layer.input_layernorm.eps == 1e-3 and layer.pre_feedforward_layernorm.eps == 3e-5
        assert all(m.offset == 1.0 for m in model.modules() if isinstance(m, K.RMSNorm))
        assert not layer.post_attention_layernorm.in_place and not layer.post_feedforward_layernorm.in_place
        assert layer.input_layernorm.in_place and layer.pre_feedforward_layernorm.in_place
        if model_type == "gemma3_text":
            assert isinstance(layer.self_attn.q_norm, K.RMSNorm) and isinstance(
                layer.self_attn.k_norm, K.RMSNorm
            )
        assert isinstance(layer.mlp, K.GeGLUMLP)


def wrap_forward(module, on_call):
    """Replace ``module.forward`` on the instance with a wrapper around the class's, as transformers' tensor-parallel
    styles do (``TensorParallelLayer.install_forward``, 5.24): ``on_call(module)`` then the captured forward."""
    inner = module.forward

    def wrapped(*args, **kwargs):
        on_call(module)
        return inner(*args, **kwargs)

    module.forward = wrapped
    return wrapped


def grad_doubling(module):
    """What ``ReplicatedWithGradAllReduce`` (transformers' style for Qwen3's QK-norms) does in its wrapper: a hook on
    each parameter's accumulated gradient (there, a sum over the ranks; here, two ranks that agree: times 2)."""

    def double(param):
        param.grad.mul_(2)

    if not getattr(module, "_doubling", False):
        for p in module.parameters(recurse=False):
            p.register_post_accumulate_grad_hook(double)
        module._doubling = True


def wrap_like_tensor_parallelism(model):
    """The QK-norms, one MLP and ``lm_head`` get a forward of their own on the instance."""
    for layer in model.model.layers:
        wrap_forward(layer.self_attn.q_norm, grad_doubling)
        wrap_forward(layer.self_attn.k_norm, grad_doubling)
    wrap_forward(model.model.layers[1].mlp, lambda m: None)
    wrap_forward(model.lm_head, lambda m: None)


def test_patch_leaves_a_module_whose_forward_is_wrapped_on_the_instance(restore_rope, caplog):
    """A norm, MLP or ``lm_head`` whose ``forward`` was replaced on the instance by a wrapper (transformers' tensor
    parallelism sums the QK-norms' weight gradients over the ranks from such a wrapper) is left as it is, wrapper
    and class alike, with the loss when it is ``lm_head``'s: named under ``"left"`` and in an INFO log. The
    gradients, the wrappers' work included, are the unpatched model's; the rest is patched."""
    ref = tiny_model("qwen3_moe")
    ours = copy.deepcopy(ref)
    for model in (ref, ours):
        wrap_like_tensor_parallelism(model)
    wrapped = {name: m.forward for name, m in ours.named_modules() if "forward" in vars(m)}
    with caplog.at_level("INFO", logger="ckpt.kernels.patch"):
        changed = K.patch(ours)
    assert {name: m.forward for name, m in ours.named_modules() if name in wrapped} == wrapped
    assert sorted(changed["left"]) == sorted(wrapped) and changed["loss"] == []
    assert not set(wrapped) & set(changed["rms_norm"] + changed["mlp"])
    assert len(changed["rms_norm"]) == 2 * 2 + 1 and changed["experts"]
    assert type(ours.model.layers[0].self_attn.q_norm) is type(ref.model.layers[0].self_attn.q_norm)
    assert any(
        r.levelname == "INFO" and "model.layers.0.self_attn.q_norm" in r.getMessage() for r in caplog.records
    )
    ids, labels = batch(ref.config.vocab_size)
    out_ref = ref(input_ids=ids, labels=labels)
    out_ref.loss.backward()
    out = ours(input_ids=ids, labels=labels)
    out.loss.backward()
    assert_close("loss", out.loss, out_ref.loss, 1e-5, 1e-4)
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"grad of {name}", p.grad, named[name].grad, 1e-5, 1e-4)
    assert K.patch(ours)["left"] == changed["left"]  # a second call leaves them again, changes nothing


def test_patch_fuses_a_module_with_hooks_in_place(restore_rope, monkeypatch):
    """A norm or MLP with hooks registered on it (FSDP2's gather and reshard of a unit, accelerate's, a user's) keeps
    its module object, so its hooks still run, and runs fused: its forward on the instance is the kernels'. FSDP2
    also swaps parameters on the module object (its gathered weight for the forward), which the same route keeps."""
    ref = tiny_model("qwen3")
    ours = copy.deepcopy(ref)
    seen = []
    for model in (ref, ours):
        for m in (model.model.norm, model.model.layers[0].mlp):
            m.register_forward_hook(lambda m, args, out: seen.append(type(m).__name__) or 2 * out)
    norm, mlp = ours.model.norm, ours.model.layers[0].mlp
    kernels = []
    real = K.rms_norm

    def counting(*args, **kwargs):
        kernels.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kpatch_module(), "rms_norm", counting)
    changed = K.patch(ours)
    assert ours.model.norm is norm and ours.model.layers[0].mlp is mlp
    assert (
        "model.norm" in changed["rms_norm"]
        and "model.layers.0.mlp" in changed["mlp"]
        and changed["left"] == []
    )
    assert isinstance(ours.model.layers[1].mlp, K.SwiGLUMLP)  # no hooks: replaced as usual
    ids, labels = batch(ref.config.vocab_size)
    check_matches_unpatched(ref, ours, ids, labels, 1e-5, 1e-4)
    assert kernels == [1] and seen.count("Qwen3RMSNorm") == 2 and seen.count("Qwen3MLP") == 2
    assert K.patch(ours)["rms_norm"] == []


def kpatch_module():
    import sys

    return sys.modules["ckpt.kernels.patch"]


@pytest.mark.parametrize("softcap", [None, 0.3, 30.0])
def test_patch_gemma2_final_logit_softcapping(softcap, restore_rope):
    """The patched loss applies config.final_logit_softcapping as the unpatched forward does (a cap
    of 0.3 saturates the tiny model's logits, 30 barely touches them, None turns it off)."""
    ref = tiny_model("gemma2", final_logit_softcapping=softcap)
    ours = copy.deepcopy(ref)
    K.patch(ours)
    ids, labels = batch(ref.config.vocab_size)
    check_matches_unpatched(ref, ours, ids, labels, 1e-5, 1e-4)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("model_type", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen3_moe"])
def test_patch_moe_experts_under_every_implementation(model_type, implementation, restore_rope):
    """The experts' fused SwiGLU serves each of transformers' experts implementations; the router is
    left as it is (same module, same weights). Mixtral's run with ``-m slow``: in the default suite
    Qwen3-MoE's cases here and test_patch_matches_unpatched[mixtral] (its default implementation) cover it."""
    ref = tiny_model(model_type)
    ref.set_experts_implementation(implementation)
    ours = copy.deepcopy(ref)
    routers = [type(m) for m in ref.modules() if type(m).__name__.endswith("TopKRouter")]
    changed = K.patch(ours)
    assert (
        changed["experts"]
        and [type(m) for m in ours.modules() if type(m).__name__.endswith("TopKRouter")] == routers
    )
    ids, labels = batch(ref.config.vocab_size)
    check_matches_unpatched(ref, ours, ids, labels, 1e-5, 1e-4)


def test_patch_moe_without_router_logits(restore_rope):
    """output_router_logits=False: no auxiliary loss, in both models."""
    ref = tiny_model("mixtral", output_router_logits=False)
    ours = copy.deepcopy(ref)
    K.patch(ours)
    ids, labels = batch(ref.config.vocab_size)
    check_matches_unpatched(ref, ours, ids, labels, 1e-5, 1e-4)
    assert ours(input_ids=ids, labels=labels).aux_loss is None


@pytest.mark.parametrize(
    "rope_parameters",
    [
        pytest.param({"rope_type": "default", "rope_theta": 10000.0}, id="full-rotary"),
        pytest.param(
            {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, id="partial-rotary"
        ),
    ],
)
def test_patch_phi3_rope_variants(rope_parameters, restore_rope):
    """Phi-3 with full and partial rotary dimensions (longrope: test_patch_matches_unpatched)."""
    ref = tiny_model("phi3", rope_parameters=rope_parameters)
    ours = copy.deepcopy(ref)
    changed = K.patch(ours)
    assert isinstance(ours.model.layers[0].mlp, K.PackedGLUMLP) and changed["rope"]
    ids, labels = batch(ref.config.vocab_size)
    check_matches_unpatched(ref, ours, ids, labels, 1e-5, 1e-4)


def test_patch_leaves_an_activation_without_a_fused_kernel_and_says_why(caplog, restore_rope):
    """An MLP whose activation no fused GLU computes (exact GELU here) stays as it is, named in a
    warning, while the rest of the model is patched."""
    ref = tiny_model("llama", hidden_act="gelu")
    ours = copy.deepcopy(ref)
    with caplog.at_level("WARNING", logger="ckpt.kernels.patch"):
        changed = K.patch(ours)
    assert changed["mlp"] == [] and len(changed["rms_norm"]) == 5
    assert "model.layers.0.mlp" in caplog.text and "GELUActivation" in caplog.text
    ids, labels = batch(ref.config.vocab_size)
    check_matches_unpatched(ref, ours, ids, labels, 1e-5, 1e-4)


#: the families whose training curve runs in the default suite: between them every module patch() fuses
#: (Llama's norms, SwiGLU, rope and loss; Gemma 3's (1 + w) norms, GeGLU, QK-norms and softcapped loss;
#: Qwen3-MoE's experts beside a dense MLP; Phi-3's packed GLU and longrope)
# one family's curve in the default suite, the others' with -m slow: the per-layer equivalence of every family
# (test_patch_matches_unpatched) stays in the default suite
CURVE_FAMILIES = ("llama",)


@pytest.mark.parametrize(
    "model_type", [t if t in CURVE_FAMILIES else pytest.param(t, marks=pytest.mark.slow) for t in FAMILIES]
)
def test_patch_follows_unpatched_training_curve(model_type, restore_rope):
    """Six AdamW steps per family: the patched model's loss follows the unpatched one's. (The bound
    is derived for Llama over 20 steps in test_patch_tracks_training_curve; over six steps at lr 1e-3
    the curves stay far from any loss spike, and a relative 1e-4 is ~100x the rounding-level difference
    observed. A wrong gradient or state not shared moves the curve by 1e-2 and up.)

    The families outside CURVE_FAMILIES run with ``-m slow``: their fused modules are those of a
    family run here (Mistral and Qwen2: Llama's; Qwen3: Qwen3-MoE's; Gemma and Gemma 2: Gemma 3's;
    Mixtral: Qwen3-MoE's experts), and test_patch_matches_unpatched checks each of them (loss and every
    gradient) in the default suite."""
    ref = tiny_model(model_type)
    ours = copy.deepcopy(ref)
    K.patch(ours)
    ids, labels = batch(ref.config.vocab_size)
    curve_ref = _train(ref, ids, labels, steps=6, lr=1e-3)
    curve = _train(ours, ids, labels, steps=6, lr=1e-3)
    assert curve_ref[-1] < curve_ref[0] - 0.05  # it learns
    for i, (a, b) in enumerate(zip(curve, curve_ref)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {i}: patched {a} vs unpatched {b}"


@pytest.mark.slow
def test_patch_tracks_training_curve(restore_rope):
    """20 AdamW steps: the patched model follows the unpatched loss curve within what rounding
    alone moves that curve by. (``-m slow``; its default sibling is
    test_patch_follows_unpatched_training_curve[llama]: six steps, away from the spike.)

    The bound is measured, not picked. At lr=1e-2 this run passes through a loss spike (step 14)
    where the loss is very sensitive to the weights, and there the unpatched fp32 curve itself
    moves by ~1e-4 when only its rounding changes (trained in fp64 instead: 1.0e-4 on the
    development machine; its transformers/torch/CPU decide the exact figure). The patched model
    rounds differently (fused kernels, other summation orders), so it is one more such curve.
    Per step the tolerance is

        2 * spread_i + n_valid * eps * |loss_i|

    * ``spread_i``: the largest distance, at step i, from the unpatched fp32 curve to the same
      model trained (a) in fp64 and (b) in fp32 from initial weights each moved one ulp up or
      down at random (three seeds), i.e. how far a rounding-sized change moves the curve there.
      Twice that: four samples underestimate how far such a curve can stray.
    * ``n_valid * eps * |loss_i|``: the rounding of the loss value itself, a mean of ``n_valid``
      fp32 per-token losses (summing n terms errs by up to (n - 1) eps of their sum); it matters
      where the spread happens to be ~0 (step 0).

    A real defect (a wrong gradient, optimizer state not shared, a stale in-place buffer) moves
    the curve by orders of magnitude more (1e-2 and up within a few steps).
    """
    ref = tiny_model("llama")
    ours, init = copy.deepcopy(ref), copy.deepcopy(ref)
    ids, labels = batch(ref.config.vocab_size)
    curve_ref = _train(ref, ids, labels)
    spread = [0.0] * len(curve_ref)
    for other in [_train(copy.deepcopy(init).double(), ids, labels)] + [
        _train(_one_ulp_off(copy.deepcopy(init), seed), ids, labels) for seed in range(3)
    ]:
        spread = [max(s, abs(o - r)) for s, o, r in zip(spread, other, curve_ref)]
    K.patch(ours)
    curve = _train(ours, ids, labels)
    assert curve[-1] < 0.5 * curve[0]  # it actually learns
    n_valid = int((labels[:, 1:] != -100).sum())
    eps = torch.finfo(torch.float32).eps
    for i, (a, b, s) in enumerate(zip(curve, curve_ref, spread)):
        bound = 2 * s + n_valid * eps * abs(b)
        assert abs(a - b) <= bound, (
            f"step {i}: patched {a} vs unpatched {b} (rounding spread {s:.3g}, bound {bound:.3g})"
        )


def _one_ulp_off(model, seed):
    """``model`` with every parameter moved one ulp up or down at random: a rounding of the weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            up = torch.rand(p.shape, generator=g) < 0.5
            p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf).to(p)))
    return model


def _train(model, ids, labels, steps=20, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    curve = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(loss.item())
    return curve


def test_patch_honours_num_items_in_batch(restore_rope):
    ref = tiny_model("llama")
    ours = copy.deepcopy(ref)
    K.patch(ours)
    ids, labels = batch(ref.config.vocab_size)
    n = torch.tensor(5.0)
    assert_close(
        "loss",
        ours(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
        ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
        1e-5,
        1e-4,
    )


@pytest.mark.parametrize(
    "model_type", ["llama", "gemma2", pytest.param("mixtral", marks=pytest.mark.slow), "phi3"]
)
def test_gradient_accumulation_with_num_items_in_batch(model_type, restore_rope):
    """Two micro-batches with different numbers of label tokens, each forward given the HF Trainer's
    ``num_items_in_batch`` (the label tokens of both): the patched model's accumulated losses and
    gradients equal the unpatched model's, and the accumulated loss is the mean over all label
    tokens (a mean per micro-batch, then averaged, would weight the short one's tokens more).
    Mixtral's runs with ``-m slow`` (its loss is the other families' fused loss; the default suite
    checks it on Llama, Gemma 2 and Phi-3 here)."""
    ref = (
        tiny_model(model_type, output_router_logits=False)
        if model_type == "mixtral"
        else tiny_model(model_type)
    )
    ours = copy.deepcopy(ref)
    K.patch(ours)
    micro = [batch(ref.config.vocab_size, seed=1, masked=2), batch(ref.config.vocab_size, seed=2, masked=8)]
    n_items = sum(int((labels[..., 1:] != -100).sum()) for _, labels in micro)
    totals = []
    for model in (ref, ours):
        total = 0.0
        for ids, labels in micro:
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(n_items)).loss
            loss.backward()
            total = total + loss.detach()
        totals.append(total)
    assert_close("accumulated loss", totals[1], totals[0], 1e-5, 1e-4)
    named_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"accumulated grad of {name}", p.grad, named_ref[name].grad, 1e-5, 1e-4)
    # the divisor is the whole batch's token count: one forward over both micro-batches gives the same
    full = copy.deepcopy(ref)
    full.zero_grad(set_to_none=True)
    ids = torch.cat([m[0] for m in micro])
    labels = torch.cat([m[1] for m in micro])
    assert_close("full-batch mean", totals[1], full(input_ids=ids, labels=labels).loss, 1e-5, 1e-4)


def test_patch_training_step_builds_no_kv_cache(restore_rope):
    """With labels in training mode the patched forward asks the base model for no KV cache
    unless the caller does (config.use_cache=True would otherwise copy every layer's k and v)."""
    model = tiny_model("llama")
    model.config.use_cache = True
    K.patch(model)
    seen = []
    inner = model.model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_cache"))
        return inner(*args, **kwargs)

    model.model.forward = spy
    ids, labels = batch(model.config.vocab_size)
    out = model(input_ids=ids, labels=labels)
    assert seen[-1] is False and out.past_key_values is None
    out = model(input_ids=ids, labels=labels, use_cache=True)
    assert seen[-1] is True and out.past_key_values is not None


def test_patch_rejects_unknown_architecture():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match="supported model types: llama, mistral, qwen2"):
        K.patch(model)
    with pytest.raises(ValueError, match="NoneType|model_type=None"):
        K.patch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "model_type,device",
    [
        pytest.param("llama", DEVICE, id="llama"),
        pytest.param("gemma", DEVICE, id="gemma"),
        pytest.param("llama", "cuda", id="llama-cuda", marks=pytest.mark.gpu),
        pytest.param("gemma", "cuda", id="gemma-cuda", marks=pytest.mark.gpu),
    ],
)
def test_patch_under_autocast_matches_unpatched(model_type, device, restore_rope):
    """fp32 weights, forward under bf16 autocast (what HF Trainer's bf16=True does): the patched
    model's loss and every parameter gradient (fp32) match the unpatched model's under the same
    autocast."""
    ref = tiny_model(model_type, device)
    ours = copy.deepcopy(ref)
    K.patch(ours)
    ids, labels = batch(ref.config.vocab_size, device)
    losses = []
    for model in (ref, ours):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss)
    assert losses[1].dtype == losses[0].dtype == torch.float32
    assert_close("loss", losses[1], losses[0], 3e-2, 3e-2)
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert_close(f"grad of {name}", p.grad, p_ref.grad, 3e-2, 5e-2)


@pytest.mark.skipif(
    DEVICE != "cpu",
    reason="torch's own CUDA loss stops at a device assert, and so does ours "
    "(test_kernels_losses: the device-assert test)",
)
def test_patch_label_outside_the_vocabulary_is_an_index_error(restore_rope):
    """A label >= vocab_size raises IndexError in the patched training forward, as it does in
    the unpatched one (the fused loss used to return a finite loss for it)."""
    ref = tiny_model("llama")
    ours = copy.deepcopy(ref)
    K.patch(ours)
    ids, labels = batch(ref.config.vocab_size)
    labels[1, 5] = ref.config.vocab_size
    with pytest.raises(IndexError):
        ref(input_ids=ids, labels=labels)
    with pytest.raises(IndexError, match=str(ref.config.vocab_size)):
        ours(input_ids=ids, labels=labels)


def test_patch_forwards_no_cache_argument_the_caller_did_not_give(restore_rope):
    """The patched forward passes ``past_key_values`` on only when the caller gave one:
    transformers 5.2x deprecates the name (``cache``) and warns on every call that passes it,
    even as None, and drops it in 5.40."""
    model = tiny_model("llama")
    K.patch(model)
    seen = []

    def spy(who, inner):
        def call(*args, **kwargs):
            seen.append((who, set(kwargs)))
            return inner(*args, **kwargs)

        return call

    model.model.forward = spy("base", model.model.forward)  # the training path's base model call
    model._ckpt_unpatched_forward = spy("unpatched", model._ckpt_unpatched_forward)  # eval / no labels
    ids, labels = batch(model.config.vocab_size)
    model(input_ids=ids, labels=labels)
    model.eval()
    model(input_ids=ids)
    # ours: the training path's call to the base model, then the hand-over to HF's own forward for eval
    # (what HF's forward then passes to its base model is HF's, and differs between versions)
    ours = [seen[0], next(x for x in seen[1:] if x[0] == "unpatched")]
    assert [w for w, _ in ours] == ["base", "unpatched"], seen
    assert not any("past_key_values" in names for _, names in ours), seen


# -- Gemma 3 with its vision tower (Gemma3ForConditionalGeneration, model_type "gemma3") -------------

#: image tokens per image (a 16 x 16 image in 4 x 4 patches, pooled 2 x 2) and their id (inside the
#: tiny vocabulary, so HF's out-of-vocabulary replacement is not what is tested)
MM_TOKENS, IMAGE_TOKEN = 4, 90


def tiny_gemma3_multimodal(dtype: torch.dtype = torch.float32, **text_overrides):
    """A tiny Gemma3ForConditionalGeneration: gemma3_text's tiny language model, a two-layer SigLIP
    vision tower (no pooling head, as Gemma 3's), every norm's weight (and LayerNorm bias) moved off
    its initial value and the projector's weight (zeros at init) random, so that a patch that drops
    a weight, a bias or an offset, or cuts the vision tower's gradient, shows."""
    _, _, extra = FAMILIES["gemma3_text"]
    text = {**TINY, **extra, "final_logit_softcapping": 0.7, **text_overrides}
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
        vision_use_head=False,
        layer_norm_eps=3e-6,
    )
    cfg = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=MM_TOKENS,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=91,
        eoi_token_id=92,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2, generator=g)
    return model.to(device=DEVICE, dtype=dtype).train()


def mm_batch(model, seed: int = 1, length: int = 14):
    """Two sequences, one image each (MM_TOKENS image tokens at different places), ``token_type_ids``
    marking them, labels -100 on the image tokens and on a prompt, and an attention mask with two
    padding positions whose labels are *not* -100: HF's loss counts them (it does not filter by the
    attention mask), so the patched loss must as well."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 89, (2, length), generator=g)
    ids[0, 2 : 2 + MM_TOKENS] = IMAGE_TOKEN
    ids[1, 6 : 6 + MM_TOKENS] = IMAGE_TOKEN
    token_type_ids = (ids == IMAGE_TOKEN).long()
    labels = ids.clone()
    labels[token_type_ids.bool()] = -100
    labels[0, :2] = -100
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -2:] = 0
    pixel_values = torch.randn(2, 3, 16, 16, generator=g)
    kw = dict(
        pixel_values=pixel_values.to(DEVICE, next(model.parameters()).dtype),
        token_type_ids=token_type_ids.to(DEVICE),
        attention_mask=attention_mask.to(DEVICE),
    )
    return ids.to(DEVICE), labels.to(DEVICE), kw


def expected_multimodal_changes(model):
    """What patch must change, found independently of patch's tables: Gemma3RMSNorm and Gemma3MLP by
    class (language model and the projector's norm), every torch LayerNorm (the vision tower)."""
    rms = [n for n, m in model.named_modules() if type(m).__name__ == "Gemma3RMSNorm"]
    ln = [n for n, m in model.named_modules() if type(m) is torch.nn.LayerNorm]
    mlp = [n for n, m in model.named_modules() if type(m).__name__ == "Gemma3MLP"]
    return rms, ln, mlp


#: the attention key biases of the vision tower: softmax is unchanged by adding q.b to every key's
#: score, so their true gradient is 0 and both models hold rounding noise (~1e-10) there
ZERO_GRAD = "self_attn.k_proj.bias"


def check_mm_matches_unpatched(ref, ours, ids, labels, atol, rtol, **kw):
    """check_matches_unpatched for the multimodal model: the gradients whose exact value is 0
    (ZERO_GRAD) are held to that, within rounding of the largest gradient of their tower."""
    out_ref = ref(input_ids=ids, labels=labels, **kw)
    out_ref.loss.backward()
    out = ours(input_ids=ids, labels=labels, **kw)
    assert out.logits is None and out.image_outputs is not None
    assert_close("loss", out.loss, out_ref.loss, atol, rtol)
    out.loss.backward()
    named_ref = dict(ref.named_parameters())
    assert set(dict(ours.named_parameters())) == set(named_ref)
    scale = max(
        p.grad.abs().max().item() for n, p in ref.named_parameters() if n.startswith("model.vision_tower")
    )
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        if name.endswith(ZERO_GRAD):
            for g in (p.grad, named_ref[name].grad):
                assert g.abs().max().item() <= 1e-5 * scale, name
        else:
            assert_close(f"grad of {name}", p.grad, named_ref[name].grad, atol, rtol)


@pytest.mark.parametrize(
    "softcap", [pytest.param(None, marks=pytest.mark.slow), 0.7]
)  # 0.7: the softcap path too
def test_patch_gemma3_multimodal_matches_unpatched(softcap, restore_rope):
    """Gemma3ForConditionalGeneration with an image per sequence: what patch returns, the vision
    tower's LayerNorms -> the fused LayerNorm sharing weight, bias and eps, and the loss and every
    gradient (vision tower and projector included) against the unpatched model. HF's multimodal
    forward applies no final_logit_softcapping (the text config's 0.7 is ignored by both)."""
    ref = tiny_gemma3_multimodal(final_logit_softcapping=softcap)
    ours = copy.deepcopy(ref)
    ids, labels, kw = mm_batch(ref)
    rms, ln, mlp = expected_multimodal_changes(ref)

    changed = K.patch(ours)
    assert changed["rms_norm"] == rms and len(rms) == 2 * 6 + 2  # 6 per layer, the final and the projector's
    assert "model.multi_modal_projector.mm_soft_emb_norm" in rms
    assert changed["layer_norm"] == ln and len(ln) == 2 * 2 + 1  # 2 per vision layer and post_layernorm
    assert changed["mlp"] == mlp and len(mlp) == 2 and changed["experts"] == []
    assert changed["loss"] == ["Gemma3ForConditionalGeneration.forward"]
    assert changed["rope"] == [f"{modeling_of(ref).__name__}.apply_rotary_pos_emb"]
    assert set(ours.state_dict()) == set(ref.state_dict())
    for name in ln:
        new, old = ours.get_submodule(name), ref.get_submodule(name)
        assert isinstance(new, K.LayerNorm) and new.eps == old.eps == 3e-6
    # SigLIP's MLP is left as it is
    assert type(ours.model.vision_tower.encoder.layers[0].mlp) is type(
        ref.model.vision_tower.encoder.layers[0].mlp
    )
    lang = ours.model.language_model.layers[0]
    assert not lang.post_attention_layernorm.in_place and not lang.post_feedforward_layernorm.in_place
    assert isinstance(lang.mlp, K.GeGLUMLP) and isinstance(lang.self_attn.q_norm, K.RMSNorm)

    check_mm_matches_unpatched(ref, ours, ids, labels, 1e-5, 1e-4, **kw)
    vision_grads = [
        p.grad
        for n, p in ours.named_parameters()
        if n.startswith("model.vision_tower") and not n.endswith(ZERO_GRAD)
    ]
    assert all(g.abs().sum() > 0 for g in vision_grads)  # the image reached the loss

    # gradient accumulation's num_items_in_batch and return_dict=False, as HF
    n = torch.tensor(7.0)
    assert_close(
        "loss / num_items",
        ours(input_ids=ids, labels=labels, num_items_in_batch=n, **kw).loss,
        ref(input_ids=ids, labels=labels, num_items_in_batch=n, **kw).loss,
        1e-5,
        1e-4,
    )
    assert_close(
        "tuple loss",
        ours(input_ids=ids, labels=labels, return_dict=False, **kw)[0],
        ref(input_ids=ids, labels=labels, return_dict=False, **kw)[0],
        1e-5,
        1e-4,
    )

    # SigLIP's MLPs are named as left again, as the first time
    assert (
        changed["left"]
        == [n for n, m in ours.named_modules() if n.startswith("model.vision_tower") and n.endswith(".mlp")]
        and len(changed["left"]) == 2
    )
    assert K.patch(ours) == {
        "rms_norm": [],
        "layer_norm": [],
        "mlp": [],
        "experts": [],
        "rope": [],
        "loss": [],
        "left": changed["left"],
    }
    ours.eval()
    ref.eval()
    with torch.no_grad():
        assert_close(
            "eval logits", ours(input_ids=ids, **kw).logits, ref(input_ids=ids, **kw).logits, 1e-5, 1e-4
        )


def test_patch_gemma3_multimodal_shares_parameters(restore_rope):
    """The fused LayerNorms and RMSNorms hold the very Parameters the model had (state dict and
    optimizer state unchanged)."""
    model = tiny_gemma3_multimodal()
    before = dict(model.named_parameters())
    K.patch(model)
    after = dict(model.named_parameters())
    assert set(after) == set(before) and all(after[n] is before[n] for n in before)
    post = model.model.vision_tower.post_layernorm
    assert post.weight is before["model.vision_tower.post_layernorm.weight"]
    assert post.bias is before["model.vision_tower.post_layernorm.bias"]


def test_patch_gemma3_multimodal_names_the_vision_mlp_it_leaves(caplog, restore_rope):
    """SigLIP's MLP (fc1 -> tanh-GELU -> fc2) is no GLU: left as it is, each named in the warning;
    ``layer_norm=False`` leaves the vision tower's LayerNorms alone."""
    model = tiny_gemma3_multimodal()
    with caplog.at_level("WARNING", logger="ckpt.kernels.patch"):
        changed = K.patch(model, layer_norm=False)
    for i in range(2):
        assert f"model.vision_tower.encoder.layers.{i}.mlp" in caplog.text
    assert "SiglipMLP" in caplog.text
    assert changed["layer_norm"] == [] and changed["mlp"] and changed["loss"]
    assert sum(type(m) is torch.nn.LayerNorm for m in model.modules()) == 5


@pytest.mark.slow
def test_patch_gemma3_multimodal_follows_unpatched_training_curve(restore_rope):
    """Six AdamW steps with images: the patched model's loss follows the unpatched one's (the bound
    of test_patch_follows_unpatched_training_curve). (``-m slow``; its default siblings are
    test_patch_gemma3_multimodal_matches_unpatched, a step with images, and
    test_patch_follows_unpatched_training_curve[gemma3_text], six steps of its language model.)"""
    ref = tiny_gemma3_multimodal()
    ours = copy.deepcopy(ref)
    K.patch(ours)
    ids, labels, kw = mm_batch(ref)
    curves = []
    for model in (ref, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for _ in range(6):
            loss = model(input_ids=ids, labels=labels, **kw).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        curves.append(curve)
    curve_ref, curve = curves
    assert curve_ref[-1] < curve_ref[0] - 0.05  # it learns
    for i, (a, b) in enumerate(zip(curve, curve_ref)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {i}: patched {a} vs unpatched {b}"

"""Patch a Hugging Face causal LM in place to use the fused kernels.

``patch(model)`` changes, for ``config.model_type`` in :data:`SUPPORTED_MODEL_TYPES` (Llama,
Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text, Gemma 3 with its vision tower, Mixtral,
Qwen3-MoE, Phi-3), finding the
modules by their class (``<Arch>RMSNorm``, ``<Arch>MLP``, ``<Arch>Experts`` of the architecture's
modeling module), so a model built from a config is patched as one loaded from a checkpoint:

* every ``<Arch>RMSNorm`` module (the QK-norms of Qwen3, Qwen3-MoE and Gemma 3 included) ->
  :class:`ckpt.kernels.RMSNorm` sharing the same ``weight`` parameter (state-dict keys and
  optimizer state are unchanged) and ``eps``. Gemma's ``1 + w`` weights, computed in fp32 and
  rounded once, keep their meaning through ``offset=1.0``. A norm writes its input gradient
  over its output gradient (``in_place``) only where its output feeds layers that do not pass
  that gradient on elsewhere: not Gemma 2/3's ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``, whose outputs join the residual stream;
* every ``<Arch>MLP`` -> :class:`SwiGLUMLP` / :class:`GeGLUMLP` (``silu`` / tanh-approximated
  GELU) wrapping the *same* ``gate_proj``/``up_proj``/``down_proj``; Phi-3's fused ``gate_up_proj``
  MLP -> :class:`PackedGLUMLP` (no copy of either half);
* the experts of a mixture-of-experts block (Mixtral, Qwen3-MoE; ``<Arch>Experts``): their forward
  -> :func:`ckpt.kernels.fused_experts` (routing, both grouped GEMMs, the SwiGLU and the weighted
  sum in Triton) over the same ``gate_up_proj`` / ``down_proj``, under every experts
  implementation of transformers (``grouped_mm``, ``batched_mm``, ``eager``), ``torch.compile``
  included; experts that transformers split over ranks (``_is_expert_parallel``) run it with
  ``expert_parallel=True``. Two routes:

  - an experts module whose ``forward`` is its class's gets the patched forward on the instance
    (it keeps serving if ``set_experts_implementation`` later names another implementation, and
    touches no other model that shares the config object);
  - one whose ``forward`` was replaced on the instance by a wrapper around the class's
    (transformers' expert- or tensor-parallel dispatch, which exchanges or all-reduces the ranks'
    shares around the inner call; an accelerate hook) keeps that wrapper, as replacing it would drop
    what it does. The class's forward it calls dispatches on ``config._experts_implementation``
    through transformers' experts registry (``transformers.integrations.moe.ExpertsInterface``), so
    ``patch`` registers the fused experts there as :data:`EXPERTS_IMPLEMENTATION` (``"ckpt_fused"``)
    and names it with ``model.set_experts_implementation``: fused_experts then runs inside the
    wrapper, on the shard and routing the dispatch hands it. Where this cannot be done
    (transformers without the registry, before 5.0; a model that does not let its experts
    implementation be set) the wrapper's inner call runs transformers' implementation with the
    SwiGLU fused, as below, and an INFO log says why. ``set_experts_implementation`` with another
    name takes the route away again (the registry entry stays: it is process-wide, and serves only
    a model whose config names it);

  Where fused_experts cannot run (CPU tensors without the interpreter, weights of another dtype
  outside autocast) transformers' implementation runs (the one the config names; where that is
  ours, the one it named before ``patch``) with the SwiGLU between the two projections ->
  :func:`swiglu_packed`. The router and the expert weights are untouched;
* ``apply_rotary_pos_emb`` of the architecture's modeling module -> :func:`rope`. HF calls this
  module-level function from its attention, so this part of the patch is process-wide for that
  architecture; the replacement falls back to the original function for tensors the kernels
  cannot run on (CPU without the interpreter). Scaled RoPE variants (Phi-3's ``longrope``,
  ``yarn``, ``llama3``, ...) live in the ``cos``/``sin`` tables HF computes, which the kernel takes
  as they are; a partial rotary dimension (``partial_rotary_factor < 1``) rotates the first
  ``cos.shape[-1]`` features and passes the rest through, as HF does;
* for ``*ForCausalLM`` models, ``forward`` of *this instance*: in training mode with ``labels``
  the LM head and the shifted causal-LM loss go through :func:`fused_linear_cross_entropy`, so the
  ``(tokens, vocab)`` logits are never built (the output's ``logits`` is ``None``). Gemma 2/3's
  ``final_logit_softcapping`` is applied inside the loss; MoE models add the router's
  load-balancing loss as HF does (``output_router_logits``). ``num_items_in_batch`` (gradient
  accumulation, as the HF Trainer passes it) makes the loss a sum divided by it, and
  ``shift_labels`` replaces the shifted labels, as in HF's loss. Evaluation, generation and calls
  without labels use the original forward.

Gemma 3 with its vision tower (``Gemma3ForConditionalGeneration``, model_type ``"gemma3"``: a
``gemma3_text`` language model, a SigLIP vision tower, a projector):

* the language model as for ``gemma3_text`` (same modeling module and classes), and the
  projector's ``mm_soft_emb_norm`` (a ``Gemma3RMSNorm``) with it;
* every ``nn.LayerNorm`` of the vision tower -> :class:`ckpt.kernels.LayerNorm` sharing the same
  ``weight`` and ``bias`` parameters and ``eps`` (``"layer_norm"`` in the returned dict);
* SigLIP's MLP (``fc1`` -> tanh-GELU -> ``fc2``) is not gated, so no GLU kernel computes it: it
  stays, named in the warning;
* ``forward`` of the instance, as for ``*ForCausalLM``: transformers 5.24's forward applies
  ``lm_head`` to the base model's last hidden states and calls ``ForCausalLMLoss``, the plain
  shifted causal-LM loss over the labels (no ``final_logit_softcapping``, unlike
  ``Gemma3ForCausalLM``; no filtering by the attention mask; image tokens count unless their
  labels are ``ignore_index``). The fused path computes exactly that, and returns HF's
  ``Gemma3CausalLMOutputWithPast`` (``image_outputs`` included) with ``logits=None``. With
  ``logits_to_keep != 0`` the original forward runs.

What a module object carries is never dropped:

* a norm, MLP, ``nn.LayerNorm`` or ``lm_head`` whose ``forward`` was replaced on the instance (a wrapper
  around the class's: transformers' tensor-parallel styles, e.g. the QK-norms' gradient all-reduce or
  ``lm_head``'s vocabulary gather; an accelerate hook) is left as it is, with the fused loss where it is
  ``lm_head``: the wrapper calls the class's forward through its own reference, so nothing can be fused
  under it. Named under ``"left"`` and at INFO. (Experts are served under theirs, above.)
* a module with hooks registered on it (FSDP2's unit hooks, accelerate's, a user's) or DTensor
  parameters (FSDP2 swaps the gathered weight onto that module object for its forward) is fused in place:
  it keeps its object, class and hooks and gets a forward on the instance that runs the kernel over the
  parameters it holds at call time (its class's forward where those are still DTensors).

``patch`` returns a dict ``{"rms_norm": [...], "layer_norm": [...], "mlp": [...], "experts": [...],
"rope": [...], "loss": [...], "left": [...]}`` naming what it changed and what it left; calling it twice
changes nothing the second time. What it leaves unpatched for want of a kernel (an activation without a
fused kernel, a vision tower's non-gated MLP, an experts layout it does not know) it names in a warning
through ``logging``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import types
from typing import Any, Callable

import torch
from torch import nn

from ._utils import interpreter_enabled
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .glu import GeGLUMLP, PackedGLUMLP, SwiGLUMLP, geglu_packed, swiglu_packed
from .layer_norm import LayerNorm, layer_norm
from .moe import fused_experts
from .rms_norm import RMSNorm, rms_norm
from .rope import rope

__all__ = ["patch", "unpatch_rope", "SUPPORTED_MODEL_TYPES", "EXPERTS_IMPLEMENTATION"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Family:
    """How one architecture is patched."""

    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # class-name prefix in that module
    norm_offset: float = 0.0  # 1.0: Gemma's (1 + w) weights, fp32 product
    residual_norms: tuple[str, ...] = ()  # norms whose output joins the residual: no in-place dx
    softcap: bool = False  # config.final_logit_softcapping applies to the LM head's logits
    moe: bool = False  # <Arch>Experts blocks and the router's auxiliary loss
    vision: bool = False  # a vision tower (LayerNorms, a plain MLP) beside the language model;
    # the loss is <Prefix>ForConditionalGeneration's


_GEMMA_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")

_FAMILIES: dict[str, _Family] = {
    "llama": _Family("llama", "Llama"),
    "mistral": _Family("mistral", "Mistral"),
    "qwen2": _Family("qwen2", "Qwen2"),
    "qwen3": _Family("qwen3", "Qwen3"),
    "gemma": _Family("gemma", "Gemma", norm_offset=1.0),
    "gemma2": _Family("gemma2", "Gemma2", norm_offset=1.0, residual_norms=_GEMMA_POST_NORMS, softcap=True),
    "gemma3_text": _Family(
        "gemma3", "Gemma3", norm_offset=1.0, residual_norms=_GEMMA_POST_NORMS, softcap=True
    ),
    # Gemma3ForConditionalGeneration: the same language model (same modeling module and classes) plus
    # a SigLIP vision tower. Its forward applies no final_logit_softcapping (transformers 5.24), so
    # neither does the patched loss.
    "gemma3": _Family("gemma3", "Gemma3", norm_offset=1.0, residual_norms=_GEMMA_POST_NORMS, vision=True),
    "mixtral": _Family("mixtral", "Mixtral", moe=True),
    "qwen3_moe": _Family("qwen3_moe", "Qwen3Moe", moe=True),
    "phi3": _Family("phi3", "Phi3"),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)
"""The Hugging Face ``config.model_type`` values :func:`patch` knows; another raises ``ValueError``."""

#: activation modules of transformers / torch -> the fused GLU's activation
_SILU_ACTS = {"SiLUActivation", "SiLU"}
_GELU_TANH_ACTS = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"}

_ORIGINAL_ROPE: dict[str, Callable[..., Any]] = {}

#: the patched experts' ``fused_experts(recompute=...)``: True keeps no ``(tokens * top_k, 2I)``
#: pre-activation for backward and recomputes it there (less memory, one more grouped GEMM)
_EXPERTS_RECOMPUTE = False

EXPERTS_IMPLEMENTATION = "ckpt_fused"
"""The name of :func:`ckpt.kernels.fused_experts` in transformers' experts registry
(``transformers.integrations.moe.ExpertsInterface``, next to ``"grouped_mm"``, ``"batched_mm"``, ...).
:func:`patch` registers it and names it in the model's config (``set_experts_implementation``) for
experts whose ``forward`` is a wrapper it keeps (transformers' expert- or tensor-parallel dispatch,
an accelerate hook), so that the class's ``forward`` the wrapper calls runs the fused kernels."""


def _activation(act: Any) -> str | None:
    """``"silu"`` or ``"gelu_tanh"`` for an activation module the fused GLUs compute, else ``None``."""
    name = type(act).__name__
    if name in _SILU_ACTS:
        return "silu"
    if name in _GELU_TANH_ACTS or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    return None


def _modeling(family: _Family) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


def _make_rope(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """Fused replacement for HF's ``apply_rotary_pos_emb`` (see ``ckpt.kernels.rope``)."""
        if not (q.device.type == "cuda" or interpreter_enabled()):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        rot = cos.shape[-1]
        if rot == q.shape[-1]:
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        # partial rotary (Phi-3 with partial_rotary_factor < 1): rotate the first `rot` features
        q_rot, k_rot = rope(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim=unsqueeze_dim)
        return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)

    apply_rotary_pos_emb._ckpt_fused = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _fused_experts_runnable(module: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether :func:`fused_experts` serves this call (else the packed-SwiGLU path does)."""
    if not (hidden_states.device.type == "cuda" or interpreter_enabled()) or hidden_states.dim() != 2:
        return False
    dtype = hidden_states.dtype
    if torch.is_autocast_enabled(hidden_states.device.type):
        return True  # fused_experts casts the three to autocast's dtype
    return module.gate_up_proj.dtype == dtype and module.down_proj.dtype == dtype


def _experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The patched experts' forward: :func:`fused_experts` (routing, both grouped GEMMs, SwiGLU and
    the weighted sum in Triton) wherever it runs, ``torch.compile`` and expert parallelism included;
    otherwise transformers' implementation with the packed SwiGLU (:func:`_transformers_experts`).

    It serves two routes with one signature, transformers' ``(self, hidden_states, top_k_index,
    top_k_weights)``: bound to the instance as its ``forward``, and registered in transformers' experts
    registry as :data:`EXPERTS_IMPLEMENTATION`, which the class's ``forward`` dispatches to."""
    if _fused_experts_runnable(self, hidden_states):
        # expert parallelism (transformers sets the flag where it splits the experts over ranks): the
        # slots of other ranks' experts carry the index num_experts and must add nothing; elsewhere the
        # flag's zeroing would be wasted work
        return fused_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            recompute=_EXPERTS_RECOMPUTE,
            expert_parallel=bool(getattr(self, "_is_expert_parallel", False)),
        )
    return _transformers_experts(self, hidden_states, top_k_index, top_k_weights)


def _transformers_experts(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts implementation, its SwiGLU the packed kernel: the one the config names or,
    where it names ours, the one it named when :func:`patch` ran (``_ckpt_experts_fallback``). Its
    ``grouped_mm`` and ``batched_mm`` call the instance's ``_apply_gate`` (patched to the fused kernel);
    its ``eager`` loop writes ``act_fn(gate) * up`` inline, so it is reproduced here with ``_apply_gate``."""
    implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
    if implementation == EXPERTS_IMPLEMENTATION:
        implementation = getattr(self, "_ckpt_experts_fallback", None)
    registry = _experts_registry()
    if implementation not in (None, "eager", EXPERTS_IMPLEMENTATION) and registry is not None:
        forward = registry.ALL_EXPERTS_FUNCTIONS.get(implementation)
        if forward is not None:
            return forward(self, hidden_states, top_k_index, top_k_weights)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        h = self._apply_gate(nn.functional.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))
        h = nn.functional.linear(h, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


def _experts_registry() -> types.ModuleType | None:
    """``transformers.integrations.moe``, home of transformers' experts registry: ``ExpertsInterface``
    (whose ``register`` adds an implementation for every model) and ``ALL_EXPERTS_FUNCTIONS`` (the
    mapping the experts' ``forward`` looks the config's name up in); ``None`` where this transformers has
    no such registry (before 5.0)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return moe if hasattr(moe, "ExpertsInterface") and hasattr(moe, "ALL_EXPERTS_FUNCTIONS") else None


def _serve_through_registry(model: nn.Module, experts: list[nn.Module]) -> str | None:
    """Make the class-level forward of ``experts`` (whose instance ``forward`` is a wrapper that calls it)
    dispatch to :func:`_experts_forward`: register it in transformers' experts registry as
    :data:`EXPERTS_IMPLEMENTATION` and name that in the model's config, as
    ``model.set_experts_implementation`` does. Returns why not, where it cannot (``None`` when done)."""
    registry = _experts_registry()
    if registry is None:
        return "this transformers has no experts registry (transformers.integrations.moe.ExpertsInterface)"
    set_implementation = getattr(model, "set_experts_implementation", None)
    if not callable(set_implementation):
        return f"{type(model).__name__} has no set_experts_implementation"
    registry.ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _experts_forward)
    try:
        set_implementation(EXPERTS_IMPLEMENTATION)
    except (RuntimeError, ValueError) as e:  # e.g. an implementation chosen for good at load time
        return f"transformers kept its experts implementation ({type(e).__name__}: {e})"
    missed = [
        m for m in experts if getattr(m.config, "_experts_implementation", None) != EXPERTS_IMPLEMENTATION
    ]
    if missed:
        return f"{type(model).__name__} does not let set_experts_implementation reach its experts' config"
    return None


def _experts_patchable(module: nn.Module) -> str | None:
    """Why the packed GLU cannot serve these experts (``None`` when it can)."""
    if not (
        isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
    ):
        return "no gate_up_proj / down_proj expert weights"
    if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        return "gate and up are not stored as [gate; up] halves"
    if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False):
        return "biased or transposed expert weights"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    if _activation(getattr(module, "act_fn", None)) != "silu":
        return (
            f"activation {type(getattr(module, 'act_fn', None)).__name__} (the experts' fused GLU is SwiGLU)"
        )
    return None


def _make_causal_lm_forward(family: _Family, modeling: types.ModuleType) -> Callable[..., Any]:
    from transformers import modeling_outputs

    out_cls = (
        modeling_outputs.MoeCausalLMOutputWithPast if family.moe else modeling_outputs.CausalLMOutputWithPast
    )
    # the cache's field name: ``cache`` from transformers 5.2x, ``past_key_values`` before (decided
    # here, once: torch.compile cannot trace dataclasses.fields)
    cache_name = "cache" if "cache" in {f.name for f in dataclasses.fields(out_cls)} else "past_key_values"

    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        """``*ForCausalLM.forward`` whose training loss skips the logits (fused linear CE)."""
        if past_key_values is not None:
            # passed on only when given: transformers 5.2x renames it ``cache`` (which arrives in
            # kwargs), warns whenever the old name is passed, even as None, and drops it in 5.40
            kwargs["past_key_values"] = past_key_values
        if labels is None or not self.training:
            return self._ckpt_unpatched_forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        if use_cache is None and kwargs.get("past_key_values", kwargs.get("cache")) is None:
            # A training step needs no inference KV cache; left to config.use_cache (True in most
            # configs), some transformers versions build one and copy every layer's keys and values
            # into it (two concatenations per layer: about 2 ms per step at the 1B shape on an H200).
            use_cache = False
        router = None
        if family.moe:
            router = kwargs.pop("output_router_logits", None)
            router = bool(self.config.output_router_logits if router is None else router)
            kwargs["output_router_logits"] = router
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        softcap = getattr(self.config, "final_logit_softcapping", None) if family.softcap else None
        loss = _causal_lm_loss(
            self, outputs[0], labels, shift_labels, ignore_index, num_items, softcap, kwargs
        )
        fields = dict(
            loss=loss,
            logits=None,
            hidden_states=outputs.get("hidden_states"),
            attentions=outputs.get("attentions"),
        )
        if family.moe:
            aux = None
            if router:
                aux = modeling.load_balancing_loss_func(
                    outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
                )
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
            fields.update(loss=loss, aux_loss=aux, router_logits=outputs.get("router_logits"))
        fields[cache_name] = outputs.get("cache", outputs.get("past_key_values"))
        out = out_cls(**fields)
        return out.to_tuple() if return_dict is False else out

    return forward


def _causal_lm_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    shift_labels: torch.Tensor | None,
    ignore_index: int,
    num_items: Any,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """HF's ``ForCausalLMLoss`` over ``model.lm_head(hidden)``, through the fused linear CE (no logits)."""
    if shift_labels is None:
        # HF's causal-LM shift: predict token t+1 at position t; the last position is ignored.
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    # The head's parameters go in as they are: under autocast the fused loss runs its GEMMs in
    # autocast's dtype, as the unpatched lm_head Linear does; otherwise in hidden's dtype. Either
    # way their gradients come back in their own dtype (fp32 master weights stay fp32).
    head = model.lm_head
    keep_hidden = bool(
        kwargs.get("output_hidden_states", getattr(model.config, "output_hidden_states", False))
    )
    loss = fused_linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels,
        head.bias,
        ignore_index=ignore_index,
        reduction="sum" if num_items is not None else "mean",
        inplace=False if keep_hidden else None,
        softcap=softcap,
    )
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return loss


def _make_conditional_generation_forward(modeling: types.ModuleType, prefix: str) -> Callable[..., Any]:
    """``<Prefix>ForConditionalGeneration.forward`` (Gemma 3 with its vision tower) whose training loss
    skips the logits.

    transformers 5.24's forward runs the multimodal base model (image features scattered into the
    image-token positions, a bidirectional mask over each image's tokens from ``token_type_ids``),
    applies ``lm_head`` to every position and hands the logits to ``ForCausalLMLoss``: the shifted
    causal-LM cross-entropy over the labels != ``ignore_index``, mean or sum / ``num_items_in_batch``;
    no ``final_logit_softcapping``, no attention-mask filtering (image and padding positions count
    unless their labels are ``ignore_index``, as a collator sets them). That is the loss computed
    here from the same hidden states.
    """
    out_cls = getattr(modeling, f"{prefix}CausalLMOutputWithPast")
    names = {f.name for f in dataclasses.fields(out_cls)}
    # ``cache`` from transformers 5.2x, ``past_key_values`` before (decided here, not in the forward)
    cache_name = "cache" if "cache" in names else "past_key_values"

    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: Any = None,
        **kwargs: Any,
    ) -> Any:
        """``*ForConditionalGeneration.forward`` whose training loss skips the logits (fused linear CE)."""
        # Only what the caller gave is passed on (every default is None): an argument this
        # transformers version does not know (or deprecates) is then never sent.
        given = {
            k: v
            for k, v in (
                ("input_ids", input_ids),
                ("pixel_values", pixel_values),
                ("attention_mask", attention_mask),
                ("position_ids", position_ids),
                (cache_name, cache),
                ("token_type_ids", token_type_ids),
                ("inputs_embeds", inputs_embeds),
                ("mm_encoder_outputs", mm_encoder_outputs),
            )
            if v is not None
        }
        if (
            labels is None
            or not self.training
            or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
        ):
            # (logits_to_keep != 0 with labels: HF's loss over the kept positions, left to HF)
            return self._ckpt_unpatched_forward(
                **given, labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs
            )
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        if use_cache is None and cache is None and kwargs.get("past_key_values", kwargs.get("cache")) is None:
            use_cache = False  # a training step needs no inference KV cache (see the causal-LM forward)
        outputs = self.model(**given, use_cache=use_cache, **kwargs)
        loss = _causal_lm_loss(self, outputs[0], labels, shift_labels, ignore_index, num_items, None, kwargs)
        fields = dict(
            loss=loss,
            logits=None,
            hidden_states=outputs.get("hidden_states"),
            attentions=outputs.get("attentions"),
        )
        fields[cache_name] = outputs.get(cache_name)  # (asking for the old name warns in 5.2x)
        for name in ("image_outputs", "image_hidden_states"):  # 5.2x / before
            if name in names:
                fields[name] = outputs.get(name)
        out = out_cls(**fields)
        return out.to_tuple() if return_dict is False else out

    return forward


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope_embedding: bool = True,
    mlp: bool = True,
    loss: bool = True,
    layer_norm: bool = True,
) -> dict[str, list[str]]:
    """Swap a supported Hugging Face model's hot paths for fused kernels, in place.

    Args:
        model: a ``*ForCausalLM``, ``Gemma3ForConditionalGeneration`` or base ``*Model`` whose
            ``config.model_type`` is in :data:`SUPPORTED_MODEL_TYPES`.
        rms_norm, rope_embedding, mlp, loss, layer_norm: which parts to patch (all by default;
            ``mlp`` covers the dense MLPs and the experts of MoE blocks; ``layer_norm`` the
            ``nn.LayerNorm``s of a vision tower).

    Returns:
        ``{"rms_norm": [module names], "layer_norm": [module names], "mlp": [module names],
        "experts": [module names], "rope": [function], "loss": [class.forward], "left": [module names]}``;
        ``"left"``: the modules found but left as they are (no fused kernel computes them, or a forward
        of their own on the instance, which patching would drop; ``"lm_head"`` for the loss).

    Raises:
        ValueError: the model's ``config.model_type`` is not supported (the message lists those that are).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(
            f"ckpt.kernels.patch does not support {type(model).__name__} (model_type={model_type!r}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family = _FAMILIES[model_type]
    modeling = _modeling(family)
    changed: dict[str, list[str]] = {
        "rms_norm": [],
        "layer_norm": [],
        "mlp": [],
        "experts": [],
        "rope": [],
        "loss": [],
        "left": [],
    }

    norm_cls = getattr(modeling, f"{family.prefix}RMSNorm")
    mlp_cls = getattr(modeling, f"{family.prefix}MLP", None)
    experts_cls = getattr(modeling, f"{family.prefix}Experts", None)
    skipped: dict[str, str] = {}  # left unpatched: no fused kernel computes it (a WARNING)
    kept: list[str] = []  # left unpatched: a forward of its own on the instance (INFO)
    wrapped: list[str] = []  # experts whose instance-level forward (a wrapper) is kept
    experts_left = False  # experts of a layout fused_experts does not compute
    for name, module in list(model.named_modules()):
        if not name:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if "_ckpt_fused" in vars(module):
            continue  # patched in place by an earlier call
        fusable = (
            (rms_norm and isinstance(module, norm_cls))
            or (mlp and mlp_cls is not None and isinstance(module, mlp_cls))
            or (family.vision and layer_norm and type(module) is nn.LayerNorm)
        )
        if fusable and "forward" in vars(module):
            # a forward installed on the instance wraps the class's (transformers' tensor-parallel styles: the QK-norms'
            # gradient all-reduce, a sharded layer's collectives; an accelerate hook). Neither the fused module that
            # would replace this one nor a fused forward on it would run what the wrapper does, and the wrapper calls
            # the class's forward through a reference of its own, out of patch's reach: the module stays as it is.
            kept.append(name)
        elif rms_norm and isinstance(module, norm_cls):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            in_place = attr not in family.residual_norms
            new = RMSNorm(
                module.weight.shape[0], eps=eps, offset=family.norm_offset, in_place=in_place, device="meta"
            )
            new.weight = module.weight  # share the parameter: same state dict, same optimizer state
            if _put(parent, attr, module, new):
                module._ckpt_fused = (float(eps), family.norm_offset, in_place)
                module.forward = types.MethodType(_rms_norm_in_place, module)
            changed["rms_norm"].append(name)
        elif mlp and mlp_cls is not None and isinstance(module, mlp_cls):
            new_mlp = _fused_mlp(module)
            if isinstance(new_mlp, str):
                skipped[name] = new_mlp
                continue
            if _put(parent, attr, module, new_mlp):
                if isinstance(new_mlp, PackedGLUMLP):
                    module._ckpt_fused = swiglu_packed if new_mlp.activation == "silu" else geglu_packed
                    module.forward = types.MethodType(_packed_mlp_in_place, module)
                else:
                    module._ckpt_fused = type(new_mlp)._fn
                    module.forward = types.MethodType(_glu_mlp_in_place, module)
            changed["mlp"].append(name)
        elif mlp and experts_cls is not None and isinstance(module, experts_cls):
            why = _experts_patchable(module)
            if why is not None:
                skipped[name] = why
                experts_left = True
                continue
            module._apply_gate = swiglu_packed  # an instance attribute: called as self._apply_gate(x)
            # what runs where fused_experts cannot once the config names ours (see _transformers_experts)
            implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
            if implementation != EXPERTS_IMPLEMENTATION:
                module._ckpt_experts_fallback = implementation
            if "forward" in vars(module):
                # a forward installed on the instance wraps the class's: transformers' expert- or tensor-parallel
                # dispatch (it exchanges or all-reduces the ranks' shares around the inner call), an accelerate
                # hook. Replacing it would drop what it does; the class's forward it calls is routed to
                # fused_experts through transformers' experts registry below.
                wrapped.append(name)
            else:
                # an instance forward (not the registry) for the others: it serves whatever implementation
                # the config names later (set_experts_implementation after patch), and no other model
                # sharing this config object
                module.forward = types.MethodType(_experts_forward, module)
            module._ckpt_fused = True
            changed["experts"].append(name)
        elif family.vision and layer_norm and type(module) is nn.LayerNorm:
            new_ln = _fused_layer_norm(module)
            if isinstance(new_ln, str):
                skipped[name] = new_ln
                continue
            if _put(parent, attr, module, new_ln):
                module._ckpt_fused = True
                module.forward = types.MethodType(_layer_norm_in_place, module)
            changed["layer_norm"].append(name)
        elif family.vision and mlp and _plain_mlp(module):
            skipped[name] = (
                f"{type(module).__name__} is fc1 -> {type(module.activation_fn).__name__} -> fc2, "
                "not a gated (GLU) MLP: no fused kernel"
            )
    for name, why in skipped.items():
        log.warning("ckpt.kernels.patch left %s (%s) unpatched: %s", name, model_type, why)
    if kept:
        log.info(
            "ckpt.kernels.patch left %s (%s) unpatched: a forward of their own on the instance (transformers' "
            "tensor parallelism, a hook) wraps the class's, and replacing either would drop what it does",
            ", ".join(kept),
            model_type,
        )
    if wrapped:
        why = (
            "experts of this model have a layout fused_experts does not compute"
            if experts_left
            else _serve_through_registry(model, [model.get_submodule(name) for name in wrapped])
        )
        if why is None:
            log.info(
                "ckpt.kernels.patch: the experts %s (%s) have a forward of their own (transformers' expert "
                "or tensor parallelism, a hook), kept: fused_experts serves the class's forward it calls "
                "(experts implementation %r)",
                ", ".join(wrapped),
                model_type,
                EXPERTS_IMPLEMENTATION,
            )
        else:
            log.info(
                "ckpt.kernels.patch: the experts %s (%s) have a forward of their own (transformers' expert "
                "or tensor parallelism, a hook), kept: their SwiGLU is fused, fused_experts does not serve "
                "them (%s)",
                ", ".join(wrapped),
                model_type,
                why,
            )

    if rope_embedding:
        current = getattr(modeling, "apply_rotary_pos_emb")
        if not getattr(current, "_ckpt_fused", False):
            _ORIGINAL_ROPE[modeling.__name__] = current
            setattr(modeling, "apply_rotary_pos_emb", _make_rope(current))
            changed["rope"].append(f"{modeling.__name__}.apply_rotary_pos_emb")

    head = getattr(model, "lm_head", None)
    if (
        loss
        and isinstance(head, nn.Module)
        and hasattr(model, "model")
        and "_ckpt_unpatched_forward" not in vars(model)
        and "forward" in vars(head)
    ):
        # the head's own forward wraps the class's (transformers' tensor parallelism: a vocabulary-sharded weight,
        # a DTensor, whose logits the wrapper gathers): the fused loss, which multiplies by the weight itself,
        # would bypass it
        kept.append("lm_head")
        log.info(
            "ckpt.kernels.patch left the loss of %s (%s) unpatched: lm_head has a forward of its own on the "
            "instance (transformers' tensor parallelism, a hook), which the fused loss would bypass",
            type(model).__name__,
            model_type,
        )
    elif (
        loss
        and hasattr(model, "lm_head")
        and hasattr(model, "model")
        and "_ckpt_unpatched_forward" not in vars(model)
    ):
        if not family.vision:
            make = _make_causal_lm_forward(family, modeling)
        elif isinstance(model, getattr(modeling, f"{family.prefix}ForConditionalGeneration")):
            make = _make_conditional_generation_forward(modeling, family.prefix)
        else:
            make = None
            log.warning(
                "ckpt.kernels.patch left the loss of %s (%s) unpatched: not %sForConditionalGeneration",
                type(model).__name__,
                model_type,
                family.prefix,
            )
        if make is not None:
            model._ckpt_unpatched_forward = model.forward
            model.forward = types.MethodType(make, model)
            changed["loss"].append(f"{type(model).__name__}.forward")
    changed["left"] = list(skipped) + kept
    return changed


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a sharded or replicated parameter)."""
    dtensor = getattr(getattr(getattr(torch, "distributed", None), "tensor", None), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def _put(parent: nn.Module, attr: str, module: nn.Module, new: nn.Module) -> bool:
    """Put the fused ``new`` (sharing ``module``'s parameters and submodules) in ``module``'s place, unless the
    module object itself carries what a replacement would not: hooks registered on it (FSDP2's gather and
    reshard of a unit, accelerate's, a user's), or parameters that FSDP2 swaps on it (a DTensor shard at rest,
    the gathered tensor registered on this very module for its forward: a replacement would keep the shard).
    Returns True where the caller must fuse ``module`` in place instead (a forward on the instance that reads
    its parameters at call time)."""
    hooks = (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._backward_pre_hooks,
        module._backward_hooks,
    )
    if any(hooks) or any(_is_dtensor(p) for p in module.parameters(recurse=False)):
        return True
    setattr(parent, attr, new)
    return False


def _rms_norm_in_place(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of an ``<Arch>RMSNorm`` fused in place: ``_ckpt_fused`` is ``(eps, offset, in_place)``."""
    weight = self.weight
    if _is_dtensor(weight) or _is_dtensor(
        x
    ):  # not gathered for this call: the class's forward takes DTensors
        return type(self).forward(self, x)
    eps, offset, in_place = self._ckpt_fused
    return rms_norm(x, weight, eps, offset, in_place=in_place)


def _layer_norm_in_place(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """The forward of an ``nn.LayerNorm`` fused in place."""
    if _is_dtensor(self.weight) or _is_dtensor(x):
        return type(self).forward(self, x)
    return layer_norm(x, self.weight, self.bias, self.eps)


def _glu_mlp_in_place(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a gated MLP fused in place: ``_ckpt_fused`` is :func:`swiglu` or :func:`geglu`."""
    return self.down_proj(self._ckpt_fused(self.gate_proj(x), self.up_proj(x)))


def _packed_mlp_in_place(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of Phi-3's MLP fused in place: ``_ckpt_fused`` is :func:`swiglu_packed` or :func:`geglu_packed`."""
    return self.down_proj(self._ckpt_fused(self.gate_up_proj(x)))


def _fused_mlp(module: nn.Module) -> nn.Module | str:
    """The fused replacement of a dense MLP, or why there is none."""
    if hasattr(module, "gate_up_proj"):  # Phi-3: one projection, gate then up
        act = _activation(getattr(module, "activation_fn", None))
        if act is None:
            return f"activation {type(getattr(module, 'activation_fn', None)).__name__} has no fused GLU"
        return PackedGLUMLP(module.gate_up_proj, module.down_proj, act)
    act = _activation(getattr(module, "act_fn", None))
    if act is None:
        return f"activation {type(getattr(module, 'act_fn', None)).__name__} has no fused GLU"
    new_cls = SwiGLUMLP if act == "silu" else GeGLUMLP
    return new_cls.from_linears(module.gate_proj, module.up_proj, module.down_proj)


def _fused_layer_norm(module: nn.LayerNorm) -> nn.Module | str:
    """The fused LayerNorm sharing ``module``'s ``weight``, ``bias`` and ``eps``, or why there is none."""
    if len(module.normalized_shape) != 1:
        return (
            f"normalized over {len(module.normalized_shape)} dimensions (the fused LayerNorm: the last one)"
        )
    if module.weight is None:
        return "no affine weight (elementwise_affine=False)"
    new = LayerNorm(module.normalized_shape[0], eps=module.eps, bias=module.bias is not None, device="meta")
    new.weight = module.weight  # shared parameters: same state dict, same optimizer state
    if module.bias is not None:
        new.bias = module.bias
    return new


def _plain_mlp(module: nn.Module) -> bool:
    """A vision tower's two-layer MLP (SigLIP's ``fc1 -> activation -> fc2``), which no GLU kernel serves."""
    return (
        type(module).__name__.endswith("MLP")
        and isinstance(getattr(module, "fc1", None), nn.Linear)
        and isinstance(getattr(module, "fc2", None), nn.Linear)
        and hasattr(module, "activation_fn")
    )


def unpatch_rope(model_type: str) -> bool:
    """Restore HF's ``apply_rotary_pos_emb`` for ``model_type``; True if something was restored."""
    family = _FAMILIES.get(model_type)
    modeling = (
        _modeling(family)
        if family is not None
        else importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    )
    original = _ORIGINAL_ROPE.pop(modeling.__name__, None)
    if original is None:
        return False
    setattr(modeling, "apply_rotary_pos_emb", original)
    return True

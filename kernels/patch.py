"""Patch a Hugging Face Llama-family model in place to use the fused kernels.

``patch(model)`` changes, for ``model_type`` in :data:`SUPPORTED_MODEL_TYPES`:

* every ``<Arch>RMSNorm`` module -> :class:`ckpt.kernels.RMSNorm` sharing the same
  ``weight`` parameter (state-dict keys and optimizer state are unchanged; Gemma's
  ``1 + w`` weights keep their meaning through ``offset=1.0``). The norms of a Llama-family
  block feed only linear layers, so they write the input gradient in place;
* every ``<Arch>MLP`` -> :class:`SwiGLUMLP` (``hidden_act="silu"``) or :class:`GeGLUMLP`
  (``"gelu_pytorch_tanh"``) wrapping the *same* ``gate_proj``/``up_proj``/``down_proj``;
* ``apply_rotary_pos_emb`` of the architecture's modeling module -> :func:`rope`. HF calls
  this module-level function from its attention, so this part of the patch is
  process-wide for that architecture; the replacement falls back to the original
  function for tensors the kernels cannot run on (CPU without the interpreter);
* for ``*ForCausalLM`` models, ``forward`` of *this instance*: in training mode with
  ``labels`` the LM head and the shifted causal-LM loss go through
  :func:`fused_linear_cross_entropy`, so the ``(tokens, vocab)`` logits are never built
  (the output's ``logits`` is ``None``). Evaluation, generation and calls without labels
  use the original forward. ``num_items_in_batch`` (gradient accumulation) is honoured.

``patch`` returns a dict ``{"rms_norm": [...], "mlp": [...], "rope": [...], "loss": [...]}``
naming what it changed; calling it twice changes nothing the second time.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Callable

import torch
from torch import nn

from ._utils import interpreter_enabled
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .glu import GeGLUMLP, SwiGLUMLP
from .rms_norm import RMSNorm
from .rope import rope

__all__ = ["patch", "unpatch_rope", "SUPPORTED_MODEL_TYPES"]

#: model_type -> class-name prefix in ``transformers.models.<type>.modeling_<type>``
_ARCHS: dict[str, str] = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma"}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_ARCHS)

#: RMSNorm weight parameterisation per model type: Gemma scales by ``1 + w`` in fp32 (rms_norm's
#: ``offset=1.0``); the others multiply ``w`` by the normalised input rounded to its dtype
_NORM_OFFSET: dict[str, float] = {"gemma": 1.0}

_MLP_BY_ACT: dict[str, type[nn.Module]] = {
    "silu": SwiGLUMLP,
    "swish": SwiGLUMLP,
    "gelu_pytorch_tanh": GeGLUMLP,
    "gelu_new": GeGLUMLP,
}

_ORIGINAL_ROPE: dict[str, Callable[..., Any]] = {}


def _make_rope(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """Fused replacement for HF's ``apply_rotary_pos_emb`` (see ``ckpt.kernels.rope``)."""
        if q.device.type == "cuda" or interpreter_enabled():
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb._ckpt_fused = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _causal_lm_forward(
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
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep,
            **kwargs,
        )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    return_dict = kwargs.pop("return_dict", None)
    if use_cache is None and kwargs.get("past_key_values", kwargs.get("cache")) is None:
        # A training step needs no inference KV cache; left to config.use_cache (True in most
        # configs), some transformers versions build one and copy every layer's keys and values
        # into it (two concatenations per layer: about 2 ms per step at the 1B shape on an H200).
        use_cache = False
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = self.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
    )
    hidden = outputs[0]
    # HF's causal-LM shift: predict token t+1 at position t; the last position is ignored.
    shift = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(hidden.device)
    # The head's parameters go in as they are: under autocast the fused loss runs its GEMMs in
    # autocast's dtype, as the unpatched lm_head Linear does; otherwise in hidden's dtype. Either
    # way their gradients come back in their own dtype (fp32 master weights stay fp32).
    head = self.lm_head
    weight, bias = head.weight, head.bias
    keep_hidden = bool(kwargs.get("output_hidden_states", getattr(self.config, "output_hidden_states", False)))
    loss = fused_linear_cross_entropy(
        hidden, weight, shift, bias, ignore_index=ignore_index,
        reduction="sum" if num_items is not None else "mean",
        inplace=False if keep_hidden else None,
    )
    if num_items is not None:
        loss = loss / num_items
    out = CausalLMOutputWithPast(
        loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None), attentions=getattr(outputs, "attentions", None),
    )
    return out.to_tuple() if return_dict is False else out


def patch(
    model: nn.Module, *, rms_norm: bool = True, rope_embedding: bool = True, mlp: bool = True, loss: bool = True
) -> dict[str, list[str]]:
    """Swap a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Gemma model's hot paths for fused kernels, in place.

    Args:
        model: a ``*ForCausalLM`` or base ``*Model`` of a supported architecture.
        rms_norm, rope_embedding, mlp, loss: which parts to patch (all by default).

    Returns:
        ``{"rms_norm": [module names], "mlp": [module names], "rope": [function], "loss": [class.forward]}``.

    Raises:
        ValueError: the model's ``config.model_type`` is not supported (the message lists those that are).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _ARCHS:
        raise ValueError(
            f"ckpt.kernels.patch does not support {type(model).__name__} (model_type={model_type!r}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    prefix = _ARCHS[model_type]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    changed: dict[str, list[str]] = {"rms_norm": [], "mlp": [], "rope": [], "loss": []}

    norm_cls = getattr(modeling, f"{prefix}RMSNorm")
    mlp_cls = getattr(modeling, f"{prefix}MLP")
    mlp_new = _MLP_BY_ACT.get(getattr(config, "hidden_act", ""))
    for name, module in list(model.named_modules()):
        if not name:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if rms_norm and isinstance(module, norm_cls):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            new = RMSNorm(module.weight.shape[0], eps=eps, offset=_NORM_OFFSET.get(model_type, 0.0), in_place=True,
                          device="meta")
            new.weight = module.weight  # share the parameter: same state dict, same optimizer state
            setattr(parent, attr, new)
            changed["rms_norm"].append(name)
        elif mlp and mlp_new is not None and isinstance(module, mlp_cls):
            setattr(parent, attr, mlp_new.from_linears(module.gate_proj, module.up_proj, module.down_proj))
            changed["mlp"].append(name)

    if rope_embedding:
        current = getattr(modeling, "apply_rotary_pos_emb")
        if not getattr(current, "_ckpt_fused", False):
            _ORIGINAL_ROPE[modeling.__name__] = current
            setattr(modeling, "apply_rotary_pos_emb", _make_rope(current))
            changed["rope"].append(f"{modeling.__name__}.apply_rotary_pos_emb")

    if loss and hasattr(model, "lm_head") and hasattr(model, "model") and "_ckpt_unpatched_forward" not in vars(model):
        model._ckpt_unpatched_forward = model.forward
        model.forward = types.MethodType(_causal_lm_forward, model)
        changed["loss"].append(f"{type(model).__name__}.forward")
    return changed


def unpatch_rope(model_type: str) -> bool:
    """Restore HF's ``apply_rotary_pos_emb`` for ``model_type``; True if something was restored."""
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = _ORIGINAL_ROPE.pop(modeling.__name__, None)
    if original is None:
        return False
    setattr(modeling, "apply_rotary_pos_emb", original)
    return True

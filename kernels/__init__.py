"""Fused Triton kernels for training transformer language models (``ckpt.kernels``).

Each kernel comes in three layers: a Triton kernel, a ``torch.autograd.Function``, and a
functional form plus (where it makes sense) an ``nn.Module``:

* :func:`rms_norm`, :class:`RMSNorm`; :func:`fused_add_rms_norm`, :class:`FusedAddRMSNorm` (``rms_norm.py``)
* :func:`layer_norm`, :class:`LayerNorm` (``layer_norm.py``)
* :func:`rope`, for Hugging Face's ``apply_rotary_pos_emb`` (``rope.py``)
* :func:`swiglu`, :func:`geglu`, :class:`SwiGLUMLP`, :class:`GeGLUMLP`; :func:`swiglu_packed`,
  :func:`geglu_packed`, :class:`PackedGLUMLP` (``glu.py``)
* :func:`cross_entropy`, :class:`CrossEntropyLoss` (``cross_entropy.py``)
* :func:`fused_linear_cross_entropy`, :class:`FusedLinearCrossEntropyLoss`
  (``fused_linear_cross_entropy.py``)
* :func:`fused_experts`, for Hugging Face's ``<Arch>Experts`` (``moe.py``)
* :func:`patch`: Hugging Face Llama, Mistral, Qwen2/3, Gemma 1/2/3, Gemma 3 multimodal, Mixtral,
  Qwen3-MoE, Phi-3 (``patch.py``)

Importing this package needs neither Triton nor a GPU; the kernels raise a clear error
on first use when Triton is missing, and accept CPU tensors only under the Triton
interpreter (``TRITON_INTERPRET=1``). See ``docs/kernels.md``.
"""

import sys as _sys

if __name__ != "ckpt.kernels":  # pragma: no cover - exercised in a subprocess test
    # Imported under another name, e.g. as a top-level ``kernels`` package: this folder, found through a source checkout's
    # root on sys.path (``python -m pytest`` run there), by code looking for Hugging Face's
    # ``kernels`` package (transformers' ``is_kernels_available`` imports it by that name).
    # Become ``ckpt.kernels`` and its submodules instead of a second copy, which would register
    # the custom operators again with functions whose module state (compiled kernels, LayerNorm
    # tickets) is a second, empty copy: inductor's CUDA graphs then saw an allocation leak.
    try:
        import importlib as _importlib

        _canonical = _importlib.import_module("ckpt.kernels")
    except ImportError:
        _canonical = None
    if _canonical is not None:
        for _name, _module in list(_sys.modules.items()):
            if _name.startswith("ckpt.kernels."):
                _sys.modules[__name__ + _name[len("ckpt.kernels") :]] = _module
        _sys.modules[__name__] = _canonical

from ._utils import HAS_TRITON, interpreter_enabled
from .cross_entropy import CrossEntropyLoss, cross_entropy
from .fused_linear_cross_entropy import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .glu import GeGLUMLP, PackedGLUMLP, SwiGLUMLP, geglu, geglu_packed, swiglu, swiglu_packed
from .layer_norm import LayerNorm, layer_norm
from .moe import fused_experts
from .patch import EXPERTS_IMPLEMENTATION, SUPPORTED_MODEL_TYPES, patch, unpatch_rope
from .rms_norm import FusedAddRMSNorm, RMSNorm, fused_add_rms_norm, rms_norm
from .rope import rope

__all__ = [
    "HAS_TRITON",
    "interpreter_enabled",
    "rms_norm",
    "RMSNorm",
    "fused_add_rms_norm",
    "FusedAddRMSNorm",
    "layer_norm",
    "LayerNorm",
    "rope",
    "swiglu",
    "geglu",
    "SwiGLUMLP",
    "GeGLUMLP",
    "swiglu_packed",
    "geglu_packed",
    "PackedGLUMLP",
    "cross_entropy",
    "CrossEntropyLoss",
    "fused_linear_cross_entropy",
    "FusedLinearCrossEntropyLoss",
    "fused_experts",
    "patch",
    "unpatch_rope",
    "EXPERTS_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
]

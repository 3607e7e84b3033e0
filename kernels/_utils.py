"""Shared plumbing for the fused kernels: Triton availability, lazy JIT, argument checks.

Why a lazy JIT: ``triton.jit`` decides *when the decorator runs* whether a kernel is
compiled for the GPU or run by the interpreter (``TRITON_INTERPRET=1``).  Applying it
at first launch instead of at import time means

* ``import ckpt.kernels`` works without Triton installed (the kernels raise a clear
  :class:`RuntimeError` on first use instead), and
* a kernel is built in the mode current at its first launch. Triton itself fixes the
  mode of its own ``tl`` helpers when *it* is first imported (``ckpt.kernels`` imports
  it when installed), so ``TRITON_INTERPRET`` must be set before that; a mismatch is
  detected and reported with a clear error instead of an obscure interpreter failure.

Kernels in this package are therefore written as plain module-level functions and
wrapped with :class:`LazyKernel`; they call no other ``@triton.jit`` helpers, so the
lazy wrapping never has to resolve nested JIT functions.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterable

import torch

__all__ = [
    "HAS_TRITON",
    "LazyKernel",
    "triton",
    "tl",
    "interpreter_enabled",
    "require_triton",
    "check_tensor",
    "check_same_device",
    "check_runnable_device",
    "num_programs",
    "next_power_of_2",
    "owns_storage",
    "bump_version",
]


class _MissingTritonLanguage:
    """Stand-in for ``triton.language`` so kernel signatures (``x: tl.constexpr``) still
    evaluate when Triton is not installed. Any real use goes through :func:`require_triton`."""

    constexpr = object
    float32 = int64 = int32 = None

    def __getattr__(self, name: str) -> Any:  # pragma: no cover - only without triton
        return None


try:  # guarded: the package must import without triton
    import triton  # type: ignore[import-not-found]
    import triton.language as tl  # type: ignore[import-not-found]

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised in a subprocess test
    triton = None  # type: ignore[assignment]
    tl = _MissingTritonLanguage()  # type: ignore[assignment]
    HAS_TRITON = False


def interpreter_enabled() -> bool:
    """True when Triton should run kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def require_triton() -> None:
    """Raise a clear error when Triton is missing (the kernels cannot run without it)."""
    if not HAS_TRITON:
        raise RuntimeError(
            "ckpt.kernels needs Triton, which is not installed: `pip install 'tierckpt[kernels]'` "
            "(or `pip install triton`). Plain `import ckpt` and checkpointing work without it."
        )


def _check_triton_mode(interp: bool) -> None:
    """Triton fixes interpreter-or-compiler for its own ``tl`` helpers when it is first imported."""
    import triton.language.standard as std

    imported_interpreted = type(std.sum).__name__ == "InterpretedFunction"
    if imported_interpreted != interp:
        raise RuntimeError(
            f"TRITON_INTERPRET is {'set' if interp else 'unset'} now but was "
            f"{'set' if imported_interpreted else 'unset'} when triton was first imported; "
            "set it before anything imports triton (e.g. at the top of conftest.py)"
        )


class LazyKernel:
    """A Triton kernel compiled (or interpreted) on first launch: ``LazyKernel(fn)[grid](...)``.

    The JIT object is rebuilt when the interpreter setting changes, so one process can
    run under the interpreter and then on the GPU.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jit: Any = None
        self._interp: bool | None = None
        functools.update_wrapper(self, fn)

    def _get(self) -> Any:
        require_triton()
        interp = interpreter_enabled()
        if self._jit is None or self._interp != interp:
            _check_triton_mode(interp)
            self._jit = triton.jit(self.fn)
            self._interp = interp
        return self._jit

    def __getitem__(self, grid: Any) -> Any:
        return self._get()[grid]


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_tensor(
    t: Any,
    name: str,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
) -> None:
    """Raise ``ValueError`` naming ``name`` when ``t`` is not a tensor of the expected dtype/rank."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of: {names}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")


def check_runnable_device(t: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` when Triton cannot run on ``t``'s device.

    CUDA tensors always work; CPU tensors only under the interpreter.
    """
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreter_enabled():
        return
    if t.device.type == "cpu":
        raise ValueError(
            f"{name} is a CPU tensor: the fused Triton kernels run on CUDA tensors. To run them on the "
            "CPU (slowly, for tests), set TRITON_INTERPRET=1 in the environment."
        )
    raise ValueError(f"{name} is on device {t.device}; the fused Triton kernels need a CUDA tensor")


def check_same_device(ref: torch.Tensor, ref_name: str, **others: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the first tensor in ``others`` not on ``ref``'s device."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must share a device")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device, cap: int, per_sm: int = 1) -> int:
    """Number of persistent programs: ``per_sm`` per SM on a GPU (4 under the interpreter), at most ``cap``."""
    if device.type == "cuda":
        n = per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        n = 4
    return max(1, min(n, cap))


def owns_storage(t: torch.Tensor) -> bool:
    """True when ``t`` is an autograd intermediate that owns its memory.

    Such a tensor is private to the graph (not a user leaf, not a view into someone else's
    buffer), so a kernel may overwrite it with a gradient once its values are no longer
    needed. Misuse (another node saved it) is caught by :func:`bump_version`.
    """
    return t.grad_fn is not None and t._base is None and t.is_contiguous()


def bump_version(*tensors: torch.Tensor) -> None:
    """Tell autograd that ``tensors`` were overwritten by a kernel.

    A Triton store through a raw pointer does not bump the version counter; doing it by
    hand makes any other node that saved the tensor fail loudly in backward instead of
    silently reading a gradient.
    """
    for t in tensors:
        torch.autograd.graph.increment_version(t)

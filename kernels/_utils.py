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
wrapped with :class:`LazyKernel`. Device functions they call are wrapped with
:func:`jit_helper` instead, which applies ``triton.jit`` when the package is imported: the
same moment, and so the same interpreter-or-compiler mode, as Triton's own ``tl`` helpers.

Why a launch cache: on the GPU machine's 2.1 GHz host, ``JITFunction.run`` spends 40-70 us
per launch binding arguments and computing Triton's specialization key (measured, H200
device, Triton 3.6), more than the GPU time of a norm over 8192 x 4096 bf16. For kernels
whose GPU time is that short the host becomes the bottleneck. :class:`LazyKernel` keeps, per
*launch key*, the compiled kernel that Triton chose the first time and afterwards calls its
launcher directly. The key is deliberately finer than Triton's own specialization
(:func:`launch_signature_of` states what that needs): per tensor its dtype and its address
modulo 16; per integer, constexpr and launch option its value; per float only that it is one.
Keying integers by value costs a cache entry per distinct shape (bounded, see
``_CACHE_LIMIT``) and halves the key's host cost. Anything else (an argument type it does
not know, launch hooks installed by a profiler) takes Triton's normal path.
``CKPT_KERNELS_FAST_LAUNCH=0`` (read when ``ckpt.kernels`` is imported) turns the cache off.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterable

import torch

__all__ = [
    "HAS_TRITON",
    "LazyKernel",
    "jit_helper",
    "op_def",
    "OP_NAMESPACE",
    "launch_signature_of",
    "triton",
    "tl",
    "interpreter_enabled",
    "require_triton",
    "check_tensor",
    "check_same_device",
    "check_runnable_device",
    "num_programs",
    "next_power_of_2",
    "row_warps",
    "register_cap",
    "as_rows",
    "rows_of",
    "empty_rows_like",
    "autocast_dtype",
    "dense_vector",
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

    try:  # launch hooks (profilers) live here; older releases lack it: then no launch cache
        from triton import knobs as _knobs  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - depends on the Triton release
        _knobs = None
    HAS_TRITON = True
    """Whether Triton imported. Without it ``import ckpt.kernels`` still works, and each kernel raises a
    ``RuntimeError`` saying so on first use."""
except ImportError:  # pragma: no cover - exercised in a subprocess test
    triton = None  # type: ignore[assignment]
    tl = _MissingTritonLanguage()  # type: ignore[assignment]
    _knobs = None
    HAS_TRITON = False

_runtime = getattr(_knobs, "runtime", None)  # where Triton keeps its launch hooks


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


def jit_helper(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)`` for a device function that kernels call (``fn`` itself without Triton).

    Applied at import, like Triton's own ``tl`` helpers, so helpers and ``tl`` always share a
    mode; a kernel launched in the other mode fails first with the clear error of
    :func:`_check_triton_mode`.
    """
    return triton.jit(fn) if HAS_TRITON else fn


OP_NAMESPACE = "ckpt"


def op_def(name: str, schema: str) -> Callable[[Callable[..., Any]], Any]:
    """Register the decorated function as the custom operator ``torch.ops.ckpt.<name>``.

    What ``torch.compile`` sees of a kernel: Dynamo puts one opaque node in the graph (no graph
    break), the operator's fake implementation gives output shapes at trace time, and the
    compiled graph calls the decorated function, i.e. the same launch code as eager, at run time.
    ``schema`` is given explicitly (``"(Tensor x, float eps) -> Tensor"``): no annotations to
    infer from. Operators here never mutate or alias their inputs.
    """

    def register(fn: Callable[..., Any]) -> Any:
        return torch.library.custom_op(f"{OP_NAMESPACE}::{name}", fn, mutates_args=(), schema=schema)

    return register


class _NoFastPath(Exception):
    """An argument the launch cache does not know how to key: use Triton's normal path."""


def launch_signature_of(arg: Any) -> Any:
    """What a launch argument contributes to the launch cache's key (see the module docstring).

    At least as fine as Triton's specialization of the argument: tensors by dtype and 16-byte
    alignment, integers by (== 1, multiple of 16, 32-bit), floats and ``None`` by kind, bools
    by value. Raises :class:`_NoFastPath` for anything else.
    """
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    kind = type(arg)
    if kind is bool:
        return "T" if arg else "F"
    if kind is int:
        return (arg == 1) | (arg & 15 == 0) << 1 | (-(2**31) <= arg < 2**31) << 2 | (arg >= 2**63) << 3
    if kind is float:
        return "f"
    if arg is None:
        return "N"
    raise _NoFastPath(kind.__name__)


#: most launch-cache entries per kernel; past it the cache starts over (entries are cheap to rebuild)
_CACHE_LIMIT = 4096


def _launch_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The hot-path cache key of a launch's runtime arguments: finer than
    :func:`launch_signature_of` (integers by value), about half its cost, and the same
    facts about tensors (dtype, address modulo 16). Arguments it cannot key come out as
    their type, and :func:`_cacheable` keeps such launches out of the cache."""
    key = []
    add = key.append
    for a in args:
        kind = type(a)
        if kind is int or a is None:
            add(a)
        elif kind is float:
            add(float)
        elif isinstance(a, torch.Tensor):
            add((a.dtype, a.data_ptr() & 15))
        else:  # bool (kept apart from the int 1, which it equals), or an unknown type
            add((kind, a) if kind is bool else kind)
    return tuple(key)


def _cacheable(args: tuple[Any, ...]) -> bool:
    """Whether every argument is one :func:`launch_signature_of` knows how to key."""
    try:
        for a in args:
            launch_signature_of(a)
    except _NoFastPath:
        return False
    return True


def _hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook is installed (``None`` in older releases, an empty
    ``HookChain`` in newer ones when nothing is)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


def _fast_launch_enabled() -> bool:
    return os.environ.get("CKPT_KERNELS_FAST_LAUNCH", "1").lower() not in ("0", "false", "off", "no")


#: read once, when the package is imported (an environment lookup per launch costs about 1 us)
_FAST_LAUNCH = _fast_launch_enabled()


class LazyKernel:
    """A Triton kernel compiled (or interpreted) on first launch: ``LazyKernel(fn)[grid](...)``.

    The JIT object is rebuilt when the interpreter setting changes, so one process can
    run under the interpreter and then on the GPU. On the GPU, repeated launches with the
    same launch signature skip Triton's argument binding (module docstring). Call sites
    pass runtime arguments positionally and ``tl.constexpr`` parameters and launch options
    (``num_warps``, ``num_stages``, ``maxnreg``) by keyword.
    """

    def __init__(self, fn: Callable[..., Any], *, debug: bool = False) -> None:
        self.fn = fn
        self.debug = debug  # compile with Triton's debug mode: tl.device_assert active
        self._jit: Any = None
        self._interp: bool | None = None
        self._compiled: dict[Any, Any] = {}
        functools.update_wrapper(self, fn)

    def _get(self) -> Any:
        require_triton()
        interp = interpreter_enabled()
        if self._jit is None or self._interp != interp:
            _check_triton_mode(interp)
            self._jit = triton.jit(self.fn, debug=True) if self.debug else triton.jit(self.fn)
            self._interp = interp
            self._compiled.clear()
        return self._jit

    def __getitem__(self, grid: Any) -> Any:
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
        """``self[grid](*args, **kwargs)``: launch on ``grid`` (1 to 3 program counts), on the
        device of the first argument (a tensor), whatever the current device is."""
        first = args[0]
        cuda = isinstance(first, torch.Tensor) and first.is_cuda
        if cuda:
            device = first.get_device()
            if device != torch.cuda.current_device():
                # Triton compiles for and launches on the current device; a model spread over
                # several GPUs in one process (device_map) calls with tensors elsewhere.
                with torch.cuda.device(device):
                    return self.launch(grid, *args, **kwargs)
        if self._jit is None or self._interp or not _FAST_LAUNCH or not cuda:
            # first launch, the interpreter, the cache turned off, or not a CUDA launch:
            # (re)build in the mode the environment asks for now, and use Triton's path
            jit = self._get()
            if self._interp or not _FAST_LAUNCH or not cuda:
                return jit[grid](*args, **kwargs)
        return self._launch(self._jit, grid, args, kwargs, device)

    def _param_layout(self, jit: Any, n_pos: int, names: tuple[str, ...]) -> tuple[str, ...] | None:
        """Names of the parameters after the positional ones, in signature order, for this
        call shape, or ``None`` where the cache cannot reproduce Triton's argument list (a
        constexpr passed positionally, a parameter left to its default, an unknown keyword)."""
        try:
            params = list(jit.params)
        except AttributeError:  # a Triton whose JITFunction looks different: normal path
            return None
        if any(p.is_constexpr for p in params[:n_pos]):
            return None
        tail = tuple(p.name for p in params[n_pos:])
        ok = set(tail) <= set(names) and set(names) - set(tail) <= _LAUNCH_OPTIONS
        return tail if ok else None

    def _launch(
        self, jit: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], device: int
    ) -> Any:
        # Hot path: one dict lookup keyed by (device, argument signature, keyword values),
        # then the compiled kernel's own launcher. Everything else happens on a miss.
        if _runtime is None:
            return jit[grid](*args, **kwargs)
        enter, leave = _runtime.launch_enter_hook, _runtime.launch_exit_hook
        if (enter is not None and _hook_set(enter)) or (leave is not None and _hook_set(leave)):
            return jit[grid](*args, **kwargs)
        key = (device, _launch_key(args), tuple(kwargs.items()))
        entry = self._compiled.get(key)
        if entry is None:
            kernel = jit.run(*args, grid=grid, warmup=False, **kwargs)
            tail = self._param_layout(jit, len(args), tuple(kwargs))
            if kernel is not None and tail is not None and _cacheable(args):
                if len(self._compiled) >= _CACHE_LIMIT:  # many distinct shapes: start over
                    self._compiled.clear()
                self._compiled[key] = (kernel, tuple(kwargs[name] for name in tail))
            return kernel
        kernel, tail_values = entry
        n = len(grid)
        kernel.run(
            grid[0],
            grid[1] if n > 1 else 1,
            grid[2] if n > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device),
            kernel.function,
            kernel.packed_metadata,
            None,
            enter,
            leave,
            *args,
            *tail_values,
        )
        return kernel


#: launch options (not kernel parameters) a cached launch may be called with
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "maxnreg"})


def register_cap(n_regs: int | None) -> dict[str, int]:
    """Launch options that cap a kernel at ``n_regs`` registers per thread (``{}`` for none).

    A one-row-per-program kernel that streams its row is limited by how many loads the SM has in
    flight, and that by how many programs fit its register file: 65536 registers per SM on
    Hopper and Ampere, so programs of 256 threads fit four at a time only at <= 64 registers
    each. ``ptxas`` left alone spends registers on keeping more of each thread's loads in flight
    and fits fewer programs. The cap is an NVIDIA option (``maxnreg``, PTX ``.maxnreg``); other
    backends get none.
    """
    if n_regs is None or torch.version.hip is not None:
        return {}
    return {"maxnreg": int(n_regs)}


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel whose row block holds ``block`` elements."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` as rows of its last dimension: ``(t, rows, row_stride)``, where ``t`` has unit stride
    in the last dim and row ``i`` starts ``i * row_stride`` elements after ``t``'s address.

    A contiguous ``x`` comes back as itself (no view: this runs on every norm call, and a view
    costs host time); otherwise a ``(rows, N)`` view, or a copy where no view has unit stride.
    """
    n = x.shape[-1]
    if x.is_contiguous():
        return x, rows_of(x), n
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.shape[0], x2.stride(0)


def rows_of(x: torch.Tensor) -> Any:
    """Number of rows of ``x`` over its last dimension (symbolic under ``torch.compile``)."""
    n = x.shape[-1]
    return x.numel() // n if n else math.prod(x.shape[:-1])


def empty_rows_like(t: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``t``'s shape and ``dtype`` (default ``t``'s) with its
    own storage, where ``rows`` is what :func:`as_rows` returned for ``t``: ``empty_like`` (the
    cheaper call) when that was ``t`` itself, i.e. ``t`` is contiguous."""
    if rows is t:
        return torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts to on ``device``'s type when it is enabled there, else
    ``None``. (Traceable: Dynamo guards on the autocast state.)"""
    kind = device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


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
            raise ValueError(
                f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of: {names}"
            )
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}"
            )
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
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must share a device"
            )


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


def dense_vector(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` itself when it is ``None`` or a unit-stride vector, else a contiguous copy
    (differentiable, so gradients still reach a strided parameter view). The kernels index
    per-feature vectors (norm weights and biases) as ``base + column``."""
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()


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

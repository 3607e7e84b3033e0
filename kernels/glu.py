"""Fused gated linear units: SwiGLU ``silu(a) * b`` and GeGLU ``gelu_tanh(a) * b``.

Math (``s = sigmoid(a)``; ``u = k (a + 0.044715 a^3)``, ``k = sqrt(2/pi)``, ``t = tanh(u)``)::

    swiglu:  c = a s b               dc/da = s (1 + a (1 - s)) b     dc/db = a s
    geglu:   c = 0.5 a (1 + t) b     dc/da = [0.5 (1 + t) + 0.5 a (1 - t^2) k (1 + 3*0.044715 a^2)] b
                                     dc/db = 0.5 a (1 + t)

With ``s2 = sigmoid(2u)`` the GeGLU terms are evaluated as ``0.5 (1 + t) = s2`` and
``1 - t^2 = 4 s2 sigmoid(-2u)``: only primitives present in every supported Triton version (and in the
interpreter), and no ``1 + t`` or ``1 - t^2`` that cancels to nothing where ``tanh`` saturates.

Memory tricks:

* Nothing but the two inputs is saved; the activation ``act(a)`` and its derivative are
  recomputed in backward (one extra ``exp`` per element on a bandwidth-bound kernel), so
  the block never stores the ``(tokens, intermediate)`` activation that eager PyTorch keeps.
* ``da``/``db`` are written over ``a``/``b`` in place when those are private autograd
  intermediates (e.g. the outputs of ``gate_proj``/``up_proj``, which nothing else reads):
  backward then allocates nothing. For user leaves or views a fresh buffer is used.
  The version counters of overwritten tensors are bumped so misuse fails loudly.

Shapes: ``a`` and ``b`` ``(..., I)`` with equal shapes; output the same shape.

Packed form (:func:`swiglu_packed`, :func:`geglu_packed`): one ``(..., 2I)`` tensor holding ``a`` in its
first half and ``b`` in its second, as a fused ``gate_up_proj`` (Phi-3's MLP, the experts of
Mixtral and Qwen3-MoE in transformers 5) makes it. The kernel addresses both halves in place
(one program per row and column block), so neither half is copied out, and the gradient is one
``(..., 2I)`` tensor (``da`` then ``db``), written over the input when it is a private intermediate.

Dtypes as ``act(a) * b`` in PyTorch, which autocast leaves alone: the output takes the promoted
dtype of ``a`` and ``b``; ``da`` comes back in ``a``'s dtype, ``db`` in ``b``'s (the kernel loads
any dtype and stores each tensor's own, so mixed dtypes cost no cast pass).

References:
    Shazeer, "GLU Variants Improve Transformer", 2020.
    Hendrycks & Gimpel, "Gaussian Error Linear Units", 2016 (tanh approximation).
    Ramachandran et al., "Searching for Activation Functions", 2017 (SiLU/Swish).
"""

from __future__ import annotations

import torch
from torch import nn

from ._utils import (
    LazyKernel,
    as_rows,
    bump_version,
    jit_helper,
    check_runnable_device,
    check_same_device,
    check_tensor,
    next_power_of_2,
    op_def,
    owns_storage,
    tl,
)

__all__ = [
    "swiglu",
    "geglu",
    "swiglu_packed",
    "geglu_packed",
    "GLUFunction",
    "PackedGLUFunction",
    "SwiGLUMLP",
    "GeGLUMLP",
    "PackedGLUMLP",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_SILU, _GELU_TANH = 0, 1
_BLOCK = 2048  # 8 elements per thread with 8 warps: 16-byte bf16 accesses


@jit_helper
def _act(a, ACT: tl.constexpr):
    """``silu(a)`` (``ACT`` 0) or ``gelu_tanh(a)`` (1), fp32."""
    if ACT == 0:
        return a * tl.sigmoid(a)
    # 0.5 a (1 + tanh(u)) = a sigmoid(2u): no 1 + tanh to cancel for negative a
    u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    return a * tl.sigmoid(2.0 * u)


@jit_helper
def _act_and_grad(a, ACT: tl.constexpr):
    """``(act(a), act'(a))``, fp32."""
    if ACT == 0:
        s = tl.sigmoid(a)
        return a * s, s * (1.0 + a * (1.0 - s))
    # with s = sigmoid(2u): 0.5 (1 + tanh u) = s and 1 - tanh^2 u = 4 s sigmoid(-2u), both without the
    # cancellation 1 + t and 1 - t * t suffer where tanh saturates (fp32 kept ~6e-8 of absolute error there)
    k = 0.7978845608028654
    u2 = 2.0 * k * (a + 0.044715 * a * a * a)
    s = tl.sigmoid(u2)
    return a * s, s + 2.0 * a * s * tl.sigmoid(-u2) * k * (1.0 + 3.0 * 0.044715 * a * a)


def _glu_fwd_kernel(A, B, C, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + offs, (_act(a, ACT) * b).to(C.dtype.element_ty), mask=mask)


def _glu_bwd_kernel(DC, A, B, DA, DB, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(a, ACT)
    # DA/DB may alias A/B: both were read above, element for element.
    tl.store(DA + offs, (dc * dact * b).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dc * act).to(DB.dtype.element_ty), mask=mask)


def _glu_packed_fwd_kernel(X, C, stride_x, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr):
    # row `row` of X holds a in columns [0, n_cols) and b in [n_cols, 2 n_cols); C is (rows, n_cols)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + row * n_cols + cols, (_act(a, ACT) * b).to(C.dtype.element_ty), mask=mask)


def _glu_packed_bwd_kernel(
    DC, X, DX, stride_dc, stride_x, stride_dx, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dc = tl.load(DC + row * stride_dc + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(a, ACT)
    # DX may alias X: this program read both halves of these columns above.
    tl.store(DX + row * stride_dx + cols, (dc * dact * b).to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + n_cols + cols, (dc * act).to(DX.dtype.element_ty), mask=mask)


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


_fwd = LazyKernel(_glu_fwd_kernel)
_bwd = LazyKernel(_glu_bwd_kernel)
_packed_fwd = LazyKernel(_glu_packed_fwd_kernel)
_packed_bwd = LazyKernel(_glu_packed_bwd_kernel)
_PACKED_BLOCK = 1024


def _out_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    return a.dtype if a.dtype == b.dtype else torch.promote_types(a.dtype, b.dtype)


def _forward(ac: torch.Tensor, bc: torch.Tensor, act: int) -> torch.Tensor:
    """``act(a) * b`` for contiguous ``a``/``b``, in their promoted dtype."""
    c = torch.empty_like(ac, dtype=_out_dtype(ac, bc))
    n = ac.numel()
    if n:
        _fwd[(_cdiv(n, _BLOCK),)](ac, bc, c, n, ACT=act, BLOCK=_BLOCK, num_warps=8)
    return c


def _backward(
    dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, act: int, da: torch.Tensor, db: torch.Tensor
) -> None:
    """Write the gradients into ``da``/``db`` (which may be ``a``/``b`` themselves); all contiguous."""
    n = a.numel()
    if n:
        _bwd[(_cdiv(n, _BLOCK),)](dc, a, b, da, db, n, ACT=act, BLOCK=_BLOCK, num_warps=8)


class GLUFunction(torch.autograd.Function):
    """Autograd glue for both GLUs: saves ``a`` and ``b`` only, recomputes the activation."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, act: int, inplace_grad: bool | None) -> torch.Tensor:
        # Decide now (before contiguous() may copy) whether a and b may take the gradients.
        private_a = inplace_grad if inplace_grad is not None else owns_storage(a)
        private_b = inplace_grad if inplace_grad is not None else owns_storage(b)
        ac, bc = a.contiguous(), b.contiguous()
        # A copy made here is private to this node whatever the caller passed.
        ctx.reuse_a = private_a or ac.data_ptr() != a.data_ptr()
        ctx.reuse_b = private_b or bc.data_ptr() != b.data_ptr()
        if ac.data_ptr() == bc.data_ptr():  # swiglu(x, x): one buffer cannot take two gradients
            ctx.reuse_b = False
        c = _forward(ac, bc, act)
        ctx.save_for_backward(ac, bc)
        ctx.act = act
        ctx.shape = a.shape
        return c

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        a, b = ctx.saved_tensors
        da = a if ctx.reuse_a else torch.empty_like(a)
        db = b if ctx.reuse_b else torch.empty_like(b)
        _backward(dc.contiguous(), a, b, ctx.act, da, db)
        overwritten = [t for t, r in ((a, ctx.reuse_a), (b, ctx.reuse_b)) if r]
        if overwritten:
            bump_version(*overwritten)
        return da.view(ctx.shape), db.view(ctx.shape), None, None


# -- torch.compile: the same two passes as custom operators (``op_def``); gradients in new buffers --


@op_def("glu", "(Tensor a, Tensor b, int act) -> Tensor")
def _glu_op(a, b, act):
    return _forward(a.contiguous(), b.contiguous(), act)


@_glu_op.register_fake
def _(a, b, act):
    return a.new_empty(a.shape, dtype=_out_dtype(a, b))


@op_def("glu_backward", "(Tensor dc, Tensor a, Tensor b, int act) -> (Tensor, Tensor)")
def _glu_backward_op(dc, a, b, act):
    a, b = a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    _backward(dc.contiguous(), a, b, act, da, db)
    return da, db


@_glu_backward_op.register_fake
def _(dc, a, b, act):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _glu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.act = inputs[2]


def _glu_grad(ctx, dc):
    a, b = ctx.saved_tensors
    da, db = torch.ops.ckpt.glu_backward(dc, a, b, ctx.act)
    return da, db, None


_glu_op.register_autograd(_glu_grad, setup_context=_glu_setup)


def _apply(a: torch.Tensor, b: torch.Tensor, act: int, inplace_grad: bool | None) -> torch.Tensor:
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        return torch.ops.ckpt.glu(a, b, act)
    return GLUFunction.apply(a, b, act, inplace_grad)


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    check_tensor(a, "a", dtypes=_FLOATS, min_ndim=1)
    check_tensor(b, "b", dtypes=_FLOATS, min_ndim=1)
    check_runnable_device(a, "a")
    check_same_device(a, "a", b=b)
    if a.shape != b.shape:
        raise ValueError(f"b has shape {tuple(b.shape)} but a has shape {tuple(a.shape)}; they must match")


def swiglu(a: torch.Tensor, b: torch.Tensor, *, inplace_grad: bool | None = None) -> torch.Tensor:
    """``silu(a) * b`` fused, fp32 math.

    Args:
        a: gate ``(..., I)``.
        b: up projection ``(..., I)``, same shape (any float dtype).
        inplace_grad: write ``da``/``db`` over ``a``/``b`` in backward. ``None`` (default)
            does so only when they are private autograd intermediates. Ignored under
            ``torch.compile``, where the kernel is a custom operator.

    Returns:
        ``(..., I)`` tensor in the promoted dtype of ``a`` and ``b`` (as ``F.silu(a) * b``);
        gradients come back in ``a``'s and ``b``'s own dtypes.
    """
    _check(a, b)
    return _apply(a, b, _SILU, inplace_grad)


def geglu(a: torch.Tensor, b: torch.Tensor, *, inplace_grad: bool | None = None) -> torch.Tensor:
    """``gelu_tanh(a) * b`` fused, fp32 math (same arguments as :func:`swiglu`)."""
    _check(a, b)
    return _apply(a, b, _GELU_TANH, inplace_grad)


# -- packed gate/up halves: ``act(x[..., :I]) * x[..., I:]`` --


def _packed_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` as ``(rows, 2I)`` with unit last stride (a view where one exists) and ``I``."""
    x2, _, _ = as_rows(x)
    if x2.dim() != 2:
        x2 = x2.reshape(-1, x.shape[-1])
    return x2, x.shape[-1] // 2


def _packed_forward(x: torch.Tensor, act: int, x2: torch.Tensor | None = None) -> torch.Tensor:
    """The ``(..., I)`` output for ``x`` ``(..., 2I)``; ``x2`` is :func:`_packed_rows` of ``x`` if made already."""
    x2, half = (x2, x.shape[-1] // 2) if x2 is not None else _packed_rows(x)
    c = torch.empty(x.shape[:-1] + (half,), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and half:
        block = min(_PACKED_BLOCK, next_power_of_2(half))
        _packed_fwd[(rows, _cdiv(half, block))](
            x2, c, x2.stride(0), half, ACT=act, BLOCK=block, num_warps=4 if block <= 1024 else 8
        )
    return c


def _packed_backward(dc: torch.Tensor, x2: torch.Tensor, dx2: torch.Tensor, act: int) -> None:
    """Write ``[da, db]`` into ``dx2`` (rows x 2I, unit last stride; may be ``x2``)."""
    rows, half = x2.shape[0], x2.shape[1] // 2
    dc2 = dc.reshape(rows, half)
    if dc2.stride(-1) != 1:
        dc2 = dc2.contiguous()
    if rows and half:
        block = min(_PACKED_BLOCK, next_power_of_2(half))
        _packed_bwd[(rows, _cdiv(half, block))](
            dc2,
            x2,
            dx2,
            dc2.stride(0),
            x2.stride(0),
            dx2.stride(0),
            half,
            ACT=act,
            BLOCK=block,
            num_warps=4 if block <= 1024 else 8,
        )


class PackedGLUFunction(torch.autograd.Function):
    """Autograd glue of the packed GLUs: saves the input only; its gradient may go over it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, act: int, inplace_grad: bool | None) -> torch.Tensor:
        private = inplace_grad if inplace_grad is not None else owns_storage(x)
        x2, _ = _packed_rows(x)
        ctx.reuse = (private and x2.is_contiguous()) or x2.data_ptr() != x.data_ptr()
        ctx.save_for_backward(x2)
        ctx.act, ctx.shape = act, x.shape
        return _packed_forward(x, act, x2)

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        (x2,) = ctx.saved_tensors
        dx2 = x2 if ctx.reuse else torch.empty_like(x2, memory_format=torch.contiguous_format)
        _packed_backward(dc, x2, dx2, ctx.act)
        if ctx.reuse:
            bump_version(x2)
        return dx2.view(ctx.shape), None, None


@op_def("glu_packed", "(Tensor x, int act) -> Tensor")
def _glu_packed_op(x, act):
    return _packed_forward(x, act)


@_glu_packed_op.register_fake
def _(x, act):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))


@op_def("glu_packed_backward", "(Tensor dc, Tensor x, int act) -> Tensor")
def _glu_packed_backward_op(dc, x, act):
    x2, _ = _packed_rows(x)
    dx2 = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _packed_backward(dc, x2, dx2, act)
    return dx2.view(x.shape)


@_glu_packed_backward_op.register_fake
def _(dc, x, act):
    return x.new_empty(x.shape)


def _glu_packed_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.act = inputs[1]


def _glu_packed_grad(ctx, dc):
    (x,) = ctx.saved_tensors
    return torch.ops.ckpt.glu_packed_backward(dc, x, ctx.act), None


_glu_packed_op.register_autograd(_glu_packed_grad, setup_context=_glu_packed_setup)


def _apply_packed(x: torch.Tensor, act: int, inplace_grad: bool | None) -> torch.Tensor:
    check_tensor(x, "gate_up", dtypes=_FLOATS, min_ndim=1)
    check_runnable_device(x, "gate_up")
    if x.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate, then up), got shape {tuple(x.shape)}")
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        return torch.ops.ckpt.glu_packed(x, act)
    return PackedGLUFunction.apply(x, act, inplace_grad)


def swiglu_packed(gate_up: torch.Tensor, *, inplace_grad: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, fused, fp32 math, no copy of either half.

    Args:
        gate_up: ``(..., 2I)``: the gate in the first half of the last dim, the up projection in the second
            (the output of a fused ``gate_up_proj``).
        inplace_grad: write the ``(..., 2I)`` gradient over ``gate_up`` in backward. ``None`` (default)
            does so only when it is a private autograd intermediate. Ignored under ``torch.compile``.

    Returns:
        ``(..., I)`` in ``gate_up``'s dtype.
    """
    return _apply_packed(gate_up, _SILU, inplace_grad)


def geglu_packed(gate_up: torch.Tensor, *, inplace_grad: bool | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)`` (as :func:`swiglu_packed`)."""
    return _apply_packed(gate_up, _GELU_TANH, inplace_grad)


class _GLUMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, the Llama / Gemma MLP block."""

    _fn = staticmethod(swiglu)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_linears(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> "_GLUMLP":
        """Wrap existing projections (shares their parameters; used by :func:`ckpt.kernels.patch`)."""
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.hidden_size = gate_proj.in_features
        mlp.intermediate_size = gate_proj.out_features
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate_proj, up_proj, down_proj
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., hidden_size)`` -> ``(..., hidden_size)``."""
        return self.down_proj(type(self)._fn(self.gate_proj(x), self.up_proj(x)))


class SwiGLUMLP(_GLUMLP):
    """Llama/Mistral/Qwen MLP with the fused SwiGLU (``hidden_act="silu"``)."""

    _fn = staticmethod(swiglu)


class GeGLUMLP(_GLUMLP):
    """Gemma-style MLP with the fused tanh-GeGLU (``hidden_act="gelu_pytorch_tanh"``)."""

    _fn = staticmethod(geglu)


class PackedGLUMLP(nn.Module):
    """``down_proj(act(gate) * up)`` with ``gate, up = gate_up_proj(x).chunk(2, -1)``: Phi-3's MLP with the
    fused packed GLU. ``activation`` is ``"silu"`` or ``"gelu_tanh"``."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Linear, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., hidden_size)`` -> ``(..., hidden_size)``."""
        fn = swiglu_packed if self.activation == "silu" else geglu_packed
        return self.down_proj(fn(self.gate_up_proj(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"

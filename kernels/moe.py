"""Fused mixture-of-experts experts: routing, both grouped GEMMs, SwiGLU and the weighted sum in Triton.

For ``x`` ``(T, H)`` (``T`` tokens), ``top_k_index`` ``(T, K)`` (each token's ``K`` experts, in
``[0, E)``; under expert parallelism also other values, below), ``top_k_weights`` ``(T, K)``,
stacked expert weights ``gate_up`` ``(E, 2I, H)`` (each expert's gate rows ``[0, I)``, then its up
rows ``[I, 2I)``: the layout of transformers' ``<Arch>Experts.gate_up_proj``) and ``down``
``(E, H, I)``::

    out[t] = sum_j  w[t, j] * down[e] @ (silu(g) * u),    g, u = (gate_up[e] @ x[t]).chunk(2)
             with e = top_k_index[t, j], w = top_k_weights

which is what transformers' ``<Arch>Experts.forward`` computes (Mixtral, Qwen3-MoE) under each of
its experts implementations.

Algorithm. The ``S = T K`` token-slots (slot ``t K + j``) are sorted by expert (a stable sort,
so the order is deterministic); each expert owns a contiguous run of the sorted slots, split into
tiles of ``BLOCK_M`` rows; a tile table (expert, first sorted row) lets one launch of each
kernel walk every expert's tiles (a fixed grid, an upper bound on the tile count: no host
synchronisation). Then, forward:

1. ``gate_up`` GEMM, the token rows gathered by index inside the kernel (no gathered copy of
   ``x``), two fp32 accumulators (gate and up columns of the same block), the SwiGLU in the
   epilogue: it stores ``a = silu(g) * u`` ``(S, I)`` and, for backward, the pre-activation
   ``h = [g, u]`` ``(S, 2I)`` (rounded to the activation dtype, as the eager GEMM returns it);
2. ``down`` GEMM over the sorted rows of ``a``, the routing weight applied to the fp32
   accumulator, each row stored at its slot's place of a ``(T, K, H)`` buffer in the
   activation dtype;
3. ``out = buffer.sum(1)`` (fp32 accumulation, one rounding; deterministic: no atomics).

Saved for backward: ``x`` (which the router's linear keeps anyway), the weights (parameters),
the routing (a few ``int32`` vectors) and ``h``: ``2 I`` elements per slot, against the
``H + 2I + I + H`` (gathered input, both GEMM outputs, the down output for the routing
weight's gradient) that the ``grouped_mm`` path keeps. With ``recompute=True`` not even ``h``:
backward recomputes it with the first GEMM (``2 S H 2I`` more flops).

Backward, for ``dout`` ``(T, H)``:

4. ``dA = dout[token] @ down[e]`` (``(S, I)``, ``dout`` rows gathered in the kernel); epilogue:
   recompute ``a`` from ``h``, ``d_weights[slot] = <dA, a>`` (per column block, summed after:
   no atomics), ``wa = w * a`` (for the down weights' gradient) and
   ``dh = [w dA u silu'(g), w dA silu(g)]`` written over ``h`` (each program reads the
   elements it overwrites first);
5. ``d_down[e] = sum_{slots of e} dout[token]^T wa`` and
   ``d_gate_up[e] = sum_{slots of e} dh^T x[token]``: one program per expert and output tile,
   looping over the expert's rows (an expert that got no token gets zeros);
6. ``dx_slots = dh @ gate_up[e]`` stored at each slot's place of ``(T, K, H)``, ``dx = sum(1)``.

So backward allocates ``wa`` ``(S, I)``, the ``(T, K, H)`` slot buffer and the weight gradients,
all freed or handed over within the layer; nothing ``(S, H)`` is ever fp32.

Dtypes: ``x``, ``gate_up`` and ``down`` share one float dtype (fp32, fp16 or bf16; under
autocast :func:`fused_experts` casts them to autocast's dtype first, differentiably, as autocast
does for ``linear``). GEMMs accumulate in fp32; fp32 inputs use full-precision products unless
``torch.backends.cuda.matmul.allow_tf32`` is set. ``top_k_weights`` any float dtype; its
gradient comes back in that dtype, the others in the inputs' dtype.

Expert parallelism. A rank holding ``E`` of the model's experts gets slots of experts held
elsewhere; transformers marks them with the index ``E``. Any index ``< 0`` or ``>= E`` sorts outside
every expert's run of sorted rows (before expert 0's or after the last one's), so no tile covers
it: no kernel reads or writes anything of such a slot. With ``expert_parallel=True`` the two
``(T, K, H)`` slot buffers (the output's in forward, ``dx``'s in backward) and the routing
weights' partial gradients start at zero, so such a slot adds nothing and its routing weight's
gradient is zero; it costs those two buffers' zeroing, so without the flag they stay
uninitialised and such a slot's share of the output, ``dx`` and its weight's gradient is
undefined. All on the device: no host synchronisation either way.

Under ``torch.compile``: two custom operators, ``torch.ops.ckpt.fused_experts`` and
``fused_experts_backward``, launching the same kernels as eager. An operator keeps no state
between forward and backward, so the forward returns what backward needs as outputs (``h``,
the routing weights in sorted order, the routing tensors). The tile table's length is the bound
``ceil(S / BLOCK_M) + E``, a function of shapes, so the fake implementations need no data. An
operator may not write over its inputs: backward writes ``dh`` to a new ``(S, 2I)`` buffer
instead of over ``h``. Under autocast the cast to autocast's dtype is traced before the
operator, which then runs with autocast off, as eager does.

References:
    Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
    Layer", 2017; Jiang et al., "Mixtral of Experts", 2024.
    Gale et al., "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", 2022
    (grouped computation over expert-sorted tokens, no padding to a capacity).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ._utils import (
    LazyKernel,
    bump_version,
    check_runnable_device,
    check_same_device,
    check_tensor,
    interpreter_enabled,
    jit_helper,
    op_def,
    tl,
)

__all__ = ["fused_experts", "FusedExpertsFunction", "experts_configs"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------


@jit_helper
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST``: the operands in fp32 first (the interpreter, whose ``tl.dot``
    mishandles 16-bit floats; never on the GPU)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


def _moe_up_kernel(
    X,
    W,
    HB,
    AB,
    TOK,
    TILE_E,
    TILE_ROW,
    ENDS,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    stride_a,
    I,
    K_DIM,
    n_blocks,
    E,
    STORE_H: tl.constexpr,
    STORE_A: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_M sorted rows of one expert x BLOCK_N columns of both gate and up
    pid = tl.program_id(0)
    t = pid // n_blocks
    nb = pid % n_blocks
    e = tl.load(TILE_E + t)
    if e >= E:
        return
    row0 = tl.load(TILE_ROW + t)
    row_end = tl.load(ENDS + e)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    tok = tl.load(TOK + rows, mask=rmask, other=0).to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tok[:, None] * stride_x + ks[None, :]
    wg_ptrs = W + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    wu_ptrs = wg_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_DIM, BLOCK_K):
        kmask = (k + ks) < K_DIM
        x = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc_g = _dot(x, wg, acc_g, PREC, UPCAST)
        acc_u = _dot(x, wu, acc_u, PREC, UPCAST)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    # round as the eager GEMM returns them, so that backward (which reads h) sees the same values
    g = acc_g.to(X.dtype.element_ty)
    u = acc_u.to(X.dtype.element_ty)
    r64 = rows.to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    if STORE_H:
        h_ptrs = HB + r64[:, None] * stride_h + cols[None, :]
        tl.store(h_ptrs, g, mask=mask)
        tl.store(h_ptrs + I, u, mask=mask)
    if STORE_A:
        gf = g.to(tl.float32)
        a = gf * tl.sigmoid(gf) * u.to(tl.float32)
        tl.store(AB + r64[:, None] * stride_a + cols[None, :], a.to(AB.dtype.element_ty), mask=mask)


def _moe_rows_kernel(
    A,
    W,
    OUT,
    SCALE,
    SLOT,
    TILE_E,
    TILE_ROW,
    ENDS,
    stride_a,
    stride_we,
    stride_wk,
    stride_wn,
    stride_o,
    N,
    K_DIM,
    n_blocks,
    E,
    HAS_SCALE: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # OUT[SLOT[r], n] = SCALE[r] * sum_k A[r, k] W[e, k, n] for the sorted rows r of one expert
    pid = tl.program_id(0)
    t = pid // n_blocks
    nb = pid % n_blocks
    e = tl.load(TILE_E + t)
    if e >= E:
        return
    row0 = tl.load(TILE_ROW + t)
    row_end = tl.load(ENDS + e)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    r64 = rows.to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + r64[:, None] * stride_a + ks[None, :]
    w_ptrs = W + e.to(tl.int64) * stride_we + ks[:, None].to(tl.int64) * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_DIM, BLOCK_K):
        kmask = (k + ks) < K_DIM
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = _dot(a, w, acc, PREC, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_SCALE:
        acc = acc * tl.load(SCALE + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    slot = tl.load(SLOT + rows, mask=rmask, other=0).to(tl.int64)
    tl.store(
        OUT + slot[:, None] * stride_o + cols[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=rmask[:, None] & cmask[None, :],
    )


def _moe_down_bwd_kernel(
    DO,
    W,
    HB,
    DH,
    WA,
    DWP,
    SCALE,
    TOK,
    TILE_E,
    TILE_ROW,
    ENDS,
    stride_do,
    stride_we,
    stride_wk,
    stride_h,
    stride_dh,
    stride_wa,
    S,
    I,
    K_DIM,
    n_blocks,
    E,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # dA = DO[TOK[r]] @ W[e] (W[e] is (K_DIM=H, I)); epilogue: SwiGLU backward, d_weights, w * a
    pid = tl.program_id(0)
    t = pid // n_blocks
    nb = pid % n_blocks
    e = tl.load(TILE_E + t)
    if e >= E:
        return
    row0 = tl.load(TILE_ROW + t)
    row_end = tl.load(ENDS + e)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    r64 = rows.to(tl.int64)
    tok = tl.load(TOK + rows, mask=rmask, other=0).to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    ks = tl.arange(0, BLOCK_K)
    d_ptrs = DO + tok[:, None] * stride_do + ks[None, :]
    w_ptrs = W + e.to(tl.int64) * stride_we + ks[:, None].to(tl.int64) * stride_wk + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_DIM, BLOCK_K):
        kmask = (k + ks) < K_DIM
        d = tl.load(d_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = _dot(d, w, acc, PREC, UPCAST)
        d_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    mask = rmask[:, None] & cmask[None, :]
    h_ptrs = HB + r64[:, None] * stride_h + cols[None, :]
    g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    sg = tl.sigmoid(g)
    act = g * sg
    # a as the forward's down GEMM read it (rounded to the activation dtype)
    a = (act * u).to(WA.dtype.element_ty).to(tl.float32)
    dw = tl.sum(acc * a, axis=1)
    tl.store(DWP + nb.to(tl.int64) * S + rows, dw, mask=rmask)
    scale = tl.load(SCALE + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(
        WA + r64[:, None] * stride_wa + cols[None, :], (a * scale[:, None]).to(WA.dtype.element_ty), mask=mask
    )
    da = (acc * scale[:, None]).to(WA.dtype.element_ty).to(tl.float32)
    dg = da * u * sg * (1.0 + g * (1.0 - sg))
    du = da * act
    # DH may be HB: this program has read every element it writes
    dh_ptrs = DH + r64[:, None] * stride_dh + cols[None, :]
    tl.store(dh_ptrs, dg.to(DH.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs + I, du.to(DH.dtype.element_ty), mask=mask)


def _moe_wgrad_kernel(
    A,
    B,
    OUT,
    IDX,
    STARTS,
    ENDS,
    stride_a,
    stride_b,
    stride_oe,
    stride_om,
    M,
    N,
    m_blocks,
    n_blocks,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # OUT[e, m, n] = sum over the sorted rows r of expert e of A[ra, m] B[rb, n], where ra (rb) is
    # IDX[r] when A (B) is gathered, else r. Zero when the expert has no row.
    pid = tl.program_id(0)
    per_e = m_blocks * n_blocks
    e = pid // per_e
    rem = pid % per_e
    mb = rem // n_blocks
    nb = rem % n_blocks
    start = tl.load(STARTS + e)
    end = tl.load(ENDS + e)
    ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = ms < M
    nmask = ns < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rr = r0 + ks
        rmask = rr < end
        if GATHER_A or GATHER_B:
            idx = tl.load(IDX + rr, mask=rmask, other=0).to(tl.int64)
        if GATHER_A:
            ra = idx
        else:
            ra = rr.to(tl.int64)
        if GATHER_B:
            rb = idx
        else:
            rb = rr.to(tl.int64)
        a = tl.load(A + ra[:, None] * stride_a + ms[None, :], mask=rmask[:, None] & mmask[None, :], other=0.0)
        b = tl.load(B + rb[:, None] * stride_b + ns[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(tl.trans(a), b, acc, PREC, UPCAST)
    tl.store(
        OUT + e.to(tl.int64) * stride_oe + ms[:, None].to(tl.int64) * stride_om + ns[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


_up = LazyKernel(_moe_up_kernel)
_rows = LazyKernel(_moe_rows_kernel)
_down_bwd = LazyKernel(_moe_down_bwd_kernel)
_wgrad = LazyKernel(_moe_wgrad_kernel)


# ----------------------------------------------------------------------------------------------------------
# launch configurations
# ----------------------------------------------------------------------------------------------------------

#: CUDA launch configurations: ``block_m`` (the sorted-row tile shared by every row-tiled kernel) and,
#: per kernel, ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``; ``wgrad`` is ``(BLOCK_M, BLOCK_N, BLOCK_K,
#: num_warps, num_stages)`` over (output rows, output columns, expert rows). Hopper (compute capability 9):
#: the fastest of a sweep at the Qwen3-MoE benchmark shape (T 16384, H 1024, I 384, E 64, K 8) on an H200,
#: 2026-11-25, Triton 3.6 (``docs/benchmarks.md``); their pipelines take up to 192 KiB of shared memory.
_HOPPER_CONFIGS: dict[str, object] = {
    "block_m": 128,
    "up": (128, 64, 8, 4),
    "down": (256, 64, 8, 3),
    "down_bwd": (32, 64, 4, 4),
    "dx": (256, 64, 8, 3),
    "wgrad": (128, 128, 64, 4, 3),
}
#: other GPUs: two-stage pipelines of at most 64 KiB of shared memory (untuned)
_OTHER_CONFIGS: dict[str, object] = {
    "block_m": 128,
    "up": (64, 64, 8, 2),
    "down": (128, 64, 8, 2),
    "down_bwd": (32, 64, 4, 2),
    "dx": (128, 64, 8, 2),
    "wgrad": (128, 128, 64, 4, 2),
}
#: under the interpreter (tests): small tiles, so that tiny shapes still span several tiles per expert
_INTERP_CONFIGS: dict[str, object] = {
    "block_m": 16,
    "up": (16, 16, 4, 1),
    "down": (16, 16, 4, 1),
    "down_bwd": (16, 16, 4, 1),
    "dx": (32, 16, 4, 1),
    "wgrad": (16, 32, 16, 4, 1),
}


def experts_configs(device: torch.device | str = "cuda") -> dict[str, object]:
    """The launch-configuration table used on ``device`` (a CUDA device, or ``"cpu"`` for the interpreter).

    A live dict: assigning an entry changes the tiles of later calls on devices of that kind (benchmark
    sweeps do this). At launch, an entry whose pipeline would not fit the device's shared memory for the
    dtype at hand (fp32 takes twice bf16's) runs with fewer stages, then a shorter ``BLOCK_K``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return _INTERP_CONFIGS
    return _HOPPER_CONFIGS if _device_facts(device.index)[0] >= 9 else _OTHER_CONFIGS


@functools.lru_cache(maxsize=None)
def _device_facts(index: int | None) -> tuple[int, int]:
    """``(compute capability major, shared memory per block in bytes)`` of a CUDA device."""
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    return props.major, int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block))


#: bytes of shared memory per pipeline stage, in elements of the operands: (BLOCK_M, BLOCK_N, BLOCK_K) ->
#: the row tile plus one (``up``: two) weight tiles
_TILE_ELEMENTS = {
    "up": lambda m, n, k: m * k + 2 * k * n,
    "down": lambda m, n, k: m * k + k * n,
    "down_bwd": lambda m, n, k: m * k + k * n,
    "dx": lambda m, n, k: m * k + k * n,
    "wgrad": lambda m, n, k: k * m + k * n,
}


@functools.lru_cache(maxsize=256)
def _fitted(kind: str, entry: tuple[int, ...], block_m: int, itemsize: int, smem: int) -> tuple[int, ...]:
    """``entry`` of ``kind`` with its pipeline cut to ``smem`` bytes (16 KiB kept for the epilogue):
    fewer stages first (down to 2), then half the ``BLOCK_K`` (down to 16), then one stage."""
    if kind == "wgrad":
        bm, bn, bk, nw, ns = entry
    else:
        (bn, bk, nw, ns), bm = entry, block_m
    need = lambda k, st: _TILE_ELEMENTS[kind](bm, bn, k) * itemsize * st + 16384  # noqa: E731
    while ns > 2 and need(bk, ns) > smem:
        ns -= 1
    while bk > 16 and need(bk, ns) > smem:
        bk //= 2
    if need(bk, ns) > smem:
        ns = 1
    return (bm, bn, bk, nw, ns) if kind == "wgrad" else (bn, bk, nw, ns)


def _config(cfg: dict[str, object], kind: str, t: torch.Tensor) -> tuple[int, ...]:
    """The launch configuration of ``kind`` for operands like ``t``."""
    entry = cfg[kind]
    if t.device.type != "cuda":
        return entry
    return _fitted(kind, tuple(entry), cfg["block_m"], t.element_size(), _device_facts(t.device.index)[1])


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


def _precision(x: torch.Tensor) -> tuple[str, bool]:
    """``(input_precision, upcast)`` of the kernels' products for ``x``'s dtype and device."""
    if x.device.type != "cuda" and interpreter_enabled():
        return "ieee", x.dtype != torch.float32
    if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee", False
    return "tf32", False


# ----------------------------------------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------------------------------------


def _route(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> dict[str, torch.Tensor]:
    """Sort the token-slots by expert and build the tile table (all on the device, no host sync).

    Returns ``perm`` (sorted row -> slot), ``tok`` (sorted row -> token), ``starts``/``ends``
    ``(E,)`` (each expert's run of sorted rows), ``tile_e``/``tile_row`` (per tile of ``block_m``
    rows: its expert, ``E`` for an unused tile, and its first sorted row); all ``int32``. An index
    outside ``[0, E)`` sorts before expert 0's run or after the last expert's: no tile covers its slot.
    """
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(ids, stable=True)
    dev = ids.device
    experts = torch.arange(num_experts, device=dev, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True)
    starts = torch.searchsorted(sorted_ids, experts, right=False)
    tiles = (ends - starts + (block_m - 1)) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    n_tiles = _cdiv(ids.numel(), block_m) + num_experts  # an upper bound of tiles.sum()
    t = torch.arange(n_tiles, device=dev, dtype=tile_ends.dtype)
    tile_e = torch.searchsorted(tile_ends, t, right=True)
    ec = tile_e.clamp(max=num_experts - 1)
    tile_row = starts[ec] + (t - (tile_ends - tiles)[ec]) * block_m
    i32 = torch.int32
    return {
        "perm": perm.to(i32),
        "tok": torch.div(perm, k, rounding_mode="floor").to(i32),
        "starts": starts.to(i32),
        "ends": ends.to(i32),
        "tile_e": tile_e.to(i32),
        "tile_row": tile_row.to(i32),
    }


# ----------------------------------------------------------------------------------------------------------
# launches
# ----------------------------------------------------------------------------------------------------------


def _launch_up(x, gate_up, r, h, a, cfg, prec):
    e, two_i, hid = gate_up.shape
    inter = two_i // 2
    bn, bk, nw, ns = _config(cfg, "up", x)
    n_blocks = _cdiv(inter, bn)
    tiles = r["tile_e"].numel()
    hb = h if h is not None else a
    ab = a if a is not None else h
    _up[(tiles * n_blocks,)](
        x,
        gate_up,
        hb,
        ab,
        r["tok"],
        r["tile_e"],
        r["tile_row"],
        r["ends"],
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        hb.stride(0),
        ab.stride(0),
        inter,
        hid,
        n_blocks,
        e,
        STORE_H=h is not None,
        STORE_A=a is not None,
        PREC=prec[0],
        UPCAST=prec[1],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        num_stages=ns,
    )


def _launch_rows(a, w, out, scale, r, w_strides, n, k_dim, cfg, name, prec):
    """``out[slot] = scale * a[sorted row] @ w[e]`` with ``w[e][k, n]`` at ``w_strides``."""
    bn, bk, nw, ns = _config(cfg, name, a)
    n_blocks = _cdiv(n, bn)
    tiles = r["tile_e"].numel()
    sc = scale if scale is not None else a
    _rows[(tiles * n_blocks,)](
        a,
        w,
        out,
        sc,
        r["perm"],
        r["tile_e"],
        r["tile_row"],
        r["ends"],
        a.stride(0),
        w.stride(0),
        w_strides[0],
        w_strides[1],
        out.stride(0),
        n,
        k_dim,
        n_blocks,
        w.shape[0],
        HAS_SCALE=scale is not None,
        PREC=prec[0],
        UPCAST=prec[1],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        num_stages=ns,
    )


def _launch_wgrad(a, b, out, r, gather_a, gather_b, cfg, prec):
    """``out[e] = sum_rows a[ra]^T b[rb]`` (``out`` ``(E, M, N)``, contiguous)."""
    bm, bn, bk, nw, ns = _config(cfg, "wgrad", a)
    e, m, n = out.shape
    mb, nb = _cdiv(m, bm), _cdiv(n, bn)
    _wgrad[(e * mb * nb,)](
        a,
        b,
        out,
        r["tok"],
        r["starts"],
        r["ends"],
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        m,
        n,
        mb,
        nb,
        GATHER_A=gather_a,
        GATHER_B=gather_b,
        PREC=prec[0],
        UPCAST=prec[1],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        num_stages=ns,
    )


def _launch_down_bwd(dout, down, h, dh, wa, w_sorted, r, cfg, prec, zero_dw):
    """Step 4 of the module docstring; returns the ``(column blocks, S)`` fp32 partial ``d_weights``
    (``zero_dw``: zeros, not garbage, in the columns of slots no tile covers)."""
    e, hid, inter = down.shape
    s = h.shape[0]
    bn, bk, nw, ns = _config(cfg, "down_bwd", h)
    n_blocks = _cdiv(inter, bn)
    dwp = (torch.zeros if zero_dw else torch.empty)((n_blocks, s), dtype=torch.float32, device=h.device)
    tiles = r["tile_e"].numel()
    _down_bwd[(tiles * n_blocks,)](
        dout,
        down,
        h,
        dh,
        wa,
        dwp,
        w_sorted,
        r["tok"],
        r["tile_e"],
        r["tile_row"],
        r["ends"],
        dout.stride(0),
        down.stride(0),
        down.stride(1),
        h.stride(0),
        dh.stride(0),
        wa.stride(0),
        s,
        inter,
        hid,
        n_blocks,
        e,
        PREC=prec[0],
        UPCAST=prec[1],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=nw,
        num_stages=ns,
    )
    return dwp


def _slot_buffer(t, k, hid, x, expert_parallel):
    """The ``(T, K, H)`` buffer a rows GEMM writes at each slot's place. Slots of experts not held here
    are written by no tile: with ``expert_parallel`` they start at zero, so they add nothing to the sum."""
    return (torch.zeros if expert_parallel else torch.empty)((t, k, hid), dtype=x.dtype, device=x.device)


def _forward(x, gate_up, down, weights, top_k_index, store_h, expert_parallel):
    cfg = experts_configs(x.device)
    prec = _precision(x)
    t, hid = x.shape
    k = top_k_index.shape[1]
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    s = t * k
    r = _route(top_k_index, e, cfg["block_m"])
    w_sorted = weights.reshape(-1)[r["perm"]]
    h = torch.empty((s, two_i), dtype=x.dtype, device=x.device) if store_h else None
    a = torch.empty((s, inter), dtype=x.dtype, device=x.device)
    _launch_up(x, gate_up, r, h, a, cfg, prec)
    y = _slot_buffer(t, k, hid, x, expert_parallel)
    # down[e] is (H, I): element [k, n] of the GEMM's right operand is down[e, n, k]
    _launch_rows(
        a, down, y.view(s, hid), w_sorted, r, (down.stride(2), down.stride(1)), hid, inter, cfg, "down", prec
    )
    del a
    out = y.sum(1) if k > 1 else y.view(t, hid)
    return out, r, w_sorted, h


def _backward(dout, x, gate_up, down, weights_dtype, r, w_sorted, h, k, need, expert_parallel, h_private):
    """Gradients ``(dx, d_gate_up, d_down, d_weights)`` (``None`` where ``need`` says so). ``h``: the
    saved pre-activation, or ``None`` to recompute it; ``h_private``: ``dh`` may be written over it."""
    cfg = experts_configs(x.device)
    prec = _precision(x)
    t, hid = x.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    s = t * k
    dout = dout.to(x.dtype).contiguous()
    if h is None:  # recompute mode: the pre-activation again, from the first GEMM
        h = torch.empty((s, two_i), dtype=x.dtype, device=x.device)
        _launch_up(x, gate_up, r, h, None, cfg, prec)
        h_private = True
    wa = torch.empty((s, inter), dtype=x.dtype, device=x.device)
    dh = h if h_private else torch.empty_like(h)
    dwp = _launch_down_bwd(dout, down, h, dh, wa, w_sorted, r, cfg, prec, zero_dw=expert_parallel and need[3])
    d_weights = None
    if need[3]:
        dw_sorted = dwp.sum(0) if dwp.shape[0] > 1 else dwp[0]
        d_weights = torch.empty(s, dtype=torch.float32, device=x.device)
        d_weights[r["perm"].long()] = dw_sorted
        d_weights = d_weights.view(t, k).to(weights_dtype)
    del dwp
    d_down = None
    if need[2]:
        d_down = torch.empty(down.shape, dtype=down.dtype, device=x.device)
        _launch_wgrad(dout, wa, d_down, r, True, False, cfg, prec)
    del wa
    d_gate_up = None
    if need[1]:
        d_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=x.device)
        _launch_wgrad(dh, x, d_gate_up, r, False, True, cfg, prec)
    dx = None
    if need[0]:
        dxs = _slot_buffer(t, k, hid, x, expert_parallel)
        # gate_up[e] is (2I, H): element [k, n] is gate_up[e, k, n]
        _launch_rows(
            dh,
            gate_up,
            dxs.view(s, hid),
            None,
            r,
            (gate_up.stride(1), gate_up.stride(2)),
            hid,
            two_i,
            cfg,
            "dx",
            prec,
        )
        dx = dxs.sum(1) if k > 1 else dxs.view(t, hid)
    return dx, d_gate_up, d_down, d_weights


class FusedExpertsFunction(torch.autograd.Function):
    """Autograd glue of :func:`fused_experts` (inputs already checked, contiguous, one dtype)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, weights, top_k_index, recompute: bool, expert_parallel: bool = False):
        train = any(ctx.needs_input_grad[:4])
        out, r, w_sorted, h = _forward(
            x, gate_up, down, weights, top_k_index, train and not recompute, expert_parallel
        )
        if train:
            ctx.save_for_backward(x, gate_up, down, w_sorted, h, *r.values())
            ctx.route_keys = tuple(r)
            ctx.k = top_k_index.shape[1]
            ctx.weights_dtype = weights.dtype
            ctx.expert_parallel = expert_parallel
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        x, gate_up, down, w_sorted, h, *route = ctx.saved_tensors
        r = dict(zip(ctx.route_keys, route))
        dx, dgu, dd, dw = _backward(
            dout,
            x,
            gate_up,
            down,
            ctx.weights_dtype,
            r,
            w_sorted,
            h,
            ctx.k,
            ctx.needs_input_grad[:4],
            ctx.expert_parallel,
            h_private=True,
        )
        if h is not None:
            bump_version(h)  # overwritten by the gradient
        return dx, dgu, dd, dw, None, None, None


# -- torch.compile: forward and backward as custom operators (``op_def``) ----------------------------------
# A custom operator keeps no Python state between its forward and its backward, so the forward returns
# what backward needs (the routing, the routing weights in sorted order, h) as outputs; the backward
# writes dh into a new buffer (an operator may not write over its inputs), one (T K, 2I) more than eager.

_ROUTE_KEYS = ("perm", "tok", "starts", "ends", "tile_e", "tile_row")
_ROUTE_SCHEMA = ", ".join(f"Tensor {name}" for name in _ROUTE_KEYS)


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device``'s type inside an operator (the dtypes were chosen at the call, and
    CUDA autocast would run the slot sums in fp32); nothing to enter when it is off already."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


@op_def(
    "fused_experts",
    "(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, "
    "bool store_h, bool expert_parallel) -> (" + ", ".join(["Tensor"] * 9) + ")",
)
def _fused_experts_op(x, top_k_index, top_k_weights, gate_up, down, store_h, expert_parallel):
    with _no_autocast(x.device):
        out, r, w_sorted, h = _forward(
            x.contiguous(),
            gate_up.contiguous(),
            down.contiguous(),
            top_k_weights.contiguous(),
            top_k_index.contiguous(),
            store_h,
            expert_parallel,
        )
    return (out, h if h is not None else x.new_empty(0), w_sorted, *(r[name] for name in _ROUTE_KEYS))


@_fused_experts_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, store_h, expert_parallel):
    t, k = top_k_index.shape
    e, two_i, _ = gate_up.shape
    s = t * k
    # the tile table's length depends on shapes only: _route's bound on the tile count
    n_tiles = _cdiv(s, experts_configs(x.device)["block_m"]) + e
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty(x.shape),
        x.new_empty((s, two_i) if store_h else (0,)),
        top_k_weights.new_empty(s),
        torch.empty(s, **i32),
        torch.empty(s, **i32),
        torch.empty(e, **i32),
        torch.empty(e, **i32),
        torch.empty(n_tiles, **i32),
        torch.empty(n_tiles, **i32),
    )


@op_def(
    "fused_experts_backward",
    f"(Tensor dout, Tensor x, Tensor gate_up, Tensor down, Tensor w_sorted, Tensor h, {_ROUTE_SCHEMA}, "
    "SymInt top_k, ScalarType weights_dtype, bool has_h, bool[4] need, bool expert_parallel) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _fused_experts_backward_op(
    dout,
    x,
    gate_up,
    down,
    w_sorted,
    h,
    perm,
    tok,
    starts,
    ends,
    tile_e,
    tile_row,
    top_k,
    weights_dtype,
    has_h,
    need,
    expert_parallel,
):
    r = dict(zip(_ROUTE_KEYS, (perm, tok, starts, ends, tile_e, tile_row)))
    with _no_autocast(x.device):
        grads = _backward(
            dout,
            x.contiguous(),
            gate_up.contiguous(),
            down.contiguous(),
            weights_dtype,
            r,
            w_sorted,
            h if has_h else None,
            top_k,
            need,
            expert_parallel,
            h_private=False,
        )
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@_fused_experts_backward_op.register_fake
def _(
    dout,
    x,
    gate_up,
    down,
    w_sorted,
    h,
    perm,
    tok,
    starts,
    ends,
    tile_e,
    tile_row,
    top_k,
    weights_dtype,
    has_h,
    need,
    expert_parallel,
):
    none = x.new_empty(0)
    return (
        x.new_empty(x.shape) if need[0] else none,
        gate_up.new_empty(gate_up.shape) if need[1] else none,
        down.new_empty(down.shape) if need[2] else none,
        x.new_empty((x.shape[0], top_k), dtype=weights_dtype) if need[3] else none,
    )


def _fused_experts_setup(ctx, inputs, output):
    x, top_k_index, top_k_weights, gate_up, down, store_h, expert_parallel = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(x, gate_up, down, *output[1:])
    ctx.top_k = top_k_index.shape[1]
    ctx.weights_dtype = top_k_weights.dtype
    ctx.has_h = store_h
    ctx.expert_parallel = expert_parallel


def _fused_experts_grad(ctx, dout, *_):
    x, gate_up, down, h, w_sorted, *route = ctx.saved_tensors
    wants = ctx.needs_input_grad
    need = [wants[0], wants[3], wants[4], wants[2]]  # x, gate_up, down, top_k_weights
    dx, dgu, dd, dw = torch.ops.ckpt.fused_experts_backward(
        dout,
        x,
        gate_up,
        down,
        w_sorted,
        h,
        *route,
        ctx.top_k,
        ctx.weights_dtype,
        ctx.has_h,
        need,
        ctx.expert_parallel,
    )
    return (
        dx if need[0] else None,
        None,
        dw if need[3] else None,
        dgu if need[1] else None,
        dd if need[2] else None,
        None,
        None,
    )


_fused_experts_op.register_autograd(_fused_experts_grad, setup_context=_fused_experts_setup)


def _check(x, top_k_index, top_k_weights, gate_up, down):
    check_tensor(x, "hidden_states", dtypes=_FLOATS, ndim=2)
    check_tensor(gate_up, "gate_up", dtypes=_FLOATS, ndim=3)
    check_tensor(down, "down", dtypes=_FLOATS, ndim=3)
    check_tensor(top_k_weights, "top_k_weights", dtypes=_FLOATS, ndim=2)
    check_tensor(top_k_index, "top_k_index", dtypes=(torch.int64, torch.int32), ndim=2)
    check_runnable_device(x, "hidden_states")
    check_same_device(
        x, "hidden_states", gate_up=gate_up, down=down, top_k_weights=top_k_weights, top_k_index=top_k_index
    )
    t, hid = x.shape
    e, two_i, h2 = gate_up.shape
    if two_i % 2 or h2 != hid:
        raise ValueError(
            f"gate_up must be (E, 2I, {hid}) for hidden size {hid}, got shape {tuple(gate_up.shape)}"
        )
    if tuple(down.shape) != (e, hid, two_i // 2):
        raise ValueError(f"down must be (E, H, I) = {(e, hid, two_i // 2)}, got shape {tuple(down.shape)}")
    if top_k_index.shape[0] != t or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both be (tokens, top_k) with tokens = {t}, got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )


def fused_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    recompute: bool = False,
    expert_parallel: bool = False,
) -> torch.Tensor:
    """The SwiGLU experts of a mixture-of-experts block, fused (module docstring).

    Args:
        hidden_states: ``(T, H)`` fp32 / fp16 / bf16.
        top_k_index: ``(T, K)`` int64 or int32, each in ``[0, E)``; with ``expert_parallel`` also
            any other value, meaning "an expert not on this rank".
        top_k_weights: ``(T, K)`` float, the routing weights (differentiable).
        gate_up: ``(E, 2I, H)``, each expert's gate rows then its up rows.
        down: ``(E, H, I)``.
        recompute: keep nothing of size ``(T K, 2I)`` for backward; recompute the pre-activation
            there with the first GEMM instead (less memory, ``2 T K H 2I`` more flops).
        expert_parallel: this rank holds ``E`` of the model's experts, and a slot whose index is
            ``< 0`` or ``>= E`` (transformers' expert parallelism marks the slots of other ranks'
            experts with ``E``) belongs to none of them: it runs through no GEMM, adds nothing to
            the output or to any gradient, and its routing weight's gradient is zero. It costs
            zeroing the ``(T, K, H)`` slot buffer in forward and in backward. Without it such an
            index is not checked (that would need a host sync): its slot is skipped all the same,
            but its share of the output, of ``dx`` and its weight's gradient are undefined.

    Returns:
        ``(T, H)`` in the dtype the GEMMs ran in: ``hidden_states``' (the weights must share it),
        or autocast's when autocast is enabled on the device (inputs cast to it, as for ``linear``).

    Under ``torch.compile`` the call is one custom operator, ``torch.ops.ckpt.fused_experts`` (its
    backward ``fused_experts_backward``): no graph break, the same kernels as eager. Which gradients
    backward makes follows ``requires_grad`` at trace time; ``dh`` goes to a new ``(T K, 2I)`` buffer
    instead of over the saved pre-activation.
    """
    _check(hidden_states, top_k_index, top_k_weights, gate_up, down)
    amp = hidden_states.device.type if torch.is_autocast_enabled(hidden_states.device.type) else None
    dtype = torch.get_autocast_dtype(amp) if amp is not None else hidden_states.dtype
    if gate_up.dtype != dtype or down.dtype != dtype or hidden_states.dtype != dtype:
        if amp is None:
            raise ValueError(
                f"hidden_states ({hidden_states.dtype}), gate_up ({gate_up.dtype}) and down "
                f"({down.dtype}) must share one dtype outside autocast"
            )
        hidden_states, gate_up, down = hidden_states.to(dtype), gate_up.to(dtype), down.to(dtype)
    if torch.compiler.is_compiling():  # traced: one opaque operator node, no graph break
        train = torch.is_grad_enabled() and any(
            t.requires_grad for t in (hidden_states, top_k_weights, gate_up, down)
        )
        return torch.ops.ckpt.fused_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            gate_up,
            down,
            train and not recompute,
            bool(expert_parallel),
        )[0]
    ctx = torch.autocast(amp, enabled=False) if amp is not None else contextlib.nullcontext()
    with ctx:
        return FusedExpertsFunction.apply(
            hidden_states.contiguous(),
            gate_up.contiguous(),
            down.contiguous(),
            top_k_weights.contiguous(),
            top_k_index.contiguous(),
            bool(recompute),
            bool(expert_parallel),
        )

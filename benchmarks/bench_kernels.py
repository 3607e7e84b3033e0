"""Benchmark the fused kernels against torch eager, torch.compile, Liger-Kernel and Cut Cross-Entropy.

Every case times forward + backward (median of ``triton.testing.do_bench``) and measures
the peak memory allocated above the inputs (``max_memory_allocated`` minus what was
allocated before the step, the inputs and the output gradient included there). Providers
run side by side in one process on the same inputs; each result is checked against
eager first. Rows go to the shared CSV (``benchmarks/harness.py``); a sweep per kernel
(hidden size, or vocabulary size for the losses) is written for the plots.

Usage (on a GPU)::

    python benchmarks/bench_kernels.py                   # main table + sweeps + plots
    python benchmarks/bench_kernels.py --only rms_norm --no-sweep
    python benchmarks/bench_kernels.py --plot-dir docs/img --csv /tmp/results.csv

Liger-Kernel and Cut Cross-Entropy are optional (``pip install liger-kernel
cut-cross-entropy``; never dependencies): when one is not importable its column is left out.
The fused linear cross-entropy runs ours twice: ``ours`` with ``d_hidden`` written over ``hidden`` (as
inside a model, where ``hidden`` is the final norm's private output) and ``ours_leaf`` with ``hidden`` a
leaf input (``d_hidden`` in a buffer of its own).
Cut Cross-Entropy has one loss, ``linear_cross_entropy`` (the fused linear cross-entropy), and
no plain cross-entropy; it runs twice: ``cce`` with its defaults (mean reduction and its
gradient filter ``filter_eps="high"``, which skips the backward blocks whose gradient entries,
softmax minus one-hot, are all under 2^-12: an approximation) and ``cce_exact``
(``filter_eps=None``). A provider that raises is reported as failed (its row says why) and the
others go on. ``--smoke`` runs tiny shapes on the CPU through the Triton interpreter to check
the script itself (the peers' kernels do not all run there: those show up as failed).

With ``--graph`` each case is also timed as one CUDA-graph replay (GPU time alone) and, for the
memory-bound kernels, given a ``% HBM`` figure: the least bytes forward + backward must move (each
activation, output and gradient read or written once; ``Case.min_bytes``) per second of replay, over
the device-to-device copy rate measured at the start of the same run.

``fused_add_rms_norm`` times the residual add and the norm after it with gradients into both
outputs (``y`` and the sum ``h``); eager and torch.compile run ``h = x + r`` then Llama's norm,
Liger its ``LigerFusedAddRMSNorm`` (when that import works).

Shapes (Llama-3-8B, bf16): 8192 tokens, hidden 4096, intermediate 14336, vocabulary
128256; RoPE on q ``(2, 32, 4096, 128)`` and k ``(2, 8, 4096, 128)``. ``moe_experts``: the experts
of the Qwen3-MoE end-to-end model (``bench_train_kernels.py --model qwen3_moe``): 16384 tokens,
hidden 1024, 64 experts of intermediate 384, 8 per token; "eager" there is transformers' default
``grouped_mm`` experts path and Liger's provider its ``LigerFusedMoEFunction``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import device_name, record, table  # noqa: E402

import ckpt.kernels as K  # noqa: E402

try:  # optional peer, benchmark only
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    from liger_kernel.transformers.layer_norm import LigerLayerNorm
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    HAS_LIGER = True
except Exception as exc:  # noqa: BLE001 - any import problem just drops the column
    HAS_LIGER = False
    LIGER_ERROR = repr(exc)

try:  # optional peer for the residual add fused with RMSNorm (a separate import: newer than the others)
    from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm

    HAS_LIGER_ADD_NORM = True
except Exception:  # noqa: BLE001
    HAS_LIGER_ADD_NORM = False

try:  # optional peer for the mixture-of-experts experts (a separate import: newer than the others)
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    HAS_LIGER_MOE = True
except Exception:  # noqa: BLE001
    HAS_LIGER_MOE = False

try:  # optional peer for the fused linear cross-entropy, benchmark only
    from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy

    HAS_CCE = True
except Exception as exc:  # noqa: BLE001
    HAS_CCE = False
    CCE_ERROR = repr(exc)

DT = torch.bfloat16


@dataclass
class Case:
    """Inputs (leaves), output gradients and one callable per provider."""

    name: str
    inputs: list[torch.Tensor]
    grad_out: list[torch.Tensor | float]
    providers: dict[str, Callable[..., Any]] = field(default_factory=dict)
    initial: list[torch.Tensor] = field(default_factory=list)
    #: bytes forward + backward must move through device memory at the least (memory-bound kernels: each
    #: input, output and gradient of the activations read or written once); None: compute-bound
    min_bytes: int | None = None

    def reset(self) -> None:
        """Restore the inputs and output gradients (in-place gradient paths overwrite them)
        and drop the inputs' grads."""
        bufs = self.inputs + [g for g in self.grad_out if isinstance(g, torch.Tensor)]
        if not self.initial:
            self.initial = [t.detach().clone() for t in bufs]
        with torch.no_grad():
            for t, s in zip(bufs, self.initial):
                t.copy_(s)
        for t in self.inputs:
            t.grad = None


def _loss_value(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.loss


def _eager_rms(x, w, eps=1e-6):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _eager_add_rms(x, r, w, eps=1e-6):
    h = x + r  # a decoder layer's residual add, then the norm of the next sublayer
    return _eager_rms(h, w, eps), h


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _eager_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _eager_ce(logits, t):
    return F.cross_entropy(logits.float(), t)


def _eager_flce(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _eager_experts(x, w, gate_up, down, idx):
    """transformers' default ``grouped_mm`` experts path (5.x ``grouped_mm_experts_forward``, Mixtral /
    Qwen3-MoE layout): sort the token-slots by expert, gather, two grouped GEMMs with SwiGLU between,
    routing weights, un-permute, sum over the top-k. On the CPU a loop over the experts instead."""
    k = idx.shape[1]
    if x.device.type != "cuda":
        out = torch.zeros_like(x)
        for e in range(gate_up.shape[0]):
            tok, pos = torch.where(idx == e)
            gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(gate) * up, down[e]) * w[tok, pos, None])
        return out
    ids = idx.reshape(-1)
    _, perm = torch.sort(ids)
    offs = torch.cumsum(torch.bincount(ids, minlength=gate_up.shape[0]), 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x[perm // k], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs) * w.reshape(-1)[perm, None]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inv].view(x.shape[0], k, x.shape[1]).sum(1)


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=False)


def make_case(
    kernel: str, size: int, dev: str, tokens: int, compile_: bool, flce_chunk: int | None = None
) -> Case:
    """Build one case. ``size`` is the hidden/intermediate size, the q-head count for RoPE,
    or the vocabulary for the losses. Every random tensor comes from the case's own generator: the
    default CUDA generator is left unusable by a provider whose CUDA-graph capture failed."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(DT).requires_grad_()

    if kernel == "rms_norm":
        x = rnd(tokens, size)
        w = torch.nn.Parameter((torch.rand(size, generator=g, device=dev) + 0.5).to(DT))
        case = Case(
            f"rms_norm {tokens}x{size}",
            [x, w],
            [torch.randn(tokens, size, generator=g, device=dev, dtype=DT)],
        )
        case.min_bytes = 5 * _nbytes(x)  # x, y; dy, x, dx
        case.providers["ours"] = lambda x, w: K.rms_norm(x, w, in_place=True)
        case.providers["eager"] = _eager_rms
        if compile_:
            case.providers["compile"] = _compiled(_eager_rms)
        if HAS_LIGER:
            m = _share(LigerRMSNorm(size, eps=1e-6).to(dev, DT), w)
            case.providers["liger"] = lambda x, w: m(x)
    elif kernel == "fused_add_rms_norm":
        # both outputs get a gradient: y from the next sublayer, h from the rest of the residual stream
        x, r = rnd(tokens, size), rnd(tokens, size)
        w = torch.nn.Parameter((torch.rand(size, generator=g, device=dev) + 0.5).to(DT))
        case = Case(
            f"fused_add_rms_norm {tokens}x{size}",
            [x, r, w],
            [
                torch.randn(tokens, size, generator=g, device=dev, dtype=DT),
                torch.randn(tokens, size, generator=g, device=dev, dtype=DT),
            ],
        )
        case.min_bytes = 8 * _nbytes(x)  # x, r, h, y; dy, dh, h, dx (= dr)
        case.providers["ours"] = lambda x, r, w: K.fused_add_rms_norm(x, r, w, in_place=True)
        case.providers["eager"] = _eager_add_rms
        if compile_:
            case.providers["compile"] = _compiled(_eager_add_rms)
        if HAS_LIGER_ADD_NORM:  # in_place as ours (dx over dy); Liger's module defaults to False
            m = _share(LigerFusedAddRMSNorm(size, eps=1e-6, in_place=True).to(dev, DT), w)
            case.providers["liger"] = lambda x, r, w: m(x, r)
    elif kernel == "layer_norm":
        x = rnd(tokens, size)
        w, b = torch.nn.Parameter(rnd(size).detach()), torch.nn.Parameter(rnd(size).detach())
        case = Case(
            f"layer_norm {tokens}x{size}",
            [x, w, b],
            [torch.randn(tokens, size, generator=g, device=dev, dtype=DT)],
        )
        case.min_bytes = 5 * _nbytes(x)  # x, y; dy, x, dx
        case.providers["ours"] = K.layer_norm
        case.providers["eager"] = lambda x, w, b: F.layer_norm(x, (size,), w, b, 1e-5)
        if compile_:
            case.providers["compile"] = _compiled(lambda x, w, b: F.layer_norm(x, (size,), w, b, 1e-5))
        if HAS_LIGER:
            m = _share(LigerLayerNorm(size, eps=1e-5, bias=True).to(dev, DT), w, b)
            case.providers["liger"] = lambda x, w, b: m(x)
    elif kernel in ("swiglu", "geglu"):
        a, b = rnd(tokens, size), rnd(tokens, size)
        case = Case(
            f"{kernel} {tokens}x{size}",
            [a, b],
            [torch.randn(tokens, size, generator=g, device=dev, dtype=DT)],
        )
        case.min_bytes = 8 * _nbytes(a)  # a, b, y; dy, a, b, da, db
        ours = K.swiglu if kernel == "swiglu" else K.geglu
        # In an MLP a and b are private projection outputs, so their memory takes the gradients.
        case.providers["ours"] = lambda a, b: ours(a, b, inplace_grad=True)
        eager = (
            (lambda a, b: F.silu(a) * b)
            if kernel == "swiglu"
            else (lambda a, b: F.gelu(a, approximate="tanh") * b)
        )
        case.providers["eager"] = eager
        if compile_:
            case.providers["compile"] = _compiled(eager)
        if HAS_LIGER:
            fn = LigerSiLUMulFunction if kernel == "swiglu" else LigerGELUMulFunction
            case.providers["liger"] = lambda a, b: fn.apply(a, b)
    elif kernel == "rope":
        bsz, seq, hd = 2, tokens // 2, 128
        q, k = rnd(bsz, size, seq, hd), rnd(bsz, max(1, size // 4), seq, hd)
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        emb = torch.cat([torch.arange(seq, device=dev, dtype=torch.float32)[:, None] * inv] * 2, -1)[None]
        cos, sin = emb.cos().to(DT), emb.sin().to(DT)
        case = Case(
            f"rope q{tuple(q.shape)} k{tuple(k.shape)}",
            [q, k],
            [torch.randn(t.shape, generator=g, device=dev, dtype=t.dtype) for t in (q, k)],
        )
        case.min_bytes = 4 * (_nbytes(q) + _nbytes(k)) + 2 * (
            _nbytes(cos) + _nbytes(sin)
        )  # q, k, q', k'; back
        case.providers["ours"] = lambda q, k: K.rope(q, k, cos, sin)
        case.providers["eager"] = lambda q, k: _eager_rope(q, k, cos, sin)
        if compile_:
            c = _compiled(_eager_rope)
            case.providers["compile"] = lambda q, k: c(q, k, cos, sin)
        if HAS_LIGER:
            case.providers["liger"] = lambda q, k: liger_rotary_pos_emb(q, k, cos, sin)
    elif kernel == "cross_entropy":
        x = rnd(tokens, size, scale=2.0)
        t = torch.randint(0, size, (tokens,), generator=g, device=dev)
        case = Case(f"cross_entropy {tokens}x{size}", [x], [1.0])
        case.min_bytes = 2 * _nbytes(x)  # the logits read once, their gradient written once
        case.providers["ours"] = lambda x: K.cross_entropy(x, t, inplace=True)
        case.providers["eager"] = lambda x: _eager_ce(x, t)
        if compile_:
            c = _compiled(_eager_ce)
            case.providers["compile"] = lambda x: c(x, t)
        if HAS_LIGER:
            m = LigerCrossEntropyLoss()
            case.providers["liger"] = lambda x: _loss_value(m(x, t))
    elif kernel == "fused_linear_cross_entropy":
        hidden = 4096 if dev == "cuda" else 32
        h = rnd(tokens, hidden)
        w = rnd(size, hidden, scale=hidden**-0.5)
        t = torch.randint(0, size, (tokens,), generator=g, device=dev)
        case = Case(f"fused_linear_ce {tokens}x{hidden}x{size}", [h, w], [1.0])
        # In a model `hidden` is the final norm's private output, so its memory takes d_hidden.
        case.providers["ours"] = lambda h, w: K.fused_linear_cross_entropy(
            h, w, t, inplace=True, chunk_size=flce_chunk
        )
        # `hidden` a leaf (or shared): d_hidden gets a buffer of its own, and the chunk its own budget
        case.providers["ours_leaf"] = lambda h, w: K.fused_linear_cross_entropy(
            h, w, t, chunk_size=flce_chunk
        )
        case.providers["eager"] = lambda h, w: _eager_flce(h, w, t)
        if compile_:
            c = _compiled(_eager_flce)
            case.providers["compile"] = lambda h, w: c(h, w, t)
        if HAS_LIGER:
            m = LigerFusedLinearCrossEntropyLoss()
            case.providers["liger"] = lambda h, w: _loss_value(m(w, h, t))
        if HAS_CCE:  # as shipped (its gradient filter drops softmax entries under 2^-12), and exact
            case.providers["cce"] = lambda h, w: cce_linear_cross_entropy(h, w, t)
            case.providers["cce_exact"] = lambda h, w: cce_linear_cross_entropy(h, w, t, filter_eps=None)
    elif kernel == "moe_experts":
        # Qwen3-MoE's experts at the end-to-end benchmark's shape: 8 x 2048 tokens, hidden 1024,
        # 64 experts of intermediate `size`, 8 per token (a tenth of that on the CPU)
        n_tok, hid, n_exp, top = (16384, 1024, 64, 8) if dev == "cuda" else (tokens, 32, 6, 2)
        x = rnd(n_tok, hid)
        logits = torch.randn(n_tok, n_exp, generator=g, device=dev)
        w, idx = torch.softmax(logits, -1).topk(top, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(DT).requires_grad_()
        gate_up = torch.nn.Parameter(rnd(n_exp, 2 * size, hid, scale=hid**-0.5).detach())
        down = torch.nn.Parameter(rnd(n_exp, hid, size, scale=size**-0.5).detach())
        case = Case(
            f"moe_experts {n_tok}x{hid} E{n_exp}x{size} top{top}",
            [x, w, gate_up, down],
            [torch.randn(n_tok, hid, generator=g, device=dev, dtype=DT)],
        )
        case.providers["ours"] = lambda x, w, gu, dn: K.fused_experts(x, idx, w, gu, dn)
        case.providers["eager"] = lambda x, w, gu, dn: _eager_experts(x, w, gu, dn, idx)
        if compile_:
            c = _compiled(_eager_experts)
            case.providers["compile"] = lambda x, w, gu, dn: c(x, w, gu, dn, idx)
        if HAS_LIGER_MOE:
            case.providers["liger"] = lambda x, w, gu, dn: LigerFusedMoEFunction.apply(x, gu, dn, idx, w)
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return case


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth in bytes/s as one device-to-device copy reaches it (bytes read + written per
    second, median CUDA-graph replay): the denominator of the % of HBM column, measured in the same run."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dst.copy_(src)
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    del graph, src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1e3)


def _share(
    module: torch.nn.Module, w: torch.nn.Parameter, b: torch.nn.Parameter | None = None
) -> torch.nn.Module:
    """Point a peer's module at the case's parameters so every provider differentiates the same tensors."""
    module.weight = w
    if b is not None:
        module.bias = b
    return module


def _step(case: Case, fn: Callable[..., Any]) -> Any:
    out = fn(*case.inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    grads = [torch.ones_like(o) * g if isinstance(g, float) else g for o, g in zip(outs, case.grad_out)]
    if all(isinstance(g, float) and g == 1.0 for g in case.grad_out):
        outs[0].backward()
    else:
        torch.autograd.backward(outs, grads)
    return out


def check(case: Case, providers: list[str]) -> dict[str, float | str]:
    """Relative L2 error of every provider's output and input gradients against eager, or
    why the provider failed (a string)."""

    def run(p):
        case.reset()
        out = _step(case, case.providers[p])
        outs = [o.detach().float().clone() for o in (out if isinstance(out, tuple) else (out,))]
        grads = [t.grad.float().clone() for t in case.inputs]
        case.reset()
        return outs + grads

    ref = run("eager")
    errs = {}
    for p in providers:
        if p == "eager":
            continue
        try:
            got = run(p)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, reported as such
            errs[p] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            case.reset()
            continue
        errs[p] = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, ref))
    return errs


def measure(case: Case, provider: str, rep_ms: int) -> tuple[float, float]:
    """(median ms of forward+backward, peak MiB above inputs)."""
    fn = case.providers[provider]
    case.reset()
    for _ in range(2):  # compile / autotune / warm caches
        _step(case, fn)
        for t in case.inputs:
            t.grad = None
    if case.inputs[0].device.type != "cuda":
        t0 = time.perf_counter()
        _step(case, fn)
        return (time.perf_counter() - t0) * 1e3, 0.0
    import triton.testing

    case.reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(case, fn)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    for t in case.inputs:
        t.grad = None

    def bench_step():
        _step(case, fn)

    ms = triton.testing.do_bench(
        bench_step, warmup=25, rep=rep_ms, grad_to_none=case.inputs, return_mode="median"
    )
    return float(ms), float(peak)


def measure_graph(case: Case, provider: str, rep_ms: int) -> float:
    """Median ms of one CUDA-graph replay of forward+backward: the GPU time alone, without the
    host overhead (Python, autograd, launches) that ``measure`` includes. NaN where the
    provider cannot be captured (e.g. it synchronises with the host)."""
    import triton.testing

    fn = case.providers[provider]
    case.reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                _step(case, fn)
                for t in case.inputs:
                    t.grad = None
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _step(case, fn)
        ms = triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report and move on
        print(f"  graph capture failed for {provider}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        torch.cuda.synchronize()
        ms = float("nan")
    finally:
        for t in case.inputs:
            t.grad = None
    return float(ms)


PROVIDERS = ("ours", "ours_leaf", "eager", "compile", "liger", "cce", "cce_exact")
KERNELS = [
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "swiglu",
    "geglu",
    "rope",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "moe_experts",
]
MAIN_SIZE = {
    "moe_experts": 384,
    "rms_norm": 4096,
    "fused_add_rms_norm": 4096,
    "layer_norm": 4096,
    "swiglu": 14336,
    "geglu": 14336,
    "rope": 32,
    "cross_entropy": 128256,
    "fused_linear_cross_entropy": 128256,
}
SWEEP = {
    "moe_experts": [256, 384, 768, 1536],
    "rms_norm": [1024, 2048, 4096, 8192, 16384],
    "fused_add_rms_norm": [1024, 2048, 4096, 8192, 16384],
    "layer_norm": [1024, 2048, 4096, 8192, 16384],
    "swiglu": [2048, 4096, 8192, 14336, 28672],
    "geglu": [2048, 4096, 8192, 14336, 28672],
    "rope": [8, 16, 32, 64],
    "cross_entropy": [32000, 64000, 128256, 256000],
    "fused_linear_cross_entropy": [32000, 64000, 128256, 200064],
}
SWEEP_AXIS = {
    "moe_experts": "expert intermediate size",
    "rms_norm": "hidden size",
    "fused_add_rms_norm": "hidden size",
    "layer_norm": "hidden size",
    "swiglu": "intermediate size",
    "geglu": "intermediate size",
    "rope": "q heads (k heads = q/4)",
    "cross_entropy": "vocabulary",
    "fused_linear_cross_entropy": "vocabulary",
}
#: torch.compile is slow to build: by default only where the reference table has a compile column
COMPILE_KERNELS = {"rms_norm", "fused_add_rms_norm", "swiglu", "fused_linear_cross_entropy"}
SMOKE_SIZE = {
    "moe_experts": 24,
    "rms_norm": 48,
    "fused_add_rms_norm": 48,
    "layer_norm": 48,
    "swiglu": 40,
    "geglu": 40,
    "rope": 4,
    "cross_entropy": 100,
    "fused_linear_cross_entropy": 100,
}


def run_one(
    kernel: str,
    size: int,
    dev: str,
    tokens: int,
    compile_: bool,
    rep_ms: int,
    verify: bool = True,
    graph: bool = False,
) -> list[dict[str, Any]]:
    case = make_case(kernel, size, dev, tokens, compile_)
    providers = list(case.providers)
    errs = check(case, providers) if verify else {}
    rows = []
    for p in providers:
        failed = errs.get(p) if isinstance(errs.get(p), str) else None
        ms = mib = gms = float("nan")
        if failed is None:
            try:
                ms, mib = measure(case, p, rep_ms)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - reported as failed, the others go on
                failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if failed is None and graph and dev == "cuda" and p != "compile":
            gms = measure_graph(case, p, rep_ms)
        rows.append(
            {
                "kernel": kernel,
                "case": case.name,
                "size": size,
                "provider": p,
                "ms": ms,
                "peak_mib": mib,
                "graph_ms": gms,
                "min_bytes": case.min_bytes,
                "rel_err_vs_eager": errs.get(p, 0.0) if failed is None else float("nan"),
                "failed": failed,
            }
        )
        if failed is not None:
            print(f"  {case.name:48s} {p:8s} FAILED: {failed}", flush=True)
            continue
        print(
            f"  {case.name:48s} {p:8s} {ms:9.3f} ms {mib:9.1f} MiB  graph {gms:8.3f} ms  "
            f"err {errs.get(p, 0.0):.2e}",
            flush=True,
        )
    del case
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = [k for k in KERNELS if any(r["kernel"] == k for r in rows)]
    fig, axes = plt.subplots(2, len(kernels), figsize=(3.2 * len(kernels), 5.6), squeeze=False)
    for j, k in enumerate(kernels):
        for i, metric in enumerate(("ms", "peak_mib")):
            ax = axes[i][j]
            for p in PROVIDERS:
                pts = sorted((r["size"], r[metric]) for r in rows if r["kernel"] == k and r["provider"] == p)
                if pts:
                    ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=p)
            ax.set_xscale("log", base=2)
            ax.set_title(k.replace("fused_linear_cross_entropy", "fused linear CE"), fontsize=9)
            ax.set_xlabel(SWEEP_AXIS[k], fontsize=8)
            ax.set_ylabel("ms (fwd+bwd)" if metric == "ms" else "peak MiB", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"ckpt.kernels sweeps, {device_name()}, bf16, 8192 tokens", fontsize=10)
    fig.tight_layout()
    path = out_dir / "kernels_sweep.png"
    fig.savefig(path, dpi=80)
    return [path]


def _hbm_pct(row: dict[str, Any], copy_bw: float) -> float:
    return 100.0 * row["min_bytes"] / (row["graph_ms"] / 1e3) / copy_bw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", choices=KERNELS, help="kernels to run (default all)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the per-kernel sweeps")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument(
        "--compile-all",
        action="store_true",
        help="torch.compile every kernel, not only " + ", ".join(sorted(COMPILE_KERNELS)),
    )
    ap.add_argument("--sweep-only", action="store_true", help="skip the main table")
    ap.add_argument(
        "--flce-chunks",
        nargs="*",
        type=int,
        default=[],
        help="also time ours fused linear CE at these chunk sizes (tokens per chunk)",
    )
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per provider")
    ap.add_argument(
        "--csv", type=Path, default=None, help="CSV to append to (default benchmarks/results.csv)"
    )
    ap.add_argument("--plot-dir", type=Path, default=None, help="where to write kernels_sweep.png")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="also time one CUDA-graph replay of fwd+bwd (GPU time without host overhead)",
    )
    args = ap.parse_args(argv)

    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    tokens = 16 if args.smoke else 8192
    kernels = args.only or KERNELS
    compile_ = not args.no_compile and not args.smoke
    print(
        f"device: {device_name()}  torch {torch.__version__}  liger: "
        f"{'yes' if HAS_LIGER else 'no (' + LIGER_ERROR + ')'}  cce: "
        f"{'yes' if HAS_CCE else 'no (' + CCE_ERROR + ')'}",
        flush=True,
    )

    copy_bw = copy_bandwidth() if dev == "cuda" and args.graph else None
    if copy_bw:
        print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write, CUDA graph)", flush=True)
    main_rows: list[dict[str, Any]] = []
    for k in kernels if not args.sweep_only else []:
        size = SMOKE_SIZE[k] if args.smoke else MAIN_SIZE[k]
        main_rows += run_one(
            k,
            size,
            dev,
            tokens,
            compile_ and (args.compile_all or k in COMPILE_KERNELS),
            args.rep_ms,
            graph=args.graph,
        )
    for c in args.flce_chunks:
        k = "fused_linear_cross_entropy"
        case = make_case(k, SMOKE_SIZE[k] if args.smoke else MAIN_SIZE[k], dev, tokens, False, flce_chunk=c)
        ms, mib = measure(case, "ours", args.rep_ms)
        main_rows.append(
            {
                "kernel": k,
                "case": case.name + f" chunk={c}",
                "size": MAIN_SIZE[k],
                "provider": "ours",
                "ms": ms,
                "peak_mib": mib,
                "rel_err_vs_eager": 0.0,
            }
        )
        print(f"  {case.name} chunk={c}: {ms:.3f} ms {mib:.1f} MiB", flush=True)
        del case
    sweep_rows: list[dict[str, Any]] = []
    if not args.no_sweep:
        for k in kernels:
            sizes = [SMOKE_SIZE[k], SMOKE_SIZE[k] * 2] if args.smoke else SWEEP[k]
            for s in sizes:
                sweep_rows += run_one(k, s, dev, tokens, False, max(50, args.rep_ms // 2), verify=False)

    def csv_rows(rows, tag):
        out = []
        for r in rows:
            note = f"{tag}; rel_err_vs_eager={r['rel_err_vs_eager']:.2e}"
            if r.get("failed"):
                note = f"{tag}; failed: {r['failed']}"
            out.append(
                {
                    "case": r["case"],
                    "provider": r["provider"],
                    "metric": "fwd_bwd_median",
                    "value": r["ms"],
                    "unit": "ms",
                    "note": note,
                }
            )
            out.append(
                {
                    "case": r["case"],
                    "provider": r["provider"],
                    "metric": "peak_mem_above_inputs",
                    "value": r["peak_mib"],
                    "unit": "MiB",
                    "note": note,
                }
            )
            if r.get("graph_ms", float("nan")) == r.get("graph_ms"):  # not NaN
                out.append(
                    {
                        "case": r["case"],
                        "provider": r["provider"],
                        "metric": "fwd_bwd_graph_replay_median",
                        "value": r["graph_ms"],
                        "unit": "ms",
                        "note": note,
                    }
                )
                if copy_bw and r.get("min_bytes"):
                    out.append(
                        {
                            "case": r["case"],
                            "provider": r["provider"],
                            "metric": "fraction_of_hbm_copy_rate",
                            "value": _hbm_pct(r, copy_bw),
                            "unit": "%",
                            "note": f"{note}; {r['min_bytes'] / 1e6:.0f} MB moved at the least / graph replay "
                            f"time / device copy rate {copy_bw / 1e9:.0f} GB/s",
                        }
                    )
        return out

    path = record("bench_kernels", csv_rows(main_rows, "main") + csv_rows(sweep_rows, "sweep"), args.csv)
    if sweep_rows and args.plot_dir:
        try:
            for p in plot(sweep_rows, args.plot_dir):
                print(f"plot: {p}")
        except ImportError as exc:
            print(f"no plot: {exc}")
    print(f"csv: {path}\n")
    # one row per case: every provider's time and memory side by side
    summary = []
    for case in dict.fromkeys(r["case"] for r in main_rows):
        row: dict[str, Any] = {"case": case}
        for r in main_rows:
            if r["case"] == case:
                row[f"{r['provider']} ms"] = "failed" if r.get("failed") else round(r["ms"], 3)
                row[f"{r['provider']} MiB"] = "failed" if r.get("failed") else round(r["peak_mib"], 1)
        summary.append(row)
    cols = ["case"] + [
        f"{p} {m}" for p in PROVIDERS for m in ("ms", "MiB") if any(f"{p} {m}" in r for r in summary)
    ]
    print(table(summary, cols))
    if args.graph:
        gsum = []
        for case in dict.fromkeys(r["case"] for r in main_rows):
            row = {"case": case}
            for r in main_rows:
                if r["case"] == case and r.get("graph_ms", float("nan")) == r.get("graph_ms"):
                    row[f"{r['provider']} graph ms"] = round(r["graph_ms"], 3)
                    if copy_bw and r.get("min_bytes"):
                        row[f"{r['provider']} % HBM"] = round(_hbm_pct(r, copy_bw), 1)
            gsum.append(row)
        gcols = ["case"] + [
            f"{p} {m}"
            for p in PROVIDERS
            if p != "compile"
            for m in ("graph ms", "% HBM")
            if any(f"{p} {m}" in r for r in gsum)
        ]
        print(
            "\nCUDA-graph replay (GPU time only, no host overhead; % HBM: the least bytes forward + backward "
            "must move, per second, over the device's copy rate):"
        )
        print(table(gsum, gcols))
    return 0


if __name__ == "__main__":
    sys.exit(main())

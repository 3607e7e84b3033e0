"""Cross-entropy's row kernel against a reference that moves the same bytes in the same schedule and nothing else.

The library's kernel (``ckpt.kernels.cross_entropy``) streams each row of logits twice (the online
normaliser, then the gradient, written over the logits or beside them) and relies on L2 to serve the second
read: the least traffic is one read and one write of the logits. The reference kernel here has the library's
schedule (the second pass from the row's last block, ``evict_last`` on the first pass's loads, ``evict_first``
on the second pass's loads and stores, one block loaded ahead) and none of its per-row work (ignore index,
scales, label smoothing, z-loss, class weights): what the schedule alone reaches. Both are timed as one
CUDA-graph replay of the loss + gradient launch, over the device-to-device copy rate measured in the same run,
after checking that their gradients agree.

``--bisect`` also times the reference with the library's per-row parts added one at a time (a 64-bit target,
the scale read from memory, the loss of an ignored row): a part that costs the schedule its rate shows there.

Usage (on a GPU)::

    python benchmarks/bench_ce_schedules.py                      # 8192 x 128256 bf16
    python benchmarks/bench_ce_schedules.py --vocab 151936 262144 --bisect
    python benchmarks/bench_ce_schedules.py --smoke               # CPU, Triton interpreter: the reference checks out
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import device_name, record, table  # noqa: E402

from ckpt.kernels.cross_entropy import _block_v, _ce, _warps, launch_ce  # noqa: E402


@triton.jit
def _reference_kernel(L, G, T, LOSS, SCALE, stride, V, ignore_index, T64: tl.constexpr, SCALED: tl.constexpr,
                      IGNORE: tl.constexpr, BLOCK: tl.constexpr):
    """Loss ``lse - x_t`` and gradient ``softmax - onehot`` (times ``SCALE[0]`` with ``SCALED``) of one row per
    program, in the library's schedule. ``T64``: the target compared as a 64-bit column; ``IGNORE``: rows whose
    target is ``ignore_index`` get a zero loss and gradient."""
    row = tl.program_id(0).to(tl.int64)
    if T64:
        t = tl.load(T + row).to(tl.int64)
    else:
        t = tl.load(T + row).to(tl.int32)
    base = L + row * stride
    gbase = G + row * stride
    cols0 = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    for off in range(0, V, BLOCK):
        cols = off + cols0
        x = tl.load(base + cols, mask=cols < V, other=-float("inf"), eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    if SCALED:
        cs = tl.load(SCALE).to(tl.float32)
    else:
        cs = 1.0
    if IGNORE:
        valid = t != ignore_index
        x_t = tl.load(base + t, mask=valid, other=0.0).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
        cs = tl.where(valid, cs, 0.0)
    else:
        x_t = tl.load(base + t).to(tl.float32)
        tl.store(LOSS + row, lse - x_t)
    n_blocks = tl.cdiv(V, BLOCK)
    off = (n_blocks - 1) * BLOCK
    cols = off + cols0
    r = tl.load(base + cols, mask=cols < V, other=0.0, eviction_policy="evict_first")
    for _ in range(0, n_blocks):
        cols_next = off - BLOCK + cols0
        r_next = tl.load(base + cols_next, mask=(cols_next < V) & (cols_next >= 0), other=0.0,
                         eviction_policy="evict_first")
        cols = off + cols0
        g = tl.exp(r.to(tl.float32) - lse) * cs
        g = tl.where(cols == t, g - cs, g)
        tl.store(gbase + cols, g.to(G.dtype.element_ty), mask=cols < V, eviction_policy="evict_first")
        r = r_next
        off -= BLOCK


def reference(x: torch.Tensor, t: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor,
              block: int, warps: int, t64: bool = True, scaled: bool = True, ignore: bool = False) -> None:
    _reference_kernel[(x.shape[0],)](x, grad, t, loss, scale, x.stride(0), x.shape[1], -100, T64=t64, SCALED=scaled,
                                     IGNORE=ignore, BLOCK=block, num_warps=warps)


def copy_rate(nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by one device-to-device copy (median CUDA-graph replay)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (_replay_ms(lambda: dst.copy_(src), 200) / 1e3)


def _replay_ms(fn: Callable[[], Any], rep_ms: int) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")


def smoke() -> int:
    """The reference kernel's loss and gradient against torch's, through the interpreter."""
    torch.manual_seed(0)
    n, v = 5, 3000
    x = torch.randn(n, v) * 3
    t = torch.randint(0, v, (n,))
    t[1] = -100
    want = torch.nn.functional.cross_entropy(x, t, reduction="none", ignore_index=-100)
    x_ = x.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(x_, t, reduction="sum", ignore_index=-100).backward()
    for t64, scaled, ignore in ((True, True, True), (False, False, True)):
        loss, grad = torch.empty(n), torch.empty_like(x)
        reference(x, t, loss, grad, torch.ones(1), 1024, 4, t64, scaled, ignore)
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(grad, x_.grad)
    print("bench_ce_schedules --smoke: the reference kernel's loss and gradient match torch's")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", nargs="*", type=int, default=[128256])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--bisect", action="store_true", help="also the reference with the library's per-row parts")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("bench_ce_schedules: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    rate = copy_rate()
    print(f"device: {device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy rate "
          f"{rate / 1e9:.0f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    shown: list[dict[str, Any]] = []
    for v in args.vocab:
        n = args.tokens
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 4
        t = torch.randint(0, v, (n,), device="cuda")
        t[::9] = -100
        one = torch.ones(1, device="cuda")
        loss = torch.empty(n, device="cuda")
        want = torch.empty_like(x)
        launch_ce(x, t, loss, want, one, -100, 0.0, 0.0)
        least = 2 * x.numel() * x.element_size()   # the logits read once, the gradient written once
        block, warps = _block_v(v), _warps(_block_v(v))
        inplace = x.clone()

        def library(block: int, warps: int) -> Callable[[], Any]:
            return lambda: _ce[(n,)](inplace, inplace, t, loss, loss, one, one, loss, loss, inplace.stride(0),
                                     inplace.stride(0), 0, v, -100, 0.0, 0.0, 0.0, COMPUTE_GRAD=True,
                                     HAS_SMOOTHING=False, HAS_SOFTCAP=False, HAS_WEIGHT=False, STORE_Z=False,
                                     BLOCK_V=block, num_warps=warps)

        def ref(block: int, warps: int, **kw: bool) -> Callable[[], Any]:
            return lambda: reference(inplace, t, loss, inplace, one, block, warps, **kw)

        variants: list[tuple[str, Callable[[], Any]]] = [
            (f"library ({block} columns, {warps} warps: the default)", library(block, warps)),
            ("library (16384 columns, 16 warps)", library(16384, 16)),
            ("reference (16384 columns, 16 warps)", ref(16384, 16, ignore=True)),
            ("reference (8192 columns, 8 warps)", ref(8192, 8, ignore=True)),
        ]
        if args.bisect:
            for t64 in (True, False):
                for scaled in (True, False):
                    for ignore in (True, False):
                        variants.append((f"reference 16384/16 t64={t64} scaled={scaled} ignore={ignore}",
                                         ref(16384, 16, t64=t64, scaled=scaled, ignore=ignore)))
        for name, fn in variants:
            inplace.copy_(x)
            fn()
            torch.cuda.synchronize()
            err = (inplace.float() - want.float()).abs().max().item()
            if err > 1e-2:
                raise AssertionError(f"{name}: its gradient differs from the library's by {err:.3g}")
            ms = _replay_ms(fn, args.rep_ms)
            pct = 100.0 * least / (ms / 1e3) / rate
            shown.append({"vocabulary": v, "kernel": name, "ms": round(ms, 3), "% of copy rate": round(pct, 1)})
            rows.append({"case": f"cross_entropy {n}x{v} in place, {name}", "provider": "ours",
                         "metric": "loss_and_grad_graph_replay_median", "value": ms, "unit": "ms",
                         "note": f"{pct:.1f}% of the copy rate {rate / 1e9:.0f} GB/s for {least / 1e6:.0f} MB"})
            print(f"  V={v} {name}: {ms:.3f} ms, {pct:.1f}%", flush=True)
        del x, inplace, want
        torch.cuda.empty_cache()
    print(f"csv: {record('bench_ce_schedules', rows, args.csv)}\n")
    print(table(shown, ["vocabulary", "kernel", "ms", "% of copy rate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

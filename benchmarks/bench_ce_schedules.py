"""Cross-entropy's row kernel at its launch configurations, against a reference with its schedule and little else.

The library's kernel (``ckpt.kernels.cross_entropy``) streams each row of logits twice (the online
normaliser, then the gradient, written over the logits or beside them) and relies on L2 to serve the second
read: the least traffic is one read and one write of the logits. The reference kernel here has the library's
schedule (the second pass from the row's last block, ``evict_last`` on the first pass's loads, ``evict_first``
on the second pass's loads and stores, one block loaded ahead) and only the per-row work of a plain loss
(ignored rows, one scale; no label smoothing, z-loss, softcap or class weights). Each is timed as one
CUDA-graph replay of the loss + gradient launch, over the device-to-device copy rate measured in the same run,
after checking that its gradient agrees with the library's, with the registers per thread and spills of its
compiled code.

The library's kernel runs at three block sizes with and without the register cap (``maxnreg``): the kernel
is bound by how many programs an SM holds, and ptxas left alone may give it more registers than two programs
of 16 warps (or four of 8) leave room for. ``--options`` also times it with each loss option (label smoothing,
softcap, class weights, all of them with z-loss) at both wide blocks, capped and not; ``--sliced-from WIDTH``
the logits as the first ``V`` columns of a padded vocabulary, the gradient not in place: in a contiguous
buffer, and in the library's (rows laid out as the logits', so both can be walked as whole vectors).

Usage (on a GPU)::

    python benchmarks/bench_ce_schedules.py                      # 8192 x 128256 bf16
    python benchmarks/bench_ce_schedules.py --vocab 32000 151936 262144 --options
    python benchmarks/bench_ce_schedules.py --vocab 50257 --sliced-from 50304   # logits of a padded vocabulary
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

from ckpt.kernels._utils import register_cap  # noqa: E402
from ckpt.kernels.cross_entropy import (  # noqa: E402
    ClassWeights,
    _ce,
    _ce_config,
    _grad_rows,
    _row_layout,
    launch_ce,
)


@triton.jit
def _reference_kernel(L, G, T, LOSS, SCALE, stride, V, ignore_index, BLOCK: tl.constexpr):
    """Loss ``lse - x_t`` and gradient ``(softmax - onehot) * SCALE[0]`` of one row per program (zero for a row
    whose target is ``ignore_index``), in the library's schedule."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row).to(tl.int64)
    base = L + row * stride
    gbase = G + row * stride
    cols0 = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    for off in range(0, V, BLOCK):
        cols = off + cols0
        x = tl.load(base + cols, mask=cols < V, other=-float("inf"), eviction_policy="evict_last").to(
            tl.float32
        )
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = t != ignore_index
    x_t = tl.load(base + t, mask=valid, other=0.0).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    cs = tl.where(valid, tl.load(SCALE).to(tl.float32), 0.0)
    n_blocks = tl.cdiv(V, BLOCK)
    off = (n_blocks - 1) * BLOCK
    cols = off + cols0
    r = tl.load(base + cols, mask=cols < V, other=0.0, eviction_policy="evict_first")
    for _ in range(0, n_blocks):
        cols_next = off - BLOCK + cols0
        r_next = tl.load(
            base + cols_next,
            mask=(cols_next < V) & (cols_next >= 0),
            other=0.0,
            eviction_policy="evict_first",
        )
        cols = off + cols0
        g = tl.exp(r.to(tl.float32) - lse) * cs
        g = tl.where(cols == t, g - cs, g)
        tl.store(gbase + cols, g.to(G.dtype.element_ty), mask=cols < V, eviction_policy="evict_first")
        r = r_next
        off -= BLOCK


def reference(
    x: torch.Tensor,
    t: torch.Tensor,
    loss: torch.Tensor,
    grad: torch.Tensor,
    scale: torch.Tensor,
    block: int,
    warps: int,
) -> Any:
    return _reference_kernel[(x.shape[0],)](
        x, grad, t, loss, scale, x.stride(0), x.shape[1], -100, BLOCK=block, num_warps=warps
    )


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
    loss, grad = torch.empty(n), torch.empty_like(x)
    reference(x, t, loss, grad, torch.ones(1), 1024, 4)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, x_.grad)
    print("bench_ce_schedules --smoke: the reference kernel's loss and gradient match torch's")
    return 0


_OPTION_SETS: dict[str, dict[str, Any]] = {
    "label smoothing 0.1": {"label_smoothing": 0.1},
    "softcap 30": {"softcap": 30.0},
    "class weights": {"weighted": True},
    "all (smoothing, softcap, weights, z-loss 1e-4, z rows)": {
        "label_smoothing": 0.1,
        "softcap": 30.0,
        "weighted": True,
        "z_loss": 1e-4,
    },
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", nargs="*", type=int, default=[128256])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument(
        "--options",
        action="store_true",
        help="also the library's kernel with each loss option, with and without the register cap",
    )
    ap.add_argument(
        "--sliced-from",
        type=int,
        default=0,
        metavar="WIDTH",
        help="also the logits as the first V columns of WIDTH (a padded vocabulary), the gradient "
        "in a contiguous buffer and in the library's",
    )
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
    print(
        f"device: {device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy rate "
        f"{rate / 1e9:.0f} GB/s",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    shown: list[dict[str, Any]] = []
    for v in args.vocab:
        n = args.tokens
        gen = torch.Generator(device="cuda").manual_seed(v)
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
        t = torch.randint(0, v, (n,), device="cuda", generator=gen)
        t[::9] = -100
        one = torch.ones(1, device="cuda")
        loss = torch.empty(n, device="cuda")
        zrows = torch.empty(n, device="cuda")
        weights = ClassWeights(torch.rand(v, device="cuda", generator=gen) + 0.5)
        least = 2 * x.numel() * x.element_size()  # the logits read once, the gradient written once
        inplace = x.clone()
        edges, align = _row_layout(inplace, inplace)

        def expected(
            label_smoothing: float = 0.0, softcap: float = 0.0, weighted: bool = False, z_loss: float = 0.0
        ) -> torch.Tensor:
            want = torch.empty_like(x)
            launch_ce(
                x,
                t,
                loss,
                want,
                one,
                -100,
                label_smoothing,
                z_loss,
                softcap,
                weights if weighted else None,
                zrows if z_loss else None,
            )
            return want

        def library(
            block: int,
            warps: int,
            regs: int | None,
            label_smoothing: float = 0.0,
            softcap: float = 0.0,
            weighted: bool = False,
            z_loss: float = 0.0,
        ) -> Callable[[], Any]:
            cw, sumw = (weights.w, weights.sum) if weighted else (loss, loss)
            return lambda: _ce[(n,)](
                inplace,
                inplace,
                t,
                loss,
                zrows,
                one,
                one,
                cw,
                sumw,
                inplace.stride(0),
                inplace.stride(0),
                0,
                v,
                -100,
                label_smoothing,
                z_loss,
                softcap,
                COMPUTE_GRAD=True,
                HAS_SMOOTHING=label_smoothing > 0.0,
                HAS_SOFTCAP=softcap > 0.0,
                HAS_WEIGHT=weighted,
                STORE_Z=z_loss > 0.0,
                BLOCK_V=block,
                EDGES=edges,
                ALIGN=align,
                num_warps=warps,
                **register_cap(regs),
            )

        def ref(block: int, warps: int) -> Callable[[], Any]:
            return lambda: reference(inplace, t, loss, inplace, one, block, warps)

        plain = expected()
        default = _ce_config(v, edges)
        variants: list[tuple[str, Callable[[], Any], torch.Tensor]] = []  # name, launch, expected gradient
        for b, w in ((4096, 4), (8192, 8), (16384, 16)):
            for regs in (None, 64):
                mark = ": the default" if (b, w, regs) == default else ""
                variants.append(
                    (f"library {b}/{w} regs {regs or 'uncapped'}{mark}", library(b, w, regs), plain)
                )
        variants += [
            ("reference 16384/16", ref(16384, 16), plain),
            ("reference 8192/8", ref(8192, 8), plain),
        ]
        if args.options:
            for label, opts in _OPTION_SETS.items():
                want = expected(**opts)
                mine = _ce_config(v, edges, opts.get("softcap", 0.0) > 0.0)
                for b, w in ((8192, 8), (16384, 16)):
                    for regs in (None, 64):
                        mark = ": the default" if (b, w, regs) == mine else ""
                        variants.append(
                            (
                                f"library {b}/{w} regs {regs or 'uncapped'}, {label}{mark}",
                                library(b, w, regs, **opts),
                                want,
                            )
                        )
        outs = {}  # variants whose gradient is not written over ``inplace``: where it is
        if args.sliced_from:
            width = max(args.sliced_from, v)
            padded = torch.empty(n, width, device="cuda", dtype=x.dtype)
            padded[:, :v] = x
            sliced = padded[:, :v]
            for label, g in (
                ("a contiguous gradient", torch.empty(n, v, device="cuda", dtype=x.dtype)),
                ("the library's gradient buffer (_grad_rows)", _grad_rows(sliced)),
            ):
                name = f"library default, logits sliced from {width} columns, {label}"
                variants.append((name, lambda g=g: launch_ce(sliced, t, loss, g, one, -100, 0.0, 0.0), plain))
                outs[name] = g
        for name, fn, want in variants:
            inplace.copy_(x)
            kernel = fn()
            torch.cuda.synchronize()
            regs = getattr(kernel, "n_regs", None)  # the compiled kernel's registers per thread and spills
            spills = getattr(kernel, "n_spills", None)
            err = (outs.get(name, inplace).float() - want.float()).abs().max().item()
            if not err <= 1e-2:
                raise AssertionError(f"{name}: its gradient differs from the library's by {err:.3g}")
            ms = _replay_ms(fn, args.rep_ms)
            pct = 100.0 * least / (ms / 1e3) / rate
            shown.append(
                {
                    "vocabulary": v,
                    "kernel": name,
                    "registers": regs,
                    "spills": spills,
                    "ms": round(ms, 3),
                    "% of copy rate": round(pct, 1),
                }
            )
            rows.append(
                {
                    "case": f"cross_entropy {n}x{v}{'' if name in outs else ' in place'}, {name}",
                    "provider": "reference" if name.startswith("reference") else "ours",
                    "metric": "loss_and_grad_graph_replay_median",
                    "value": ms,
                    "unit": "ms",
                    "note": f"{pct:.1f}% of the copy rate {rate / 1e9:.0f} GB/s for {least / 1e6:.0f} MB; "
                    f"{regs} registers per thread, {spills} spills",
                }
            )
            print(f"  V={v} {name}: {ms:.3f} ms, {pct:.1f}%, {regs} registers, {spills} spills", flush=True)
        del x, inplace, plain, variants, outs
        torch.cuda.empty_cache()
    print(f"csv: {record('bench_ce_schedules', rows, args.csv)}\n")
    print(table(shown, ["vocabulary", "kernel", "registers", "spills", "ms", "% of copy rate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

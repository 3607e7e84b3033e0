"""A sweep of the fused experts' launch tiles at the Qwen3-MoE benchmark shape (GPU only).

Where ``kernels/moe.py``'s Hopper table comes from, and how to re-tune it on another GPU or Triton: for one
kernel of ``fused_experts`` (``--kind``: ``up``, ``down``, ``down_bwd``, ``dx`` or ``wgrad``) each candidate
tile is written into the live configuration table (``ckpt.kernels.moe.experts_configs``), its forward +
backward checked against the table's own configuration (output and every gradient within bf16 rounding of
it) and timed (CUDA graph replays, median); the others keep the table's tiles. The layer: 16384 tokens,
hidden 1024, 64 experts of intermediate 384, top 8, bf16 (``bench_kernels.py --only moe_experts``).
Prints the fastest candidates and the table's entry; rows go to the shared CSV.

    python benchmarks/bench_moe_tiles.py --kind down_bwd
    python benchmarks/bench_moe_tiles.py --kind down_bwd --n 32,64,128 --k 64 --warps 4,8 --stages 2,3
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import record, table  # noqa: E402

T, H, E, I, TOP = 16384, 1024, 64, 384, 8
KINDS = ("up", "down", "down_bwd", "dx", "wgrad")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=KINDS, default="down_bwd")
    ap.add_argument("--m", type=_ints, default=[64, 128], help="wgrad only: BLOCK_M values")
    ap.add_argument("--n", type=_ints, default=[32, 64, 128], help="BLOCK_N values")
    ap.add_argument("--k", type=_ints, default=[32, 64, 128], help="BLOCK_K values")
    ap.add_argument("--warps", type=_ints, default=[4, 8])
    ap.add_argument("--stages", type=_ints, default=[2, 3, 4])
    ap.add_argument("--top", type=int, default=12, help="rows of the printed table")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_tiles: needs a CUDA GPU")
    import triton.testing

    import ckpt.kernels as K
    from ckpt.kernels.moe import experts_configs

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(T, H, generator=g, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, generator=g, device=dev)
    w, idx = torch.softmax(logits, -1).topk(TOP, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16).requires_grad_()
    gate_up = (
        (torch.randn(E, 2 * I, H, generator=g, device=dev) * H**-0.5).to(torch.bfloat16).requires_grad_()
    )
    down = (torch.randn(E, H, I, generator=g, device=dev) * I**-0.5).to(torch.bfloat16).requires_grad_()
    dout = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    leaves = (x, w, gate_up, down)

    def step() -> None:
        for t in leaves:
            t.grad = None
        K.fused_experts(x, idx, w, gate_up, down).backward(dout)

    def results() -> list[torch.Tensor]:
        for t in leaves:
            t.grad = None
        out = K.fused_experts(x, idx, w, gate_up, down)
        out.backward(dout)
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    def timed() -> float:
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm on the side stream, as capture requires
            with torch.cuda.graph(graph, stream=stream):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        return triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")

    cfg = experts_configs(dev)
    default = tuple(cfg[args.kind])
    reference = results()
    flops = 2 * T * TOP * H * 2 * I + 2 * T * TOP * I * H  # forward: gate/up GEMM and down GEMM
    flops *= 3  # forward + backward (two GEMMs per forward GEMM)
    if args.kind == "wgrad":
        grid = list(itertools.product(args.m, args.n, args.k, args.warps, args.stages))
    else:
        grid = list(itertools.product(args.n, args.k, args.warps, args.stages))
    if default not in grid:
        grid.insert(0, default)
    rows = []
    for cand in grid:
        cfg[args.kind] = cand
        try:
            got = results()
            worst = max(
                float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, reference)
            )
            ok = worst <= 2e-2
            ms = timed() if ok else float("nan")
            note = f"max relative difference to the table's tiles {worst:.1e}" + ("" if ok else ": WRONG")
        except Exception as e:  # noqa: BLE001 - a tile that does not compile or launch: said, and the sweep goes on
            ms, note = float("nan"), f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        finally:
            cfg[args.kind] = default
        rows.append(
            {
                "tiles": str(cand),
                "ms": ms,
                "layer TFLOP/s": flops / ms / 1e9 if ms == ms else float("nan"),
                "table's": "yes" if cand == default else "",
                "note": note,
            }
        )
        print(f"{args.kind} {cand}: {ms:.3f} ms  {note}", flush=True)
    case = f"moe_experts fwd+bwd {T}x{H} E{E}x{I} top{TOP} bf16, sweep of {args.kind}"
    if not args.no_record:
        record(
            "moe_tiles",
            [
                {
                    "case": case,
                    "provider": f"{args.kind} {r['tiles']}",
                    "metric": "fwd+bwd ms",
                    "value": r["ms"],
                    "unit": "ms",
                    "note": r["note"] + (" (the table's)" if r["table's"] else ""),
                }
                for r in rows
            ],
        )
    ranked = sorted((r for r in rows if r["ms"] == r["ms"]), key=lambda r: r["ms"])
    shown = ranked[: args.top] + [r for r in ranked[args.top :] if r["table's"]]
    print(f"\n{torch.cuda.get_device_name()}, {case}")
    print(table(shown, ["tiles", "ms", "layer TFLOP/s", "table's"]))
    failed = [r for r in rows if r["ms"] != r["ms"]]
    if failed:
        print(
            f"{len(failed)} candidate(s) failed or gave other values: "
            + "; ".join(f"{r['tiles']}: {r['note']}" for r in failed[:6])
        )


if __name__ == "__main__":
    main()

"""Where a GPU sat idle in a PyTorch profiler Chrome trace, and what the host was doing then.

``python benchmarks/trace_gaps.py TRACE.json [--top 15]``: sums the idle time between consecutive
GPU activities (kernels, copies, memsets) and lists the longest gaps with the host-side operations
(outermost first) that launched the activity ending each gap, so host-bound stretches of a training
step can be told from GPU-bound ones. Used with ``bench_train_kernels.py --profile 1 --trace DIR``.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--min-us", type=float, default=20.0, help="gaps shorter than this are counted, not listed"
    )
    args = ap.parse_args(argv)
    events = json.load(open(args.trace))["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"), key=lambda e: e["ts"]
    )
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    ops_by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and e.get("ph") == "X":
            ops_by_tid[e["tid"]].append(e)
    for ops in ops_by_tid.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_tid.items()}

    def enclosing(launch: dict) -> list[str]:
        ops, st = ops_by_tid.get(launch["tid"], []), starts.get(launch["tid"], [])
        i = bisect.bisect_right(st, launch["ts"])
        return [e["name"] for e in ops[max(0, i - 400) : i] if e["ts"] + e.get("dur", 0) >= launch["ts"]]

    if not gpu:
        print("no GPU activity in this trace (profiled on the CPU?)")
        return 1
    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    gaps, end = [], gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, e))
        end = max(end, e["ts"] + e["dur"])
    idle = sum(g for g, _ in gaps)
    print(
        f"{len(gpu)} GPU activities over {span / 1e3:.1f} ms: busy {busy / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
        f"in {len(gaps)} gaps ({sum(g for g, _ in gaps if g >= args.min_us) / 1e3:.1f} ms in gaps >= {args.min_us:g} us)"
    )
    by_op: dict = defaultdict(float)
    for g, e in gaps:
        launch = launches.get(e.get("args", {}).get("correlation"))
        ctx = enclosing(launch) if launch else []
        by_op[ctx[0] if ctx else "?"] += g
    print("idle before activities launched under (outermost host op):")
    for name, g in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {g / 1e3:8.2f} ms  {name[:100]}")
    print("longest gaps:")
    for g, e in sorted(gaps, key=lambda x: -x[0])[: args.top]:
        launch = launches.get(e.get("args", {}).get("correlation"))
        ctx = " > ".join(n[:40] for n in (enclosing(launch) if launch else [])[-4:])
        print(f"  {g:9.1f} us before {e['name'][:50]}  [{ctx}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

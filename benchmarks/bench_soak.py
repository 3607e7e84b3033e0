"""Host memory over many saves: the process's RSS plus the job's ``/dev/shm`` bytes stay flat and under
``host_memory_limit``.

A state of ``--mb`` MB (CUDA when there is a GPU, else CPU) is saved ``--saves`` times with snapshots every
step through ``maybe_save`` (the local tier writing as it keeps up, newest wins, ``keep=Retention(local=2)``),
the state changing before each save. Every ``--every`` saves: the process's RSS, the bytes of the job's
memory-tier segments in the RAM file system, and their sum against ``host_memory_limit``. A short table last;
rows appended to ``benchmarks/results.csv``.

    python benchmarks/bench_soak.py --saves 1000 --mb 256
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

import ckpt  # noqa: E402
from ckpt import shm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=1000)
    p.add_argument("--mb", type=int, default=256, help="state size (MB)")
    p.add_argument("--every", type=int, default=100, help="sample the memory every this many saves")
    p.add_argument(
        "--limit-factor",
        type=float,
        default=4.0,
        help="host_memory_limit as a multiple of the state (three buffers need 3)",
    )
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.mb * (1 << 20) // 4
    state = {"a": torch.zeros(n // 2, device=device), "b": torch.zeros(n - n // 2, device=device), "step": 0}
    nbytes = n * 4
    limit = int(args.limit_factor * nbytes) + (64 << 20)
    root = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    proc = psutil.Process()
    rows, samples = [], []
    t0 = time.perf_counter()
    committed = 0
    try:
        with ckpt.Checkpointer(
            local_dir=root, every_steps=1, host_memory_limit=limit, keep=ckpt.Retention(local=2)
        ) as ck:
            prefix = ck.memory.space.prefix if ck.memory.space is not None else None
            for step in range(1, args.saves + 1):
                state["a"].fill_(step)
                state["b"].fill_(-step)
                state["step"] = step
                h = ck.maybe_save(step, state)
                if h is not None and h.status != "skipped":
                    h.wait("memory")  # the copy lands before the next change, as within a training step
                    committed += 1
                if step % args.every == 0 or step == 1:
                    shm_bytes = sum(g.nbytes for g in shm.segments(prefix=prefix)) if prefix else 0
                    rss = proc.memory_info().rss
                    samples.append((step, rss, shm_bytes))
                    print(
                        f"save {step:>5}: RSS {rss / 2**20:8.1f} MiB, /dev/shm {shm_bytes / 2**20:8.1f} MiB, "
                        f"sum {(rss + shm_bytes) / 2**20:8.1f} MiB (limit {limit / 2**20:.0f} MiB)",
                        flush=True,
                    )
            counts = ck.tier_counts["local"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    took = time.perf_counter() - t0
    first = [s for s in samples if s[0] >= args.every][0] if len(samples) > 1 else samples[0]
    last = samples[-1]
    grow = (last[1] + last[2]) - (first[1] + first[2])
    case = f"{args.mb} MB state, {device}"
    rows.append(
        {
            "case": case,
            "provider": "ours",
            "metric": "RSS + /dev/shm after the first sample",
            "value": round((first[1] + first[2]) / 2**20, 1),
            "unit": "MiB",
            "note": f"at save {first[0]}; host_memory_limit {limit / 2**20:.0f} MiB (for the buffers)",
        }
    )
    rows.append(
        {
            "case": case,
            "provider": "ours",
            "metric": f"growth from save {first[0]} to {last[0]}",
            "value": round(grow / 2**20, 1),
            "unit": "MiB",
            "note": f"{args.saves} saves in {took:.0f} s, {committed} committed to the memory tier; local: "
            f"persisted {counts.persisted}, superseded {counts.superseded}",
        }
    )
    rows.append(
        {
            "case": case,
            "provider": "ours",
            "metric": "/dev/shm at the end",
            "value": round(last[2] / 2**20, 1),
            "unit": "MiB",
            "note": f"{last[2] / nbytes:.2f} x the state",
        }
    )
    path = harness.record("soak", rows, args.csv)
    print(f"\ndevice: {harness.device_name()}; rows appended to {path}")
    print(harness.table(rows, ["case", "provider", "metric", "value", "unit", "note"]))


if __name__ == "__main__":
    main()

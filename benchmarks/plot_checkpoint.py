"""Plot the newest checkpoint benchmark run of one device from ``benchmarks/results.csv``.

``python benchmarks/plot_checkpoint.py [--device "NVIDIA H200"] [--out docs/img/checkpoint.png]``
(needs matplotlib, which is not a dependency of the library).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def newest_run(rows: list[dict], device: str) -> list[dict]:
    rows = [r for r in rows if r["benchmark"] == "checkpoint" and r["device"] == device]
    # A run is a contiguous block that starts with the pinned D2H probe; keep the last one.
    starts = [i for i, r in enumerate(rows) if r["metric"] == "pinned D2H"]
    return rows[starts[-1] :] if starts else rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", default=str(HERE / "results.csv"))
    p.add_argument("--device", default="NVIDIA H200")
    p.add_argument("--out", default=str(HERE.parent / "docs" / "img" / "checkpoint.png"))
    args = p.parse_args()
    with open(args.csv) as f:
        run = newest_run(list(csv.DictReader(f)), args.device)
    blocked: dict[str, list[float]] = defaultdict(list)
    restore: dict[str, float] = {}
    step: dict[str, float] = {}
    for r in run:
        v = float(r["value"])
        if r["case"] == "state" and r["metric"] == "blocked per save":
            blocked[r["provider"]].append(v / 1e3)
        elif r["metric"] in ("restore from memory", "restore local, cold cache", "restore, warm cache"):
            restore[f"{r['provider']}\n{r['metric'].replace('restore', '').strip(', ')}"] = v
        elif r["case"] == "train" and r["metric"] == "mean step time":
            step[r["provider"]] = v
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(blocked)
    axes[0].bar(range(len(names)), [statistics.median(blocked[n]) for n in names], color="tab:blue")
    axes[0].set_xticks(
        range(len(names)), [n.replace("+", "\n+").replace("dcp.", "dcp.\n") for n in names], fontsize=8
    )
    axes[0].set_yscale("log")
    axes[0].set_ylabel("seconds (log)")
    axes[0].set_title("training blocked per save (8.1 GB state, median)")
    axes[1].bar(range(len(restore)), list(restore.values()), color="tab:green")
    axes[1].set_xticks(range(len(restore)), list(restore), fontsize=8)
    axes[1].set_ylabel("seconds")
    axes[1].set_title("restore to GPU")
    axes[2].bar(range(len(step)), list(step.values()), color="tab:orange")
    axes[2].set_xticks(range(len(step)), list(step), fontsize=9)
    axes[2].set_ylabel("s / step")
    axes[2].set_title("Llama-3.2-1B loop, save every 50 steps")
    fig.suptitle(f"{args.device}, {run[0]['date'] if run else ''}, torch {run[0]['torch'] if run else ''}")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

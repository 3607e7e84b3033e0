"""One harness for every benchmark script: device name, CSV append, table print.

Every script in ``benchmarks/`` builds its inputs, checks correctness, times the
providers side by side in one run, then calls :func:`record` so that all results
land in one CSV (``benchmarks/results.csv``) with the device name and the date,
and prints a short table last.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Mapping

RESULTS_CSV = Path(__file__).with_name("results.csv")

FIELDS = ["date", "device", "torch", "benchmark", "case", "provider", "metric", "value", "unit", "note"]


def device_name() -> str:
    """Name of the GPU the run used, or of the CPU when there is none."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def record(benchmark: str, rows: Iterable[Mapping[str, Any]], path: Path | str | None = None) -> Path:
    """Append ``rows`` (dicts with case, provider, metric, value, unit[, note]) to the CSV."""
    import torch

    path = Path(path or os.environ.get("CKPT_BENCH_CSV", RESULTS_CSV))
    new = not path.exists()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    dev = device_name()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(
                {
                    "date": stamp,
                    "device": dev,
                    "torch": torch.__version__,
                    "benchmark": benchmark,
                    "note": "",
                    **{k: r[k] for k in r if k in FIELDS},
                }
            )
    return path


def table(rows: list[Mapping[str, Any]], columns: list[str]) -> str:
    """Format ``rows`` as a fixed-width text table with the given columns."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)

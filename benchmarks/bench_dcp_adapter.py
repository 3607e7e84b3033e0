"""``dcp.save`` / ``dcp.load`` through :mod:`ckpt.integrations.dcp` against DCP's own file storage.

One process (DCP without a process group), a state of bf16 parameters and two fp32 Adam moments per
matrix (on the GPU when there is one), saved and loaded side by side in one run:

* ``dcp-fs``: ``FileSystemWriter`` / ``FileSystemReader`` (DCP's default: pickled metadata);
* ``tiers-local``: ``TierStorageWriter(local_dir=...)`` / ``TierStorageReader``;
* ``tiers-local+remote``: the same plus a second copy at a ``file://`` URL (the remote tier's code
  path, on the same disk);
* ``tiers-remote``: the ``file://`` URL alone (each rank's file streamed through fsspec's writer).

Every load is checked bit for bit against the saved state first; then the median of ``--rounds``
rounds is recorded (save: until ``dcp.save`` returns, which includes fsync of the local files for
both; an untimed ``os.sync()`` follows, so that writeback does not slow the next load; load: into
preallocated tensors on the state's device). The page cache is warm for loads (same files, just
written): this compares the two storage layers' own costs, not the disk.

    python benchmarks/bench_dcp_adapter.py --mb 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).parent))
from harness import device_name, record, table  # noqa: E402
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def build(mb: int, device: str) -> dict:
    n = 2048
    per = n * n * (2 + 4 + 4)
    g = torch.Generator(device="cpu").manual_seed(0)
    state = {
        "model": {},
        "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}], "step": 7},
    }
    for i in range(max(1, mb * 2**20 // per)):
        w = torch.randn(n, n, generator=g)
        state["model"][f"layer{i}.weight"] = w.to(device=device, dtype=torch.bfloat16)
        state["optim"][f"layer{i}.exp_avg"] = (w * 0.1).to(device)
        state["optim"][f"layer{i}.exp_avg_sq"] = (w * w).to(device)
    return state


def empty_like(state: dict) -> dict:
    return {
        "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
        "optim": {
            k: (
                torch.empty_like(v)
                if torch.is_tensor(v)
                else ([{"lr": 0.0, "betas": None, "eps": 0.0}] if k == "param_groups" else 0)
            )
            for k, v in state["optim"].items()
        },
    }


def same(a: dict, b: dict) -> bool:
    for part in ("model", "optim"):
        for k, v in a[part].items():
            w = b[part][k]
            if torch.is_tensor(v) and not torch.equal(v, w):
                return False
            if not torch.is_tensor(v) and v != w:
                return False
    return True


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=400, help="state size in MB (rounded down to whole layers)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = build(args.mb, device)
    nbytes = sum(
        t.numel() * t.element_size() for part in state.values() for t in part.values() if torch.is_tensor(t)
    )
    root = Path(tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir))
    providers = {
        "dcp-fs": (lambda d: dcp.FileSystemWriter(d / "fs"), lambda d: dcp.FileSystemReader(d / "fs")),
        "tiers-local": (
            lambda d: TierStorageWriter(local_dir=d / "local"),
            lambda d: TierStorageReader(local_dir=d / "local"),
        ),
        "tiers-local+remote": (
            lambda d: TierStorageWriter(local_dir=d / "l2", url=f"file://{d}/remote"),
            lambda d: TierStorageReader(local_dir=d / "l2", url=f"file://{d}/remote"),
        ),
        "tiers-remote": (
            lambda d: TierStorageWriter(url=f"file://{d}/remote-only"),
            lambda d: TierStorageReader(url=f"file://{d}/remote-only"),
        ),
    }
    times = {p: {"save": [], "load": []} for p in providers}
    try:
        for rnd in range(args.rounds):
            for name, (make_writer, make_reader) in providers.items():
                d = root / f"r{rnd}"
                sync()
                t0 = time.perf_counter()
                dcp.save(
                    state, storage_writer=make_writer(d), checkpoint_id=None if name == "dcp-fs" else "ck"
                )
                sync()
                times[name]["save"].append(time.perf_counter() - t0)
                os.sync()  # untimed: the next load must not compete with this save's writeback
                out = empty_like(state)
                sync()
                t0 = time.perf_counter()
                dcp.load(out, storage_reader=make_reader(d), checkpoint_id=None if name == "dcp-fs" else "ck")
                sync()
                times[name]["load"].append(time.perf_counter() - t0)
                if not same(state, out):
                    raise SystemExit(f"{name}: the loaded state differs from the saved one")
                del out
            shutil.rmtree(root / f"r{rnd}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    case = f"{nbytes / 1e9:.2f} GB {device}, one process"
    rows = []
    for name, t in times.items():
        for op in ("save", "load"):
            med = statistics.median(t[op])
            rows.append(
                {
                    "case": case,
                    "provider": name,
                    "metric": f"{op}_s",
                    "value": round(med, 4),
                    "unit": "s",
                    "note": f"median of {args.rounds}; {nbytes / med / 1e9:.2f} GB/s; rounds "
                    + ", ".join(f"{x:.3f}" for x in t[op]),
                }
            )
    record("bench_dcp_adapter", rows, args.csv)
    print(f"device: {device_name()}  torch {torch.__version__}  state {nbytes / 1e9:.2f} GB on {device}")
    print(
        table(
            [
                {
                    "provider": r["provider"],
                    "metric": r["metric"],
                    "seconds": r["value"],
                    "GB/s": round(nbytes / r["value"] / 1e9, 2),
                }
                for r in rows
            ],
            ["provider", "metric", "seconds", "GB/s"],
        )
    )


if __name__ == "__main__":
    main()

"""Restoring a sharded checkpoint on another number of ranks: ours (job tier) vs DCP, side by side.

The state: ``--mb`` MB of DTensors, one bf16 "parameter" and two fp32 "moments" per 1024 x 4096
matrix (random values, never zeros), sharded by rows (``Shard(0)``) over ``--save-world`` ranks.
Saved once with ours (every rank the same ``file://`` url: the job tier) and once with
``torch.distributed.checkpoint.save``. Then ``--load-world`` ranks, holding the same tensors sharded
by rows (FSDP2's layout, the default) or by columns (``--load-dim 1``), restore each in turn, ``--rounds`` times, alternating which goes first;
after every restore each rank checks its shards against the values saved. Reported: the restore
time (slowest rank; median of rounds) and the state's size over it. One untimed round of each comes
first, so both read the same file system from a warm page cache: this compares the loaders' work,
not the disk (on the development machine the first read of freshly written files ran at 0.05-0.15
GB/s per 16 MiB part, for both).

Usage::

    python benchmarks/bench_reshard.py                          # CPU processes (gloo), 2 -> 3 ranks
    python benchmarks/bench_reshard.py --cuda --save-world 2 --load-world 1   # GPUs (NCCL)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import device_name, record, table  # noqa: E402

ROWS, COLS = 1024, 4096
PER_MATRIX = ROWS * COLS * (2 + 4 + 4)  # bf16 parameter + two fp32 moments


def _globals(n: int, device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for i in range(n):
        out[f"w{i}"] = torch.randn(ROWS, COLS, generator=g, device=device).to(torch.bfloat16)
        out[f"m{i}"] = torch.randn(ROWS, COLS, generator=g, device=device)
        out[f"v{i}"] = torch.rand(ROWS, COLS, generator=g, device=device)
    return out


def _worker(rank: int, world: int, phase: str, args: argparse.Namespace, port: int, root: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = "cuda" if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.cuda else "gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(dev, (world,))
    full = _globals(args.mb * 2**20 // PER_MATRIX, dev)
    url = f"file://{root}/job"

    def sync() -> None:
        if args.cuda:
            torch.cuda.synchronize()
        dist.barrier()

    if phase == "save":
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        with ckpt.Checkpointer(url, local_dir=f"{root}/save-local/rank-{rank}") as ck:
            ck.save(1, {"state": state}).wait()
        dcp.save({"state": state}, checkpoint_id=f"{root}/dcp")
        sync()
    else:
        place = [Shard(args.load_dim)]
        want = {k: distribute_tensor(v, mesh, place).to_local().clone() for k, v in full.items()}
        state = {k: distribute_tensor(torch.zeros_like(v), mesh, place) for k, v in full.items()}
        del full
        ck = ckpt.Checkpointer(url, local_dir=f"{root}/load-local-{world}/rank-{rank}")
        times: dict[str, list[float]] = {"ours": [], "dcp.load": []}
        ok = True
        for r in range(-1, args.rounds):  # round -1: untimed, so that both read from the page cache
            order = ["ours", "dcp.load"] if r % 2 == 0 else ["dcp.load", "ours"]
            for name in order:
                for v in state.values():
                    v.to_local().zero_()
                sync()
                t0 = time.perf_counter()
                if name == "ours":
                    got = ck.restore({"state": state})
                    ok = ok and got == 1 and ck.last_restore.tier == "remote"
                else:
                    dcp.load({"state": state}, checkpoint_id=f"{root}/dcp")
                sync()
                if r >= 0:
                    times[name].append(time.perf_counter() - t0)
                ok = ok and all(torch.equal(state[k].to_local(), want[k]) for k in want)
        ck.close()
        oks = [None] * world
        dist.all_gather_object(oks, ok)
        if rank == 0:
            Path(root, "result.json").write_text(json.dumps({"times": times, "ok": all(oks)}))
    dist.destroy_process_group()


def _spawn(world: int, phase: str, args: argparse.Namespace, root: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, phase, args, port, root), nprocs=world, join=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save-world", type=int, default=2)
    ap.add_argument("--load-world", type=int, default=3)
    ap.add_argument("--mb", type=int, default=400, help="state size in MB (rounded down to whole matrices)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--load-dim",
        type=int,
        default=0,
        choices=(0, 1),
        help="the loading ranks shard by rows (0: FSDP2's layout, default) or by columns (1)",
    )
    ap.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args()
    if args.load_world == args.save_world and args.load_dim == 0:
        ap.error("that is the saved layout (nothing to reshard): change --load-world or pass --load-dim 1")
    n = args.mb * 2**20 // PER_MATRIX
    if n < 1:
        ap.error(f"--mb must be at least {PER_MATRIX // 2**20 + 1}")
    root = tempfile.mkdtemp(prefix="bench-reshard-", dir=args.dir)
    try:
        _spawn(args.save_world, "save", args, root)
        os.sync()  # both savers' files written back: no writeback competes with the first restore
        _spawn(args.load_world, "load", args, root)
        res = json.loads(Path(root, "result.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = n * PER_MATRIX
    case = (
        f"{nbytes / 1e9:.2f} GB state, {args.save_world} -> {args.load_world} ranks, "
        f"Shard(0) -> Shard({args.load_dim})"
    )
    rows, csv_rows = [], []
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        rows.append(
            {
                "provider": name,
                "restore_s": f"{med:.3f}",
                "GB/s": f"{nbytes / med / 1e9:.2f}",
                "rounds": ", ".join(f"{t:.3f}" for t in ts),
            }
        )
        csv_rows.append(
            {
                "case": case,
                "provider": name,
                "metric": "restore_resharded",
                "value": med,
                "unit": "s",
                "note": f"{'cuda' if args.cuda else 'cpu'}; rounds {[round(t, 3) for t in ts]}",
            }
        )
    record("bench_reshard", csv_rows, args.csv)
    print(f"device: {device_name()}; {case}; every restore checked: {'ok' if res['ok'] else 'MISMATCH'}")
    print(table(rows, ["provider", "restore_s", "GB/s", "rounds"]))
    if not res["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The peer tier over gloo: replication rate per rank pair, its cost to a training loop, and the restore of
a replaced rank from its holder's RAM, against the raw transfer of the same bytes, in one run.

Two ranks on this machine (loopback), each with a state of ``--mb`` MB and a fixed CPU "step"
(``--step-ms`` of matmuls). Measured, per rank, side by side:

* ``raw``: one ``isend``/``irecv`` of the state's bytes each way over a gloo group (the floor);
* ``loop, no saves`` / ``loop, snapshots every N`` / ``loop, snapshots every N + peers``: mean step time;
* replication: each exchange's seconds (``handle.stats.persist_s["peer"]``) -> GB/s per direction;
* restore of rank 1 after both processes died and its RAM and disk were wiped: seconds, from the peer tier.

Usage: ``python benchmarks/bench_peer.py [--mb 512] [--steps 60] [--every 10]``. On a GPU machine this
runs the gloo path as well (CPU state); the NCCL path is ``CKPT_PEER_NCCL=1`` with CUDA state (two GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _worker(root: str, rank: int, world: int, mode: str, mb: int, steps: int, every: int, step_ms: float) -> None:
    os.makedirs(f"{root}/shm-{rank}", exist_ok=True)
    os.environ["CKPT_SHM_DIR"] = f"{root}/shm-{rank}"
    import torch

    import ckpt

    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = mb * 1_000_000 // 4
    state = {"w": torch.randn(n, generator=torch.Generator().manual_seed(rank)), "step": 0}
    a = torch.randn(256, 256)
    reps = 1
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    reps = max(1, int(step_ms / 1000 / ((time.perf_counter() - t0) / 20)))
    out: dict = {"rank": rank}

    def step_fn(s: int) -> None:
        for _ in range(reps):
            a @ a
        state["w"][:1000].add_(1.0)
        state["step"] = s

    if mode == "raw":
        g = dist.new_group(backend="gloo")
        buf, got = torch.empty(n * 4, dtype=torch.uint8), torch.empty(n * 4, dtype=torch.uint8)
        times = []
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            ops = [dist.P2POp(dist.isend, buf, 1 - rank, group=g), dist.P2POp(dist.irecv, got, 1 - rank, group=g)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
            times.append(time.perf_counter() - t)
        out["raw_s"] = min(times)
    elif mode.startswith("loop"):
        peers = 1 if mode == "loop-peers" else None
        saving = mode != "loop-none"
        with ckpt.Checkpointer(local_dir=f"{root}/rank-{rank}", every_steps=every, peers=peers,
                               persist_every={"local": 10_000}) as ck:
            times, handles = [], []
            for s in range(1, steps + 1):
                dist.barrier()
                t = time.perf_counter()
                ck.wait_staged()
                step_fn(s)
                if saving:
                    h = ck.maybe_save(s, state)
                    if h is not None:
                        handles.append(h)
                times.append(time.perf_counter() - t)
            ck.wait()
            out["step_ms"] = statistics.mean(times[every:]) * 1e3
            out["counts"] = {k: v.persisted for k, v in ck.tier_counts.items()}
            if peers:
                ex = [h.stats.persist_s.get("peer") for h in handles if h.tier_status("peer") == "done"]
                ex = [x for x in ex if x]
                out["peer_cold_s"], out["peer_s"] = ex[:2], ex[2:]   # the first two fill fresh replica buffers
                out["data_bytes"] = handles[-1].stats.nbytes
            ck.close(keep_memory=True)   # the RAM stays as a crash leaves it
    elif mode == "restore":
        with ckpt.Checkpointer(local_dir=f"{root}/rank-{rank}", every_steps=every, peers=1) as ck:
            state["w"].zero_()
            t = time.perf_counter()
            step = ck.restore(state)
            out["restore_s"] = time.perf_counter() - t
            out["tier"] = ck.last_restore.tier
            out["step"] = step
            out["exact"] = bool(torch.equal(state["w"][1000:], torch.randn(
                n, generator=torch.Generator().manual_seed(rank))[1000:]))
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _run(root: str, mode: str, args: argparse.Namespace) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", root, str(r), mode, str(args.mb), str(args.steps),
                               str(args.every), str(args.step_ms)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    res = []
    for p in procs:
        o, e = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{mode}: rank failed ({p.returncode}):\n{e[-3000:]}")
        res.append(json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]))
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, rank, mode, mb, steps, every, step_ms = sys.argv[2], int(sys.argv[3]), sys.argv[4], *map(float, sys.argv[5:9])
        _worker(root, rank, 2, mode, int(mb), int(steps), int(every), step_ms)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="state per rank, MB")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=200.0, help="CPU work per step, ms")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from harness import record, table

    root = tempfile.mkdtemp(prefix="bench-peer-")
    try:
        raw = _run(root, "raw", args)
        loops = {m: _run(root, m, args) for m in ("loop-none", "loop-snap", "loop-peers")}
        shutil.rmtree(f"{root}/rank-1")   # rank 1's node is replaced: its disk and RAM are gone
        shutil.rmtree(f"{root}/shm-1")
        rest = _run(root, "restore", args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = loops["loop-peers"][0]["data_bytes"]
    raw_s = max(r["raw_s"] for r in raw)
    ex = [x for r in loops["loop-peers"] for x in r["peer_s"]]
    cold = [x for r in loops["loop-peers"] for x in r["peer_cold_s"]]
    base = statistics.mean(r["step_ms"] for r in loops["loop-none"])
    case = f"2 gloo ranks, {nbytes / 1e9:.2f} GB per rank, snapshot every {args.every}"
    rows = [
        {"case": case, "provider": "raw gloo exchange", "metric": "GB/s per direction", "value": nbytes / raw_s / 1e9,
         "unit": "GB/s", "note": f"{raw_s:.3f} s"},
        {"case": case, "provider": "peer tier exchange", "metric": "GB/s per direction",
         "value": nbytes / statistics.median(ex) / 1e9, "unit": "GB/s",
         "note": f"median of {len(ex)} exchanges into warm buffers, {statistics.median(ex):.3f} s (send, receive, "
                 "every chunk checked, commit)"},
        {"case": case, "provider": "peer tier exchange, first two", "metric": "GB/s per direction",
         "value": nbytes / statistics.median(cold) / 1e9, "unit": "GB/s",
         "note": f"median of {len(cold)}, {statistics.median(cold):.3f} s: the holder's replica buffers are new"},
    ]
    for m, label in (("loop-none", "no saves"), ("loop-snap", "snapshots (memory tier)"), ("loop-peers", "snapshots + peer tier")):
        v = statistics.mean(r["step_ms"] for r in loops[m])
        rows.append({"case": case, "provider": label, "metric": "mean step time", "value": v, "unit": "ms",
                     "note": f"{(v / base - 1) * 100:+.2f}% vs no saves; committed {loops[m][0]['counts']}"})
    r1 = rest[1]
    rows.append({"case": case, "provider": "restore of the replaced rank", "metric": "seconds", "value": r1["restore_s"],
                 "unit": "s", "note": f"tier {r1['tier']}, step {r1['step']}, bit-exact {r1['exact']}, "
                                      f"{r1['restore_s'] / raw_s:.2f}x the raw transfer"})
    print(table(rows, ["provider", "metric", "value", "unit", "note"]))
    if not args.no_record:
        record("peer", rows)


if __name__ == "__main__":
    main()

"""The peer tier over gloo: replication rate per rank pair, its cost to a training loop, and the restore of
a replaced rank from its holder's RAM, against the raw transfer of the same bytes, in one run.

Two ranks on this machine (loopback), each with a state of ``--mb`` MB and a fixed CPU "step"
(``--step-ms`` of matmuls). Measured, per rank, side by side:

* ``raw``: one ``isend``/``irecv`` of the state's bytes each way over a gloo group (the floor);
* ``loop, no saves`` / ``loop, snapshots every N`` / ``loop, snapshots every N + peers``: mean step time;
* replication: each exchange's seconds (``handle.stats.persist_s["peer"]``) -> GB/s per direction;
* restore of rank 1 after both processes died and its RAM and disk were wiped: seconds, from the peer tier;
  each rank constructs its Checkpointer, then builds its state (0.5 s at least, as a model build), then
  restores; the construction's seconds and the background adoption of the RAM segments are reported beside.
  The replaced rank calls restore 1 s after the other (a replaced node's process starts cold and comes to the
  restore after the others, which wait for it in the restore's agreement); then again, rank 1 wiped anew,
  both calling restore at the same moment.

With ``--nccl`` (two GPUs): the state lives on each rank's GPU, a step is ``--step-ms`` of GPU matmuls, the
peer tier moves the data over NCCL (``CKPT_PEER_NCCL=1``: host -> device staging -> NCCL -> device -> host), and
the floors are measured on the same GPUs: ``raw, GPU to GPU`` (one NCCL exchange of the state's bytes between
the two GPUs: the link) and ``raw, RAM to GPU`` (a pinned host buffer copied to its GPU and sent to the other
GPU, both directions at once: the least a restore from a holder's RAM onto the replaced rank's GPU must do,
with no pieces and no checks), and ``raw, a restore's transfers`` (the holder copies its own state from pinned
host memory to its GPU and, at once, the replica to its GPU and on to the replaced rank's: the bytes a restore
moves over the holder's one host-to-GPU link); the restore is compared with both. The restore rows list
``RestoreInfo.phases`` of both ranks (agreeing, the peer exchange, loading, waiting for the other rank).
``wire`` rows time the staged exchange alone (host to host, no checks) for a few ring depths and piece sizes.

Usage: ``python benchmarks/bench_peer.py [--mb 512] [--steps 60] [--every 10] [--nccl]``. The ranks' RAM
directories (``CKPT_SHM_DIR``) and local tiers go under ``--root`` (default: ``/dev/shm`` where it has room
for them, else the temporary directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: seconds after the other rank that the replaced rank calls restore in the first restore (a replaced node comes
#: up after the others: they wait for it in the restore's agreement)
LATE_S = 1.0


def _worker(
    root: str, rank: int, world: int, mode: str, mb: int, steps: int, every: int, step_ms: float
) -> None:
    os.makedirs(f"{root}/shm-{rank}", exist_ok=True)
    os.environ["CKPT_SHM_DIR"] = f"{root}/shm-{rank}"
    import torch

    import ckpt

    torch.set_num_threads(1)
    dist = torch.distributed
    nccl = os.environ.get("CKPT_PEER_NCCL") == "1"
    dev = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = mb * 1_000_000 // 4

    def initial() -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dev)

    state = {"w": initial(), "step": 0}
    # a step's work: matmuls on the CPU, or large bf16 ones on the GPU (enough per launch that the GPU is busy)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) if nccl else torch.randn(256, 256)

    def spin(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            a @ a
        if nccl:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    spin(5)
    reps = max(1, int(step_ms / 1000 / (spin(20) / 20)))
    out: dict = {"rank": rank}

    def step_fn(s: int) -> None:
        for _ in range(reps):
            a @ a
        state["w"][:1000].add_(1.0)
        state["step"] = s
        if nccl:
            torch.cuda.synchronize()  # as a loop that reads its loss each step

    if mode == "raw":
        g = dist.new_group(backend="gloo")
        buf, got = torch.empty(n * 4, dtype=torch.uint8), torch.empty(n * 4, dtype=torch.uint8)  # gloo: host
        times = []
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            ops = [
                dist.P2POp(dist.isend, buf, 1 - rank, group=g),
                dist.P2POp(dist.irecv, got, 1 - rank, group=g),
            ]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
            times.append(time.perf_counter() - t)
        out["raw_s"] = min(times)
        if nccl:
            out.update(_nccl_floors(rank, n * 4))
    elif mode.startswith("loop"):
        peers = 1 if mode == "loop-peers" else None
        saving = mode != "loop-none"
        with ckpt.Checkpointer(
            local_dir=f"{root}/rank-{rank}", every_steps=every, peers=peers, persist_every={"local": 10_000}
        ) as ck:
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
                out["peer_cold_s"], out["peer_s"] = ex[:2], ex[2:]  # the first two fill fresh replica buffers
                out["data_bytes"] = handles[-1].stats.nbytes
            ck.close(keep_memory=True)  # the RAM stays as a crash leaves it
    elif mode == "restore":
        logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(message)s")
        logging.getLogger("ckpt.tiers.peer").setLevel(logging.INFO)  # the exchange's own breakdown
        lines: list[str] = []  # and printed under the table: where the holder served the bytes from

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        logging.getLogger("ckpt.tiers.peer").addHandler(_Keep())
        logging.getLogger("ckpt.tiers.memory").setLevel(logging.INFO)  # and whether it read its own ahead
        logging.getLogger("ckpt.tiers.memory").addHandler(_Keep())
        out["log"] = lines
        del state["w"]
        if nccl:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ckpt.Checkpointer(local_dir=f"{root}/rank-{rank}", every_steps=every, peers=1) as ck:
            out["construct_s"] = time.perf_counter() - t0
            # the model is built after the Checkpointer (as docs/operations.md advises): its taking over of the
            # previous process's RAM segments runs meanwhile
            state["w"] = torch.zeros(n, device=dev)
            time.sleep(0.5)  # what building a model takes at least
            dist.barrier()  # both ranks here; the replaced one calls restore BENCH_PEER_LATE seconds after
            if rank == 1:
                time.sleep(float(os.environ.get("BENCH_PEER_LATE", "0")))
            t = time.perf_counter()
            step = ck.restore(state)
            if nccl:
                torch.cuda.synchronize()
            out["restore_s"] = time.perf_counter() - t
            span = ck.pool.adopt_span
            if span is not None and span[1] is not None and ck.pool.buffers:  # segments it took over
                out["adopt_s"] = span[1] - span[0]
                out["adopt_left_s"] = max(0.0, span[1] - (time.monotonic() - out["restore_s"]))
            out["tier"] = ck.last_restore.tier
            out["load_s"] = (
                ck.last_restore.seconds
            )  # reading its tier into the state, the agreement not counted
            out["phases"] = ck.last_restore.phases
            out["step"] = step
            out["exact"] = bool(torch.equal(state["w"][1000:], initial()[1000:]))
            ck.close(keep_memory=True)  # the RAM stays as a crash leaves it: the next restore finds it again
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _nccl_floors(rank: int, nbytes: int) -> dict:
    """The NCCL floors on this pair of GPUs, and the staged exchange alone for a few rings and piece sizes."""
    import torch

    from ckpt.tiers.peer import Exchange

    dist = torch.distributed
    other = 1 - rank
    g = dist.new_group(backend="nccl")
    ctl = dist.new_group(backend="gloo")
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(rank + 1)

    def best(fn, reps: int = 3) -> float:
        times = []
        for _ in range(reps + 1):  # the first one sets up the communicator
            dist.barrier(group=ctl)
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times[1:])

    def link() -> None:
        ops = [
            dist.P2POp(dist.isend, dev_out, other, group=g),
            dist.P2POp(dist.irecv, dev_in, other, group=g),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def from_ram() -> None:
        dev_out.copy_(host, non_blocking=True)
        link()

    side = torch.cuda.Stream()

    def restore_moves() -> None:
        # what a restore of rank 1 from rank 0's RAM must move: rank 0 loads its own state from its RAM onto its
        # GPU and, over the same host-to-GPU link meanwhile, rank 1's replica, which goes on to rank 1's GPU
        if rank == 0:
            with torch.cuda.stream(side):
                dev_in.copy_(host_in, non_blocking=True)  # its own state
            dev_out.copy_(host, non_blocking=True)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, dev_out, other, group=g)])
        else:
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, dev_in, other, group=g)])
        for w in works:
            w.wait()
        side.synchronize()

    res = {
        "link_s": best(link),
        "from_ram_s": best(from_ram),
        "restore_moves_s": best(restore_moves),
        "wire": {},
    }
    sweep = os.environ.get("BENCH_PEER_SWEEP", "1") == "1"
    for ring in (2, 3) if sweep else ():
        for piece_mb in (16, 32, 64):
            wire = Exchange(ctl, piece_mb << 20, g, torch.device("cuda", rank), ring=ring)
            t = best(
                lambda: wire.data(host, other, host_in, other, piece_mb << 20, lambda off, k: None), reps=2
            )
            ok = bool((host_in[:: 1 << 20] == other + 1).all())
            res["wire"][f"ring {ring}, pieces of {piece_mb} MiB"] = (t, ok)
            del wire
    del dev_out, dev_in
    torch.cuda.empty_cache()
    return res


def _run(root: str, mode: str, args: argparse.Namespace, extra: dict | None = None) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(extra or {}),
    }
    env["BENCH_PEER_SWEEP"] = "0" if args.no_sweep else "1"
    if args.nccl:
        env["CKPT_PEER_NCCL"] = "1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("CKPT_PEER_NCCL", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                root,
                str(r),
                mode,
                str(args.mb),
                str(args.steps),
                str(args.every),
                str(args.step_ms),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode != 0 for p in procs):  # every rank's log: the holder's says why it refused
        logs = "\n".join(
            f"--- rank {r} (exit {p.returncode}):\n{e[-3000:]}"
            for r, (p, (o, e)) in enumerate(zip(procs, outs))
        )
        raise SystemExit(f"{mode}: a rank failed\n{logs}")
    return [json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]) for o, e in outs]


def _phases(r: dict) -> str:
    return "phases " + ", ".join(f"{k} {v:.3f} s" for k, v in r["phases"].items())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, rank, mode, mb, steps, every, step_ms = (
            sys.argv[2],
            int(sys.argv[3]),
            sys.argv[4],
            *map(float, sys.argv[5:9]),
        )
        _worker(root, rank, 2, mode, int(mb), int(steps), int(every), step_ms)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="state per rank, MB")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=200.0, help="CPU work per step, ms")
    ap.add_argument("--nccl", action="store_true", help="CUDA state on two GPUs, the peer tier over NCCL")
    ap.add_argument("--root", default=None, help="where the ranks' RAM directories and local tiers go")
    ap.add_argument(
        "--loops",
        default="none,snap,peers",
        help="which loops to time (comma-separated; 'peers' is needed for the restore)",
    )
    ap.add_argument("--no-sweep", action="store_true", help="--nccl: leave the ring / piece sweep out")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from harness import record, table

    # per rank: two snapshot buffers, two replica buffers and a received copy, with room to spare
    need = 6 * args.mb * 1_000_000 * 2
    base_dir = args.root
    if base_dir is None and os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        base_dir = "/dev/shm"
    root = tempfile.mkdtemp(prefix="bench-peer-", dir=base_dir)
    try:
        raw = _run(root, "raw", args)
        wanted = {f"loop-{m.strip()}" for m in args.loops.split(",")} | {"loop-peers"}
        loops = {m: _run(root, m, args) for m in ("loop-none", "loop-snap", "loop-peers") if m in wanted}
        rests = []
        for late in (LATE_S, 0.0):  # the replaced rank comes later (its node was replaced), then at once
            shutil.rmtree(
                f"{root}/rank-1", ignore_errors=True
            )  # rank 1's node is replaced: disk and RAM gone
            shutil.rmtree(f"{root}/shm-1", ignore_errors=True)
            rests.append(_run(root, "restore", args, {"BENCH_PEER_LATE": str(late)}))
        rest = rests[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = loops["loop-peers"][0]["data_bytes"]
    raw_s = max(r["raw_s"] for r in raw)
    ex = [x for r in loops["loop-peers"] for x in r["peer_s"]]
    cold = [x for r in loops["loop-peers"] for x in r["peer_cold_s"]]
    if not ex or not cold:
        raise SystemExit(
            f"--steps {args.steps} / --every {args.every}: too few exchanges to time warm ones "
            f"({len(cold)} first, {len(ex)} later); give three or more snapshots"
        )
    base = statistics.mean(r["step_ms"] for r in loops["loop-none"]) if "loop-none" in loops else None
    case = (
        f"2 {'GPUs, NCCL' if args.nccl else 'gloo ranks'}, {nbytes / 1e9:.2f} GB per rank, "
        f"snapshot every {args.every}"
    )
    rows = [
        {
            "case": case,
            "provider": "raw gloo exchange",
            "metric": "GB/s per direction",
            "value": nbytes / raw_s / 1e9,
            "unit": "GB/s",
            "note": f"{raw_s:.3f} s, host to host",
        },
        {
            "case": case,
            "provider": "peer tier exchange",
            "metric": "GB/s per direction",
            "value": nbytes / statistics.median(ex) / 1e9,
            "unit": "GB/s",
            "note": f"median of {len(ex)} exchanges into warm buffers, {statistics.median(ex):.3f} s (send, receive, "
            f"every chunk checked, commit); each: {', '.join(f'{x:.3f}' for x in ex)}",
        },
        {
            "case": case,
            "provider": "peer tier exchange, first two",
            "metric": "GB/s per direction",
            "value": nbytes / statistics.median(cold) / 1e9,
            "unit": "GB/s",
            "note": f"median of {len(cold)}, {statistics.median(cold):.3f} s: the holder's replica buffers are new; "
            f"each: {', '.join(f'{x:.3f}' for x in cold)}",
        },
    ]
    floor_s, floor = raw_s, "the raw gloo exchange"
    if args.nccl:
        link_s = max(r["link_s"] for r in raw)
        floor_s, floor = max(r["from_ram_s"] for r in raw), "the raw RAM-to-GPU transfer"
        moves_s = max(r["restore_moves_s"] for r in raw)
        rows[:0] = [
            {
                "case": case,
                "provider": "raw NCCL exchange, GPU to GPU",
                "metric": "GB/s per direction",
                "value": nbytes / link_s / 1e9,
                "unit": "GB/s",
                "note": f"{link_s:.3f} s: the link",
            },
            {
                "case": case,
                "provider": "raw, RAM to GPU over NCCL",
                "metric": "GB/s per direction",
                "value": nbytes / floor_s / 1e9,
                "unit": "GB/s",
                "note": f"{floor_s:.3f} s: pinned host -> own GPU -> other GPU, both ways at once, one piece",
            },
            {
                "case": case,
                "provider": "raw, a restore's transfers",
                "metric": "seconds",
                "value": moves_s,
                "unit": "s",
                "note": "the holder's pinned host -> its GPU (its own state) and, at once, -> its GPU -> the replaced "
                "rank's GPU (the replica): both over the holder's one host-to-GPU link",
            },
        ]
        for name in raw[0]["wire"]:
            t = max(r["wire"][name][0] for r in raw)
            ok = all(r["wire"][name][1] for r in raw)
            rows.append(
                {
                    "case": case,
                    "provider": f"wire: staged exchange, {name}",
                    "metric": "GB/s per direction",
                    "value": nbytes / t / 1e9,
                    "unit": "GB/s",
                    "note": f"{t:.3f} s host to host, no checks; bytes {'right' if ok else 'WRONG'}",
                }
            )
    for m, label in (
        ("loop-none", "no saves"),
        ("loop-snap", "snapshots (memory tier)"),
        ("loop-peers", "snapshots + peer tier"),
    ):
        if m not in loops:
            continue
        v = statistics.mean(r["step_ms"] for r in loops[m])
        over = f"{(v / base - 1) * 100:+.2f}% vs no saves" if base else "no saves not timed"
        rows.append(
            {
                "case": case,
                "provider": label,
                "metric": "mean step time",
                "value": v,
                "unit": "ms",
                "note": f"{over}; committed {loops[m][0]['counts']}",
            }
        )
    r0, r1 = rest
    rows.append(
        {
            "case": case,
            "provider": f"restore of the replaced rank, calling restore {LATE_S:g} s after the other",
            "metric": "seconds",
            "value": r1["restore_s"],
            "unit": "s",
            "note": f"tier {r1['tier']}, step {r1['step']}, bit-exact {r1['exact']}, "
            f"{r1['restore_s'] / floor_s:.2f}x {floor}"
            + (f", {r1['restore_s'] / moves_s:.2f}x a restore's transfers" if args.nccl else "")
            + f"; {_phases(r1)}",
        }
    )
    rows.append(
        {
            "case": case,
            "provider": "restore of the other rank",
            "metric": "seconds",
            "value": r0["restore_s"],
            "unit": "s",
            "note": f"tier {r0['tier']}, bit-exact {r0['exact']}; {_phases(r0)}",
        }
    )
    t0, t1 = rests[1]
    rows.append(
        {
            "case": case,
            "provider": "restore of the replaced rank, both calling restore at once",
            "metric": "seconds",
            "value": t1["restore_s"],
            "unit": "s",
            "note": f"tier {t1['tier']}, bit-exact {t1['exact'] and t0['exact']}, "
            f"{t1['restore_s'] / floor_s:.2f}x {floor}"
            + (f", {t1['restore_s'] / moves_s:.2f}x a restore's transfers" if args.nccl else "")
            + f"; {_phases(t1)}; the other rank: {_phases(t0)}",
        }
    )
    for r in (r1, r0):  # what came before each restore: the Checkpointer's construction, its adoption
        rows.append(
            {
                "case": case,
                "provider": f"rank {r['rank']}: Checkpointer construction",
                "metric": "seconds",
                "value": r["construct_s"],
                "unit": "s",
                "note": (
                    "no RAM segments to take over"
                    if "adopt_s" not in r
                    else f"then its RAM segments taken over in the background in {r['adopt_s']:.3f} s, "
                    f"{r['adopt_left_s']:.3f} s of it left when the restore began (a 0.5 s model build "
                    "came between)"
                ),
            }
        )
    print(table(rows, ["provider", "metric", "value", "unit", "note"]))
    for r in rest:  # each rank's own account of its peer-tier restore (what it served, from where)
        for line in r.get("log", []):
            print(f"rank {r['rank']}: {line}")
    if not args.no_record:
        record("peer", rows)


if __name__ == "__main__":
    main()

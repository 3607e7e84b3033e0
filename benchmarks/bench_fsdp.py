"""Checkpointing an FSDP2 job: step time with our saves vs no saves vs DCP ``async_save``, side by side.

A Llama-shaped Hugging Face ``LlamaForCausalLM`` built from a config (the 1.24B
Llama-3.2-1B shape), bf16, every decoder layer and the root sharded with ``fully_shard`` over all
GPUs of the machine, AdamW, random tokens. In one run and the same processes: ``--steps`` timed
steps without saves, then with ``ckpt.Checkpointer`` saving every ``--every`` steps (each rank its
shards, into its own directory), then with ``torch.distributed.checkpoint.async_save`` of
``get_state_dict(model, optimizer)`` every ``--every`` steps (the previous save awaited first, as
DCP requires). Reported per mode: mean step time, overhead over no saves, the time each save
blocked the training loop (rank 0), and how long the last save took to finish after the last step
(not counted in the step time). One untimed save of each kind comes first (our pinned buffer
is allocated there, DCP sets up its staging), as in a long job. Checks at the end that a restore
of our last save reproduces the model's shards on every rank.

With ``--peers`` a fourth mode, timed after ours: the same snapshots with the peer tier on (``peers=1``:
every snapshot also sent to the next rank, which checks every chunk and keeps it in its RAM) and the local
tier every 10,000 steps (the RAM hierarchy alone: a replica per snapshot, no disk on the way). Its
exchanges' rate (bytes per rank / seconds per exchange, each direction) is reported too. ``CKPT_PEER_NCCL=1``
moves the replicas over NCCL. ``--no-dcp`` leaves DCP's mode out.

Usage::

    python benchmarks/bench_fsdp.py                       # all GPUs, NCCL
    python benchmarks/bench_fsdp.py --steps 200 --peers   # also ours with the peer tier
    CKPT_PEER_NCCL=1 python benchmarks/bench_fsdp.py --every 10 --peers --no-dcp
    python benchmarks/bench_fsdp.py --smoke               # 2 CPU processes (gloo), a tiny model
"""

from __future__ import annotations

import argparse
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


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    dev = "cuda" if cuda else "cpu"
    from bench_train_kernels import build_model  # the same model as the single-GPU training benchmark

    model = build_model(args.smoke)  # on the current device: GPU `rank`
    mesh = init_device_mesh(dev, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(dev)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    root = Path(out) / "ckpt"
    results: dict[str, Any] = {}
    for _ in range(args.warmup):
        step()
    sync()

    def timed(name: str, after_step) -> None:
        stalls: list[float] = []
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            step()
            s = after_step(i)
            if s is not None:
                stalls.append(s)
        sync()
        dt = (time.perf_counter() - t0) / args.steps
        t1 = time.perf_counter()
        finish = getattr(after_step, "finish", None)
        if finish is not None:  # the last save becoming durable: reported apart, not as step time
            finish()
        sync()
        results[name] = {"step_s": dt, "stalls": stalls, "drain_s": time.perf_counter() - t1}

    ck = ckpt.Checkpointer(local_dir=root / f"ours-rank-{rank}", every_steps=args.every)
    state = {"model": model, "optim": opt}
    # DCP's background save runs collectives from its own thread: give it its own group (sharing the
    # training's group between two threads would interleave their collectives)
    dcp_group = dist.new_group(backend="gloo")
    # One untimed save of each kind first, as a long job made its first save long before: ours
    # allocates its pinned buffer there, DCP sets up its staging.
    ck.save(0, state).wait()
    msd, osd = get_state_dict(model, opt)
    dcp.async_save(
        {"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp-prime"), process_group=dcp_group
    ).result()
    del msd, osd
    sync()

    timed("no saves", lambda i: None)

    def saving_with(c: Any):
        """The per-step hook of a mode that saves with checkpointer ``c``: the time a save blocked."""

        def after_step(i: int) -> float | None:
            t = time.perf_counter()
            h = c.maybe_save(i, state)
            return None if h is None else time.perf_counter() - t

        after_step.finish = c.wait  # type: ignore[attr-defined]
        return after_step

    timed("ours", saving_with(ck))
    nbytes = ck.history[-1].nbytes if ck.history else 0
    # the last save is the last step of this phase (steps % every == 0): remember the shards it holds
    want = {k: v.to_local().clone() for k, v in model.state_dict().items()}

    if args.peers:  # snapshots, each also sent to the next rank's peer tier; the local tier off the path
        ckp = ckpt.Checkpointer(
            local_dir=root / f"peer-rank-{rank}",
            every_steps=args.every,
            peers=1,
            persist_every={"local": 10_000},
        )
        for k in range(2):  # untimed: both replica buffers of the holder are filled once, as in a long job
            ckp.save(k, state).wait()
        sync()
        timed("ours + peer tier", saving_with(ckp))
        results["peer_exchange_s"] = [h.persist_s.get("peer") for h in list(ckp.history)[2:]]
        ckp.close()
        del ckp

    pending: list[Any] = []

    def dcp_save(i: int) -> float | None:
        if i % args.every:
            return None
        t = time.perf_counter()
        if pending:
            pending.pop().result()
        msd, osd = get_state_dict(model, opt)
        pending.append(
            dcp.async_save(
                {"model": msd, "optim": osd}, checkpoint_id=str(root / f"dcp-{i}"), process_group=dcp_group
            )
        )
        return time.perf_counter() - t

    dcp_save.finish = lambda: pending and pending.pop().result()  # type: ignore[attr-defined]
    if not args.no_dcp:
        timed("dcp.async_save", dcp_save)

    # check: restoring our last save reproduces every rank's shards (after DCP's phase changed them)
    last = ck.list()[0].step
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    got = ck.restore(state)
    ck.close()
    ok = got == last == args.steps and all(
        torch.equal(v.to_local(), want[k]) for k, v in model.state_dict().items()
    )
    results["check"] = {"restored": got, "ok": bool(ok), "nbytes": nbytes}
    if rank == 0:
        import json

        Path(out, "result.json").write_text(json.dumps(results))
    del model, opt, state, ck  # before the groups end (see tests/dtensor_worker.py: a gloo shutdown race)
    import gc

    gc.collect()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU; 2 with --smoke)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="two CPU processes, a tiny model")
    ap.add_argument("--peers", action="store_true", help="also time ours with the peer tier (peers=1)")
    ap.add_argument("--no-dcp", action="store_true", help="leave DCP's async_save mode out")
    args = ap.parse_args(argv)
    import json

    import torch
    import torch.multiprocessing as mp

    if args.smoke:
        args.batch, args.seq, args.steps, args.every, args.warmup = 2, 16, 4, 2, 1
    if args.steps % args.every:
        ap.error("--steps must be a multiple of --every (the check restores the last step's save)")
    world = args.nproc or (2 if args.smoke else torch.cuda.device_count())
    if world < 2:
        print("bench_fsdp needs two or more GPUs (or --smoke)")
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="ckpt-fsdp-")
    try:
        mp.spawn(_worker, args=(world, args, port, out), nprocs=world, join=True)
        res = json.loads(Path(out, "result.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if not res["check"]["ok"]:
        print(f"CHECK FAILED: restore of our last save did not reproduce the shards: {res['check']}")
        return 1
    base = res["no saves"]["step_s"]
    rows, csv_rows = [], []
    case = f"fsdp2 llama {'tiny' if args.smoke else '1b'} x{world} b{args.batch}x{args.seq}, save every {args.every}"
    for name in [n for n in ("no saves", "ours", "ours + peer tier", "dcp.async_save") if n in res]:
        r = res[name]
        stall = statistics.mean(r["stalls"]) * 1e3 if r["stalls"] else 0.0
        rows.append(
            {
                "mode": name,
                "step_ms": round(r["step_s"] * 1e3, 1),
                "overhead": f"{(r['step_s'] / base - 1) * 100:+.2f}%",
                "saves": len(r["stalls"]),
                "blocked_ms_per_save": round(stall, 1),
                "last_save_done_s": round(r["drain_s"], 2),
            }
        )
        csv_rows.append(
            {
                "case": case,
                "provider": name,
                "metric": "step_time",
                "value": r["step_s"],
                "unit": "s",
                "note": f"shard bytes/rank={res['check']['nbytes']}",
            }
        )
        if r["stalls"]:
            csv_rows.append(
                {
                    "case": case,
                    "provider": name,
                    "metric": "blocked_per_save",
                    "value": stall / 1e3,
                    "unit": "s",
                    "note": f"{len(r['stalls'])} saves, rank 0",
                }
            )
    path = record("bench_fsdp", csv_rows, args.csv)
    print(
        f"csv: {path}\ndevice: {device_name()} x{world}; per-rank shard state "
        f"{res['check']['nbytes'] / 1e9:.2f} GB; restore check ok (step {res['check']['restored']})\n"
    )
    print(table(rows, ["mode", "step_ms", "overhead", "saves", "blocked_ms_per_save", "last_save_done_s"]))
    ex = [x for x in res.get("peer_exchange_s", []) if x]
    if ex:
        med = statistics.median(ex)
        gbs = res["check"]["nbytes"] / med / 1e9
        print(
            f"peer tier, rank 0: {gbs:.2f} GB/s per direction (median of {len(ex)} exchanges, {med:.3f} s: send, "
            f"receive, every chunk checked, commit); each (s): {[round(x, 3) for x in ex]}"
        )
        record(
            "bench_fsdp",
            [
                {
                    "case": case,
                    "provider": "ours + peer tier",
                    "metric": "peer exchange rate",
                    "value": gbs,
                    "unit": "GB/s",
                    "note": f"per direction, median of {len(ex)}, {med:.3f} s, "
                    f"transport {'nccl' if os.environ.get('CKPT_PEER_NCCL') == '1' else 'gloo'}",
                }
            ],
            args.csv,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Recovery as users feel it: from a killed rank to the next good step, under torchrun.

``torchrun --nproc-per-node N --max-restarts 3`` runs an FSDP2 job (the 1.24B Llama shape of
bench_train_kernels.py, bf16, AdamW, random tokens fixed per step and rank, deterministic algorithms)
that snapshots every ``--every`` steps. On the first attempt one rank SIGKILLs itself right after step
``--kill-step`` completed. TorchElastic's agent sees the worker die, stops the others and starts every
worker again; each restores and trains on to ``--steps``. Every worker appends what it did and when
(wall clock) to a file of its own; this script reports, per mode:

* **kill to next good step**: seconds from the kill to the first step completed after the restart by
  every rank (the slowest), split into the agent (kill to the new worker's process start: detection,
  stopping the others, the rendezvous), the worker's start (interpreter and imports, the model's modeling
  code included), the process-group init, the model build, the restore (and the phases ``last_restore``
  names) and the first step, each ending when the slowest rank ends it (the critical path: they add up to
  the whole);
* the steps lost (the kill step minus the step restored);
* whether the run ends bit-identical to an uninterrupted run of the same job (a digest of every rank's
  shards and optimizer state after the last step).

Modes, side by side in one run:

* ``ours``: ``ckpt.Checkpointer(local_dir=..., every_steps=every)``: the restarted workers restore from the
  RAM the killed job left (the memory tier's shared segments).
* ``ours-replaced``: the same with ``peers=1``; the killed rank wipes its RAM segments and its local_dir just
  before it dies (a replaced node): it restores from its peer's RAM, the others from their own.
* ``dcp``: ``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, optimizer)`` every
  ``every`` steps to the local disk (the previous one awaited first); the restarted job ``dcp.load``\\ s the
  newest complete one.

``--fast-start`` (any mode): the restarted workers start as docs/guides/launchers.md's "Restart fast" says:
the Checkpointer first (for ``dcp``: the listing of complete steps), then the model, built with its
parameters on the meta device (``ckpt.empty_params``) when a restore will fill it, sharded and given
storage (``ckpt.materialize``); the phases are then reported in that order (the checkpointer before the
model build), and the rows' provider reads ``MODE, fast start``. A first start (the uninterrupted
reference, the killed run's first attempt) builds the model as usual.

Usage::

    python benchmarks/bench_recovery.py                      # every GPU of the machine, the three modes
    python benchmarks/bench_recovery.py --modes ours,dcp --kill-step 37
    python benchmarks/bench_recovery.py --shape 8b --batch 2 --modes ours,dcp
    python benchmarks/bench_recovery.py --fast-start --modes ours,dcp
    python benchmarks/bench_recovery.py --smoke              # 2 CPU processes (gloo), a tiny model
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = ("ours", "ours-replaced", "dcp")


# -- the worker (one per rank, started by torchrun) -------------------------------------------------------


def _process_start() -> float:
    """Wall-clock time this process started (from /proc: the kernel's start time, before the interpreter)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class _Events:
    """One JSON line per event, appended and flushed at once (a SIGKILL loses none written before it)."""

    def __init__(self, path: Path, rank: int, attempt: int) -> None:
        self.f = open(path, "a", buffering=1)
        self.base = {"rank": rank, "attempt": attempt}

    def __call__(self, event: str, t: float | None = None, **extra: Any) -> None:
        self.f.write(
            json.dumps({**self.base, "event": event, "t": time.time() if t is None else t, **extra}) + "\n"
        )
        self.f.flush()
        os.fsync(self.f.fileno())


def worker(args: argparse.Namespace) -> None:
    started = _process_start()
    faulthandler.register(signal.SIGUSR1)  # the parent asks for the stacks of a job that hangs
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    ev = _Events(out / f"events-r{rank}.jsonl", rank, attempt)
    ev("start", t=started, fast_start=args.fast_start)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import transformers

    import ckpt
    from bench_train_kernels import build_model

    transformers.LlamaForCausalLM  # imports the modeling code (on first use): the start's, not the build's
    ev("imported")
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    ev("pg")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if (
        cuda
    ):  # the fused attention kernels' backward passes are not deterministic under warn_only: the math one is
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    def build(empty: bool) -> tuple[Any, Any]:
        """The model, sharded, and its optimizer; ``empty``: its parameters built on meta and given storage
        after fully_shard, for the restore to fill (docs/guides/launchers.md, "Restart fast")."""
        t0 = time.time()
        with ckpt.empty_params(empty):
            model = build_model(args.smoke) if args.shape == "1.24b" else _build_8b()
        mesh = init_device_mesh(dev.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ckpt.materialize(model, dev)  # nothing to do after an ordinary build
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if cuda:
            torch.cuda.synchronize()
        ev("built", empty=empty, build_s=round(time.time() - t0, 4))
        return model, opt

    root = out / args.mode
    start = 0
    ck = None
    pending: list[Any] = []
    dcp_group = None
    if not args.fast_start:  # the model first, as a job that knows nothing of restarts builds it
        model, opt = build(False)
    if args.mode.startswith("ours"):
        ck = ckpt.Checkpointer(
            local_dir=root / f"rank-{rank}",
            every_steps=args.every,
            peers=1 if args.mode == "ours-replaced" else None,
        )
        ev("opened")
        if args.fast_start:  # empty when a restore will fill it: the ranks agree on that
            model, opt = build(ck.restorable())
        state = {"model": model, "optim": opt}
        got = ck.restore(state)
        info = ck.last_restore
        start = got or 0
        ev(
            "restored",
            step=got,
            tier=None if info is None else info.tier,
            phases=None if info is None else {k: round(v, 4) for k, v in (info.phases or {}).items()},
        )
    else:
        dcp_group = dist.new_group(backend="gloo")  # DCP's background save runs collectives from its thread
        ev("opened")
        done = sorted(
            (int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / ".metadata").exists()),
            reverse=True,
        )
        if args.fast_start:  # every rank lists the same directory
            model, opt = build(bool(done))
        if done:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(root / f"step-{done[0]}"))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            start = done[0]
        ev("restored", step=start if done else None, tier="disk" if done else None)
        state = {"model": model, "optim": opt}
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    ev("ready")

    def batch(step: int) -> Any:
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        return torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(dev)

    def train_step(step: int) -> None:
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = True
    for step in range(start + 1, args.steps + 1):
        train_step(step)
        if ck is not None:
            ck.maybe_save(step, state)
        elif step % args.every == 0:
            if pending:
                pending.pop().result()
            msd, osd = get_state_dict(model, opt)
            pending.append(
                dcp.async_save(
                    {"model": msd, "optim": osd},
                    checkpoint_id=str(root / f"step-{step}"),
                    process_group=dcp_group,
                )
            )
        if first or (attempt == 0 and step == args.kill_step):
            if cuda:
                torch.cuda.synchronize()
            ev("step", step=step)
            first = False
        if attempt == 0 and step == args.kill_step and rank == args.kill_rank and not args.reference:
            if ck is not None:  # the last snapshot due is in RAM: the kill comes after a training step
                ck.wait("memory")
            if args.mode == "ours-replaced":  # a new node: no RAM, no local disk of the old one
                from ckpt import shm

                for g in shm.segments():
                    if g.local_dir is not None and Path(g.local_dir) == root / f"rank-{rank}":
                        shm.free(prefix=g.prefix)
                shutil.rmtree(root / f"rank-{rank}", ignore_errors=True)
            ev("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    if pending:
        pending.pop().result()
    if cuda:
        torch.cuda.synchronize()
    h = hashlib.sha256()
    msd, osd = get_state_dict(model, opt)
    for name, t in sorted(ckpt_flat({"model": msd, "optim": osd}).items()):
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(name.encode())
        h.update(local.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    ev("end", digest=h.hexdigest())
    if ck is not None:
        ck.close()
    dist.barrier()
    dist.destroy_process_group()


def _build_8b():
    """The Llama-3 8B shape (bf16, on this rank's GPU, seeded as build_model seeds)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            m = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return m.train()


def ckpt_flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors of a nested dict/list, by dotted path."""
    import torch

    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(ckpt_flat(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(ckpt_flat(v, f"{prefix}{i}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


# -- the parent ------------------------------------------------------------------------------------------


def _torchrun(args: argparse.Namespace, mode: str, out: Path, reference: bool) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc}",
        f"--max-restarts={0 if reference else 3}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--monitor-interval=0.1",
        str(Path(__file__).resolve()),
        "--worker",
        "--mode",
        mode,
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--kill-step",
        str(args.kill_step),
        "--kill-rank",
        str(args.kill_rank),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--shape",
        args.shape,
    ]
    if args.smoke:
        cmd.append("--smoke")
    if args.fast_start:
        cmd.append("--fast-start")
    if reference:
        cmd.append("--reference")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        PYTHONUNBUFFERED="1",
        # a fresh store per restart (docs/guides/launchers.md): with the agent's store shared, a restarted
        # worker can read its peer's address from the killed attempt and its init_process_group fails
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    t0 = time.time()
    what = f"torchrun ({mode}, {'reference' if reference else 'killed'})"
    log = out / "torchrun.log"
    with open(log, "w") as f:  # a file, not a pipe: a worker the agent left behind holds no pipe open
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop(out, proc)
            seen = "\n".join(json.dumps(e) for e in _events(out)[-12:])
            raise SystemExit(
                f"{what} did not end in {args.timeout:.0f} s; its last events:\n{seen}\n"
                f"{log.read_text(errors='replace')[-8000:]}"
            ) from None
    if proc.returncode != 0:
        raise SystemExit(
            f"{what} failed with status {proc.returncode}:\n{log.read_text(errors='replace')[-8000:]}"
        )
    return time.time() - t0


def _stop(out: Path, proc: subprocess.Popen) -> None:
    """Stop a job that outlived its time: each worker prints its threads' stacks first (faulthandler,
    SIGUSR1), then the agent and every worker of this run (found by ``out`` in their command line) are
    killed; torchrun starts its workers in sessions of their own, out of reach of a kill of its group."""
    workers = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(out).encode() in f.read() and int(pid) != proc.pid:
                    workers.append(int(pid))
        except (OSError, ValueError):
            continue
    for pid in workers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2)
    for pid in [proc.pid, *workers]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _events(out: Path) -> list[dict]:
    return [
        json.loads(line) for p in sorted(out.glob("events-r*.jsonl")) for line in p.read_text().splitlines()
    ]


def analyse(ref: list[dict], run: list[dict], nproc: int) -> dict[str, Any]:
    """The figures of one killed run (``run``) against its uninterrupted reference (``ref``)."""
    kill = next(e for e in run if e["event"] == "kill")
    after = [e for e in run if e["attempt"] > 0]
    attempt = max(e["attempt"] for e in after)
    after = [e for e in after if e["attempt"] == attempt]

    def at(event: str) -> dict[int, dict]:
        return {e["rank"]: e for e in after if e["event"] == event}

    marks = {
        k: at(k) for k in ("start", "imported", "pg", "built", "opened", "restored", "ready", "step", "end")
    }
    fast = all(e.get("fast_start") for e in marks["start"].values())
    missing = [k for k, v in marks.items() if len(v) != nproc]
    if missing:
        raise SystemExit(f"the restarted attempt did not reach {missing} on every rank")
    last = lambda k: max(e["t"] for e in marks[k].values())  # noqa: E731 - the slowest rank decides
    # the critical path: each phase ends when the slowest rank ends it (a collective in the next phase waits
    # for that rank), so the phases add up to the whole; the first starts at the kill
    phases = {"agent": min(e["t"] for e in marks["start"].values()) - kill["t"]}
    order = [
        "start",
        "imported",
        "pg",
        *(("opened", "built") if fast else ("built", "opened")),
        "restored",
        "ready",
        "step",
    ]
    names = {
        "imported": "worker start",
        "pg": "process group",
        "built": "model build",
        "opened": "checkpointer",
        "restored": "restore",
        "ready": "agree",
        "step": "first step",
    }
    prev = min(e["t"] for e in marks["start"].values())
    for b in order[1:]:
        phases[names[b]] = last(b) - prev
        prev = last(b)
    restored = {e["step"] for e in marks["restored"].values()}
    digests_ref = {e["rank"]: e["digest"] for e in ref if e["event"] == "end"}
    digests = {r: e["digest"] for r, e in marks["end"].items()}
    return {
        "kill_to_step_s": last("step") - kill["t"],
        "phases": phases,
        "restore_phases": {r: e.get("phases") for r, e in marks["restored"].items()},
        "tiers": {r: e.get("tier") for r, e in marks["restored"].items()},
        "built_empty": sorted({bool(e.get("empty")) for e in marks["built"].values()}),
        "build_s": {r: e.get("build_s") for r, e in marks["built"].items()},
        "restored": sorted(s for s in restored if s is not None),
        "kill_step": kill["step"],
        "steps_lost": kill["step"] - min((s or 0) for s in restored),
        "bit_identical": digests == digests_ref and len(digests) == nproc,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ours", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--nproc", type=int, default=None, help="workers (default: every GPU; 2 with --smoke)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=None, help="default: random in (every, steps - every)")
    p.add_argument("--kill-rank", type=int, default=None, help="default: random")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--shape", choices=("1.24b", "8b"), default="1.24b", help="the Llama shape (8b: Llama-3 8B)"
    )
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny model")
    p.add_argument(
        "--fast-start",
        action="store_true",
        help="each worker asks whether a restore will fill the model before building it, and builds it "
        "empty then (ckpt.empty_params, ckpt.materialize; docs/guides/launchers.md, Restart fast)",
    )
    p.add_argument("--csv", default=None, help="results file (default benchmarks/results.csv)")
    p.add_argument("--events", default=None, help="a folder for each killed run's events (JSON lines)")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.nproc = args.nproc or 2
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 32)
        args.steps = min(args.steps, 24)
        args.every = min(args.every, 5)
    else:
        import torch

        args.nproc = args.nproc or torch.cuda.device_count()
    if args.smoke and args.shape != "1.24b":
        p.error("--smoke builds a tiny model; leave --shape out")
    rng = random.Random()
    if args.kill_step is None:
        args.kill_step = rng.randrange(args.every + 1, args.steps - args.every)
    if args.kill_rank is None:
        args.kill_rank = rng.randrange(args.nproc)
    from harness import record, table

    rows, results = [], {}
    case = f"{'tiny' if args.smoke else args.shape.upper()} Llama, FSDP2 x{args.nproc}"
    modes = args.modes.split(",")
    shm_dir = Path(
        tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    os.environ["CKPT_SHM_DIR"] = str(shm_dir)

    def clear_ram() -> None:
        for f in shm_dir.iterdir():
            f.unlink()

    try:
        with tempfile.TemporaryDirectory(prefix="recovery-") as d:
            # one uninterrupted run is the reference of every mode: checkpointing changes no number of training
            ref_out = Path(d, "ref")
            ref_out.mkdir()
            took = _torchrun(args, modes[0], ref_out, reference=True)
            print(f"reference ({modes[0]}, uninterrupted): {took:.1f} s", flush=True)
            shutil.rmtree(ref_out / modes[0], ignore_errors=True)  # its checkpoints (a disk holds one run's)
            clear_ram()
            ref = _events(ref_out)
            for mode in modes:
                run_out = Path(d, mode)
                run_out.mkdir()
                took = _torchrun(args, mode, run_out, reference=False)
                clear_ram()
                results[mode] = r = analyse(ref, _events(run_out), args.nproc)
                provider = f"{mode}, fast start" if args.fast_start else mode
                if args.events:  # every worker's events, for a look at each rank's timeline
                    Path(args.events).mkdir(parents=True, exist_ok=True)
                    Path(args.events, f"events-{mode}.jsonl").write_text(
                        "".join(json.dumps(e) + "\n" for e in _events(run_out))
                    )
                shutil.rmtree(run_out, ignore_errors=True)
                note = (
                    f"{args.nproc} ranks, kill of rank {args.kill_rank} after step {r['kill_step']}, every "
                    f"{args.every}; restored {r['restored']} from {sorted(set(map(str, r['tiers'].values())))}; "
                    f"bit-identical {r['bit_identical']}"
                    + (f"; model built empty {r['built_empty']}" if args.fast_start else "")
                )
                got = [
                    {
                        "case": case,
                        "provider": provider,
                        "metric": "kill to next good step",
                        "value": r["kill_to_step_s"],
                        "unit": "s",
                        "note": note,
                    }
                ]
                got += [
                    {"case": case, "provider": provider, "metric": k, "value": v, "unit": "s", "note": ""}
                    for k, v in r["phases"].items()
                ]
                got.append(
                    {
                        "case": case,
                        "provider": provider,
                        "metric": "steps lost",
                        "value": r["steps_lost"],
                        "unit": "",
                        "note": "",
                    }
                )
                print(
                    f"{provider}: run {took:.1f} s; kill to next good step {r['kill_to_step_s']:.2f} s; "
                    f"restore phases by rank {json.dumps(r['restore_phases'])}; model build (s) by rank "
                    f"{json.dumps(r['build_s'])}, empty {r['built_empty']}",
                    flush=True,
                )
                if not args.smoke:  # each mode as soon as it is measured: a later one that fails loses none
                    record("bench_recovery", got, args.csv)
                rows += got
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    print(table(rows, ["provider", "metric", "value", "unit", "note"]))
    bad = [m for m, r in results.items() if not r["bit_identical"]]
    if bad:
        print("NOT bit-identical to the uninterrupted run:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

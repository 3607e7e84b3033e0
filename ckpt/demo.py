"""``ckpt demo``: train, checkpoint through the tiers, get killed, resume, compare bit for bit.

The parent process runs three training children on the same seed:

1. an uninterrupted reference run;
2. a run that checkpoints every few steps and is SIGKILLed by the parent
   a few steps after a save was issued (phase 2 may still be writing);
3. a new process that restores from the nearest tier holding a verified copy
   (the memory tier: its snapshots are in shared memory, which outlived the
   killed process; the local tier where there is no ``/dev/shm``), and in
   the middle of the remaining steps simulates a recoverable fault (the weights
   turn to NaN) and rolls back from the memory tier.

It then checks the final weights of run 3 against run 1 bit for bit and
prints, per save, the stall of the training loop, the staging bandwidth and
the persist bandwidth, plus each restore's tier and time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["main"]


class SyntheticStream:
    """A deterministic data stream whose position is part of the checkpoint (Stateful)."""

    def __init__(self, seed: int, batch: int, dim: int, device: torch.device) -> None:
        import torch

        self.gen = torch.Generator().manual_seed(seed)
        self.batch, self.dim, self.device = batch, dim, device
        self.w_true = torch.randn(dim, 8, generator=torch.Generator().manual_seed(seed + 1))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        x = torch.randn(self.batch, self.dim, generator=self.gen)
        y = (x @ self.w_true).tanh()
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["gen"])


def _build(device: torch.device, width: int) -> dict[str, Any]:
    import torch
    from torch import nn

    import ckpt

    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Linear(256, width),
        nn.BatchNorm1d(width),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 8),
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "data": SyntheticStream(7, 64, 256, device),
        "rng": ckpt.RNGState(),
        "step": 0,
    }


def _train_step(state: dict[str, Any]) -> float:
    model, opt, sched = state["model"], state["optim"], state["sched"]
    from torch import nn

    x, y = state["data"].next()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach().item()


def _digest(model: nn.Module) -> str:
    import torch

    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def child(args: argparse.Namespace) -> None:
    import torch
    import ckpt

    device = torch.device(args.device)
    state = _build(device, args.width)
    if args.mode == "reference":
        for step in range(1, args.steps + 1):
            _train_step(state)
        _emit(event="final", digest=_digest(state["model"]))
        return
    with ckpt.Checkpointer(local_dir=args.dir, every_steps=args.every, keep=ckpt.Retention(local=3)) as ck:
        t0 = time.perf_counter()
        last = ck.restore(state)
        if last is not None:
            r = ck.last_restore
            _emit(event="restore", step=last, tier=r.tier, seconds=time.perf_counter() - t0, nbytes=r.nbytes)
        start = 1 if last is None else last + 1
        pending: list[Any] = []
        fault_at = args.fault_at if args.mode == "resume" else None
        step = start
        while step <= args.steps:
            loss = _train_step(state)
            state["step"] = step
            h = ck.maybe_save(step, state)
            if h is not None:
                pending.append(h)
            for h in [h for h in pending if h.done()]:
                pending.remove(h)
                h.wait()
                s = h.stats
                _emit(
                    event="save",
                    step=h.step,
                    stall_ms=s.stall_s * 1e3,
                    wait_ms=s.wait_s * 1e3,
                    nbytes=s.nbytes,
                    stage_gbps=s.stage_gbps,
                    persist_gbps=s.persist_gbps("local"),
                )
            _emit(event="step", step=step, loss=loss)
            if fault_at is not None and step == fault_at:
                fault_at = None
                ck.wait_staged()  # in-place writes outside optimizer.step() must not race a snapshot copy
                with torch.no_grad():
                    for p in state["model"].parameters():
                        p.fill_(float("nan"))  # a recoverable fault: roll back in this process
                t1 = time.perf_counter()
                back = ck.restore(state)
                r = ck.last_restore
                _emit(
                    event="restore",
                    step=back,
                    tier=r.tier,
                    seconds=time.perf_counter() - t1,
                    nbytes=r.nbytes,
                    reason="NaN weights",
                )
                step = back + 1
                continue
            step += 1
        ck.wait()
        for h in pending:
            s = h.stats
            _emit(
                event="save",
                step=h.step,
                stall_ms=s.stall_s * 1e3,
                wait_ms=s.wait_s * 1e3,
                nbytes=s.nbytes,
                stage_gbps=s.stage_gbps,
                persist_gbps=s.persist_gbps("local"),
            )
    _emit(event="final", digest=_digest(state["model"]))


def _spawn(args: argparse.Namespace, mode: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "ckpt.demo",
        "--child",
        "--mode",
        mode,
        "--dir",
        args.dir,
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--device",
        args.device,
        "--width",
        str(args.width),
        "--fault-at",
        str(args.fault_at),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)


def _collect(proc: subprocess.Popen, events: list[dict], kill_at: int | None = None) -> int:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        events.append(ev)
        if kill_at is not None and ev.get("event") == "step" and ev["step"] >= kill_at:
            os.kill(proc.pid, signal.SIGKILL)
            ev["killed"] = True
            break
    proc.wait()
    return proc.returncode


def parent(args: argparse.Namespace) -> int:
    if args.device is None:  # chosen here, not when the command line is parsed: `ckpt --help` needs no torch
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-demo-")
    if args.kill_at is None:
        args.kill_at = args.every * (args.steps // args.every // 2) + max(1, args.every // 2)
    if args.fault_at is None or args.fault_at < 0:
        args.fault_at = min(args.steps - 1, args.kill_at + args.every + 2)
    dev = args.device
    print(
        f"ckpt demo: {args.steps} steps of an MLP (width {args.width}) with AdamW, a cosine LR schedule, "
        f"dropout and BatchNorm on {dev}; checkpoint every {args.every} steps to {args.dir}"
    )
    t0 = time.perf_counter()
    ref: list[dict] = []
    _collect(_spawn(args, "reference"), ref)
    print(f"[1/3] uninterrupted reference run: done in {time.perf_counter() - t0:.1f} s")

    run1: list[dict] = []
    t1 = time.perf_counter()
    rc = _collect(_spawn(args, "train"), run1, kill_at=args.kill_at)
    killed = [e for e in run1 if e.get("killed")]
    print(
        f"[2/3] training run: SIGKILLed at step {killed[0]['step'] if killed else '?'} "
        f"(exit status {rc}) after {time.perf_counter() - t1:.1f} s; "
        f"committed before the kill: {sorted(int(p.name.split('-')[1]) for p in Path(args.dir).glob('step-*') if (p / 'COMMIT').exists())}"
    )

    run2: list[dict] = []
    t2 = time.perf_counter()
    rc2 = _collect(_spawn(args, "resume"), run2)
    print(f"[3/3] resumed run in a new process: exit status {rc2} after {time.perf_counter() - t2:.1f} s")

    saves = [e for e in run1 + run2 if e["event"] == "save"]
    print(
        "\nPer save: how long save() blocked the loop (of which: waiting for the previous save to finish "
        "persisting, if_busy='wait'), and the bandwidth of each phase."
    )
    print(
        f"{'save of step':>12} {'stall ms':>9} {'of which waiting':>17} {'MB':>7} {'staging GB/s':>13} "
        f"{'persist GB/s':>13}"
    )
    for e in saves:
        print(
            f"{e['step']:>12} {e['stall_ms']:>9.2f} {e['wait_ms']:>17.2f} {e['nbytes'] / 1e6:>7.1f} "
            f"{_f(e['stage_gbps']):>13} {_f(e['persist_gbps']):>13}"
        )
    print()
    for e in [e for e in run2 if e["event"] == "restore"]:
        why = f" after {e['reason']}" if "reason" in e else " after the SIGKILL"
        print(
            f"restore{why}: step {e['step']} from the {e['tier']} tier in {e['seconds'] * 1e3:.1f} ms "
            f"({e['nbytes'] / 1e6:.1f} MB)"
        )
    ref_digest = next((e["digest"] for e in ref if e["event"] == "final"), None)
    got = next((e["digest"] for e in run2 if e["event"] == "final"), None)
    same = ref_digest is not None and ref_digest == got
    print(
        f"final weights vs the uninterrupted run: {'IDENTICAL bit for bit' if same else 'DIFFERENT'} "
        f"(sha256 {str(got)[:16]}... vs {str(ref_digest)[:16]}...)"
    )
    if own_dir:
        import shutil

        shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if same and rc2 == 0 else 1


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    p.add_argument("--dir", default=None, help="local tier directory (default: a temporary one)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when there is one, else cpu)"
    )
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default 1024)")
    p.add_argument("--kill-at", type=int, default=None, help="step at which the training child is SIGKILLed")
    p.add_argument(
        "--fault-at", type=int, default=None, help="step of the simulated NaN fault in the resumed run"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ckpt demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="train", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

"""Tiers at their own pace: the training loop's cost of frequent snapshots, the first save, and the
restore of a killed process from the memory tier, in one run.

Part 1, a Llama-3.2-1B-shaped Hugging Face model (bf16, fused AdamW, 8 x 2048 tokens, kernels patched
when Triton is there), its state about 7.4 GB: mean step time with no saves, snapshots every 10 and every
50 steps (the local tier writing as often as it keeps up, newest wins), every 10 with
``if_busy="wait"`` (every snapshot to the disk, in order), and ``interval="auto"`` (each tier's cadence
from its measured cost and MTBF); for each: the time a save blocks the loop
(the first one apart: it comes at step 50 of its run, the buffers allocated in the background from
step 1), and how many snapshots each tier committed or skipped.

Part 2, a training process that snapshotted (the local tier every 1000 steps) is SIGKILLed; a new
process restores the newest snapshot from the memory tier (shared memory), bit-exact, then, with the
shared memory freed, from the local tier, and ``dcp.load`` of the same state from a ``dcp.save``.

``--cpu`` runs the loop at small size on the CPU (fp32, no kernels; ``--disk-mbps`` emulates a slower
local disk), to show the coalescing ratio on a machine without a GPU: ``--cpu --parts loop --layers 4
--batch 4 --seq 256 --disk-mbps 100 --modes "none;every 1;every 5;every 1, if_busy=wait"``.

Rows go to ``benchmarks/results.csv`` (``--csv``) with the device and the date; a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

import ckpt  # noqa: E402
from ckpt import shm  # noqa: E402

ROWS: list[dict] = []


def row(case: str, provider: str, metric: str, value: float, unit: str, note: str = "") -> None:
    ROWS.append(
        {
            "case": case,
            "provider": provider,
            "metric": metric,
            "value": round(value, 4),
            "unit": unit,
            "note": note,
        }
    )
    print(f"{case:<10} {provider:<24} {metric:<28} {value:>10.3f} {unit:<6} {note}", flush=True)


def build(layers: int, seed: int = 0, cpu: bool = False):
    """The Llama-3.2-1B-shaped model and fused AdamW on the GPU (bf16, kernels patched); with ``cpu``,
    the same shape at small size in fp32 on the CPU (hidden 256, vocabulary 8192, plain AdamW)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=1024,
            vocab_size=VOCAB_CPU,
        )
        if cpu
        else dict(
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=128256,
        )
    )
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        **size,
    )
    torch.manual_seed(seed)
    if cpu:
        model = LlamaForCausalLM(cfg)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    global KERNELS
    try:
        from ckpt.kernels import patch

        patch(model)
        KERNELS = "kernels patched"
    except Exception as e:  # noqa: BLE001 - the loop runs unpatched then (said in the table)
        KERNELS = f"kernels NOT patched ({type(e).__name__}: {e})"
        print(KERNELS, flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, opt


VOCAB_CPU = 8192
KERNELS = "no kernels (CPU)"  # whether the GPU model runs with ckpt.kernels patched: in each step-time row


def fingerprint(state: dict) -> list[int]:
    """One wrapping int64 sum per tensor of the model and optimizer state, on the GPU."""
    out = []
    for p in state["model"].parameters():
        out.append(int(p.detach().reshape(-1).view(torch.int16).sum(dtype=torch.int64)))
    for s in state["optim"].state.values():
        for v in s.values():
            if torch.is_tensor(v) and v.numel():
                out.append(
                    int(
                        v.reshape(-1)
                        .view(torch.int32 if v.element_size() == 4 else torch.int16)
                        .sum(dtype=torch.int64)
                    )
                )
    return out


def train_loop(root: Path, args) -> None:
    model, opt = build(args.layers, cpu=args.cpu)
    ids = torch.randint(
        0, VOCAB_CPU if args.cpu else 128256, (args.batch, args.seq), device="cpu" if args.cpu else "cuda"
    )

    def step() -> None:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.loss.item()

    for _ in range(3):
        step()
    state = {"model": model, "optim": opt}
    results = {}
    modes = [
        ("none", None, {}),
        ("every 10", 10, {}),
        ("every 50", 50, {}),
        ("every 10, persist threads not niced", 10, {"nice": 0}),
        ("every 10, 16 writer threads", 10, {"writers": 16}),
        ("every 10, memory only", 10, {"persist_every": {"local": 10**9}}),
        ("every 10, memory only, in-process pinned", 10, {"persist_every": {"local": 10**9}, "shm": 0}),
        ("every 50, in-process pinned", 50, {"shm": 0}),
        ("every 50, memory only", 50, {"persist_every": {"local": 10**9}}),
        ("every 10, if_busy=wait", 10, {"if_busy": "wait"}),
        ("dcp.async_save every 10", 10, {"dcp": None}),
        ("dcp.async_save + DefaultStager every 10", 10, {"dcp": "stager"}),
        ("every 1", 1, {}),
        ("every 5", 5, {}),
        ("every 1, if_busy=wait", 1, {"if_busy": "wait"}),
        ("every 1, 4 buffers", 1, {"max_in_flight": 4}),
        ("every 1, 2 ahead", 1, {"ahead": 2}),
        ("every 1, 4 ahead", 1, {"ahead": 4}),
        ("every 1, 8 ahead", 1, {"ahead": 8}),
        ("every 10, 4 ahead", 10, {"ahead": 4}),
        ("every 1, profiled", 1, {"profile": True}),
        # whether the background allocation is GIL-bound beside the loop (each of its pieces waits for the
        # training thread to drop the GIL, up to the switch interval): the same loop with 0.5 ms
        ("every 1, switch interval 0.5 ms", 1, {"switch": 0.0005}),
        ("every 10, switch interval 0.5 ms", 10, {"switch": 0.0005}),
        # the background allocation registers one 64 MiB piece per moment with no copy in flight (about once a
        # step at every 1): pieces back to back for up to 10 / 20 ms in each such moment
        ("every 1, registration bursts 10 ms", 1, {"burst": 10}),
        ("every 1, registration bursts 20 ms", 1, {"burst": 20}),
        ("every 10, registration bursts 20 ms", 10, {"burst": 20}),
        ("dcp.async_save every 50", 50, {"dcp": None}),
        ("auto, mtbf memory 10 min, local 1 h", "auto", {"mtbf": {"memory": 600, "local": 3600}}),
        ("none (again)", None, {}),
    ]
    modes = [m for m in modes if m[0] in args.modes.split(";")] if args.modes else modes
    for name, every, kw in modes:
        d = root / f"loop-{every}-{len(results)}"
        if "dcp" in kw:
            try:
                results[name] = dcp_loop(name, every, kw["dcp"], d, step, model, opt, args)
            except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
                row("loop", name, "failed", 0, "", f"{type(e).__name__}: {e}"[:160])
            shutil.rmtree(d, ignore_errors=True)
            continue
        os.environ["CKPT_PERSIST_NICE"] = str(kw.pop("nice", 10))  # read as each persist thread starts
        os.environ["CKPT_PERSIST_THREADS"] = str(
            kw.pop("writers", ckpt.knobs._DEFAULTS["CKPT_PERSIST_THREADS"])
        )
        os.environ["CKPT_COPY_AHEAD"] = str(kw.pop("ahead", ckpt.knobs._DEFAULTS["CKPT_COPY_AHEAD"]))
        os.environ["CKPT_REGISTER_BURST_MS"] = str(
            kw.pop("burst", ckpt.knobs._DEFAULTS["CKPT_REGISTER_BURST_MS"])
        )
        profile = kw.pop("profile", False)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(kw.pop("switch", switch))
        with ckpt.knobs.override(CKPT_SHM=kw.pop("shm", 1)):
            local = SlowDisk(d, args.disk_mbps) if args.disk_mbps else d
            cadence = {"interval": "auto"} if every == "auto" else {"every_steps": every}
            ck = (
                ckpt.Checkpointer(local_dir=local, keep=ckpt.Retention(local=1), **cadence, **kw)
                if every
                else None
            )
        times, calls, handles = [], [], []
        causes: dict[str, int] = {}
        first_call = ready = None  # the first maybe_save(); seconds until every host buffer was there
        prof = None
        if (args.profile_save or profile) and ck is not None and every == 1:
            import cProfile

            prof = cProfile.Profile()
        for s in range(1, args.steps + 1):
            t0 = time.perf_counter()
            step()
            if ck is not None:
                c0 = time.perf_counter()
                if prof is not None and s > 10:
                    prof.enable()
                h = ck.maybe_save(s, state)
                if first_call is None:
                    first_call = c0
                if ready is None and len(ck.pool.buffers) >= ck.pool.slots:
                    ready = time.perf_counter() - first_call
                if prof is not None:
                    prof.disable()
                if s > 10 and h is not None:  # after the warm-up: what each due save cost the caller
                    calls.append(time.perf_counter() - c0)
                    handles.append(h)
                    if h.status == "skipped":  # what the buffers were doing (just after the skip)
                        causes[ck.pool.describe_busy()] = causes.get(ck.pool.describe_busy(), 0) + 1
            times.append(time.perf_counter() - t0)
        if prof is not None:
            import io
            import pstats

            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
            print(out.getvalue(), flush=True)
        if ck is not None:
            ck.wait_staged()
            taken = sum(1 for h in handles if h.status != "skipped" and h.tier_status("memory") != "failed")
            row(
                "loop",
                name,
                "host buffers ready after",
                ready if ready is not None else float("nan"),
                "s",
                f"{ck.pool.slots} buffers of {ck.pool.buffers[0].capacity / 1e9:.2f} GB, from the first maybe_save()"
                if ck.pool.buffers
                else "no buffer",
            )
            top = "; ".join(f"{n}x [{what}]" for what, n in sorted(causes.items(), key=lambda kv: -kv[1])[:3])
            row(
                "loop",
                name,
                "snapshots committed after warm-up",
                100 * taken / max(1, len(handles)),
                "%",
                f"{taken} of {len(handles)} due saves (steps 11-{args.steps}) committed to the memory tier"
                + (f"; buffers at the skips: {top}" if top else ""),
            )
            recorded = sum(1 for h in handles if h.tier_status("memory") == "done")
            mem = ck.tier_figures()["memory"]
            row(
                "loop",
                name,
                "snapshots recorded after warm-up",
                100 * recorded / max(1, len(handles)),
                "%",
                f"{recorded} of {len(handles)} due saves recorded in shared memory (they outlive the process); "
                f"the rest superseded before their record ({mem.records_superseded} in the run)",
            )
            if calls:
                calls.sort()
                row(
                    "loop",
                    name,
                    "save() call returns (median)",
                    calls[len(calls) // 2] * 1e3,
                    "ms",
                    f"p90 {calls[int(len(calls) * 0.9)] * 1e3:.1f} ms, max {calls[-1] * 1e3:.1f} ms, the GPU a step "
                    "behind (no synchronize before the call)",
                )
            if every == "auto":  # the cadence each tier chose from what its writes cost this loop
                rep = ck.interval_report()
                snaps = [h.step for h in ck.history]
                row(
                    "loop",
                    name,
                    "snapshot interval",
                    rep.get("interval_s") or 0,
                    "s",
                    f"snapshots at steps {snaps[:12]}{'...' if len(snaps) > 12 else ''}; measured cost "
                    f"{(rep.get('cost_s') or 0) * 1e3:.1f} ms per snapshot",
                )
                for tier, r in rep["tiers"].items():
                    row(
                        "loop",
                        name,
                        f"{tier} tier interval",
                        r.get("interval_s") or 0,
                        "s",
                        f"cost {r.get('cost_s')} s of training per write, last write {r.get('write_s')} s; "
                        f"persisted {ck.tier_counts[tier].persisted}",
                    )
            t0 = time.perf_counter()
            ck.close()
            close_s = time.perf_counter() - t0
            hist = list(ck.history)
            counts = ck.tier_counts["local"]
            row("loop", name, "first save blocked", hist[0].stall_s * 1e3, "ms", f"at step {hist[0].step}")
            later = [h.stall_s for h in hist[1:]] or [0.0]
            row(
                "loop",
                name,
                "later saves blocked (mean)",
                statistics.mean(later) * 1e3,
                "ms",
                f"max {max(later) * 1e3:.1f} ms",
            )
            row(
                "loop",
                name,
                "snapshots",
                len(hist),
                "",
                f"local: persisted {counts.persisted}, superseded "
                f"{counts.superseded}, not due {counts.not_due}; close() {close_s:.1f} s",
            )
            row("loop", name, "state size", hist[0].nbytes / 1e9, "GB")
            staged = [h.stage_s for h in hist if h.stage_s]
            if staged:
                row(
                    "loop",
                    name,
                    "copy to host (mean)",
                    statistics.mean(staged) * 1e3,
                    "ms",
                    f"{hist[0].nbytes / statistics.mean(staged) / 1e9:.1f} GB/s, overlapped with the next steps",
                )
        sys.setswitchinterval(switch)
        blocks = [statistics.mean(times[i : i + 10]) * 1e3 for i in range(10, len(times), 10)]
        print(f"    per 10 steps (ms, from step 11): {' '.join(f'{b:.0f}' for b in blocks)}", flush=True)
        mean = statistics.mean(times[10:])
        results[name] = mean
        slow = max(range(10, len(times)), key=lambda i: times[i])
        row(
            "loop",
            name,
            "mean step time",
            mean * 1e3,
            "ms",
            f"steps 11-{args.steps}; median "
            f"{statistics.median(times[10:]) * 1e3:.1f} ms; steps 11-40 {statistics.mean(times[10:40]) * 1e3:.1f}, "
            f"41-{args.steps} {statistics.mean(times[40:] or [float('nan')]) * 1e3:.1f} ms; slowest: step {slow + 1}, "
            f"{times[slow] * 1e3:.0f} ms; {KERNELS}",
        )
        shutil.rmtree(d, ignore_errors=True)
    for name in results:
        if not name.startswith("none"):
            row("loop", name, "overhead vs no saves", (results[name] / results["none"] - 1) * 100, "%")
    del model, opt, state
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class SlowDisk(ckpt.tiers.LocalTier):
    """The local tier on a disk of ``mbps`` MB/s (``--disk-mbps``): each write takes at least its bytes at
    that rate (the real write, then a sleep for the rest), like a network file system or a busy disk."""

    def __init__(self, root, mbps: float) -> None:
        super().__init__(root)
        self.mbps = mbps

    def write(self, step, manifest, data):
        t0 = time.perf_counter()
        out = super().write(step, manifest, data)
        time.sleep(max(0.0, manifest.data_bytes / (self.mbps * 1e6) - (time.perf_counter() - t0)))
        return out


def dcp_loop(name: str, every: int, stager: str | None, d: Path, step, model, opt, args) -> float:
    """The same loop saving with ``dcp.async_save`` as its docs advise: the previous save's future is
    waited for before the next save starts; with the pinned ``DefaultStager``, the step after a save
    waits for the staging to complete (the optimizer must not change the state while it is copied)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    init_pg()
    kw = {}
    if stager:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        kw["async_stager"] = DefaultStager(
            StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=True,
            )
        )
    times, blocked, saved = [], [], []
    prev = staging = None
    for s in range(1, args.steps + 1):
        t0 = time.perf_counter()
        if staging is not None:
            staging.result()
            staging = None
        step()
        if s % every == 0:
            b0 = time.perf_counter()
            if prev is not None:
                prev.result()
                for old in saved[:-1]:  # keep the newest finished one, as ours does (keep local=1)
                    shutil.rmtree(old, ignore_errors=True)
                del saved[:-1]
            saved.append(d / f"step-{s}")
            msd, osd = get_state_dict(model, opt)
            out = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(d / f"step-{s}"), **kw)
            if hasattr(out, "upload_completion"):
                prev, staging = out.upload_completion, out.staging_completion
            else:
                prev = out
            blocked.append(time.perf_counter() - b0)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if prev is not None:
        prev.result()
    if stager:
        kw["async_stager"].close()
    row("loop", name, "first save blocked", blocked[0] * 1e3, "ms", f"at step {every}")
    later = blocked[1:] or [0.0]
    row(
        "loop",
        name,
        "later saves blocked (mean)",
        statistics.mean(later) * 1e3,
        "ms",
        f"max {max(later) * 1e3:.1f} ms; the last save finished {time.perf_counter() - t0:.1f} s after the loop",
    )
    mean = statistics.mean(times[10:])
    row(
        "loop",
        name,
        "mean step time",
        mean * 1e3,
        "ms",
        f"steps 11-{args.steps}; median {statistics.median(times[10:]) * 1e3:.1f} ms",
    )
    return mean


def child(root: Path, args) -> None:
    """Train a few steps, snapshot each, print the fingerprint of the last, wait to be killed."""
    model, opt = build(args.layers)
    ids = torch.randint(0, 128256, (2, 256), device="cuda")
    state = {"model": model, "optim": opt}
    ck = ckpt.Checkpointer(local_dir=root / "killed")
    for s in range(1, 4):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ck.save(s, state)
    ck.wait()  # step 3 in memory and on the local tier (newest wins: 2 may be superseded there)
    torch.cuda.synchronize()
    print(json.dumps({"step": 3, "fp": fingerprint(state)}), flush=True)
    time.sleep(3600)


def restore_after_kill(root: Path, args) -> None:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", "--dir", str(root), "--layers", str(args.layers)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if not line.strip():
        raise RuntimeError(
            f"the training child ended before its snapshot (exit status {proc.returncode}); "
            "its error is above"
        )
    want = json.loads(line)
    model, opt = build(args.layers, seed=1)
    # the optimizer's state must exist to be restored into: one step on the fresh model
    ids = torch.randint(0, 128256, (1, 16), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {"model": model, "optim": opt}
    local = root / "killed"
    for tier in ("memory", "local"):
        torch.cuda.synchronize()
        with ckpt.Checkpointer(local_dir=local) as ck:
            t0 = time.perf_counter()
            step = ck.restore(state)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            got = ck.last_restore
        exact = fingerprint(state) == want["fp"]
        row(
            "restore",
            f"ours, {got.tier} tier",
            "restore after SIGKILL",
            dt,
            "s",
            f"step {step}, {got.nbytes / 1e9:.2f} GB, {got.nbytes / dt / 1e9:.1f} GB/s, "
            f"{'bit-exact' if exact else 'MISMATCH'}; new process, same node",
        )
        if tier == "memory":
            shm.free(prefix=shm.prefix_for(local, 0, create=True))
            harness_drop(local)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    init_pg()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp"))
    harness_drop(root / "dcp")
    msd, osd = get_state_dict(model, opt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    torch.cuda.synchronize()
    row("restore", "dcp.load", "restore from disk", time.perf_counter() - t0, "s", "page cache dropped")


def harness_drop(path: Path) -> None:
    """Drop ``path``'s files from the page cache (posix_fadvise DONTNEED), so reads come from the disk."""
    for f in Path(path).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def init_pg() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--parts", default="loop,restore")
    p.add_argument("--modes", default=None, help="loop modes separated by ';' (default: all)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--cpu",
        action="store_true",
        help="the same loop shape at small size on the CPU (the coalescing ratio on a machine "
        "without a GPU); use with --parts loop and --modes",
    )
    p.add_argument(
        "--disk-mbps",
        type=float,
        default=None,
        help="emulate a local disk of this many MB/s (each write takes at least bytes / rate)",
    )
    p.add_argument(
        "--profile-save",
        action="store_true",
        help="cProfile the maybe_save() calls of the 'every 1' modes and print where their time goes",
    )
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-tiers-"))
    if args.child:
        child(root, args)
        return
    print(f"/dev/shm: {shutil.disk_usage('/dev/shm').free / 1e9:.0f} GB free", flush=True)
    try:
        if "loop" in args.parts:
            train_loop(root, args)
        if "restore" in args.parts:
            restore_after_kill(root, args)
    finally:  # what was measured is kept, even when a later part fails
        path = harness.record("tiers", ROWS, args.csv)
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ndevice: {harness.device_name()}; rows appended to {path}")
    print(harness.table(ROWS, ["case", "provider", "metric", "value", "unit", "note"]))


if __name__ == "__main__":
    main()

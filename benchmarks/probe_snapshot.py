"""Where a snapshot's cost goes in the real training loop: the 1.24 B loop of ``bench_tiers.py``, one
process, phases side by side.

Each step is timed on the host (whole step, and the time to enqueue it) and on the GPU (CUDA events on
the compute stream: forward+backward, optimizer step); each snapshot's copy (its start/done events on
the side stream) is placed against the next step's events, and ``save()``'s host time is split into
its parts. Phases (one model, one ``Checkpointer`` that snapshots every 10 steps, memory tier only):

* ``none``: no saves;
* ``ckpt``: the library as it is (its first save at step 10: the background allocation from step 1);
* ``ckpt, no host checks``: the watcher's host-side work stubbed out (fingerprint comparison and the
  memory tier's CRC-32C): what the host checks cost the loop;
* ``ckpt, no fingerprints, no host checks``: also no fingerprint kernels at save();
* ``raw copy``: no library: the same per-tensor device-to-host copies on a side stream into a pinned
  buffer, the next optimizer step waiting for them on the GPU;
* ``raw fingerprints``: no library: only the per-tensor fingerprint sums on the compute stream;

``profile``: a torch.profiler trace of the steps around one snapshot (``$OUT``/``--out``); and
``alloc: as is`` / ``alloc: populate`` / ``alloc: pieces`` / ``alloc: pinned``: one snapshot buffer
allocated in the background while the loop runs, each stage timed (see :func:`alloc_phase`).
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_tiers as bt  # noqa: E402

import ckpt  # noqa: E402
from ckpt import api, pipeline, shm  # noqa: E402
from ckpt import stage as st  # noqa: E402
from ckpt.tiers import memory as mem  # noqa: E402

EV = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

# host-side timings of the current save, and of the watcher threads
SAVE: dict[str, float] = {}
WATCH: list[tuple[str, int, float, float]] = []  # (what, step, t_start, t_end) on perf_counter
SNAPS: dict[int, st.Snapshot] = {}


def timed(mod, name, key):
    real = getattr(mod, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            SAVE[key] = SAVE.get(key, 0.0) + time.perf_counter() - t0

    setattr(mod, name, wrapper)
    return real


def instrument() -> None:
    timed(api, "flatten", "flatten")
    timed(api, "layout", "layout")
    real_stage = api.stage

    def stage(snap, side):
        t0 = time.perf_counter()
        real_stage(snap, side)
        SAVE["stage"] = time.perf_counter() - t0
        SNAPS[snap.step] = snap

    api.stage = stage
    timed(pipeline.Pipeline, "submit", "submit")
    real_wait = st.Snapshot.wait_copied

    def wait_copied(self):
        t0 = time.perf_counter()
        real_wait(self)
        WATCH.append(("verify", self.step, t0, time.perf_counter()))

    st.Snapshot.wait_copied = wait_copied
    real_commit = mem.MemoryTier.commit

    def commit(self, step, manifest, buffer):
        t0 = time.perf_counter()
        real_commit(self, step, manifest, buffer)
        WATCH.append(("commit", step, t0, time.perf_counter()))

    mem.MemoryTier.commit = commit


def stub_host_checks() -> None:
    def verify(self):  # wait for the copies only: no fingerprint comparison on the host
        with self._verify_lock:
            groups, self._groups = self._groups, []
            for ev, _ in groups:
                ev.synchronize()
            self._checks, self._fp_host = [], None

    st.Snapshot._verify_cuda_copies = verify
    shm.chunk_checksums = lambda tensor, data_bytes, chunk, background=False: [0] * (-(-data_bytes // chunk))


def stub_fingerprints() -> None:
    st._fingerprints = lambda pairs: ([True] * len(pairs), None)


def profile_snapshot(step, ck, state, s_ck: int, out: Path) -> int:
    """A torch.profiler trace of 5 steps, a snapshot after the 2nd (``trace.json.gz``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    print("\n== profile: 5 steps, save() after step 2", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(1, 6):
            with record_function(f"step {i}"):
                step()
            s_ck += 1
            if i == 2:
                with record_function("save"):
                    ck.save(s_ck, state)
        torch.cuda.synchronize()
    ck.wait()
    path = out / "trace.json"
    prof.export_chrome_trace(str(path))
    import trace_gaps

    trace_gaps.main([str(path), "--top", "25"])
    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
        g.write(f.read())
    path.unlink()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20), flush=True)
    return s_ck


def alloc_phase(step, variant: str, nbytes: int, base_s: float) -> None:
    """One snapshot buffer allocated in a background thread (niced, as the pool does) while the loop
    runs: ``as is`` (fallocate, map, cudaHostRegister, as ``Segment.create`` + ``register``),
    ``populate [N]`` (MADV_POPULATE_WRITE before registering, on N threads), ``pieces`` (registered 256 MiB at a time),
    ``pinned`` (``torch.empty(pin_memory=True)``, the in-process buffer). Prints each stage's time
    and the loop's excess over ``base_s`` per step while it ran."""
    from ckpt import priority

    marks: dict[str, float] = {}
    holder: dict[str, object] = {}
    path = Path(f"/dev/shm/probe-alloc-{os.getpid()}")

    def bg() -> None:
        priority.lower_this_thread()
        torch.cuda.set_device(0)
        now = time.perf_counter
        marks["start"] = now()
        if variant == "pinned":
            holder["t"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            marks["register"] = now()
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        os.close(fd)
        marks["fallocate"] = now()
        t = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        holder["t"] = t
        marks["map"] = now()
        if variant.startswith("populate"):  # "populate N": on N threads (ckpt.shm.populate)
            threads = int(variant.split()[1]) if " " in variant else 1
            holder["populate_rc"] = shm.populate(t.data_ptr(), nbytes, threads=threads)
            marks["populate"] = now()
        if variant == "pieces":
            piece = 256 << 20
            rcs = [
                shm.host_register(t.data_ptr() + off, min(piece, nbytes - off))
                for off in range(0, nbytes, piece)
            ]
            holder["rc"] = max(rcs)
            holder["pieces"] = list(range(0, nbytes, piece))
        else:
            holder["rc"] = shm.host_register(t.data_ptr(), nbytes)
        marks["register"] = now()

    th = threading.Thread(target=bg, name="probe-alloc")
    t_begin = time.perf_counter()
    th.start()
    rows = []
    after = 0
    while after < 3 and len(rows) < 200:
        r = step()
        rows.append(r)
        if not th.is_alive():
            after += 1
    th.join()
    t = holder.get("t")
    t0 = time.perf_counter()
    if holder.get("rc") == 0 and t is not None:
        for off in holder.get("pieces", [0]):
            shm.host_unregister(t.data_ptr() + off)
    unreg = time.perf_counter() - t0
    holder.pop("t", None)
    del t
    path.unlink(missing_ok=True)
    stages = " ".join(f"{k} +{(v - t_begin) * 1e3:.0f}" for k, v in marks.items())
    excess = sum(max(0.0, r["host"] - base_s) for r in rows)
    worst = max(rows, key=lambda r: r["host"])
    print(
        f"\n== alloc, {variant}: {nbytes / 2**30:.2f} GiB; ms from the start: {stages}; register rc "
        f"{holder.get('rc')}{' populate ' + str(holder['populate_rc']) if 'populate_rc' in holder else ''}; "
        f"unregister {unreg * 1e3:.0f} ms",
        flush=True,
    )
    print(
        f"   {len(rows)} steps while it ran (+3): excess over {base_s * 1e3:.0f} ms: {excess * 1e3:.0f} ms in all; "
        f"worst step {worst['host'] * 1e3:.0f} ms (enqueue {worst['enq'] * 1e3:.0f}) at +{(worst['t0'] - t_begin) * 1e3:.0f} ms",
        flush=True,
    )
    print(
        "   steps (start ms: host ms): "
        + " ".join(f"{(r['t0'] - t_begin) * 1e3:.0f}:{r['host'] * 1e3:.0f}" for r in rows),
        flush=True,
    )


def ce_phase() -> None:
    """How long a 4-byte ``.item()`` on the compute stream waits while a side stream copies 4 GiB to pinned
    host memory, enqueued in different ways (no model): the copy engine's share between streams."""
    n, chunk = 4 << 30, 64 << 20
    big = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    small = torch.ones(1, device="cuda")
    pageable = torch.ones(1)

    def chunks(stream, gap_cycles=0):
        with torch.cuda.stream(stream):
            for off in range(0, n, chunk):
                host[off : off + chunk].copy_(big[off : off + chunk], non_blocking=True)
                if gap_cycles:
                    torch.cuda._sleep(gap_cycles)

    def paced(stream, ahead):
        def run():
            evs = []
            with torch.cuda.stream(stream):
                for off in range(0, n, chunk):
                    if len(evs) >= ahead:
                        evs.pop(0).synchronize()
                    host[off : off + chunk].copy_(big[off : off + chunk], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    evs.append(ev)

        th = threading.Thread(target=run)
        th.start()
        return th

    low, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    variants = {
        "one 4 GiB copy": lambda: _on(low, lambda: host.copy_(big, non_blocking=True)),
        "64 MiB chunks at once": lambda: chunks(low),
        "64 MiB chunks, high-priority stream": lambda: chunks(high),
        "64 MiB chunks, 20 us sleep kernel between": lambda: chunks(low, 40000),
        "64 MiB chunks, 2 us sleep kernel between": lambda: chunks(low, 4000),
        "paced thread, 1 ahead": lambda: paced(low, 1),
        "paced thread, 2 ahead": lambda: paced(low, 2),
    }
    print(
        "\n== copy engine: a 4-byte .item() (and a pageable 4-byte upload) while 4 GiB go device-to-host",
        flush=True,
    )
    for name, go in variants.items():
        for probe in ("item", "upload"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            th = go()
            time.sleep(0.01)
            t1 = time.perf_counter()
            if probe == "item":
                small.item()
            else:
                pageable.to("cuda")
                torch.cuda.current_stream().synchronize()
            lat = time.perf_counter() - t1
            if isinstance(th, threading.Thread):
                th.join()
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
            print(
                f"   {name:<44} {probe:<6}: waited {lat * 1e3:7.2f} ms; the copy took {total * 1e3:6.1f} ms "
                f"({n / total / 1e9:.1f} GB/s)",
                flush=True,
            )


def _on(stream, fn):
    with torch.cuda.stream(stream):
        return fn()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=50, help="steps per phase")
    p.add_argument(
        "--phases",
        default="none;ckpt;profile;ckpt, no host checks;"
        "ckpt, no fingerprints, no host checks;raw copy;raw fingerprints;none (again)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ckpt.stage").setLevel(logging.INFO)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, opt = bt.build(args.layers)
    ids = torch.randint(0, 128256, (args.batch, args.seq), device="cuda")
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    pending: list[torch.cuda.Event] = []

    def step() -> dict:
        e0, e1, e2 = EV(), EV(), EV()
        t0 = time.perf_counter()
        e0.record()
        o = model(input_ids=ids, labels=ids)
        o.loss.backward()
        e1.record()
        if pending:  # the raw copy's fence
            compute.wait_event(pending.pop())
        opt.step()
        e2.record()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        o.loss.item()
        return {"e": (e0, e1, e2), "enq": t1 - t0, "host": time.perf_counter() - t0, "t0": t0}

    for _ in range(3):
        step()
    state = {"model": model, "optim": opt}
    instrument()
    tensors = [t for t in model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel()
    ]
    print(
        f"{len(tensors)} state tensors, {sum(t.numel() * t.element_size() for t in tensors) / 1e9:.3f} GB",
        flush=True,
    )
    raw_buf = None
    results = {}
    root = Path(args.dir or f"/tmp/probe-{os.getpid()}")
    ck = ckpt.Checkpointer(
        local_dir=root, every_steps=10, keep=ckpt.Retention(local=1), persist_every={"local": 10**9}
    )
    s_ck = 0  # the checkpointer's step counter runs across the ckpt phases
    for phase in [x for x in args.phases.split(";") if x]:
        if phase == "profile":
            s_ck = profile_snapshot(step, ck, state, s_ck, out)
            continue
        if phase == "ce":
            ce_phase()
            continue
        if phase.startswith("alloc: "):
            alloc_phase(step, phase[len("alloc: ") :], int(7.415e9), results.get("none", 0.245))
            continue
        if phase.startswith("ckpt, ahead "):
            st._COPIES_AHEAD = int(phase.split()[-1])
        if phase == "ckpt, no host checks":
            stub_host_checks()
        if phase == "ckpt, no fingerprints, no host checks":
            stub_host_checks()
            stub_fingerprints()
        if phase == "raw copy" and raw_buf is None:
            t0 = time.perf_counter()
            raw_buf = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            print(f"raw copy: pinned {len(raw_buf)} buffers in {time.perf_counter() - t0:.1f} s", flush=True)
        rows = []
        for i in range(1, args.steps + 1):
            r = step()
            r["i"] = i
            SAVE.clear()
            t0 = time.perf_counter()
            if phase.startswith("ckpt"):
                s_ck += 1
                h = ck.maybe_save(s_ck, state)
                if h is not None:
                    r["save_step"] = s_ck
            elif phase == "raw copy" and i % 10 == 0:
                side.wait_stream(compute)
                c0, c1 = EV(), EV()
                with torch.cuda.stream(side):
                    c0.record()
                    for t, b in zip(tensors, raw_buf):
                        b.copy_(t, non_blocking=True)
                    c1.record()
                pending.append(c1)
                r["raw"] = (c0, c1)
            elif phase == "raw fingerprints" and i % 10 == 0:
                fp = torch.stack([st._fingerprint_on_device(t, st._fits_words(t)) for t in tensors])
                host = torch.empty(len(tensors), dtype=torch.int64, pin_memory=True)
                host.copy_(fp, non_blocking=True)
                r["raw_fp"] = True
            r["save"] = time.perf_counter() - t0
            r["save_parts"] = dict(SAVE)
            rows.append(r)
        torch.cuda.synchronize()
        if phase.startswith("ckpt"):
            ck.wait()
        # per step: GPU times
        for k, r in enumerate(rows):
            e0, e1, e2 = r["e"]
            r["fb"] = e0.elapsed_time(e1)
            r["opt"] = e1.elapsed_time(e2)
            if k + 1 < len(rows):  # GPU time from this step's start to the next one's: includes idle
                r["gpu_period"] = e0.elapsed_time(rows[k + 1]["e"][0])
            copy = None
            if "save_step" in r:
                snap = SNAPS.get(r["save_step"])
                if snap is not None and snap._cuda_start is not None:
                    copy = (snap._cuda_start, snap._cuda_done)
            elif "raw" in r:
                copy = r["raw"]
            if copy is not None and k + 1 < len(rows):
                n0, n1, _ = rows[k + 1]["e"]
                r["copy_ms"] = copy[0].elapsed_time(copy[1])
                r["copy_start_vs_next_fwd"] = n0.elapsed_time(copy[0])
                r["copy_end_vs_next_bwd_end"] = n1.elapsed_time(copy[1])  # > 0: the next opt step waited
        host = [r["host"] + r["save"] for r in rows[10:]]
        mean = statistics.mean(host)
        results[phase] = mean
        late = [r["host"] + r["save"] for r in rows[20:]] or host
        print(
            f"\n== {phase}: mean step {mean * 1e3:.1f} ms (steps 11-{args.steps}; 21-{args.steps}: "
            f"{statistics.mean(late) * 1e3:.1f}), median "
            f"{statistics.median(host) * 1e3:.1f}; GPU fwd+bwd median {statistics.median(r['fb'] for r in rows[10:]):.1f} ms,"
            f" opt {statistics.median(r['opt'] for r in rows[10:]):.2f} ms, enqueue median "
            f"{statistics.median(r['enq'] for r in rows[10:]) * 1e3:.1f} ms",
            flush=True,
        )
        print(
            "   step  host  enq  save |  fb   opt  period | copy  c0-next  cEnd-nextBwd | save parts",
            flush=True,
        )
        for k, r in enumerate(rows):
            near = any(
                abs(k - j) <= 3 and any(x in rows[j] for x in ("save_step", "raw", "raw_fp"))
                for j in range(len(rows))
            )
            if not (near or (phase == "ckpt" and k < 25)):
                continue
            parts = " ".join(f"{a}={b * 1e3:.1f}" for a, b in r["save_parts"].items())
            print(
                f"   {r['i']:4d} {r['host'] * 1e3:5.0f} {r['enq'] * 1e3:4.0f} {r['save'] * 1e3:5.1f} | "
                f"{r['fb']:5.1f} {r['opt']:5.2f} {r.get('gpu_period', 0):6.1f} | "
                f"{r.get('copy_ms', float('nan')):5.1f} {r.get('copy_start_vs_next_fwd', float('nan')):7.1f} "
                f"{r.get('copy_end_vs_next_bwd_end', float('nan')):8.1f} | {parts}",
                flush=True,
            )
        if phase.startswith("ckpt"):
            t_first = rows[0]["t0"]
            for what, s, a, b in WATCH:
                if a >= t_first:
                    print(
                        f"   watcher {what} of step {s}: from {(a - t_first) * 1e3:.0f} to {(b - t_first) * 1e3:.0f} ms "
                        f"({(b - a) * 1e3:.0f} ms) after the phase began",
                        flush=True,
                    )
            WATCH.clear()
    ck.close()
    print("\nphase                                      mean step   over none")
    base = results.get("none")
    for k, v in results.items():
        print(f"{k:<42} {v * 1e3:8.1f} ms  {((v / base - 1) * 100 if base else 0):+6.2f}%")


if __name__ == "__main__":
    main()

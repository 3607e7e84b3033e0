"""Remote tier benchmark: upload and download throughput, ours vs fsspec's own put/get, in one run.

Targets a real S3 server on loopback (moto's server mode, started here) and a
``file://`` remote, with and without zstd compression, on two states of the
same size: real trained weights + AdamW moments (a small transformer trained
for a few hundred steps: random data would not compress) and random data.
Also reports the compression ratio and throughput. Results are appended to
``benchmarks/results.csv``; a short table is printed last.

``python benchmarks/bench_remote.py [--mb 128] [--train-steps 300]`` (needs ``s3fs`` and ``moto[server]``).

``--sections backends [--backend-mb 1024] [--rounds 2]``: the two S3 clients the remote tier can use
(``ckpt.fs``: s3fs, and pyarrow's C++ ``S3FileSystem`` through fsspec's ``ArrowFSWrapper``) side by side
in each round against one moto server running in a process of its own (so that neither client shares
an interpreter lock with the server): the remote tier's own upload and download + verify of a state of
random bytes (parallel 16 MiB objects, ranged reads), fsspec's ``put_file`` of one file of that size
(a multipart upload) and parallel 16 MiB ranged reads of that one object.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import harness  # noqa: E402

import ckpt  # noqa: E402
from ckpt.tiers import LocalTier, RemoteTier  # noqa: E402

ROWS: list[dict] = []


def row(case: str, provider: str, metric: str, value: float, unit: str, note: str = "") -> None:
    ROWS.append(
        {"case": case, "provider": provider, "metric": metric, "value": value, "unit": unit, "note": note}
    )
    print(f"  {case:22s} {provider:18s} {metric:22s} {value:10.4g} {unit} {note}", flush=True)


def trained_state(mb: int, steps: int) -> dict:
    """A small transformer trained on a synthetic copy task: real weights and moments."""
    torch.manual_seed(0)
    d = 256
    layers = max(1, int(mb * 1e6 / (12 * d * d * 4 * 3)))
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True), layers)
    head = nn.Linear(d, d)
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4)
    for _ in range(steps):
        x = torch.randn(16, 32, d)
        loss = nn.functional.mse_loss(head(model(x)), x.flip(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model, "head": head, "optim": opt}


def random_state(nbytes: int) -> dict:
    return {"w": torch.randn(nbytes // 4)}


def stage_to_local(state: dict, root: Path) -> tuple[LocalTier, int]:
    with ckpt.Checkpointer(local_dir=root) as ck:
        h = ck.save(1, state).wait()
    return LocalTier(root), h.stats.nbytes


def bench_case(
    label: str, local: LocalTier, url: str, opts: dict, compression: str | None, nbytes: int
) -> None:
    _, manifest = local.open(1)
    remote = RemoteTier(url, opts, compression=compression)
    fs = remote.fs
    # Ours uploads from host memory in production (the staged snapshot), so the bytes come from memory here
    # too; fsspec's put_file gets the same bytes as the committed local file.
    data = memoryview(bytearray((local.step_dir(1) / "rank-00000.bin").read_bytes()))
    remote.write(1, manifest, data)  # warm-up (connections, first requests)
    t = time.perf_counter()
    remote.write(1, manifest, data)
    up = time.perf_counter() - t
    _, rman = remote.open(1)
    stored = sum(rman.stored_sizes)
    t = time.perf_counter()
    remote.load(1, rman, None)
    down = time.perf_counter() - t
    codec = compression or "raw"
    row(label, f"ours {codec}", "upload", nbytes / up / 1e9, "GB/s")
    row(label, f"ours {codec}", "download+verify", nbytes / down / 1e9, "GB/s")
    if compression:
        row(label, f"ours {codec}", "stored / raw", stored / nbytes, "x")
        return
    src = str(local.step_dir(1) / "rank-00000.bin")
    dst = f"{remote.root}/fsspec-put.bin"
    fs.put_file(src, dst)
    t = time.perf_counter()
    fs.put_file(src, dst)
    put = time.perf_counter() - t
    out = Path(tempfile.mkdtemp()) / "get.bin"
    t = time.perf_counter()
    fs.get_file(dst, str(out))
    get = time.perf_counter() - t
    row(label, "fsspec put/get", "upload", nbytes / put / 1e9, "GB/s")
    row(label, "fsspec put/get", "download", nbytes / get / 1e9, "GB/s")
    fs.rm(dst)
    shutil.rmtree(out.parent)


def codec_throughput(local: LocalTier, label: str) -> None:
    from ckpt.codec import encode
    from ckpt.tiers.remote import _dominant_elem_size

    _, m = local.open(1)
    size = _dominant_elem_size(m.items, m.chunk_bytes)
    with local.mapped(1) as data:
        c = m.chunk_bytes
        chunks = [data[i * c : (i + 1) * c] for i in range(len(m.chunks))]
        t = time.perf_counter()
        out = [encode(v, "zstd", size(i))[0] for i, v in enumerate(chunks)]
        dt = time.perf_counter() - t
        row(label, "zstd:shuffle", "compress 1 thread", len(data) / dt / 1e9, "GB/s")
        row(label, "zstd:shuffle", "ratio raw / stored", len(data) / sum(len(o) for o in out), "x")
        t = time.perf_counter()
        plain = [encode(v, "zstd", 1)[0] for v in chunks]
        row(
            label,
            "zstd (no shuffle)",
            "ratio raw / stored",
            len(data) / sum(len(o) for o in plain),
            "x",
            f"{len(data) / (time.perf_counter() - t) / 1e9:.3f} GB/s",
        )
        del chunks


def moto_process(port: int) -> subprocess.Popen:
    """moto's S3 server in a process of its own on 127.0.0.1:``port``, once it accepts connections."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto's server did not start")


def bench_backends(port: int, mb: int, rounds: int, work: Path) -> None:
    """Both S3 clients, side by side in each round (see the module docstring)."""
    from ckpt.fs import resolve
    from s3server import storage_options

    nbytes = mb << 20
    label = f"backends {mb} MiB"
    local, n = stage_to_local(random_state(nbytes), work / "backends")
    _, manifest = local.open(1)
    data = memoryview(bytearray((local.step_dir(1) / "rank-00000.bin").read_bytes()))
    src = str(local.step_dir(1) / "rank-00000.bin")
    row(label, "-", "state size", n / 1e6, "MB", f"{rounds} rounds, moto in its own process")
    chunk = 16 << 20
    for r in range(rounds):
        for backend in ("s3fs", "arrow"):
            opts = storage_options(port, backend=backend)
            remote = RemoteTier(f"s3://bench/{backend}-{r}", opts)
            t = time.perf_counter()
            remote.write(1, manifest, data)
            up = time.perf_counter() - t
            _, rman = remote.open(1)
            t = time.perf_counter()
            remote.load(1, rman, None)
            down = time.perf_counter() - t
            remote.delete(1)
            fs = resolve(f"s3://bench/{backend}-{r}", opts).fs
            obj = f"bench/{backend}-{r}/one-object.bin"
            t = time.perf_counter()
            fs.put_file(src, obj)
            put = time.perf_counter() - t
            size = fs.info(obj)["size"]
            assert size == n, (size, n)
            ranges = [(o, min(o + chunk, n)) for o in range(0, n, chunk)]
            t = time.perf_counter()
            with ThreadPoolExecutor(8) as ex:
                got = sum(ex.map(lambda ab: len(fs.cat_file(obj, start=ab[0], end=ab[1])), ranges))
            ranged = time.perf_counter() - t
            assert got == n
            fs.rm(obj)
            note = f"round {r + 1}"
            row(label, backend, "ours upload", n / up / 1e9, "GB/s", note)
            row(label, backend, "ours download+verify", n / down / 1e9, "GB/s", note)
            row(label, backend, "put_file (multipart)", n / put / 1e9, "GB/s", note)
            row(label, backend, "ranged reads x8", n / ranged / 1e9, "GB/s", note)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=128)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument(
        "--sections",
        default="targets,backends",
        help="comma-separated: targets (ours vs fsspec put/get, s3 and file://, raw and zstd), "
        "backends (s3fs vs pyarrow's S3)",
    )
    p.add_argument("--backend-mb", type=int, default=1024, help="state size of the backends section, MiB")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the backends section")
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    sections = set(args.sections.split(","))
    import moto.server
    from s3server import free_port, storage_options

    work = Path(tempfile.mkdtemp(prefix="ckpt-remote-bench-"))
    print(f"device: {harness.device_name()}; S3 = moto server on 127.0.0.1")
    try:
        if "targets" in sections:
            port = free_port()
            server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            try:
                import s3fs

                s3fs.S3FileSystem(**storage_options(port)).mkdir("bench")
                states = {"trained": trained_state(args.mb, args.train_steps)}
                local, nbytes = stage_to_local(states["trained"], work / "trained")
                states["random"] = random_state(nbytes)
                tiers = {
                    "trained": (local, nbytes),
                    "random": stage_to_local(states["random"], work / "random"),
                }
                for kind, (tier, n) in tiers.items():
                    row(kind, "-", "state size", n / 1e6, "MB")
                    codec_throughput(tier, kind)
                    for target, url, opts in (
                        ("s3", "s3://bench/" + kind, storage_options(port, backend="s3fs")),
                        ("file", f"file://{work}/remote-{kind}", {}),
                    ):
                        for comp in (None, "zstd"):
                            bench_case(f"{kind} -> {target}", tier, url + f"-{comp or 'raw'}", opts, comp, n)
            finally:
                server.stop()
        if "backends" in sections:
            port = free_port()
            proc = moto_process(port)
            try:
                import s3fs

                s3fs.S3FileSystem(**storage_options(port), skip_instance_cache=True).mkdir("bench")
                bench_backends(port, args.backend_mb, args.rounds, work)
            finally:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = harness.record("remote", ROWS, args.csv)
    print(f"\nappended {len(ROWS)} rows to {path}\n")
    print(harness.table(ROWS, ["case", "provider", "metric", "value", "unit", "note"]))


if __name__ == "__main__":
    main()

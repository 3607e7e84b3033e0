"""Small models and comparisons shared by the tests."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import ckpt


def make_state(seed: int = 0, device: str = "cpu") -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "rng": ckpt.RNGState(),
        "meta": {"epoch": 0, "name": "run", "lrs": [1e-2, None, True], "inf": float("inf")},
    }


def train(state: dict, steps: int = 1) -> None:
    model, opt = state["model"], state["optim"]
    dev = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(16, 12).to(dev)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["sched"].step()
        state["meta"]["epoch"] += 1


def snapshot_values(state: dict) -> dict:
    """Deep copies of every tensor and value that a restore must reproduce."""
    opt = state["optim"]
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optim": [
            {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
            for g in opt.param_groups
            for p in g["params"]
        ],
        "lr": [g["lr"] for g in opt.param_groups],
        "sched": dict(state["sched"].state_dict()),
        "rng": torch.get_rng_state().clone(),
        "meta": dict(state["meta"]),
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model tensor {k} differs"
    assert len(a["optim"]) == len(b["optim"])
    for i, (x, y) in enumerate(zip(a["optim"], b["optim"])):
        assert x.keys() == y.keys()
        for k in x:
            if torch.is_tensor(x[k]):
                assert torch.equal(x[k], y[k]), f"optimizer state {i}/{k} differs"
                assert x[k].device == y[k].device and x[k].dtype == y[k].dtype
            else:
                assert x[k] == y[k]
    assert a["lr"] == b["lr"]
    assert a["sched"] == b["sched"]
    assert torch.equal(a["rng"], b["rng"])
    assert a["meta"] == b["meta"]


def run_ranks(
    script: Path, *args: str, world: int = 2, timeout: float = 180, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """Run ``python script args[0] RANK WORLD args[1:]`` for every rank of a fresh job on loopback
    (MASTER_ADDR / MASTER_PORT set; ``env`` added); returns each rank's completed process.

    Without CUDA the ranks fork from :func:`fork_server` and run the script as a fresh interpreter would
    (:func:`_script_main`): the seconds each rank would spend importing torch are the bulk of a small job's
    time. With CUDA (a GPU job's processes must not fork from one that may have touched the driver), or
    ``CKPT_TEST_FRESH_INTERPRETERS=1``, each rank is a fresh interpreter."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": f"{script.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(env or {}),
    }
    argvs = [[args[0], str(r), str(world), *args[1:]] for r in range(world)]
    if os.environ.get("CKPT_TEST_FRESH_INTERPRETERS") == "1" or torch.cuda.is_available():
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for argv in argvs
        ]
        out = []
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        return out
    ctx = fork_server()
    with tempfile.TemporaryDirectory(prefix="ckpt-ranks-") as tmp:
        procs = []
        for r, argv in enumerate(argvs):
            files = (os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err"))
            for f in files:
                Path(f).touch()
            p = ctx.Process(target=_script_main, args=(str(script), argv, env, *files))
            p.start()
            procs.append((p, [sys.executable, str(script), *argv], files))
        out = []
        for p, cmd, (stdout, stderr) in procs:
            p.join(timeout)
            if p.exitcode is None:
                for q, _, _ in procs:
                    q.kill()
                    q.join()
                raise subprocess.TimeoutExpired(cmd, timeout)
            out.append(
                subprocess.CompletedProcess(
                    cmd,
                    p.exitcode,
                    Path(stdout).read_text(errors="replace"),
                    Path(stderr).read_text(errors="replace"),
                )
            )
        return out


def _script_main(script: str, argv: list[str], env: dict, stdout: str, stderr: str) -> None:
    """In a process forked from :func:`fork_server`: ``python script *argv`` with the environment ``env``,
    its output into the files ``stdout`` and ``stderr``, as a fresh interpreter runs it: ``__main__``,
    ``sys.argv``, ``sys.path`` (the script's folder, then ``PYTHONPATH``), the exit status of ``sys.exit``
    or 1 and the traceback for an exception, and at the end what the interpreter does on its way out
    (threading's exit hooks, where ckpt finishes the persists still queued; the wait for non-daemon
    threads; ``atexit``'s hooks). Ends the process."""
    import atexit
    import runpy
    import threading
    import traceback

    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path[:0] = [os.path.dirname(script)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status & 0xFF)


def fork_server():
    """A ``multiprocessing`` context whose processes fork from a server that imported torch and ckpt once:
    real processes (their own pid, killable), started in a fraction of a second where a fresh interpreter
    spends seconds importing torch. The server has no threads, unlike the test process (a store's server, a
    tier's workers): a fork of that can hang on a lock one of them held. A process forked from it ends
    without the interpreter's exit (threading's and ``atexit``'s hooks) unless it runs that itself, as
    :func:`_script_main` does."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckpt"])
    return ctx


def kill_after(proc: subprocess.Popen, line: str, timeout: float = 120.0) -> None:
    """Read ``proc``'s stdout (text) until it prints ``line``, then SIGKILL it at once. A worker that ends,
    or does not print ``line`` within ``timeout`` seconds, is killed too and the test fails: a worker that
    went another way never hangs the suite."""
    import threading

    found = threading.Event()
    errors: list[str] = []

    def read() -> None:
        for got in proc.stdout:
            if got.strip() == line:
                found.set()
                return

    def drain() -> None:  # a worker blocked writing a full stderr pipe would never print the line
        for got in proc.stderr:
            errors.append(got)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if proc.stderr is not None:
        threading.Thread(target=drain, daemon=True).start()
    reader.join(timeout)
    proc.kill()
    proc.wait(timeout=60)
    if not found.is_set():
        err = "".join(errors)[-3000:]
        raise AssertionError(
            f"the worker did not print {line!r} within {timeout:.0f} s (status {proc.returncode})"
            f"{': ' + err if err else ''}"
        )


def assert_ok(results: list[subprocess.CompletedProcess]) -> None:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]


class DiskLog:
    """Spies (calling the real functions) on every write through fsspec's local file system, every rename
    into place (``os.replace``: the write of its destination) and every fsync, in order: enough to check
    that nothing vouches for a file before that file is on disk."""

    def __init__(self, monkeypatch):
        from fsspec.implementations.local import LocalFileSystem

        self.events: list[tuple[str, str]] = []
        real_pipe, real_fsync = LocalFileSystem.pipe_file, os.fsync
        log = self.events

        def pipe_file(fs, path, value, *a, **kw):
            out = real_pipe(fs, path, value, *a, **kw)
            log.append(("write", os.path.realpath(fs._strip_protocol(path))))
            return out

        def fsync(fd):
            real_fsync(fd)
            log.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))

        real_replace = os.replace

        renamed = self.renamed = {}  # destination -> the temporary name it was written and fsynced under

        def replace(src, dst, *a, **kw):  # a file written under a temporary name lands at its rename
            src_real = os.path.realpath(src)
            real_replace(src, dst, *a, **kw)
            renamed[os.path.realpath(dst)] = src_real
            log.append(("write", os.path.realpath(dst)))

        monkeypatch.setattr(LocalFileSystem, "pipe_file", pipe_file)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def first(self, kind: str, path: Path) -> int:
        p = os.path.realpath(path)
        return next(i for i, (k, q) in enumerate(self.events) if k == kind and q == p)

    def synced_before(self, path: Path, index: int) -> bool:
        """Whether ``path`` (or the temporary name it was renamed from) was fsynced before event ``index``."""
        p = os.path.realpath(path)
        names = {p, self.renamed.get(p)}
        return any(k == "fsync" and q in names for k, q in self.events[:index])


def run_worker_in_process(worker: str, *args: object, raises: type[BaseException] | None = None) -> str:
    """Run ``tests/<worker>.py``'s ``main(args)`` in this process (its heavy imports are made once per
    session: seconds saved per run) and return what it printed. ``main`` must return 0, or raise
    ``raises`` (an exception class the worker defines, given by name: ``"Crash"``) when that is given."""
    here = str(Path(__file__).parent)
    sys.path.insert(0, here)
    try:
        module = importlib.import_module(worker)
    finally:
        sys.path.remove(here)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if raises is None:
            assert module.main([str(a) for a in args]) == 0
        else:
            try:
                module.main([str(a) for a in args])
            except raises:
                pass
            else:
                raise AssertionError(f"{worker}.main did not raise {raises.__name__}")
    return out.getvalue()


def stall_second_tensor_copy() -> None:
    """In a worker process about to be killed: the next snapshot's copy stops before its second tensor
    (``copying`` is printed, then the staging thread sleeps), so the buffer is left half overwritten."""
    import threading
    import time

    from ckpt import stage as stage_mod

    real = stage_mod._dst
    copied = [0]

    def stall(buf, rec, t):
        if threading.current_thread().name.startswith("ckpt-stage"):
            copied[0] += 1
            if copied[0] == 2:
                print("copying", flush=True)
                time.sleep(600)
        return real(buf, rec, t)

    stage_mod._dst = stall


def verifies(local_dir: str | os.PathLike, step: int) -> bool:
    """Whether step ``step`` of the local tier in ``local_dir`` reads back with every byte checked."""
    from ckpt.tiers import LocalTier

    try:
        LocalTier(local_dir).verify(step)
        return True
    except (ckpt.errors.CheckpointError, OSError):
        return False


def delay_staging(monkeypatch, seconds: float) -> None:
    """Make each CPU staging copy take ``seconds`` longer: a write right after save() lands before the copy."""
    import threading
    import time

    from ckpt import stage as stage_mod

    real = stage_mod._dst

    def slow(buf, rec, t):
        if threading.current_thread().name.startswith("ckpt-stage"):
            time.sleep(seconds)
        return real(buf, rec, t)

    monkeypatch.setattr(stage_mod, "_dst", slow)

"""Signals: SIGTERM before a node drains (flag-only handler, forced durable save at the step boundary,
exit 128+15) and a save request (SIGUSR1: save durably at the next boundary and keep training)."""

from __future__ import annotations

import ast
import logging
import os
import signal
import socket
import subprocess
import time
import sys
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.tiers import LocalTier

HERE = Path(__file__).parent
STEPS = 40


def _spawn(local_dir: Path, *extra: str, env: dict | None = None, steps: int = STEPS) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    return subprocess.Popen(
        [sys.executable, str(HERE / "preempt_worker.py"), str(local_dir), str(steps), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_step(proc: subprocess.Popen, n: int) -> list[str]:
    """Read the worker's output up to its report of step ``n``; returns the lines read."""
    read = []
    for line in proc.stdout:
        read.append(line.rstrip("\n"))
        if line.startswith("step ") and int(line.split()[1]) >= n:
            return read
    raise AssertionError(f"worker ended before step {n}: {proc.stderr.read()}")


def _final(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=120)
    lines = out.splitlines()
    assert proc.returncode == 0, err
    return next(l.split()[1] for l in lines if l.startswith("final")), next(
        l for l in lines if l.startswith("restored")
    )


def _committed(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.glob("step-*") if (p / "COMMIT").exists())


def test_sigterm_saves_exits_143_and_the_resumed_run_is_bit_identical(tmp_path):
    ref = _spawn(tmp_path / "ref")  # the uninterrupted run, beside the one signalled (a directory of its own)
    d = tmp_path / "run"
    proc = _spawn(d)
    _wait_for_step(proc, 5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received" in err
    saved = _committed(d)
    assert len(saved) == 1 and 5 <= saved[0] < STEPS
    reference, _ = _final(ref)
    digest, restored = _final(_spawn(d))
    assert restored == f"restored {saved[0]}"
    assert digest == reference


def test_sigterm_outside_the_loop_drains_the_newest_snapshot_in_ram_and_exits_143(tmp_path):
    """A preemption while the process evaluates (no maybe_save for minutes): the newest snapshot already in
    RAM is made durable on the local tier from a background thread, and the process exits 143 long before
    the evaluation would have ended; the next run resumes from it."""
    d = tmp_path / "run"
    proc = _spawn(d, "--every", "1", "--evaluate-after", "6")
    for line in proc.stdout:
        if line.startswith("evaluating"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)  # the evaluation sleeps 300 s
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert 6 in _committed(d)
    _, restored = _final(_spawn(d, steps=8))
    assert restored == "restored 6"


def test_a_preemption_outside_the_loop_raises_at_the_next_maybe_save_with_on_preempt_raise(local_dir):
    w = torch.zeros(4)
    signals = ckpt.Signals(preempt=(signal.SIGUSR1,), on_preempt="raise", outside_loop_after=0.2)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(every_steps=1, persist_every={"local": 100}),
        signals=signals,
    ) as ck:
        for step in (1, 2, 3):
            w.fill_(step)
            ck.maybe_save(step, {"w": w}).wait("memory")
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not any(i.step == 3 and "local" in i.tiers for i in ck.list()):  # drained from RAM meanwhile
            assert time.monotonic() < deadline, "the snapshot in RAM was not drained"
            time.sleep(0.05)
        w.fill_(4)
        with pytest.raises(ckpt.Preempted) as info:
            ck.maybe_save(4, {"w": w})  # the state of step 4 is not saved: step 3 was drained
        assert info.value.step == 3 and info.value.durable


@pytest.mark.parametrize("bad", [0, -1, True, "5"])
def test_outside_loop_after_is_checked(bad):
    with pytest.raises(ValueError, match="outside_loop_after"):
        ckpt.Signals(outside_loop_after=bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_agree_when_only_one_receives_sigterm(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [_spawn(tmp_path / f"rank{r}", str(r), "2", env=env) for r in range(2)]
    for p in procs:
        _wait_for_step(p, 5)
    procs[1].send_signal(signal.SIGTERM)  # rank 0 never sees the signal
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 128 + signal.SIGTERM, err
    steps = [_committed(tmp_path / f"rank{r}") for r in range(2)]
    assert steps[0] == steps[1] and len(steps[0]) == 1, steps


def test_on_preempt_raise_and_handlers_are_restored(local_dir):
    before = signal.getsignal(signal.SIGUSR1)
    w = torch.zeros(4)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(every_steps=1000),
        signals=ckpt.Signals(preempt=(signal.SIGUSR1,), on_preempt="raise"),
    ) as ck:
        assert ck.maybe_save(1, {"w": w}) is None
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only sets the flag
        assert ck.preempted == signal.SIGUSR1 and ck.list() == []
        with pytest.raises(ckpt.Preempted, match="SIGUSR1: step 2 saved") as info:
            ck.maybe_save(2, {"w": w})
        assert info.value.durable and info.value.step == 2
        assert [i.step for i in ck.list()] == [2]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_bad_preemption_arguments_name_the_argument(local_dir):
    with pytest.raises(ValueError, match="drain_tier"):
        ckpt.Checkpointer(local_dir=local_dir, signals=(signal.SIGTERM,), drain_tier="remote")  # no url
    with pytest.raises(ValueError, match="drain_tier"):
        ckpt.Checkpointer(local_dir=local_dir, signals=(signal.SIGTERM,), drain_tier="tape")
    with pytest.raises(ValueError, match="on_preempt"):
        ckpt.Checkpointer(local_dir=local_dir, on_preempt="ignore")


def test_drain_to_the_remote_tier_waits_for_the_upload(tmp_path):
    w = torch.ones(1000)
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=tmp_path / "local"),
        policy=ckpt.Policy(every_steps=1000),
        signals=ckpt.Signals(preempt=(signal.SIGUSR1,), drain_tier="remote", on_preempt="raise"),
    ) as ck:
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(ckpt.Preempted) as info:
            ck.maybe_save(7, {"w": w})
        assert info.value.durable
        assert ck.remote.committed_steps() == [7]


# -- save requests: save durably at the next boundary and keep training ------------------------------------


def _run_to_end(proc: subprocess.Popen) -> tuple[list[str], str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out.splitlines(), err


def _digests(lines: list[str]) -> dict[int, str]:
    return {int(l.split()[1]): l.split()[2] for l in lines if l.startswith("step ")}


def test_sigusr1_saves_that_step_and_training_goes_on_to_the_last_step(tmp_path):
    ref = _spawn(tmp_path / "ref", "--save-on", "USR1")  # the uninterrupted run, beside the one signalled
    d = tmp_path / "run"
    proc = _spawn(d, "--save-on", "USR1")
    before = _wait_for_step(proc, 5)
    proc.send_signal(signal.SIGUSR1)
    lines, err = _run_to_end(proc)
    reference = _digests(_run_to_end(ref)[0])
    lines = before + lines
    saved = [l.split() for l in lines if l.startswith("saved ")]
    assert len(saved) == 1, lines
    step = int(saved[0][1])
    assert saved[0][2] == "done" and 5 < step < STEPS
    assert _committed(d) == [step]
    # training went on, undisturbed, to its last step
    assert _digests(lines) == reference
    assert lines[-1] == f"final {reference[STEPS]}"
    assert "SIGUSR1 received: saving step" in err and f"step {step} (requested by SIGUSR1) is durable" in err
    assert err.count(f"saved step {step}:") == 1  # the metrics line, once
    # the saved step restores bit-exactly: alone (the model at that step) and resumed to the end
    lines, _ = _run_to_end(_spawn(d, "--save-on", "USR1", steps=step))
    assert lines[0] == f"restored {step}" and lines[-1] == f"final {reference[step]}"
    lines, _ = _run_to_end(_spawn(d, "--save-on", "USR1"))
    assert lines[0] == f"restored {step}" and lines[-1] == f"final {reference[STEPS]}"


def test_two_gloo_ranks_both_save_the_same_step_when_one_gets_sigusr1_and_both_go_on(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [_spawn(tmp_path / f"rank{r}", str(r), "2", "--save-on", "USR1", env=env) for r in range(2)]
    before = [_wait_for_step(p, 5) for p in procs]
    procs[0].send_signal(signal.SIGUSR1)  # rank 1 never sees the signal
    runs = [b + _run_to_end(p)[0] for b, p in zip(before, procs)]
    saved = [[l.split()[1] for l in lines if l.startswith("saved ")] for lines in runs]
    assert len(saved[0]) == 1 and saved[0] == saved[1], saved
    for r, lines in enumerate(runs):
        assert max(_digests(lines)) == STEPS and lines[-1].startswith("final ")
        assert _committed(tmp_path / f"rank{r}") == [int(saved[0][0])]


def _signals_ck(local_dir, max_in_flight=None, if_busy="skip", **kw) -> ckpt.Checkpointer:
    kw.setdefault(
        "signals", ckpt.Signals(preempt=(signal.SIGUSR2,), save=(signal.SIGUSR1,), on_preempt="raise")
    )
    return ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir, max_in_flight=max_in_flight),
        policy=ckpt.Policy(every_steps=1000, if_busy=if_busy),
        **kw,
    )


def test_signals_before_the_boundary_make_one_save_and_the_flag_resets_after_it(local_dir):
    w = torch.zeros(4)
    with _signals_ck(local_dir) as ck:
        assert ck.maybe_save(1, {"w": w}) is None and ck.save_requested is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ck.save_requested == signal.SIGUSR1 and ck.list() == []
        handle = ck.maybe_save(2, {"w": w})
        assert handle.step == 2 and handle.done("local") and ck.save_requested is None
        assert ck.maybe_save(3, {"w": w}) is None  # the two signals made one save
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ck.maybe_save(4, {"w": w}).step == 4  # a later signal makes another
        assert ck.preempted is None
        ck.wait()
        assert [i.step for i in ck.list()] == [4, 2]


def test_preemption_wins_over_a_save_request(local_dir):
    w = torch.zeros(4)
    with _signals_ck(local_dir) as ck:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        with pytest.raises(ckpt.Preempted) as info:
            ck.maybe_save(7, {"w": w})
        assert info.value.signum == signal.SIGUSR2 and info.value.durable
        assert len(ck.history) == 1 and [i.step for i in ck.list()] == [7]


class _SignalsDuringWrite(LocalTier):
    """Sends this process SIGUSR1 while it writes (the loop is then waiting for the save)."""

    def write(self, step, manifest, data):
        os.kill(os.getpid(), signal.SIGUSR1)
        return super().write(step, manifest, data)


def test_a_signal_during_the_durable_wait_asks_for_another_save(local_dir):
    w = torch.zeros(4)
    with _signals_ck(_SignalsDuringWrite(local_dir)) as ck:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ck.maybe_save(1, {"w": w}).step == 1
        assert ck.save_requested == signal.SIGUSR1  # arrived after the save was taken
        assert ck.maybe_save(2, {"w": w}).step == 2


class _GatedLocal(LocalTier):
    def __init__(self, root, go: threading.Event, fail: bool = False):
        super().__init__(root)
        self.go, self.fail = go, fail
        self.started = threading.Event()  # a write is under way (it holds its host buffer)

    def write(self, step, manifest, data):
        self.started.set()
        assert self.go.wait(60)
        if self.fail:
            raise OSError(28, "No space left on device (injected)", str(self.root))
        return super().write(step, manifest, data)


def test_a_save_request_past_its_deadline_lets_training_go_on_and_still_commits(local_dir, caplog):
    go = threading.Event()
    w = torch.zeros(4)
    signals = ckpt.Signals(preempt=(), save=(signal.SIGUSR1,), save_deadline=0.2)
    with caplog.at_level(logging.INFO, logger="ckpt"):
        with _signals_ck(_GatedLocal(local_dir, go), signals=signals) as ck:
            os.kill(os.getpid(), signal.SIGUSR1)
            handle = ck.maybe_save(3, {"w": w})
            assert handle.step == 3 and not handle.done("local")  # the loop goes on; the save persists
            assert "is not durable on the local tier after" in caplog.text
            go.set()
            ck.wait()
            assert ck.local.committed_steps() == [3]


def test_a_failed_save_request_is_logged_not_raised_and_wait_raises_it(local_dir, caplog):
    go = threading.Event()
    go.set()
    w = torch.zeros(4)
    ck = _signals_ck(_GatedLocal(local_dir, go, fail=True))
    with ck:
        os.kill(os.getpid(), signal.SIGUSR1)
        handle = ck.maybe_save(3, {"w": w})  # does not raise: the request came from outside the program
        assert handle.status == "failed"
        assert "failed on the local tier" in caplog.text
        with pytest.raises(OSError) as info:
            ck.wait()
        assert info.value.errno == 28


def test_a_requested_save_is_never_skipped_by_if_busy_skip(local_dir):
    go = threading.Event()
    w = torch.zeros(4)
    with _signals_ck(_GatedLocal(local_dir, go), if_busy="skip", max_in_flight=1) as ck:
        first = ck.save(1, {"w": w})  # holds the only host buffer until `go`
        assert ck.local.started.wait(60)
        assert ck.save(2, {"w": w}).status == "skipped"
        os.kill(os.getpid(), signal.SIGUSR1)
        threading.Timer(0.3, go.set).start()
        handle = ck.maybe_save(3, {"w": w})  # waits for the buffer, then for the local tier
        assert handle.status == "done" and first.status == "done"
        assert ck.local.committed_steps() == [3, 1]


def test_a_preemption_save_is_never_skipped_by_if_busy_skip(local_dir):
    go = threading.Event()
    w = torch.zeros(4)
    with _signals_ck(_GatedLocal(local_dir, go), if_busy="skip", max_in_flight=1) as ck:
        ck.save(1, {"w": w})
        os.kill(os.getpid(), signal.SIGUSR2)
        threading.Timer(0.3, go.set).start()
        with pytest.raises(ckpt.Preempted) as info:
            ck.maybe_save(3, {"w": w})
        assert info.value.durable and 3 in ck.local.committed_steps()


def test_a_save_request_to_the_remote_tier_returns_once_uploaded(tmp_path):
    signals = ckpt.Signals(preempt=(), save=(signal.SIGUSR1,), save_tier="remote")
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=f"file://{tmp_path}/remote", local_dir=tmp_path / "local"),
        policy=ckpt.Policy(every_steps=1000),
        signals=signals,
    ) as ck:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ck.maybe_save(9, {"w": torch.ones(100)}).done("remote")
        assert ck.remote.committed_steps() == [9]


def test_handlers_of_both_kinds_are_restored_after_the_block(local_dir):
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    with _signals_ck(local_dir):
        assert all(signal.getsignal(s) is not before[s] for s in (signal.SIGUSR1, signal.SIGUSR2))
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]  # not listed: untouched
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_keyword_form_and_the_config_object_are_the_same_configuration(local_dir):
    old = ckpt.Checkpointer(
        local_dir=local_dir, signals=(signal.SIGTERM,), drain_deadline=5, on_preempt="raise"
    )
    assert old.signals == ckpt.Signals(preempt=(signal.SIGTERM,), deadline=5, on_preempt="raise")
    assert (old.drain_deadline, old.drain_tier, old.on_preempt) == (5, "local", "raise")
    assert ckpt.Checkpointer(local_dir=local_dir).signals.handled == ()
    assert ckpt.Signals().preempt == (signal.SIGTERM,) and ckpt.Signals(deadline=7).save_deadline == 7


@pytest.mark.parametrize(
    "bad, argument",
    [
        (dict(preempt=(signal.SIGUSR1,), save=(signal.SIGUSR1,)), "Signals(save=...)"),
        (dict(save=(signal.SIGKILL,)), "Signals(save=...)"),
        (dict(save=(99999,)), "Signals(save=...)"),
        (dict(save=signal.SIGUSR1), "Signals(save=...)"),
        (dict(save_tier="tape"), "save_tier"),
        (dict(drain_tier="tape"), "drain_tier"),
        (dict(deadline=0), "deadline"),
        (dict(save_deadline=-1), "save_deadline"),
        (dict(on_preempt="ignore"), "on_preempt"),
    ],
)
def test_a_bad_signals_config_names_the_argument(bad, argument):
    with pytest.raises((ValueError, TypeError)) as info:
        ckpt.Signals(**bad)
    assert argument in str(info.value)


def test_tiers_the_checkpointer_lacks_and_mixed_forms_are_refused(local_dir):
    with pytest.raises(ValueError, match="save_tier"):
        ckpt.Checkpointer(
            local_dir=local_dir, signals=ckpt.Signals(save=(signal.SIGUSR1,), save_tier="remote")
        )
    with pytest.raises(ValueError, match="save_tier"):
        ckpt.Checkpointer(local_dir=local_dir, signals=ckpt.Signals(save_tier="peer"))
    with pytest.raises(ValueError, match="drain_tier"):
        ckpt.Checkpointer(local_dir=local_dir, signals=ckpt.Signals(), drain_tier="remote")


def test_the_engine_imports_nothing_from_integrations():
    root = Path(ckpt.__file__).parent
    offenders = []
    # the command line is a front end over the engine and the integrations (ckpt gc --dcp), not the engine
    for path in [p for p in root.glob("*.py") if p.name != "cli.py"] + [*root.glob("tiers/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                names = [a.name for a in node.names]
                if "integrations" in module.split(".") or (
                    module.strip(".") in ("", "ckpt") and "integrations" in names
                ):
                    offenders.append(f"{path.name}: from {module} import {names}")
            elif isinstance(node, ast.Import):
                offenders += [
                    f"{path.name}: import {a.name}" for a in node.names if "integrations" in a.name.split(".")
                ]
    assert offenders == []


def test_the_old_import_path_still_gives_the_guard():
    from ckpt.integrations.signals import PreemptionGuard

    assert PreemptionGuard is ckpt.preempt.PreemptionGuard


def test_a_save_signal_sent_to_every_process_saves_and_the_data_loader_workers_live_on(tmp_path):
    """SLURM's ``--signal`` and ``scancel --signal`` reach every process of the step, the data-loader
    workers too. With SIGUSR1 as the save signal the workers (forked inside the ``with`` block: they
    inherit the flag-only handler) live on, the save is taken and training goes on to its last step.
    (SIGTERM sent the same way kills PyTorch's workers, whose own handler ends a worker on a SIGTERM
    that its parent did not send; operations.md says what to do about it.)"""
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen(
        [sys.executable, str(HERE / "dataloader_signal_worker.py"), str(tmp_path / "local")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        os.killpg(p.pid, signal.SIGUSR1)  # every process of the group, as SLURM signals a step
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, err[-2000:]
    done = ast.literal_eval(out.strip().splitlines()[-1].removeprefix("done "))
    assert len(done) == 1 and 5 <= done[0] < 40, out


def test_a_preemption_sent_to_every_process_is_saved_when_the_workers_leave_it_to_their_parent(tmp_path):
    """SIGTERM to every process of the group (SLURM's preemption): with ``worker_init_fn=ckpt.WorkerSignals()``
    the data-loader workers live through it, so the training process reaches its next step boundary, saves
    that step durably and exits with 128 + SIGTERM; the user's own ``worker_init_fn`` still runs."""
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    local = tmp_path / "local"
    p = subprocess.Popen(
        [sys.executable, str(HERE / "dataloader_signal_worker.py"), str(local), "preempt"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        lines = []
        while True:
            line = p.stdout.readline()
            assert line, p.stderr.read()[-2000:]
            lines.append(line.strip())
            if line.strip() == "ready":
                break
        os.killpg(p.pid, signal.SIGTERM)  # every process of the group, the workers too
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert sorted(lines[:-1]) == ["worker 0", "worker 1"]  # the user's init function ran in each worker
    assert "done" not in out  # it exited at the preemption, not at its last step
    steps = [c.step for c in ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local)).list()]
    assert len(steps) == 1 and 5 <= steps[0] < 40, (steps, err[-2000:])


def test_worker_signals_checks_its_arguments_and_travels_to_spawned_workers():
    import pickle

    with pytest.raises(TypeError):
        ckpt.WorkerSignals(fn=3)
    with pytest.raises(ValueError):
        ckpt.WorkerSignals(signals=(signal.SIGKILL,))
    w = pickle.loads(pickle.dumps(ckpt.WorkerSignals(signals=(signal.SIGTERM,))))  # how spawn sends it
    assert w.signals == (signal.SIGTERM,) and w.fn is None


def test_a_guard_that_could_not_install_is_not_left_for_the_workers(local_dir):
    """Installing from another thread fails: that guard's signals are not what a worker leaves to its parent."""
    from ckpt import preempt

    guard = preempt.PreemptionGuard((signal.SIGUSR2,))
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, guard.install)))
    t.start()
    t.join()
    assert errors and guard not in preempt._installed and not guard.active

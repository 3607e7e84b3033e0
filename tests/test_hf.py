"""Hugging Face Trainer integration: real ``transformers.Trainer`` runs of a tiny Llama killed (SIGKILL),
stopped (SIGTERM) or crashed, then resumed, must give the weights and the log history (losses, gradient
norms, learning rates, evaluation losses) of an uninterrupted run bit for bit; and the runnable examples of
docs/hf.md."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="4.57")  # the version ckpt.integrations.hf needs
pytest.importorskip("accelerate", minversion="1.1")  # transformers' Trainer needs it

import torch  # noqa: E402

import ckpt  # noqa: E402
from helpers import run_worker_in_process  # noqa: E402

# Trainer.train() collects garbage three times: outside what this suite imported before (conftest.py)
pytestmark = pytest.mark.usefixtures("frozen_heap")

HERE = Path(__file__).parent
WORKER = HERE / "hf_worker.py"
DOC = HERE.parent / "docs" / "hf.md"
TOTAL_STEPS = 24  # hf_worker: 2 epochs of 12 optimizer steps


def _worker(ckpt_dir: Path, out: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(ckpt_dir), str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )


def _committed(local_dir: Path) -> list[int]:
    """Steps with a COMMIT in ``local_dir``, newest first (read from the directory, as another process sees it)."""
    steps = []
    for d in local_dir.glob("step-*"):
        if (d / "COMMIT").exists():
            steps.append(int(d.name.split("-")[1]))
    return sorted(steps, reverse=True)


def _kill_after_commit(proc: subprocess.Popen, local_dir: Path, min_step: int) -> tuple[int, str]:
    """SIGKILL ``proc`` as soon as a checkpoint of a step >= ``min_step`` is committed in ``local_dir``."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(s >= min_step for s in _committed(local_dir)):
            proc.kill()
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=60)
    steps = [int(s) for s in re.findall(r"^step (\d+)$", out, re.M)]
    return (max(steps) if steps else -1), out


def _signal_after(proc: subprocess.Popen, step: int, sig: int) -> tuple[int, str]:
    """Send ``sig`` once the worker reported ``step``; returns (last step it reported, its output)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line == f"step {step}\n":
            proc.send_signal(sig)
            break
    lines.append(proc.stdout.read())
    proc.wait(timeout=60)
    out = "".join(lines)
    steps = [int(s) for s in re.findall(r"^step (\d+)$", out, re.M)]
    return (max(steps) if steps else -1), out


def _in_process(*args: str) -> str:
    """Run hf_worker.main in this process (transformers is imported already: seconds saved per run)."""
    return run_worker_in_process("hf_worker", *args)


def _crash_in_process(*args: str) -> str:
    from hf_worker import Crash

    return run_worker_in_process("hf_worker", *args, raises=Crash)


def _result(out: Path) -> tuple[bytes, dict]:
    return Path(f"{out}.bin").read_bytes(), json.loads(Path(f"{out}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, frozen_heap):
    """The uninterrupted run, then two real Trainer processes at once, each interrupted, then resumed.

    ``ref``: the uninterrupted run, in this process (transformers is imported already: seconds saved).
    ``kill``: snapshots at the Trainer's own save steps (``save_steps=4``), SIGKILLed as soon as a
    checkpoint of step 8 or later is committed. ``term``: a policy that never saves (``every_steps=1000``),
    SIGTERMed after step 7, so its one checkpoint is the one the signal forces. Each is resumed in this
    process, from what the killed or stopped process left (its snapshots in RAM and on disk).
    """
    d = tmp_path_factory.mktemp("hf_runs")
    _in_process(d / "ref", d / "ref", "--no-restore")
    r = {"dir": d}
    kill = _worker(d / "kill", d / "kill", "--save-steps", "4", "--sleep", "0.1")
    term = _worker(d / "term", d / "term", "--every", "1000", "--sleep", "0.1")
    with ThreadPoolExecutor(2) as ex:
        kill_f = ex.submit(_kill_after_commit, kill, d / "kill", 8)
        term_f = ex.submit(_signal_after, term, 7, signal.SIGTERM)
        r["kill_last_and_out"], r["term_last_and_out"] = kill_f.result(), term_f.result()
    r["kill_rc"], r["term_rc"] = kill.returncode, term.returncode
    r["kill_steps"], r["term_steps"] = _committed(d / "kill"), _committed(d / "term")
    for name, extra in (("kill", ("--save-steps", "4")), ("term", ("--every", "1000"))):
        r[f"{name}_resume_out"] = _in_process(d / name, d / name, *extra)
    return r


def test_sigkill_mid_run_then_resume_matches_the_uninterrupted_run(runs):
    last, out = runs["kill_last_and_out"]
    assert runs["kill_rc"] == -signal.SIGKILL, out
    assert "finished" not in out
    steps = runs["kill_steps"]
    # the Trainer's save steps (save_steps=4) were snapshotted through the tiers, up to the kill
    assert steps and steps[0] >= 8 and all(s % 4 == 0 for s in steps) and steps[0] < TOTAL_STEPS, steps
    # ... instead of the Trainer's own checkpoint-N directories (keep_trainer_checkpoints=False)
    assert not list((runs["dir"] / "kill-hf-out").glob("checkpoint-*"))
    ref_w, ref = _result(runs["dir"] / "ref")
    w, got = _result(runs["dir"] / "kill")
    assert got["restored"] == steps[0], runs["kill_resume_out"]
    assert got["global_step"] == ref["global_step"] == TOTAL_STEPS
    # bit for bit: the final weights, and the whole log history (restored with the TrainerState up to the
    # checkpoint, then logged by the resumed run): losses, gradient norms, learning rates, evaluation losses
    assert len(w) == len(ref_w) > 0 and w == ref_w
    assert got["log"] == ref["log"]
    assert len([e for e in ref["log"] if "loss" in e]) == TOTAL_STEPS


def test_sigterm_saves_the_last_step_durably_exits_143_and_resumes_exactly(runs):
    last, out = runs["term_last_and_out"]
    assert runs["term_rc"] == 128 + signal.SIGTERM, out
    assert "finished" not in out
    # every_steps=1000 never triggers: the one checkpoint is the SIGTERM's, of the last completed step
    assert runs["term_steps"] == [last] and 7 <= last < TOTAL_STEPS, (runs["term_steps"], out)
    assert re.search(rf"step {last} is durable on the local tier", out), out
    ref_w, ref = _result(runs["dir"] / "ref")
    w, got = _result(runs["dir"] / "term")
    assert got["restored"] == last
    assert w == ref_w
    assert got["log"] == ref["log"]


def test_crash_after_an_epoch_boundary_checkpoint_resumes_exactly(runs, tmp_path):
    # every_steps=6 saves steps 6 and 12; step 12 ends epoch 1, so the resumed run starts epoch 2 afresh
    # (the generators loaded before its data loader draws its order and worker seeds)
    _crash_in_process(tmp_path / "c", tmp_path / "c", "--every", "6", "--crash-at", "14")
    assert _committed(tmp_path / "c") == [12, 6]
    _in_process(tmp_path / "c", tmp_path / "c", "--every", "6")
    ref_w, ref = _result(runs["dir"] / "ref")
    w, got = _result(tmp_path / "c")
    assert got["restored"] == 12
    assert w == ref_w and got["log"] == ref["log"]


def test_a_corrupt_newest_checkpoint_resumes_from_the_previous_one_exactly(runs, tmp_path):
    _crash_in_process(tmp_path / "c", tmp_path / "c", "--every", "5", "--crash-at", "11")
    assert _committed(tmp_path / "c") == [10, 5]
    from ckpt import shm  # the crash left the snapshots in RAM: this node lost them, only the disk is left

    shm.free(prefix=shm.prefix_for(tmp_path / "c", 0, create=True))
    data = tmp_path / "c" / "step-000000010" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="step 10"):
        _in_process(tmp_path / "c", tmp_path / "c", "--every", "5")
    ref_w, ref = _result(runs["dir"] / "ref")
    w, got = _result(tmp_path / "c")
    # the weights, the optimizer, the TrainerState and the generators all came from step 5; step 5 also
    # evaluated (drawing from the global generator), so this also checks that the snapshot of a step is taken
    # after its evaluation, where the Trainer's resume loads the generators (one taken at the step's end fails)
    assert got["restored"] == 5
    assert w == ref_w and got["log"] == ref["log"]


def test_gradient_accumulation_resumes_exactly(tmp_path):
    _in_process(tmp_path / "ref", tmp_path / "ref", "--no-restore", "--accum", "2", "--max-steps", "10")
    _crash_in_process(
        tmp_path / "c", tmp_path / "c", "--every", "4", "--accum", "2", "--max-steps", "10", "--crash-at", "6"
    )
    _in_process(tmp_path / "c", tmp_path / "c", "--every", "4", "--accum", "2", "--max-steps", "10")
    ref_w, ref = _result(tmp_path / "ref")
    w, got = _result(tmp_path / "c")
    assert got["restored"] == 4
    assert w == ref_w and got["log"] == ref["log"]


def test_bf16_autocast_resumes_exactly(tmp_path):
    _in_process(tmp_path / "ref", tmp_path / "ref", "--no-restore", "--bf16", "--max-steps", "8")
    _crash_in_process(
        tmp_path / "c", tmp_path / "c", "--every", "3", "--bf16", "--max-steps", "8", "--crash-at", "4"
    )
    _in_process(tmp_path / "c", tmp_path / "c", "--every", "3", "--bf16", "--max-steps", "8")
    ref_w, ref = _result(tmp_path / "ref")
    w, got = _result(tmp_path / "c")
    assert got["restored"] == 3
    assert w == ref_w and got["log"] == ref["log"]


def _kernels_run(*runs: list[str]) -> subprocess.CompletedProcess:
    """hf_worker runs (one argument list each) with ckpt.kernels.patch, one after the other in a fresh process:
    without CUDA, Triton's interpreter must be chosen before triton is first imported."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import hf_worker\n"
        "for argv in json.loads(sys.argv[2]):\n"
        "    try:\n"
        "        hf_worker.main(argv)\n"
        "    except hf_worker.Crash:\n"
        "        pass\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(HERE), json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.slow  # ~40-75 s in Triton's interpreter; bf16 resume: test_bf16_autocast_resumes_exactly
def test_bf16_with_kernels_patch_resumes_exactly(tmp_path):
    pytest.importorskip("triton")
    ref, c = tmp_path / "ref", tmp_path / "c"
    # one sequence per step: without a GPU the kernels run in Triton's interpreter, whose time grows with
    # the tokens; what is tested (the patched model's state saved and resumed bit for bit) does not
    common = ["--bf16", "--kernels", "--max-steps", "3", "--batch", "1"]
    # one process: the uninterrupted run, a run crashing after step 3 (saved every 2 steps), its resume
    out = _kernels_run(
        [str(ref), str(ref), *common, "--no-restore"],
        [str(c), str(c), *common, "--every", "2", "--crash-at", "3"],
        [str(c), str(c), *common, "--every", "2"],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ref_w, ref_r = _result(ref)
    w, got = _result(c)
    assert got["restored"] == 2
    assert w == ref_w and got["log"] == ref_r["log"]


# ---------------------------------------------------------------------------------------------
# Attaching, the Trainer's own checkpoints, refusals (in process, a few steps each)


def _trainer(out_dir: Path, callbacks: list | None = None, **overrides):
    sys.path.insert(0, str(HERE))
    try:
        from hf_worker import Tokens, tiny_llama
    finally:
        sys.path.remove(str(HERE))
    from transformers import Trainer, TrainingArguments

    args = dict(
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        save_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    args.update(overrides)
    evaluates = args.get("eval_strategy", "no") != "no"
    return Trainer(
        tiny_llama(),
        TrainingArguments(str(out_dir), **args),
        train_dataset=Tokens(16, 1),
        eval_dataset=Tokens(4, 2) if evaluates else None,
        callbacks=callbacks,
    )


def test_a_callback_that_was_not_attached_stops_train_with_a_clear_error(tmp_path):
    from ckpt.integrations.hf import CheckpointCallback

    cb = CheckpointCallback(local_dir=tmp_path / "ck", every_steps=2)
    trainer = _trainer(tmp_path / "out", callbacks=[cb])
    with pytest.raises(RuntimeError, match=r"attach\(trainer\)"):
        trainer.train()
    assert _committed(tmp_path / "ck") == []


def test_keep_trainer_checkpoints_writes_both_and_an_explicit_resume_uses_the_trainers(tmp_path):
    from ckpt.integrations.hf import CheckpointCallback

    cb = CheckpointCallback(local_dir=tmp_path / "ck", keep_trainer_checkpoints=True)
    trainer = _trainer(tmp_path / "out", save_strategy="steps", save_steps=2)
    assert cb.attach(trainer) is cb and cb in trainer.callback_handler.callbacks
    trainer.train()
    assert cb.restored_step is None
    assert _committed(tmp_path / "ck") == [4, 2]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    # train(resume_from_checkpoint=...) resumes from the Trainer's own directory, not from the tiers
    again = _trainer(tmp_path / "out", save_strategy="steps", save_steps=2, max_steps=6)
    cb2 = CheckpointCallback(local_dir=tmp_path / "ck", keep_trainer_checkpoints=True).attach(again)
    again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert cb2.restored_step is None and again.state.global_step == 6


def test_a_later_train_call_resumes_from_the_tiers_and_leaves_no_resume_directory(tmp_path, monkeypatch):
    import tempfile

    from ckpt.integrations.hf import CheckpointCallback

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cb = CheckpointCallback(local_dir=tmp_path / "ck", every_steps=2)
    trainer = _trainer(tmp_path / "out", max_steps=4)
    cb.attach(trainer)
    trainer.train()
    # step 4 surely (the newest reaches every tier at the end); step 2 too unless step 4 replaced it in the
    # local tier's queue before its write began (newest wins under if_busy="skip": a loaded machine)
    first = _committed(tmp_path / "ck")
    assert cb.restored_step is None and first[0] == 4 and set(first) <= {4, 2}
    # a longer run: train() again restores step 4 (a new engine: the first was closed when train() returned)
    trainer.args.max_steps = 6
    trainer.train()
    assert cb.restored_step == 4 and trainer.state.global_step == 6
    assert _committed(tmp_path / "ck") == [6, 4]
    assert list((tmp_path / "tmp").iterdir()) == []  # the Trainer's resume directory is gone


def test_refusals_name_the_argument_to_change(tmp_path):
    from ckpt.integrations.hf import CheckpointCallback

    with pytest.raises(ValueError, match="keep_trainer_checkpoints=True"):
        CheckpointCallback(local_dir=tmp_path / "ck").attach(
            _trainer(
                tmp_path / "out",
                load_best_model_at_end=True,
                eval_strategy="steps",
                save_strategy="steps",
                eval_steps=2,
                save_steps=2,
            )
        )
    with pytest.raises(TypeError, match="not both"):
        CheckpointCallback(ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "ck")), every_steps=2)
    with pytest.raises(ValueError, match="every_steps"):
        CheckpointCallback(local_dir=tmp_path / "ck", every_steps=0)
    trainer = _trainer(tmp_path / "out")
    cb = CheckpointCallback(local_dir=tmp_path / "ck").attach(trainer)
    assert cb.attach(trainer) is cb  # attaching again to the same Trainer changes nothing
    with pytest.raises(ValueError, match="another Trainer"):
        cb.attach(_trainer(tmp_path / "out2"))
    with pytest.raises(ValueError, match="has a CheckpointCallback attached already"):
        CheckpointCallback(local_dir=tmp_path / "ck2").attach(trainer)


# ---------------------------------------------------------------------------------------------
# docs/hf.md


def _doc_examples() -> dict[str, str]:
    blocks = re.findall(r"```python\n(# runnable-example: (\w+)\n.*?)```", DOC.read_text(), re.S)
    return {name: code for code, name in blocks}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("trainer", "resumed from step 13; final weights and all 24 losses equal the uninterrupted run's"),
        ("accelerate", "accelerate: resumed from step 10; final weights equal the uninterrupted run's"),
    ],
)
def test_the_docs_examples_run(tmp_path, name, expected):
    assert set(_doc_examples()) == {"trainer", "accelerate"}
    script = tmp_path / f"example_{name}.py"  # not accelerate.py: it would shadow the package
    script.write_text(_doc_examples()[name])
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert expected in out.stdout
    if name == "trainer":
        # no checkpoint-N directory: the snapshots replace them
        assert not list((tmp_path / "runs").glob("*/out/checkpoint-*"))


def test_a_callback_checkpoint_exports_as_a_model_directory_without_a_separate_config(tmp_path, capsys):
    """The callback keeps ``trainer.model.config`` with every snapshot: ``ckpt export --format hf`` needs
    nothing else, and the directory loads with ``from_pretrained`` bit for bit."""
    pytest.importorskip("safetensors")
    from transformers import AutoModelForCausalLM

    from ckpt.cli import main
    from ckpt.integrations.hf import CheckpointCallback

    trainer = _trainer(tmp_path / "out", max_steps=2)
    CheckpointCallback(local_dir=tmp_path / "ck", every_steps=2).attach(trainer)
    trainer.train()
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = trainer.model.state_dict()
    assert loaded.config.to_dict()["hidden_size"] == trainer.model.config.hidden_size
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_a_checkpoint_without_the_config_still_resumes(tmp_path, monkeypatch):
    """Checkpoints the callback wrote before it kept the config resume as they did."""
    from ckpt.integrations import hf

    real = hf.CheckpointCallback._state
    monkeypatch.setattr(
        hf.CheckpointCallback,
        "_state",
        lambda self, trainer: {k: v for k, v in real(self, trainer).items() if k != "hf_config"},
    )
    trainer = _trainer(tmp_path / "out", max_steps=2)
    hf.CheckpointCallback(local_dir=tmp_path / "ck", every_steps=2).attach(trainer)
    trainer.train()
    monkeypatch.undo()
    again = _trainer(tmp_path / "out", max_steps=4)
    cb = hf.CheckpointCallback(local_dir=tmp_path / "ck", every_steps=2).attach(again)
    again.train()
    assert cb.restored_step == 2 and again.state.global_step == 4

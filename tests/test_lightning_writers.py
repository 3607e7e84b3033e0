"""CheckpointCallback next to code that writes the saved tensors in place outside ``optimizer.step()``.

A save's tensors are copied to host memory in the background; only the next ``optimizer.step()`` waits for
that copy. Lightning's averaging callbacks (``WeightAveraging`` / EMA, ``StochasticWeightAveraging``), a
LightningModule's own ``on_train_batch_end`` and BatchNorm forwards outside the step write tensors the
snapshot holds. Each test runs a real ``Trainer`` (CPU, a few seconds) saving every step, with the snapshot
copy slowed down (``slow_copy``: the background copy starts 0.1 s late, as a large state on a busy host
would) so that a write landing during the copy is seen every time, and checks that no save is dropped
(``TornSnapshotError``; the Checkpointer raises the first failure at the end of ``fit``) and that a run
stopped and resumed by a new Trainer continues bit for bit like an uninterrupted one: the weights, the
averaged weights and the optimizer state. Each test but the BatchNorm one failed before the fixes in
``CheckpointCallback`` (torn saves dropped, or a resume that diverged).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("lightning", minversion="2.5")

import torch  # noqa: E402
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import StochasticWeightAveraging  # noqa: E402

import ckpt  # noqa: E402
from ckpt import stage as _stage  # noqa: E402
from ckpt.integrations.lightning import CheckpointCallback  # noqa: E402

try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # lightning < 2.6
    WeightAveraging = None

HERE = Path(__file__).parent
EPOCHS, BATCHES = 3, 8  # lightning_worker's loader: 8 batches an epoch
STOP = 5  # the interrupted run stops mid-epoch 1 (after 5 of its 8 steps)


@pytest.fixture(autouse=True)
def slow_copy(monkeypatch):
    """Start every background snapshot copy 0.1 s late (the engine's CPU staging thread lowers its priority
    first thing): a write made right after a save lands during its copy, deterministically."""
    lower = _stage.priority.lower_this_thread

    def late() -> None:
        lower()
        time.sleep(0.1)

    monkeypatch.setattr(_stage.priority, "lower_this_thread", late)


@pytest.fixture(autouse=True)
def worker_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def _model(kind: str = "tiny") -> L.LightningModule:
    from lightning_worker import Tiny

    class Plain(Tiny):
        """lightning_worker's Tiny with SGD+momentum and no LR scheduler (SWA brings its own)."""

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Clamped(Tiny):
        """Edits its weights after every batch, outside the optimizer step (a max-norm constraint)."""

        def on_train_batch_end(self, outputs, batch, batch_idx):
            with torch.no_grad():
                self.net[0].weight.clamp_(-0.3, 0.3)

    class BatchNormManual(Tiny):
        """Manual optimization with BatchNorm: the forward (running statistics) runs before opt.step()."""

        def __init__(self) -> None:
            super().__init__(0.0)
            self.automatic_optimization = False
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

        def validation_step(self, batch, batch_idx):
            self.train()  # BatchNorm in train mode during validation: its running statistics move
            super().validation_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    return {"tiny": lambda: Tiny(0.0), "plain": Plain, "clamped": Clamped, "bn_manual": BatchNormManual}[
        kind
    ]()


def _averaging(kind: str):
    if kind == "ema":
        if WeightAveraging is None:
            pytest.skip("lightning.pytorch.callbacks.WeightAveraging needs lightning 2.6")
        return WeightAveraging(multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    if kind == "swa":
        return StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)
    return None


def _fit(
    local_dir: Path,
    *,
    model: str = "tiny",
    averaging: str | None = None,
    first: str = "ckpt",
    max_steps: int = -1,
    restore: bool = True,
):
    """One fit with CheckpointCallback saving every step (every save kept and waited for: none is skipped
    because the previous one is still being written). Returns (model, averaging callback, trainer, cb)."""
    L.seed_everything(0, verbose=False)
    module = _model(model)
    cb = CheckpointCallback(
        local_dir=local_dir, every_steps=1, keep=ckpt.Retention(local=None), if_busy="wait", restore=restore
    )
    avg = _averaging(averaging) if averaging else None
    callbacks = [cb] if avg is None else ([cb, avg] if first == "ckpt" else [avg, cb])
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        max_steps=max_steps,
        limit_train_batches=BATCHES,
        limit_val_batches=2,
        val_check_interval=4,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    trainer.fit(module)  # raises a save's failure (a torn snapshot dropped) when the Checkpointer closes
    return module, avg, trainer, cb


def _averaged(avg) -> dict[str, torch.Tensor]:
    if avg is None:
        return {}
    return {k: v.detach().clone() for k, v in avg._average_model.state_dict().items()}


def _optimizer_tensors(trainer) -> list[torch.Tensor]:
    out = []
    for opt in trainer.optimizers:
        for st in opt.state_dict()["state"].values():
            out += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _committed(local_dir: Path) -> list[int]:
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        return sorted(c.step for c in ck.list())


def _stop_resume_and_compare(tmp_path: Path, stop: int = STOP, **kw) -> None:
    # The uninterrupted run: every save of every step committed, none torn.
    ref, ref_avg, ref_trainer, _ = _fit(tmp_path / "ref", **kw)
    total = EPOCHS * BATCHES
    assert ref_trainer.global_step == total
    assert _committed(tmp_path / "ref") == list(range(1, total + 1))
    # Stopped at step `stop`, then a new Trainer and callback resume it from the newest checkpoint.
    _fit(tmp_path / "run", max_steps=stop, **kw)
    assert _committed(tmp_path / "run") == list(range(1, stop + 1))
    resumed, avg, trainer, cb = _fit(tmp_path / "run", **kw)
    assert cb.restored_step == stop and trainer.global_step == total
    assert _same(resumed.state_dict(), ref.state_dict())
    assert _same(_averaged(avg), _averaged(ref_avg))
    assert _same(_optimizer_tensors(trainer), _optimizer_tensors(ref_trainer))
    assert _committed(tmp_path / "run") == list(range(1, total + 1))


# EMA with the checkpoint callback first in the default suite; SWA and the other order with -m slow
@pytest.mark.parametrize(
    "averaging,first",
    [
        ("ema", "ckpt"),
        pytest.param("swa", "ckpt", marks=pytest.mark.slow),
        pytest.param("ema", "averaging", marks=pytest.mark.slow),
        pytest.param("swa", "averaging", marks=pytest.mark.slow),
    ],
)
def test_averaging_callbacks_save_every_step_and_resume_bit_identically(tmp_path, averaging, first):
    """EMA updates its average at every batch end, swaps it with the weights around validation and copies
    it into the model at the end of training; SWA averages at an epoch's start and copies at the end."""
    # SWA is resumed at an epoch's end: on a mid-epoch restart Lightning does not run on_train_epoch_start,
    # where SWA makes its LR scheduler, so the rest of that epoch has none (with Lightning's own resume too).
    _stop_resume_and_compare(
        tmp_path,
        model="tiny" if averaging == "ema" else "plain",
        averaging=averaging,
        first=first,
        stop=STOP if averaging == "ema" else 2 * BATCHES,
    )


def test_module_editing_its_weights_at_batch_end(tmp_path):
    """A LightningModule.on_train_batch_end that writes its weights in place after every step."""
    _stop_resume_and_compare(tmp_path, model="clamped")


def test_batchnorm_under_manual_optimization_and_train_mode_validation(tmp_path):
    """The forward (BatchNorm running statistics) before opt.step(), and in a validation in train mode.
    This held before the averaging fixes (module buffers are copied before save() returns); a guard. The
    stop is a step not followed by validation: Lightning skips the validation that follows a batch-end
    checkpoint on resume, so its train-mode statistics would not be replayed."""
    _stop_resume_and_compare(tmp_path, model="bn_manual")


@pytest.mark.parametrize("first", ["ckpt", "averaging"])
def test_final_save_holds_the_weights_before_the_averaging_callback_copies_its_average_in(tmp_path, first):
    """save_on_train_end with a policy that never saves: the one checkpoint is the final one. WeightAveraging
    copies its average into the model at on_train_end; a later fit with more epochs must continue from the
    trained weights (and the average), as the uninterrupted longer run does."""
    import lightning_worker

    def fit(local_dir: Path, epochs: int):
        L.seed_everything(0, verbose=False)
        module = _model("tiny")
        cb = CheckpointCallback(local_dir=local_dir, every_steps=1000)
        avg = _averaging("ema")
        trainer = L.Trainer(
            max_epochs=epochs,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            accelerator="cpu",
            devices=1,
            deterministic=True,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[cb, avg] if first == "ckpt" else [avg, cb],
        )
        trainer.fit(module)
        return module, avg, trainer, cb

    ref, ref_avg, ref_trainer, _ = fit(tmp_path / "ref", EPOCHS)
    fit(tmp_path / "run", EPOCHS - 1)
    assert _committed(tmp_path / "run") == [(EPOCHS - 1) * lightning_worker.BATCHES]
    resumed, avg, trainer, cb = fit(tmp_path / "run", EPOCHS)
    assert cb.restored_step == (EPOCHS - 1) * lightning_worker.BATCHES
    assert _same(resumed.state_dict(), ref.state_dict())
    assert _same(_averaged(avg), _averaged(ref_avg))
    assert _same(_optimizer_tensors(trainer), _optimizer_tensors(ref_trainer))

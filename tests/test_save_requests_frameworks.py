"""Save requests (ckpt.Signals(save=...)) through the framework integrations: a real Lightning Trainer and a
real Hugging Face Trainer save the step after the signal, train on to the end, and the saved step resumes
to the same final weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import ckpt

HERE = Path(__file__).parent


@pytest.fixture
def worker_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def test_lightning_callback_saves_on_request_and_training_goes_on(tmp_path, worker_on_path):
    pytest.importorskip("lightning", minversion="2.5")
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning_worker import EPOCHS, BATCHES, Tiny, weights_bytes

    from ckpt.integrations.lightning import CheckpointCallback

    # listed after CheckpointCallback, and its batch-end save follows every batch-end hook: the request is
    # served at this very batch end
    class SignalAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGUSR2)

    def fit(extra: list) -> tuple[Tiny, CheckpointCallback]:
        L.seed_everything(0, verbose=False)
        model = Tiny()
        cb = CheckpointCallback(
            local_dir=tmp_path / "ck",
            every_steps=1000,
            save_on_train_end=False,
            signals=ckpt.Signals(save=(signal.SIGUSR2,)),
        )
        trainer = L.Trainer(
            max_epochs=EPOCHS,
            accelerator="cpu",
            devices=1,
            deterministic=True,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            callbacks=[cb, *extra],
        )
        trainer.fit(model)
        assert trainer.global_step == EPOCHS * BATCHES  # trained on to the end
        return model, cb

    before = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    signalled, cb = fit([SignalAt()])
    assert (signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)) == before
    assert cb.restored_step is None
    assert ckpt.tiers.LocalTier(tmp_path / "ck").committed_steps() == [5]
    resumed, cb = fit([])
    assert cb.restored_step == 5 and weights_bytes(resumed) == weights_bytes(signalled)


@pytest.mark.usefixtures("frozen_heap")  # Trainer.train() collects garbage three times (conftest.py)
def test_hf_trainer_callback_saves_on_request_and_training_goes_on(tmp_path, worker_on_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from hf_worker import BATCH, SAMPLES, Tokens, tiny_llama, weights_bytes

    from ckpt.integrations.hf import CheckpointCallback

    class SignalAt(TrainerCallback):  # the callback serves the request at the next step's start
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)

    def train(extra: list) -> tuple[torch.nn.Module, CheckpointCallback, int]:
        model = tiny_llama()
        args = TrainingArguments(
            str(tmp_path / "hf-out"),
            per_device_train_batch_size=BATCH,
            max_steps=8,
            learning_rate=1e-2,
            lr_scheduler_type="cosine",
            warmup_steps=2,
            seed=3,
            use_cpu=True,
            report_to=[],
            dataloader_num_workers=0,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(model, args, train_dataset=Tokens(SAMPLES, 1), callbacks=extra)
        cb = CheckpointCallback(
            local_dir=tmp_path / "ck",
            every_steps=1000,
            save_on_train_end=False,
            signals=ckpt.Signals(save=(signal.SIGUSR1,)),
        ).attach(trainer)
        trainer.train()
        return model, cb, trainer.state.global_step

    before = signal.getsignal(signal.SIGUSR1)
    signalled, cb, steps = train([SignalAt()])
    assert steps == 8 and cb.restored_step is None and signal.getsignal(signal.SIGUSR1) is before
    assert ckpt.tiers.LocalTier(tmp_path / "ck").committed_steps() == [4]
    resumed, cb, steps = train([])
    assert steps == 8 and cb.restored_step == 4 and weights_bytes(resumed) == weights_bytes(signalled)

"""A real Lightning ``Trainer`` run for tests/test_lightning.py, meant to be killed and resumed.

    python lightning_worker.py CKPT_DIR OUT_FILE [--every N] [--sleep S] [--sleep-at start|end] [--no-restore]

Trains a tiny deterministic model (dropout, AdamW, StepLR every step, a
shuffling resumable dataloader, 3 epochs of 8 batches, validation twice per
epoch) with ``CheckpointCallback``,
prints ``step N`` after each optimizer step (once the callback had its turn),
and writes the final weights as raw float32 bytes to OUT_FILE (no pickle).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import Callback

from ckpt.integrations.lightning import CheckpointCallback

EPOCHS, BATCHES, BATCH = 3, 8, 4


class ResumableSampler(Sampler[int]):
    """A shuffling sampler whose position survives a restart.

    The order of epoch ``e`` depends only on (seed, e); ``pos`` counts the
    indices handed out in the current epoch. Lightning calls ``set_epoch`` at
    every epoch start and puts the loader's ``state_dict`` in the fit loop's.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.pos = epoch, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()
        while self.pos < self.n:
            self.pos += 1
            yield order[self.pos - 1]


class ResumableLoader(DataLoader):
    """A DataLoader with ``state_dict``/``load_state_dict``: Lightning restores its position mid-epoch."""

    def __init__(self, dataset, batch_size: int, seed: int) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=ResumableSampler(len(dataset), seed))

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "pos": self.sampler.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.sampler.epoch, self.sampler.pos = sd["epoch"], sd["pos"]


class Tiny(L.LightningModule):
    def __init__(self, dropout: float = 0.2) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def val_dataloader(self):
        # A plain loader: creating its iterator draws from the global generator, as the training one does.
        x = torch.randn(2 * BATCH, 8, generator=torch.Generator().manual_seed(2))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=BATCH)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        # Stepped every optimizer step, so a resume must also put the scheduler exactly where it was.
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(BATCHES * BATCH, 8, generator=g)
        y = x.sum(1, keepdim=True).sin()
        return ResumableLoader(TensorDataset(x, y), BATCH, seed=7)


class Progress(Callback):
    """Reports steps; sleeps before the batch (so a signal lands before CheckpointCallback's batch end) or
    after it (so it lands after CheckpointCallback had its turn)."""

    def __init__(self, sleep: float, at: str) -> None:
        self.sleep, self.at = sleep, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at == "start":
            time.sleep(self.sleep)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"step {trainer.global_step}", flush=True)
        if self.at == "end":
            time.sleep(self.sleep)


def weights_bytes(module: torch.nn.Module) -> bytes:
    return b"".join(p.detach().contiguous().cpu().numpy().tobytes() for p in module.parameters())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt_dir")
    ap.add_argument("out")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--sleep-at", choices=["start", "end"], default="end")
    ap.add_argument("--no-restore", action="store_true")
    a = ap.parse_args(argv)
    L.seed_everything(0, verbose=False)
    model = Tiny()
    cb = CheckpointCallback(local_dir=a.ckpt_dir, every_steps=a.every, restore=not a.no_restore)
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        val_check_interval=0.5,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[cb, Progress(a.sleep, a.sleep_at)],
    )
    trainer.fit(model)
    print(f"restored {cb.restored_step}", flush=True)
    with open(a.out, "wb") as f:
        f.write(weights_bytes(model))
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

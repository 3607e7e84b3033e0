"""A real two-process Lightning ``Trainer`` (strategy "ddp" on the CPU, gloo) for tests/test_lightning.py.

    python lightning_ddp_worker.py CKPT_DIR MAX_STEPS

Lightning's launcher starts rank 1 by running this script again. Trains a tiny model with
``CheckpointCallback(local_dir=CKPT_DIR, url=file://CKPT_DIR/job, every_steps=2)`` (one url for
both ranks: the job tier) and writes, on each rank, the line
``restored S dir D`` (S: the step the callback resumed from, D: its checkpoint directory) to
``CKPT_DIR/result-<rank>.txt`` (the two processes share stdout).
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

from ckpt.integrations.lightning import CheckpointCallback


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    ckpt_dir, max_steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    cb = CheckpointCallback(local_dir=ckpt_dir, url=f"file://{ckpt_dir}/job", every_steps=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(Tiny(), train_dataloaders=DataLoader(data, batch_size=4))
    with open(f"{ckpt_dir}/result-{trainer.global_rank}.txt", "w") as f:
        f.write(f"restored {cb.restored_step} dir {cb.checkpointer.local.root}")


if __name__ == "__main__":
    main()

"""A real ``transformers.Trainer`` run for tests/test_hf.py, meant to be killed and resumed.

    python hf_worker.py CKPT_DIR OUT [--every N] [--save-steps N] [--sleep S] [--no-restore] [--max-steps N]
                        [--accum N] [--batch N] [--bf16] [--kernels] [--crash-at N]

Trains a tiny ``LlamaForCausalLM`` built from a config (attention dropout, so the
generators matter; AdamW, a cosine schedule stepped every step; a shuffled
dataset of random tokens, 2 epochs of 12 optimizer steps of 4 sequences, or
``--batch`` sequences; an evaluation every 5 steps, which draws from the global
generator) with ``CheckpointCallback`` attached. Prints ``step N`` after each
optimizer step, writes the final weights
as raw bytes to OUT.bin (no pickle) and, as JSON to OUT.json, the restored step
and the Trainer's log history (losses, gradient norms, learning rates, epochs,
evaluation losses). ``--crash-at N`` raises :class:`Crash` after step N (a crash
that the test running ``main`` in its own process catches).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

SEQ, SAMPLES, BATCH, EPOCHS = 16, 48, 4, 2
# the log entries that must match an uninterrupted run (the rest are timings)
LOG_KEYS = ("step", "epoch", "loss", "grad_norm", "learning_rate", "eval_loss")


class Crash(RuntimeError):
    """The injected failure of ``--crash-at``."""


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        attention_dropout=0.1,
    )
    return LlamaForCausalLM(cfg)


def weights_bytes(module: torch.nn.Module) -> bytes:
    return b"".join(p.detach().float().contiguous().cpu().numpy().tobytes() for p in module.parameters())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt_dir")
    ap.add_argument("out")
    ap.add_argument("--every", type=int, default=None, help="Checkpointer(every_steps=...)")
    ap.add_argument(
        "--save-steps", type=int, default=0, help="the Trainer's save_steps (0: save_strategy='no')"
    )
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--no-restore", action="store_true")
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per optimizer step")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--crash-at", type=int, default=-1)
    a = ap.parse_args(argv)

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckpt.integrations.hf import CheckpointCallback

    class Progress(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"step {state.global_step}", flush=True)
            if state.global_step == a.crash_at:
                raise Crash(f"injected crash after step {a.crash_at}")
            time.sleep(a.sleep)

    model = tiny_llama()
    if a.kernels:
        import ckpt.kernels

        ckpt.kernels.patch(model)
    args = TrainingArguments(
        os.path.join(a.ckpt_dir + "-hf-out"),
        per_device_train_batch_size=a.batch // a.accum,
        gradient_accumulation_steps=a.accum,
        num_train_epochs=EPOCHS,
        max_steps=a.max_steps,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        seed=3,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=5,
        per_device_eval_batch_size=4,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        bf16=a.bf16,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model, args, train_dataset=Tokens(SAMPLES, 1), eval_dataset=Tokens(8, 2), callbacks=[Progress()]
    )
    cb = CheckpointCallback(local_dir=a.ckpt_dir, every_steps=a.every, restore=not a.no_restore).attach(
        trainer
    )
    trainer.train()
    log = [
        {k: e[k] for k in LOG_KEYS if k in e} for e in trainer.state.log_history if "train_runtime" not in e
    ]
    with open(a.out + ".bin", "wb") as f:
        f.write(weights_bytes(model))
    with open(a.out + ".json", "w") as f:
        json.dump({"restored": cb.restored_step, "log": log, "global_step": trainer.state.global_step}, f)
    print(f"restored {cb.restored_step}", flush=True)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

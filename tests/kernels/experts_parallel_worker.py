"""Child side of test_kernels_moe's parallel tests: one gloo rank of transformers' own expert or tensor
parallelism on the CPU, its experts served by ckpt.kernels.patch; with ``CKPT_TEST_NCCL=1``, one NCCL rank
on its own GPU (``cuda:RANK``), the kernels compiled.

``python experts_parallel_worker.py MODEL_DIR RANK WORLD LAYOUT OUT``, MASTER_ADDR / MASTER_PORT from the
environment. ``LAYOUT`` names the ``DistributedConfig`` (below). The tiny model saved in ``MODEL_DIR`` is
loaded twice with it, as a user would (``from_pretrained(distributed_config=...)``: transformers builds
the meshes, shards the experts and installs its dispatch on their ``forward``), and one copy is patched.
Both run a training step with labels (``AllToAllEP`` under expert parallelism: gradients flow) and an
evaluation forward under ``no_grad`` (``AllReduceEP`` where the ranks share a batch). ``OUT`` gets, per
rank, ``rank-<r>.pt``: both losses and evaluation logits, every parameter's gradient from both (this
rank's shard of a sharded one), the calls that reached ``fused_experts`` and the fused RMSNorm in training,
and what patch() changed and left.

patch() runs in full: it leaves what transformers' tensor parallelism wraps (the QK-norms, whose weight
gradients a wrapper on their ``forward`` all-reduces; ``lm_head``, whose wrapper gathers the vocabulary
shards, and with it the fused loss) and fuses FSDP's norms in place (FSDP swaps their parameters on the
module objects).
"""

from __future__ import annotations

import os
import sys

NCCL = os.environ.get("CKPT_TEST_NCCL") == "1"
if not NCCL:
    # a CPU job: no GPU even where there is one (transformers picks the mesh's device from the accelerator),
    # and the kernels through Triton's interpreter, set before Triton is imported
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import ckpt.kernels  # noqa: E402,F401

kpatch = sys.modules["ckpt.kernels.patch"]

#: LAYOUT -> DistributedConfig arguments, over two ranks
LAYOUTS = {
    "ep+tp": dict(
        tp_size=2, ep_size=2
    ),  # the ranks share a batch: all-to-all in training, all-reduce at eval
    "ep+fsdp": dict(fsdp_size=2, ep_size=2),  # a batch per rank: all-to-all
    "tp": dict(tp_size=2),  # every expert split over both ranks (moe_tp_experts)
}


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.cpu() if t is not None else None


def main() -> None:
    model_dir, rank, world, layout, out_dir = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if NCCL:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if NCCL else torch.device("cpu")

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, distributed_config=DistributedConfig(**LAYOUTS[layout]), dtype=torch.float32
        ).train()

    ref, ours = load(), load()
    calls = []
    real = kpatch.fused_experts

    def counting(*args, **kwargs):  # the real kernels, counted
        calls.append(bool(kwargs.get("expert_parallel")))
        return real(*args, **kwargs)

    kpatch.fused_experts = counting
    norm_kernel = sys.modules["ckpt.kernels.rms_norm"]
    norm_calls = []
    real_norm = norm_kernel._forward

    def counting_norm(*args, **kwargs):  # the fused RMSNorm's forward pass, counted
        norm_calls.append(1)
        return real_norm(*args, **kwargs)

    norm_kernel._forward = counting_norm
    wrapped = [
        name for name, m in ours.named_modules() if name.endswith("mlp.experts") and "forward" in vars(m)
    ]
    changed = ckpt.kernels.patch(ours)

    # the ranks of a tensor-parallel group hold one batch; FSDP ranks each their own
    g = torch.Generator().manual_seed(rank if "fsdp" in layout else 0)
    ids = torch.randint(0, ref.config.vocab_size, (2, 13), generator=g).to(device)
    losses = []
    for model in (ref, ours):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().cpu())
    train_calls, train_norm_calls = list(calls), len(norm_calls)
    with torch.no_grad():
        logits = [local(model.eval()(input_ids=ids).logits) for model in (ref, ours)]
    grads = {
        name: (local(p.grad), local(q.grad))
        for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters())
    }
    torch.save(
        dict(
            losses=losses,
            logits=logits,
            grads=grads,
            train_calls=train_calls,
            eval_calls=calls[len(train_calls) :],
            wrapped=wrapped,
            experts=changed["experts"],
            changed=changed,
            train_norm_calls=train_norm_calls,
            implementation=ours.config._experts_implementation,
            forwards_kept=all("forward" in vars(ours.get_submodule(n)) for n in wrapped),
        ),
        os.path.join(out_dir, f"rank-{rank}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""End-to-end training throughput: unpatched vs ours vs Liger-Kernel (and Liger + Cut Cross-Entropy).

Models, built from a config (no download), bf16 weights, fused AdamW, batch 8 x 2048 tokens
of random ids, one GPU, SDPA attention:

* ``--model llama`` (default): Llama-3.2-1B-shaped, hidden 2048, 16 layers, 32 heads / 8 KV
  heads, intermediate 8192, vocabulary 128256, tied embeddings (1.24B parameters);
* ``--model qwen3_moe``: a Qwen3-MoE-shaped mixture of experts (Qwen3-30B-A3B's layout at about
  1/25 of its size): hidden 1024, 12 layers, 16 heads / 4 KV heads of 128 with QK-norms,
  64 experts of intermediate 384, 8 per token, vocabulary 151936, untied (1.28B parameters,
  about 0.33B active per token), the router's load-balancing loss on (``output_router_logits``);
* ``--model mixtral``: a Mixtral-shaped one: hidden 1024, 16 layers, 16 heads / 8 KV heads,
  8 experts of intermediate 3584, 2 per token, vocabulary 32000, untied (1.53B parameters).

Providers: ``unpatched``; ``ours`` (``ckpt.kernels.patch``); ``liger``
(``apply_liger_kernel_to_<family>``, its fused linear cross-entropy included); ``liger+cce``
(Liger's kernels without its loss, the LM head and loss through Cut Cross-Entropy's
``linear_cross_entropy`` with its defaults; the package ships no patch for these models, so
the forward is the one below); ``liger+cce_exact``, the same with CCE's gradient filter off
(``filter_eps=None``; its default skips the backward blocks whose gradient entries, softmax
minus one-hot, are all under 2^-12: near a uniform softmax over a large vocabulary, nearly
every block without a target). Each provider runs in its own fresh process (Liger patches
Hugging Face classes process-wide, and the peak memory must not carry over), side by side
in one invocation. Reported: tokens/s over the timed steps, peak ``max_memory_allocated``
over the run (weights, gradients and optimizer state included), and the first/last loss so
the providers can be seen to train the same model.

Usage::

    python benchmarks/bench_train_kernels.py                 # every provider, the Llama shape
    python benchmarks/bench_train_kernels.py --model qwen3_moe
    python benchmarks/bench_train_kernels.py --providers ours --steps 5
    python benchmarks/bench_train_kernels.py --compile       # each provider under torch.compile

With ``--compile`` every provider's model goes through ``torch.compile`` (inductor, default
mode) after patching; compilation happens in the warm-up steps, which are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import device_name, record, table  # noqa: E402

PROVIDERS = ("unpatched", "ours", "liger", "liger+cce", "liger+cce_exact")
MODELS = ("llama", "qwen3_moe", "mixtral")
#: the CSV's case name per model (the Llama one kept from before the MoE models were added)
CASE = {"llama": "llama-3.2-1b-shape", "qwen3_moe": "qwen3-moe-1.3b-shape", "mixtral": "mixtral-1.5b-shape"}


def model_config(model: str, tiny: bool):
    """The Hugging Face config of ``model`` (``tiny``: a few-layer one for the CPU interpreter)."""
    import transformers

    if model == "llama":
        if tiny:
            return transformers.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=300,
                max_position_embeddings=128,
                tie_word_embeddings=True,
                attn_implementation="sdpa",
            )
        return transformers.LlamaConfig(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            attn_implementation="sdpa",
        )
    # MoE: the router's load-balancing loss is on, as when such a model is trained
    if model == "qwen3_moe":
        dims = (
            dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_experts=8,
                moe_intermediate_size=32,
                num_experts_per_tok=2,
                vocab_size=300,
            )
            if tiny
            else dict(
                hidden_size=1024,
                num_hidden_layers=12,
                num_attention_heads=16,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=64,
                moe_intermediate_size=384,
                num_experts_per_tok=8,
                vocab_size=151936,
            )
        )
        return transformers.Qwen3MoeConfig(
            **dims,
            intermediate_size=4 * dims["hidden_size"],
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            output_router_logits=True,
            attn_implementation="sdpa",
        )
    if model == "mixtral":
        dims = (
            dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                num_local_experts=4,
                vocab_size=300,
            )
            if tiny
            else dict(
                hidden_size=1024,
                num_hidden_layers=16,
                num_attention_heads=16,
                num_key_value_heads=8,
                intermediate_size=3584,
                num_local_experts=8,
                vocab_size=32000,
            )
        )
        return transformers.MixtralConfig(
            **dims,
            num_experts_per_tok=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            output_router_logits=True,
            attn_implementation="sdpa",
        )
    raise ValueError(f"unknown model {model!r}; choose from {MODELS}")


def build_model(tiny: bool, model: str = "llama"):
    import torch
    import transformers

    cfg = model_config(model, tiny)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
    }[model]
    dev = "cpu" if tiny else "cuda"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            m = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    return m.train()


def apply_liger(model, family: str, with_loss: bool) -> None:
    """Liger-Kernel's patch for ``family`` on this instance; its fused linear cross-entropy only
    if ``with_loss``."""
    import liger_kernel.transformers as lt

    getattr(lt, f"apply_liger_kernel_to_{family}")(model=model, fused_linear_cross_entropy=with_loss)


def cce_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    labels=None,
    filter_eps: float | str | None = "high",
    **kwargs,
):
    """A causal LM's training forward with the LM head and the shifted loss through Cut
    Cross-Entropy (``linear_cross_entropy(..., shift=True)``; ``filter_eps`` its gradient filter,
    ``"high"`` its default, ``None`` exact), and a mixture of experts' load-balancing loss added
    as Hugging Face adds it. Training only: the logits are never built (``logits`` is ``None``)."""
    import importlib

    from cut_cross_entropy import linear_cross_entropy

    moe = hasattr(self, "router_aux_loss_coef")
    extra = {"output_router_logits": self.config.output_router_logits} if moe else {}
    out = self.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **extra, **kwargs
    )
    loss = linear_cross_entropy(
        out.last_hidden_state, self.lm_head.weight, labels, shift=True, filter_eps=filter_eps
    )
    if moe and self.config.output_router_logits:
        modeling = importlib.import_module(type(self).__module__)
        aux = modeling.load_balancing_loss_func(
            out.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
        )
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=None)


def child(
    provider: str,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    tiny: bool,
    compile_model: bool = False,
    profile: int = 0,
    flce_chunk: int = 0,
    trace: str = "",
    family: str = "llama",
) -> dict[str, Any]:
    """Train ``steps`` timed steps with one provider in this process; return the measurements."""
    import functools
    import types

    import torch

    model = build_model(tiny, family)
    if provider == "ours":
        import ckpt.kernels as K

        changed = K.patch(model)
        if flce_chunk:  # what-if: a fixed chunk instead of the default rule (reported in the provider name)
            import ckpt.kernels.fused_linear_cross_entropy as flce

            flce.default_chunk_size = lambda *_: flce_chunk
        print(f"[ours] patched: { {k: len(v) for k, v in changed.items()} }", flush=True)
    elif provider == "liger":
        apply_liger(model, family, with_loss=True)
    elif provider in ("liger+cce", "liger+cce_exact"):
        apply_liger(model, family, with_loss=False)
        eps = None if provider.endswith("_exact") else "high"
        model.forward = types.MethodType(functools.partial(cce_forward, filter_eps=eps), model)
    n_params = sum(p.numel() for p in model.parameters())
    dev = next(model.parameters()).device
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    losses = []
    run = torch.compile(model) if compile_model else model
    t_compile = time.perf_counter()

    def step() -> float:
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(warmup):
        losses.append(step())
    if fused:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t_compile
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    if fused:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if fused else 0.0
    if profile:  # after the timed steps: where the GPU time of `profile` more steps goes
        from torch.profiler import ProfilerActivity, profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if fused else [])
        with torch_profile(activities=acts) as prof:
            for _ in range(profile):
                step()
            if fused:
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if fused else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70), flush=True)
        if trace:
            os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
            prof.export_chrome_trace(trace)
            print(f"trace: {trace}", flush=True)
        if fused:  # where the step's peak is set: forward (loss included), backward, optimizer step
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = run(input_ids=ids, labels=ids).loss
            fwd = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            bwd = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ostep = torch.cuda.max_memory_allocated()
            print(
                f"peak by phase (GiB): start {base / 2**30:.2f}, forward {fwd / 2**30:.2f}, "
                f"backward {bwd / 2**30:.2f}, optimizer {ostep / 2**30:.2f}",
                flush=True,
            )
    losses = [float(x) for x in losses]
    name = provider + ("+compile" if compile_model else "") + (f"(chunk {flce_chunk})" if flce_chunk else "")
    if provider.startswith("liger") and os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1").lower() in (
        "0",
        "false",
        "no",
    ):
        name += "(fused-MoE autotune off)"  # Liger's escape hatch: one fixed config for its MoE kernels
    return {
        "provider": name,
        "warmup_s": warmup_s,
        "params_b": n_params / 1e9,
        "tokens_per_s": batch * seq * steps / dt,
        "step_ms": dt / steps * 1e3,
        "peak_gib": peak,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--providers", nargs="*", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--model", default="llama", choices=MODELS, help="the model shape (see above)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (Triton interpreter)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each provider's model (inductor)")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after timing, profile this many steps and print the top GPU kernels",
    )
    ap.add_argument(
        "--flce-chunk",
        type=int,
        default=0,
        metavar="TOKENS",
        help="ours only: a fixed fused-linear-CE chunk instead of the default rule (a what-if)",
    )
    ap.add_argument(
        "--trace",
        default="",
        metavar="DIR",
        help="with --profile: also write each provider's Chrome trace (DIR/<provider>.json)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop a provider's process after S seconds and report it as failed",
    )
    ap.add_argument("--child", choices=PROVIDERS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        res = child(
            args.child,
            args.batch,
            args.seq,
            args.steps,
            args.warmup,
            args.smoke,
            args.compile,
            args.profile,
            args.flce_chunk,
            args.trace,
            args.model,
        )
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    results = []
    env = dict(os.environ)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
        args.batch, args.seq, args.steps, args.warmup = 2, 16, 2, 1
    for p in args.providers:
        cmd = (
            [
                sys.executable,
                __file__,
                "--child",
                p,
                "--model",
                args.model,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ]
            + (["--smoke"] if args.smoke else [])
            + (["--compile"] if args.compile else [])
            + ["--profile", str(args.profile)]
            + (["--flce-chunk", str(args.flce_chunk)] if args.flce_chunk and p == "ours" else [])
            + (["--trace", os.path.join(args.trace, f"{p}.json")] if args.trace else [])
        )
        print(f"== {p}", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as exc:  # the child is killed; the others go on
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            print(f"{p} failed: no result within {args.timeout:.0f} s\n{out[-2000:]}", flush=True)
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(
                f"{p} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}",
                flush=True,
            )
            continue
        if args.profile:
            print(
                "\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True
            )
        res = json.loads(lines[-1][len("RESULT ") :])
        print(f"   {res}", flush=True)
        results.append(res)

    if not results:
        return 1
    rows = []
    case = f"{CASE[args.model]} bf16 b{args.batch}x{args.seq}" + (" smoke" if args.smoke else "")
    for r in results:
        note = f"first_loss={r['first_loss']:.4f} last_loss={r['last_loss']:.4f} params={r['params_b']:.3f}B"
        rows.append(
            {
                "case": case,
                "provider": r["provider"],
                "metric": "tokens_per_s",
                "value": r["tokens_per_s"],
                "unit": "tok/s",
                "note": note,
            }
        )
        rows.append(
            {
                "case": case,
                "provider": r["provider"],
                "metric": "peak_mem",
                "value": r["peak_gib"],
                "unit": "GiB",
                "note": note,
            }
        )
    path = record("bench_train_kernels", rows, args.csv)
    print(f"csv: {path}\ndevice: {device_name()}\n")
    print(
        table(
            [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in results],
            ["provider", "tokens_per_s", "step_ms", "peak_gib", "first_loss", "last_loss", "warmup_s"],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

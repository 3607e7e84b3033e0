"""The kernels inside ``torch.compile``: Dynamo graph-breaks around them and runs them eagerly,
so a compiled function gives the eager function's values and gradients.

CPU (Triton interpreter): Dynamo plus AOTAutograd (``aot_eager``), which is where tracing
into the launch path used to fail. GPU (``-m gpu``): inductor, on a patched tiny Llama.
"""

from __future__ import annotations

import pytest
import torch

import ckpt.kernels as K
from kernel_helpers import DEVICE, HAS_CUDA, assert_close


def every_kernel(x, w, b, q, k, cos, sin, head, target):
    # every kernel input below is a fresh intermediate that nothing else saves, so the kernels
    # may write gradients over them (their default)
    h = K.rms_norm(x, w) * 1.5
    h = K.layer_norm(h, w, b)
    m = K.swiglu(h * 1.0, h + 1.0) + K.geglu(h * 0.5, h - 1.0)
    qo, ko = K.rope(q, k, cos, sin)
    loss = K.cross_entropy(m @ head.t(), target) + K.fused_linear_cross_entropy(m * 2.0, head, target)
    return loss + qo.square().mean() + ko.square().mean()


def inputs(device):
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    pos = torch.arange(6, device=device, dtype=torch.float32)[:, None] * torch.rand(1, 4, device=device, generator=g)
    emb = torch.cat([pos, pos], -1)[None]
    leaves = [rnd(6, 32), rnd(32) + 1.0, rnd(32), rnd(1, 4, 6, 8), rnd(1, 2, 6, 8), rnd(40, 32) * 0.2]
    return [t.requires_grad_() for t in leaves], (emb.cos(), emb.sin(), torch.randint(0, 40, (6,), device=device, generator=g))


def run(fn, device):
    (x, w, b, q, k, head), (cos, sin, target) = inputs(device)
    loss = fn(x, w, b, q, k, cos, sin, head, target)
    loss.backward()
    return [loss] + [t.grad for t in (x, w, b, q, k, head)]


def test_kernels_under_torch_compile_match_eager():
    torch._dynamo.reset()
    expected = run(every_kernel, DEVICE)
    got = run(torch.compile(every_kernel, backend="aot_eager", fullgraph=False), DEVICE)
    for name, a, e in zip(["loss", "x", "w", "b", "q", "k", "head"], got, expected):
        assert_close(name, a, e, 1e-5, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
def test_patched_llama_under_inductor_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().train()
    K.patch(model)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]

    expected = step(model)
    torch._dynamo.reset()
    got = step(torch.compile(model))
    for i, (a, e) in enumerate(zip(got, expected)):
        assert_close(f"tensor {i}", a, e, 2e-4, 2e-4)

"""Kernels on a GPU that is not the current device (a model spread over GPUs in one process,
as Hugging Face's ``device_map`` does): results must match PyTorch on that GPU."""

from __future__ import annotations

import pytest
import torch

import ckpt.kernels as K
from kernel_helpers import assert_close

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (run on the device machine's two-GPU kind)",
    ),
]


def test_every_kernel_on_a_non_current_gpu():
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g, requires_grad=True)  # noqa: E731
    x, w, b, head = rnd(64, 256), rnd(256), rnd(256), rnd(500, 256)
    q, k = rnd(2, 4, 16, 32), rnd(2, 2, 16, 32)
    pos = torch.arange(16, device=dev, dtype=torch.float32)[:, None] * torch.rand(
        1, 16, device=dev, generator=g
    )
    cos, sin = torch.cat([pos, pos], -1).cos()[None], torch.cat([pos, pos], -1).sin()[None]
    target = torch.randint(0, 500, (64,), device=dev, generator=g)

    def rot(t):
        t1, t2 = t.chunk(2, -1)
        return torch.cat([-t2, t1], -1)

    def ours():
        h = K.layer_norm(K.rms_norm(x, w) * 1.0, w, b)
        m = K.swiglu(h * 1.0, h + 1.0) + K.geglu(h * 0.5, h - 1.0)
        qo, ko = K.rope(q, k, cos, sin)
        return (
            K.cross_entropy(m @ head.t(), target)
            + K.fused_linear_cross_entropy(m * 2.0, head, target)
            + qo.square().mean()
            + ko.square().mean()
        )

    def reference():
        h = torch.nn.functional.rms_norm(x, (256,), w, 1e-6)
        h = torch.nn.functional.layer_norm(h, (256,), w, b)
        m = torch.nn.functional.silu(h) * (h + 1.0) + torch.nn.functional.gelu(
            h * 0.5, approximate="tanh"
        ) * (h - 1.0)
        qo = q * cos[:, None] + rot(q) * sin[:, None]
        ko = k * cos[:, None] + rot(k) * sin[:, None]
        ce = torch.nn.functional.cross_entropy
        return (
            ce(m @ head.t(), target)
            + ce((m * 2.0) @ head.t(), target)
            + qo.square().mean()
            + ko.square().mean()
        )

    results = []
    for fn in (ours, reference):
        loss = fn()
        loss.backward()
        results.append([loss.detach()] + [t.grad.clone() for t in (x, w, b, head, q, k)])
        for t in (x, w, b, head, q, k):
            t.grad = None
    assert torch.cuda.current_device() == 0
    for name, a, e in zip(["loss", "x", "w", "b", "head", "q", "k"], *results):
        assert a.device == dev, name
        assert_close(name, a, e, 1e-4, 1e-4)

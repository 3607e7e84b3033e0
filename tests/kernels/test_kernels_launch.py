"""The launch cache of ``LazyKernel``: keys at least as fine as Triton's specialization."""

from __future__ import annotations

import sys

import pytest
import torch

import ckpt.kernels as K
from ckpt.kernels._utils import _NoFastPath, _launch_key, launch_signature_of
from kernel_helpers import HAS_CUDA


def test_signature_separates_what_triton_specializes_on():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    aligned, shifted = buf[:8], buf[1:9]  # 16-byte aligned start vs 2 bytes past it
    assert launch_signature_of(aligned) != launch_signature_of(shifted)
    assert launch_signature_of(aligned) != launch_signature_of(buf[:8].float())
    ints = [1, 2, 16, 17, 32, 2**31 - 16, 2**31, 2**40, 2**63]
    sigs = {i: launch_signature_of(i) for i in ints}
    assert sigs[1] != sigs[2] != sigs[16]
    assert sigs[16] == sigs[32] and sigs[2] == sigs[17]  # same specialization: the key may be shared
    assert sigs[2**31 - 16] != sigs[2**31]  # 32-bit vs 64-bit
    assert sigs[2**40] != sigs[2**63]  # signed vs unsigned 64-bit
    assert launch_signature_of(True) != launch_signature_of(1)  # bools are not ints
    assert launch_signature_of(None) != launch_signature_of(0.0)
    with pytest.raises(_NoFastPath):
        launch_signature_of("a string")


def test_launch_key_is_finer_than_the_signature():
    """The hot-path key must separate every pair of calls that the signature separates."""
    buf = torch.zeros(64, dtype=torch.bfloat16)
    calls = [
        (buf[:8], 16),
        (buf[1:9], 16),
        (buf[:8].float(), 16),
        (buf[:8], 17),
        (buf[:8], 1),
        (buf[:8], True),
        (buf[:8], None),
        (buf[:8], 0.5),
        (buf[:8], 2**31),
        (buf[:8], 2**63),
    ]
    for a in calls:
        for b in calls:
            if tuple(map(launch_signature_of, a)) != tuple(map(launch_signature_of, b)):
                assert _launch_key(a) != _launch_key(b), (a, b)
    assert _launch_key((buf[:8], 0.5)) == _launch_key((buf[:8], 2.0))  # floats: kind only


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device machine)")
def test_cached_launches_respecialize_on_alignment_and_divisibility():
    """Alternate 16-byte aligned inputs with misaligned ones and row counts that are and are not
    multiples of 16: every call matches eager, and the cache holds one kernel per specialization."""
    lnm = sys.modules["ckpt.kernels.layer_norm"]
    n = 1024
    w = torch.rand(n, device="cuda") + 0.5
    b = torch.randn(n, device="cuda")
    for rows, offset in [(16, 0), (16, 1), (7, 0), (16, 0), (7, 1), (16, 1)]:
        storage = torch.randn(rows * n + offset, device="cuda").to(torch.bfloat16)
        x = storage[offset:].view(rows, n).requires_grad_()
        y = K.layer_norm(x, w.to(torch.bfloat16), b.to(torch.bfloat16))
        ref = torch.nn.functional.layer_norm(x.float(), (n,), w, b)
        torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=2e-2)
        y.float().sum().backward()
        xr = x.detach().float().requires_grad_()
        torch.nn.functional.layer_norm(xr, (n,), w, b).sum().backward()
        torch.testing.assert_close(x.grad.float(), xr.grad, atol=3e-2, rtol=2e-2)
    if lnm._fwd._interp is False:
        assert len(lnm._fwd._compiled) >= 4, lnm._fwd._compiled.keys()


def test_launch_hooks_are_detected():
    """A profiler's launch hook must see every launch: the cache steps aside while one is set."""
    from ckpt.kernels._utils import _hook_set

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_set(None)
    assert not _hook_set(Chain([]))
    assert _hook_set(Chain([print]))
    assert _hook_set(print)

"""Bad input gives a ValueError naming the argument; import works without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt.kernels as K
from kernel_helpers import DEVICE


def _f(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


BAD_CALLS = [
    ("x", lambda: K.rms_norm(_f(3, 4).long(), _f(4))),
    ("weight", lambda: K.rms_norm(_f(3, 4), _f(5))),
    ("weight", lambda: K.rms_norm(_f(3, 4), _f(2, 2))),
    ("x", lambda: K.layer_norm(torch.ones(3, 4, dtype=torch.int32, device=DEVICE), _f(4), _f(4))),
    ("bias", lambda: K.layer_norm(_f(3, 4), _f(4), _f(3))),
    ("q", lambda: K.rope(_f(2, 3, 4), _f(1, 2, 3, 4), _f(3, 4), _f(3, 4))),
    ("k", lambda: K.rope(_f(1, 2, 3, 4), _f(1, 2, 5, 4), _f(3, 4), _f(3, 4))),
    ("cos", lambda: K.rope(_f(1, 2, 3, 4), _f(1, 2, 3, 4), _f(3, 6), _f(3, 4))),
    ("head_dim", lambda: K.rope(_f(1, 2, 3, 5), _f(1, 2, 3, 5), _f(3, 5), _f(3, 5))),
    ("b", lambda: K.swiglu(_f(3, 4), _f(3, 5))),
    ("target", lambda: K.cross_entropy(_f(3, 4), _f(3))),
    ("target", lambda: K.cross_entropy(_f(3, 4), torch.zeros(4, dtype=torch.long, device=DEVICE))),
    (
        "reduction",
        lambda: K.cross_entropy(_f(3, 4), torch.zeros(3, dtype=torch.long, device=DEVICE), reduction="avg"),
    ),
    (
        "label_smoothing",
        lambda: K.cross_entropy(
            _f(3, 4), torch.zeros(3, dtype=torch.long, device=DEVICE), label_smoothing=2.0
        ),
    ),
    (
        "weight",
        lambda: K.fused_linear_cross_entropy(
            _f(3, 4), _f(7, 5), torch.zeros(3, dtype=torch.long, device=DEVICE)
        ),
    ),
    (
        "bias",
        lambda: K.fused_linear_cross_entropy(
            _f(3, 4), _f(7, 4), torch.zeros(3, dtype=torch.long, device=DEVICE), _f(6)
        ),
    ),
    ("hidden", lambda: K.fused_linear_cross_entropy([1.0], _f(7, 4), torch.zeros(3, dtype=torch.long))),
]


@pytest.mark.parametrize("name,call", BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_input_names_the_argument(name, call):
    with pytest.raises(ValueError, match=name):
        call()


def test_cpu_tensor_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        K.rms_norm(torch.randn(2, 8), torch.ones(8))
    with pytest.raises(ValueError, match="logits is a CPU tensor"):
        K.cross_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
def test_mixed_devices_name_the_argument():
    with pytest.raises(ValueError, match="weight"):
        K.rms_norm(torch.randn(2, 8, device="cuda"), torch.ones(8))
    with pytest.raises(ValueError, match="target"):
        K.cross_entropy(torch.randn(2, 8, device="cuda"), torch.zeros(2, dtype=torch.long))


def _assert_prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (Triton interpreter mode); it must print OK."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_import_without_triton():
    """`import ckpt` and `import ckpt.kernels` work with triton unimportable; use fails clearly."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import ckpt, ckpt.kernels as K, torch\n"
        "assert not K.HAS_TRITON\n"
        "try:\n"
        "    K.rms_norm(torch.randn(2, 4), torch.ones(4))\n"
        "except RuntimeError as e:\n"
        "    assert 'needs Triton' in str(e), e\n"
        "    print('OK')\n"
    )
    _assert_prints_ok(code)


def test_public_api():
    for name in K.__all__:
        assert hasattr(K, name), name
    assert set(K.SUPPORTED_MODEL_TYPES) >= {"llama", "mistral", "qwen2"}


@pytest.mark.parametrize("first", ["ckpt.kernels", "kernels"])
def test_kernels_folder_imported_as_top_level_kernels_is_ckpt_kernels(first):
    """From a source checkout's root, ``import kernels`` (transformers does it, looking for Hugging
    Face's ``kernels`` package) must give ``ckpt.kernels`` itself, not a second copy whose custom
    operators and module state (compiled kernels, tickets) would shadow the real ones."""
    root = Path(K.__file__).resolve().parent.parent
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r})\n"
        f"import {first}\n"
        "import ckpt.kernels as K, kernels, kernels.layer_norm, kernels._reduce\n"
        "assert kernels is K, (kernels, K)\n"
        "assert kernels.layer_norm is K.layer_norm and kernels._reduce is sys.modules['ckpt.kernels._reduce']\n"
        "print('OK')\n"
    )
    _assert_prints_ok(code)

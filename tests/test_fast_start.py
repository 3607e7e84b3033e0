"""Restart fast (docs/guides/launchers.md): a model built empty (``ckpt.empty_params``), given storage
(``ckpt.materialize``) and filled by ``restore`` is the saved model bit for bit, its non-persistent buffers
(Hugging Face Llama's rotary ``inv_freq``) included, and trains on as the saved one does; a job with no
checkpoint (``restorable()`` is ``False``) builds its model as it always did."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg).train()


class _Scaled(nn.Module):
    """A plain module with a persistent buffer and a non-persistent one computed in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8).exp(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.lin(x) * self.scale


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    if isinstance(model, _Scaled):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        return model(x).square().mean()
    ids = _ids(seed)
    return model(input_ids=ids, labels=ids).loss


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    loss = _loss(model, seed)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, persistent or not, by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(
            a[k].detach().view(-1).view(torch.uint8), b[k].detach().view(-1).view(torch.uint8)
        ), k


def _saved(build, local_dir) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model trained two steps and saved at step 2, the Checkpointer closed (a job that ended)."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in (1, 2):
        _step(model, opt, s)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1)
    ) as ck:
        ck.save(2, {"model": model, "optim": opt})
        ck.wait()
    return model, opt


def _restarted(build, local_dir) -> tuple[nn.Module, torch.optim.Optimizer, int | None, bool]:
    """The recipe of the launchers guide: build empty when a restore will fill the model."""
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=1)
    ) as ck:
        restoring = ck.restorable()
        torch.manual_seed(1)  # another seed: nothing of the restored model may come from the build
        with ckpt.empty_params(restoring):
            model = build()
        if restoring:
            assert all(p.is_meta for p in model.parameters())
        ckpt.materialize(model, "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = ck.restore({"model": model, "optim": opt})
    return model, opt, step, restoring


@pytest.mark.parametrize("build", [_llama, _Scaled], ids=["hf-llama", "plain-module"])
def test_a_model_built_empty_and_restored_is_the_saved_one_bit_for_bit(build, local_dir):
    saved, saved_opt = _saved(build, local_dir)
    model, opt, step, restoring = _restarted(build, local_dir)
    assert restoring and step == 2
    _assert_same_bits(_tensors(model), _tensors(saved))  # non-persistent buffers too (rotary inv_freq)
    assert not any(t.is_meta for t in _tensors(model).values())
    # the same loss, and the same next optimizer step
    assert torch.equal(_step(model, opt, 3), _step(saved, saved_opt, 3))
    _assert_same_bits(_tensors(model), _tensors(saved))


def test_tied_weights_stay_tied_through_an_empty_build(local_dir):
    _saved(_llama, local_dir)
    model, _, _, _ = _restarted(_llama, local_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("build", [_llama, _Scaled], ids=["hf-llama", "plain-module"])
def test_a_first_start_builds_the_model_as_an_ordinary_build_does(build, local_dir):
    model, _, step, restoring = _restarted(build, local_dir)
    assert not restoring and step is None
    torch.manual_seed(1)
    _assert_same_bits(_tensors(model), _tensors(build()))


def test_the_rotary_buffers_are_computed_by_the_models_own_init():
    with ckpt.empty_params():
        model = _llama()
    rotary = model.model.rotary_emb
    assert not rotary.inv_freq.is_meta and "inv_freq" in rotary._non_persistent_buffers_set
    assert torch.equal(rotary.inv_freq, _llama().model.rotary_emb.inv_freq)


def test_a_non_persistent_buffer_left_on_meta_is_refused_before_anything_changes():
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(ValueError):
        ckpt.materialize(model, "cpu")
    assert all(t.is_meta for t in _tensors(model).values())


def test_the_block_leaves_module_registration_as_it_was():
    before = nn.Module.register_parameter
    with ckpt.empty_params():
        with ckpt.empty_params():
            pass
        assert nn.Linear(2, 2).weight.is_meta  # the inner block's exit kept the outer one's
    assert nn.Module.register_parameter is before and not nn.Linear(2, 2).weight.is_meta

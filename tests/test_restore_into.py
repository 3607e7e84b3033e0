"""What restore loads into: strict=False loads exactly the keys both sides have, a state that saves
restores into itself (non-contiguous tensors included), and values too deep to read back are
refused at save time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt
from ckpt.format import MAX_TREE_DEPTH


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _trained(seed=0):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    return m, opt


# -- strict=False ---------------------------------------------------------------------------------
def test_strict_false_loads_only_the_model_of_a_checkpoint_that_also_holds_the_optimizer(local_dir):
    m, opt = _trained()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(3, {"model": m, "optim": opt, "step": 3, "w": torch.ones(5)}).wait()
    m2 = _model(seed=1)
    state = {"model": m2}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(state, strict=False) == 3
    assert set(state) == {"model"}, "strict=False never adds keys to the state"
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k


def test_strict_false_leaves_keys_the_checkpoint_lacks_untouched(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"a": torch.ones(2), "n": 5}).wait()
    extra, keep = torch.full((3,), 7.0), object()
    state = {"a": torch.zeros(2), "extra": extra, "obj": keep}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(state, strict=False) == 1
    assert torch.equal(state["a"], torch.ones(2)) and state["extra"] is extra and state["obj"] is keep
    assert torch.equal(extra, torch.full((3,), 7.0)) and set(state) == {"a", "extra", "obj"}


def test_strict_false_loads_the_common_keys_of_a_module_and_of_a_plain_dict(local_dir):
    big = nn.ModuleDict({"enc": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"m": big, "meta": {"epoch": 4, "name": "run"}}).wait()
    torch.manual_seed(5)
    small = nn.ModuleDict({"enc": nn.Linear(4, 4), "aux": nn.Linear(4, 1)})
    aux = small["aux"].weight.detach().clone()
    meta = {"epoch": 0, "lr": 0.1}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.IncompatibleCheckpointError):
            ck.restore({"m": small, "meta": meta})
        assert ck.restore({"m": small, "meta": meta}, strict=False) == 1
    assert torch.equal(small["enc"].weight, big["enc"].weight) and torch.equal(small["aux"].weight, aux)
    assert meta == {"epoch": 4, "lr": 0.1}


def test_strict_false_loads_a_tensor_whose_shared_original_is_not_in_the_state(local_dir):
    """Tied tensors are stored once: the second is an alias of the first. Leaving out the key that
    holds the stored copy must still load the other one."""
    m = _model()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": m, "ema": {"w": m[0].weight}}).wait()
    ema = {"w": torch.zeros(6, 4)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"ema": ema}, strict=False) == 1
    assert torch.equal(ema["w"], m[0].weight)


# -- non-contiguous destinations ------------------------------------------------------------------
class WithView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.register_buffer("t", torch.randn(5, 4).t())  # a transposed view as a buffer


def test_a_channels_last_model_and_its_optimizer_restore_into_themselves(local_dir):
    torch.manual_seed(0)
    m = WithView().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m.conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()
    assert not m.conv.weight.is_contiguous() and not m.t.is_contiguous()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"m": m, "opt": opt}).wait()
        want = {k: v.clone() for k, v in m.state_dict().items()}
        moments = {k: v.clone() for k, v in opt.state[m.conv.weight].items()}
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
            m.t.zero_()
        for v in opt.state[m.conv.weight].values():
            v.zero_()
        ptr = m.conv.weight.data_ptr()
        assert ck.restore({"m": m, "opt": opt}) == 1
    for k, v in m.state_dict().items():
        assert torch.equal(v, want[k]), k
    for k, v in opt.state[m.conv.weight].items():
        assert torch.equal(v, moments[k]), k
    assert m.conv.weight.data_ptr() == ptr, "loaded in place"
    assert m.conv.weight.is_contiguous(memory_format=torch.channels_last), "memory format kept"
    assert m.t.stride() == (1, 4)
    assert opt.state[m.conv.weight]["exp_avg"].is_contiguous(memory_format=torch.channels_last)


def test_a_bare_non_contiguous_tensor_is_loaded_in_place(local_dir):
    base = torch.arange(20.0).reshape(4, 5)
    w = base.t()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": w}).wait()
    target = torch.zeros(4, 5).t()
    state = {"w": target}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(state) == 1
    assert state["w"] is target and torch.equal(target, w) and target.stride() == (1, 5)


@pytest.mark.gpu
def test_a_channels_last_model_on_the_gpu_restores_into_itself(local_dir):
    torch.manual_seed(0)
    m = nn.Conv2d(3, 8, 3).cuda().to(memory_format=torch.channels_last)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"m": m}).wait()
    want = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.zero_()
    for memory in (False, True):  # from the local tier, then from the memory tier
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
            if memory:
                ck.save(2, {"m": m}).wait()
                with torch.no_grad():
                    m.weight.zero_()
            assert ck.restore({"m": m}) == (2 if memory else 1)
            assert ck.last_restore.tier == ("memory" if memory else "local")
        torch.cuda.synchronize()
        assert torch.equal(m.weight, want) and m.weight.is_contiguous(memory_format=torch.channels_last)
        want = m.weight.detach().clone()


# -- depth ------------------------------------------------------------------------------------------
def _nested(depth):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


def test_a_value_nested_too_deep_to_read_back_is_refused_at_save_with_its_key(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.RefusedStateError) as ei:
            ck.save(1, {"w": torch.ones(2), "cfg": {"deep": _nested(100_000)}})
        assert ei.value.path.startswith("cfg/deep/0/0/")
        with pytest.raises(ckpt.RefusedStateError) as ei:
            ck.save(1, {"cfg": _nested(MAX_TREE_DEPTH + 1)})
        assert ei.value.path.startswith("cfg/0/") and ei.value.path.count("/") < MAX_TREE_DEPTH + 2
        ck.save(2, {"cfg": _nested(MAX_TREE_DEPTH)}).wait()
    assert not (local_dir / "step-000000001").exists()
    state = {"cfg": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(state) == 2
    assert state["cfg"] == _nested(MAX_TREE_DEPTH)


class WithExtraState(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.note = {"seen": 0}

    def get_extra_state(self):
        return dict(self.note)

    def set_extra_state(self, state):
        self.note = dict(state)


def test_a_modules_extra_state_is_restored_even_when_every_tensor_loads_in_place(local_dir):
    m = WithExtraState()
    m.note["seen"] = 5
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"m": m}).wait()
    m2 = WithExtraState()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"m": m2}) == 1
    assert m2.note == {"seen": 5} and torch.equal(m2.weight, m.weight)


def test_brackets_and_escaped_quotes_inside_strings_do_not_count_as_nesting(local_dir):
    value = {"[" * 300: "]" * 300 + '\\"' + "{" * 300, "q": '"[[[' * 100}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"cfg": value}).wait()
    state = {"cfg": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(state) == 1
    assert state["cfg"] == value

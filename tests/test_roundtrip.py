"""Save and restore reproduce the whole training state bit for bit."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import ckpt
from ckpt import values
from ckpt.format import MAX_JSON_DEPTH, MAX_TREE_DEPTH
from ckpt.plan import flatten
from helpers import assert_same, make_state, snapshot_values, train


def test_round_trip_from_the_local_tier_in_a_fresh_checkpointer_is_bit_exact(local_dir):
    state = make_state()
    train(state, 4)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(4, state).wait()
    expected = snapshot_values(state)

    fresh = make_state(seed=99)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(fresh) == 4
        assert ck.last_restore.tier == "local"
    assert_same(snapshot_values(fresh), expected)


def test_round_trip_from_the_memory_tier_after_training_moved_on(local_dir):
    state = make_state()
    train(state, 3)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(3, state)
        expected = snapshot_values(state)
        train(state, 5)
        assert ck.restore(state) == 3
        assert ck.last_restore.tier == "memory"
        assert_same(snapshot_values(state), expected)


def test_resumed_training_continues_bit_identically(local_dir):
    ref = make_state()
    train(ref, 6)
    reference = snapshot_values(ref)

    a = make_state()
    train(a, 3)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(3, a).wait()
    b = make_state(seed=5)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(b) == 3
    train(b, 3)
    assert_same(snapshot_values(b), reference)


def test_restore_returns_none_when_there_is_no_checkpoint(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(make_state()) is None
        assert ck.list() == []


def test_plain_tensors_numpy_tuples_and_json_values_round_trip(local_dir):
    state = {
        "t": torch.arange(10, dtype=torch.float64).reshape(2, 5),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "arr": np.arange(6, dtype=np.int32).reshape(3, 2),
        "nested": {"a": (1, "x", [2.5, None]), 3: "int key", "$weird": {"k": float("-inf")}},
        "np_scalar": np.float32(1.5),
        "dtype": torch.float16,
    }
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, state).wait()
    target = {
        "t": torch.zeros(2, 5, dtype=torch.float64),
        "bf16": torch.zeros(7, dtype=torch.bfloat16),
        "flags": torch.zeros(3, dtype=torch.bool),
        "scalar": torch.tensor(0.0),
        "empty": torch.empty(0, 3),
        "arr": None,
        "nested": None,
        "np_scalar": None,
        "dtype": None,
    }
    t_before = target["t"]
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(target) == 1
    assert target["t"] is t_before, "tensors are loaded in place"
    for k in ("t", "bf16", "flags", "scalar", "empty"):
        assert torch.equal(target[k], state[k]), k
    assert isinstance(target["arr"], np.ndarray) and (target["arr"] == state["arr"]).all()
    assert target["nested"] == {"a": (1, "x", [2.5, None]), 3: "int key", "$weird": {"k": float("-inf")}}
    assert target["np_scalar"] == 1.5 and target["dtype"] is torch.float16


def test_the_engines_tree_encoding_of_values_is_unchanged_by_sharing_it():
    """The engine's state tree is written by ckpt.values' encoder (shared with the DCP adapter): the same
    JSON, byte for byte, as the engine wrote before it was shared."""
    tree = flatten(
        {
            "t": (1, torch.Size([2])),
            "f": [float("nan"), float("-inf"), 0.5],
            "d": {1: "a", "$k": None, 2.5: True},
            "s": {"a": {"b": "c"}},
            "dt": torch.bfloat16,
        }
    ).tree
    assert json.dumps(tree) == (
        '{"t": {"$tuple": [1, {"$tuple": [2]}]}, "f": [{"$f": "nan"}, {"$f": "-inf"}, 0.5], '
        '"d": {"$d": [[1, "a"], ["$k", null], [2.5, true]]}, "s": {"a": {"b": "c"}}, '
        '"dt": {"$dtype": "bfloat16"}}'
    )
    assert MAX_TREE_DEPTH + 4 <= MAX_JSON_DEPTH == values.MAX_DECODE_DEPTH  # the depth limits fit together


def test_bytes_stay_out_of_engine_checkpoints(local_dir):
    """The one encoding has bytes for the DCP adapter; the engine's format does not take them."""
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        for v in (b"x", io.BytesIO(b"x")):
            with pytest.raises(ckpt.RefusedStateError) as e:
                ck.save(1, {"extras": {"blob": v}})
            assert e.value.path == "extras/blob" and "without pickle" in str(e.value)


def test_a_numpy_nan_scalar_round_trips_as_a_float(local_dir):
    """(numpy 2 spells np.float64("nan") "np.float64(nan)": the engine once wrote that into its "$f" tag,
    which no reader takes; a numpy scalar is now stored as the Python value it holds.)"""
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"x": np.float64("nan"), "y": [np.float32("-inf"), np.float64(2.5)]}).wait()
    out = {"x": None, "y": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(out) == 1
    assert math.isnan(out["x"]) and out["y"] == [float("-inf"), 2.5]


def test_tied_weights_are_stored_once_and_stay_tied(local_dir):
    def model():
        torch.manual_seed(0)
        m = nn.ModuleDict({"emb": nn.Embedding(50, 16), "head": nn.Linear(16, 50, bias=False)})
        m["head"].weight = m["emb"].weight
        return m

    m = model()
    with torch.no_grad():
        m["emb"].weight.mul_(3)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"m": m}).wait()
        assert h.stats.nbytes < 2 * 50 * 16 * 4
    m2 = model()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.restore({"m": m2})
    assert torch.equal(m2["emb"].weight, m["emb"].weight)
    assert m2["head"].weight is m2["emb"].weight


def test_shape_mismatch_is_an_incompatible_checkpoint_not_a_fallback(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"m": nn.Linear(4, 4)}).wait()
        with pytest.raises(ckpt.IncompatibleCheckpointError):
            ck.restore({"m": nn.Linear(4, 5)})


def test_differing_keys_are_named_and_strict_false_loads_the_common_ones(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"a": torch.ones(2), "b": 7}).wait()
        with pytest.raises(ckpt.IncompatibleCheckpointError, match=r"strict=False"):
            ck.restore({"a": torch.zeros(2), "c": 1})
        target = {"a": torch.zeros(2), "c": 1}
        assert ck.restore(target, strict=False) == 1
        assert torch.equal(target["a"], torch.ones(2)) and target["c"] == 1 and "b" not in target


def test_restore_of_an_explicit_step_and_of_a_missing_one(local_dir):
    t = torch.zeros(3)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        for s in (1, 2, 3):
            t.fill_(s)
            ck.save(s, {"t": t}).wait()
        assert ck.restore({"t": t}, step=2) == 2 and t[0] == 2
        with pytest.raises(FileNotFoundError, match="step 9"):
            ck.restore({"t": t}, step=9)


def test_saving_the_same_step_again_replaces_it(local_dir):
    t = torch.zeros(3)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(5, {"t": t}).wait()
        t.fill_(2)
        ck.save(5, {"t": t}).wait()
    out = torch.zeros(3)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"t": out}) == 5
    assert torch.equal(out, torch.full((3,), 2.0))


def test_a_list_of_optimizers_loads_in_place(local_dir):
    m = nn.Linear(3, 3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.AdamW(m.parameters(), lr=0.01)]
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"opts": opts, "pair": (opts[0], 5)}).wait()
    fresh = [torch.optim.SGD(m.parameters(), lr=0.5), torch.optim.AdamW(m.parameters(), lr=0.5)]
    state = {"opts": fresh, "pair": (fresh[0], 0)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(state) == 1
    assert state["opts"][0] is fresh[0] and fresh[0].param_groups[0]["lr"] == 0.1
    assert fresh[1].param_groups[0]["lr"] == 0.01
    assert state["pair"] == (fresh[0], 5)


class Holder:
    def __init__(self, x):
        self.x, self.obj = x, object()

    def state_dict(self):
        return {"x": self.x, "obj": self.obj}

    def load_state_dict(self, sd):
        self.x = sd["x"]


def test_values_skipped_at_save_are_left_out_at_restore(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(on_unsupported="skip")
    ) as ck:
        ck.save(1, {"h": Holder(7), "cfg": {"a": 1, "obj": object()}}).wait()
    h = Holder(0)
    state = {"h": h, "cfg": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(state, strict=False) == 1
    assert h.x == 7 and state["cfg"] == {"a": 1}

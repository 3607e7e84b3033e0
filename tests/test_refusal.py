"""Values that would need pickle are refused at save time, naming their key; nothing is persisted."""

from __future__ import annotations


import pytest
import torch

import ckpt


class Opaque:
    pass


def test_a_non_json_value_is_refused_with_its_key_named(local_dir):
    state = {"w": torch.ones(2), "extras": {"fn": Opaque()}}
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        with pytest.raises(ckpt.RefusedStateError, match=r"'extras/fn'.*Opaque.*on_unsupported='skip'"):
            ck.save(1, state)
        assert ck.list() == []
        ck.save(2, {"w": torch.ones(2)}).wait()   # the checkpointer is still usable
    assert not (local_dir / "step-000000001").exists()


def test_a_set_and_a_lambda_are_refused_too(local_dir):
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        with pytest.raises(ckpt.RefusedStateError, match="'s'"):
            ck.save(1, {"s": {1, 2}})
        with pytest.raises(ckpt.RefusedStateError, match="'cb'"):
            ck.save(1, {"cb": lambda: 0})


def test_on_unsupported_skip_leaves_such_values_out_and_keeps_them_on_restore(local_dir):
    keep = Opaque()
    with ckpt.Checkpointer(local_dir=local_dir, on_unsupported="skip") as ck:
        ck.save(1, {"w": torch.full((2,), 3.0), "obj": Opaque()}).wait()
    target = {"w": torch.zeros(2), "obj": keep}
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        assert ck.restore(target) == 1
    assert target["obj"] is keep and torch.equal(target["w"], torch.full((2,), 3.0))


def test_non_string_top_level_keys_and_non_dict_states_are_type_errors(local_dir):
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        with pytest.raises(TypeError, match="keys must be strings"):
            ck.save(1, {1: torch.ones(1)})
        with pytest.raises(TypeError, match="dict"):
            ck.save(1, [torch.ones(1)])


def test_sparse_tensors_are_refused_with_a_hint(local_dir):
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
        with pytest.raises(ckpt.RefusedStateError, match="to_dense"):
            ck.save(1, {"sp": torch.eye(3).to_sparse()})


def test_bad_arguments_name_the_argument(local_dir, monkeypatch):
    monkeypatch.delenv("CKPT_LOCAL_DIR", raising=False)
    with pytest.raises(ValueError, match="local_dir"):
        ckpt.Checkpointer()
    with pytest.raises(ValueError, match="if_busy"):
        ckpt.Checkpointer(local_dir=local_dir, if_busy="drop")
    with pytest.raises(ValueError, match="every_steps"):
        ckpt.Checkpointer(local_dir=local_dir, every_steps=0)
    with pytest.raises(ValueError, match="Retention"):
        ckpt.Retention(local=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        ckpt.Checkpointer(local_dir=local_dir, max_in_flight=0)

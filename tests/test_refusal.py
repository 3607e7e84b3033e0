"""Values that would need pickle are refused at save time, naming their key; nothing is persisted."""

from __future__ import annotations


import pytest
import torch

import ckpt


class Opaque:
    pass


def test_a_non_json_value_is_refused_with_its_key_named(local_dir):
    state = {"w": torch.ones(2), "extras": {"fn": Opaque()}}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.RefusedStateError) as ei:
            ck.save(1, state)
        assert ei.value.path == "extras/fn"
        assert ck.list() == []
        ck.save(2, {"w": torch.ones(2)}).wait()  # the checkpointer is still usable
    assert not (local_dir / "step-000000001").exists()


def test_a_set_and_a_lambda_are_refused_too(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        for key, value in (("s", {1, 2}), ("cb", lambda: 0)):
            with pytest.raises(ckpt.RefusedStateError) as ei:
                ck.save(1, {key: value})
            assert ei.value.path == key


def test_on_unsupported_skip_leaves_such_values_out_and_keeps_them_on_restore(local_dir):
    keep = Opaque()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(on_unsupported="skip")
    ) as ck:
        ck.save(1, {"w": torch.full((2,), 3.0), "obj": Opaque()}).wait()
    target = {"w": torch.zeros(2), "obj": keep}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(target) == 1
    assert target["obj"] is keep and torch.equal(target["w"], torch.full((2,), 3.0))


def test_non_string_top_level_keys_and_non_dict_states_are_type_errors(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(TypeError, match="keys must be strings"):
            ck.save(1, {1: torch.ones(1)})
        with pytest.raises(TypeError, match="dict"):
            ck.save(1, [torch.ones(1)])


def test_sparse_tensors_are_refused_with_a_hint(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.RefusedStateError) as ei:
            ck.save(1, {"sp": torch.eye(3).to_sparse()})
        assert ei.value.path == "sp"


def test_bad_arguments_name_the_argument(local_dir, monkeypatch):
    monkeypatch.delenv("CKPT_LOCAL_DIR", raising=False)
    with pytest.raises(ValueError, match="local_dir"):
        ckpt.Checkpointer()
    with pytest.raises(ValueError, match="if_busy"):
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(if_busy="drop"))
    with pytest.raises(ValueError, match="every_steps"):
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(every_steps=0))
    with pytest.raises(ValueError, match="Retention"):
        ckpt.Retention(local=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir, max_in_flight=0))


_BYTE_DTYPES = [
    n
    for n in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, n)
]
_UNSTORED_DTYPES = [n for n in ("complex32", "uint4", "int4", "bits8") if hasattr(torch, n)]


@pytest.mark.parametrize("name", _BYTE_DTYPES)
def test_one_byte_float_dtypes_round_trip_bit_exact(local_dir, name):
    """MX / fp8 / fp4 dtypes (scales, packed weights) are kept as their bytes, tensors and dtype values alike."""
    dt = getattr(torch, name)
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)  # every bit pattern
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": raw.view(dt), "extras": {"dtype": dt}}).wait()
    target = {"w": torch.zeros(16, 16, dtype=torch.uint8).view(dt), "extras": {"dtype": None}}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(target) == 1
    assert target["w"].dtype == dt and torch.equal(target["w"].view(torch.uint8), raw)
    assert target["extras"]["dtype"] == dt


@pytest.mark.parametrize("name", _BYTE_DTYPES)
def test_byte_dtypes_restore_and_export_under_deterministic_algorithms(tmp_path, local_dir, name):
    """``torch.use_deterministic_algorithms(True)`` (also what Lightning's ``deterministic=True`` sets) makes
    torch fill new memory, and torch has no fill for the packed fp4 dtype: every tensor a restore or an
    export allocates (a key missing from the target, a stand-in for a non-contiguous target) must still come."""
    dt = getattr(torch, name)
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": raw.view(dt), "t": raw.view(dt)}).wait()
    torch.use_deterministic_algorithms(True)  # the conftest fixture turns it off again
    stand_in = torch.zeros(16, 16, dtype=torch.uint8).t().view(dt)  # fits, not contiguous
    target = {"w": None, "t": stand_in}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(target) == 1
    assert target["w"].dtype == dt and torch.equal(target["w"].view(torch.uint8), raw)
    assert target["t"] is stand_in and torch.equal(stand_in.view(torch.uint8).contiguous(), raw)
    info = ckpt.export(local_dir, tmp_path / "out", format="torch")
    assert info.tensors == 2


@pytest.mark.parametrize("name", _UNSTORED_DTYPES)
def test_a_dtype_the_format_does_not_store_is_refused_naming_the_key(local_dir, name):
    dt = getattr(torch, name)
    torch.use_deterministic_algorithms(True)  # the refusal must not depend on torch's global modes
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.RefusedStateError) as ei:
            ck.save(
                1,
                {
                    "model": {
                        "layer.w": torch.zeros(0, dtype=torch.uint8).view(dt)
                        if dt.itemsize == 1
                        else torch.zeros(0, dtype=dt)
                    }
                },
            )
        assert ei.value.path == "model/layer.w"
        with pytest.raises(ckpt.RefusedStateError):  # a dtype value in the state too
            ck.save(1, {"extras": {"dtype": dt}})
        assert ck.list() == []
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(on_unsupported="skip")
    ) as ck:  # a value can be left out
        ck.save(2, {"w": torch.ones(2), "extras": {"dtype": dt}}).wait()
        assert [c.step for c in ck.list()] == [2]

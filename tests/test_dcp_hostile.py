"""Hostile, endless and non-regular files under a DCP checkpoint (:mod:`ckpt.integrations.dcp`): each
is a clear error naming the file, the reader falls back to the next tier, and one bad checkpoint
never breaks ``ckpt ls/verify/gc --dcp`` for the others."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt import values
from ckpt.cli import main as cli_main
from ckpt.errors import CorruptCheckpointError, RefusedStateError
from ckpt.integrations import dcp as dcp_adapter
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter
from ckpt.integrity import checksum
from ckpt.plan import flatten
from test_corruption import hang_detector
from test_dcp_adapter import _check, _fresh, _inner, _state, _tiers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
DEEP = 100_000


def _save(tmp_path, *ids):
    for i in ids:
        dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id=i)


def _put_metadata(step: Path, raw: bytes) -> None:
    """Replace a checkpoint's metadata.json and make its COMMIT vouch for it."""
    (step / "metadata.json").write_bytes(raw)
    commit = json.loads((step / "COMMIT").read_text())
    commit.update(metadata_bytes=len(raw), metadata_checksum=checksum(raw))
    (step / "COMMIT").write_text(json.dumps(commit))


def _edit_metadata(step: Path, edit) -> None:
    meta = json.loads((step / "metadata.json").read_text())
    edit(meta)
    _put_metadata(step, json.dumps(meta).encode())


def _item(meta, fqn):
    return next(i for i in meta["items"] if i["index"]["fqn"] == fqn)


def _loads_from_remote(tmp_path, name):
    """dcp.load of step-2 skips the local tier with a warning naming ``name`` and loads from the remote."""
    reader = TierStorageReader(**_tiers(tmp_path))
    loaded = _fresh()
    with hang_detector(), pytest.warns(UserWarning, match=name.replace(".", r"\.")):
        dcp.load(loaded, storage_reader=reader, checkpoint_id="step-2")
    assert reader.source == f"file://{tmp_path}/remote"
    _check(loaded)


def _cli(capsys, *args):
    capsys.readouterr()
    with hang_detector():
        rc = cli_main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _verify_reports_one_bad(tmp_path, capsys, name):
    rc, rows = _cli(capsys, "verify", str(tmp_path / "local"), "--dcp")
    res = {r["id"]: r for r in rows}
    assert rc == 1 and res["step-1"]["ok"] and not res["step-2"]["ok"] and name in res["step-2"]["error"]


def test_deeply_nested_metadata_is_corrupt_the_remote_copy_is_used_and_the_cli_goes_on(tmp_path, capsys):
    _save(tmp_path, "step-1", "step-2")
    step = tmp_path / "local" / "step-2"
    meta = json.loads((step / "metadata.json").read_text())
    meta["planner_data"] = "@DEEP@"
    _put_metadata(step, json.dumps(meta).replace('"@DEEP@"', "[" * DEEP + "]" * DEEP).encode())
    _loads_from_remote(tmp_path, "metadata.json")
    _verify_reports_one_bad(tmp_path, capsys, "metadata.json")


def test_a_deeply_nested_commit_breaks_only_its_own_checkpoint_for_ls_verify_and_gc(tmp_path, capsys):
    _save(tmp_path, "step-1", "step-2", "step-3")
    c = tmp_path / "local" / "step-2" / "COMMIT"
    c.write_bytes(c.read_bytes()[:-1] + b', "x": ' + b"[" * DEEP + b"]" * DEEP + b"}")
    _loads_from_remote(tmp_path, "COMMIT")
    rc, rows = _cli(capsys, "ls", str(tmp_path / "local"), "--dcp")
    assert rc == 0 and [r["id"] for r in rows] == ["step-1", "step-3"]
    capsys.readouterr()
    with hang_detector():
        assert cli_main(["verify", str(tmp_path / "local"), "--dcp", "--id", "step-2"]) == 1
    assert "COMMIT" in capsys.readouterr().out
    with hang_detector():
        assert cli_main(["gc", str(tmp_path / "local"), "--dcp", "--keep", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step-2", "step-3"]


@pytest.mark.parametrize("name", ["metadata.json", "COMMIT", "rank-00000.dcp.bin"])
def test_a_fifo_in_the_local_tier_is_refused_without_blocking(tmp_path, capsys, name):
    _save(tmp_path, "step-1", "step-2")
    p = tmp_path / "local" / "step-2" / name
    p.unlink()
    os.mkfifo(p)
    if name == "rank-00000.dcp.bin":  # the metadata is fine: the items come from the remote tier instead
        reader = TierStorageReader(**_tiers(tmp_path))
        loaded = _fresh()
        with hang_detector(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(loaded, storage_reader=reader, checkpoint_id="step-2")
        _check(loaded)
    else:
        _loads_from_remote(tmp_path, name)
    rc, rows = _cli(capsys, "ls", str(tmp_path / "local"), "--dcp")
    assert rc == 0 and [r["id"] for r in rows] == (["step-1"] if name == "COMMIT" else ["step-1", "step-2"])
    if name == "COMMIT":  # not listed, so not verified with the others: name it
        rc, rows = _cli(capsys, "verify", str(tmp_path / "local"), "--dcp", "--id", "step-2")
        assert rc == 1 and not rows[0]["ok"] and name in rows[0]["error"]
    else:
        _verify_reports_one_bad(tmp_path, capsys, name)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: _item(m, "model.empty").update(shape=[2**70, 0]),
        lambda m: (
            m["state"]["model.empty"].update(size=[2**70, 0])
            or m["state"]["model.empty"]["chunks"][0].update(sizes=[2**70, 0])
        ),
        lambda m: _item(m, "model.w").update(shape=[3, 5]),  # not its chunk's shape
        lambda m: _item(m, "model.i").update(dtype="float64"),  # not the entry's dtype
        lambda m: _item(m, "model.i").update(offset_bytes=_item(m, "model.w")["offset_bytes"]),  # overlap
        lambda m: m.update(
            storage_meta={"checkpoint_id": None, "save_id": None, "load_id": None, "modules": 5}
        ),
        lambda m: _item(m, "model.w")["index"].update(offset=[1, 0]),  # no such chunk
        # a global size of 2**40 rows that the one saved 5-row chunk does not cover: a planner that builds the
        # state from the metadata (DCP's _load_state_dict_from_keys) would allocate 12 TiB
        lambda m: m["state"]["model.w"].update(size=[2**40, 3]),
        lambda m: m["state"]["model.w"]["chunks"].append(
            {"offsets": [0, 0], "sizes": [5, 3]}
        ),  # a chunk twice
    ],
    ids=[
        "item-shape-2^70x0",
        "size-2^70x0",
        "item-shape",
        "item-dtype",
        "overlap",
        "storage-meta",
        "no-chunk",
        "size-not-covered",
        "chunk-twice",
    ],
)
def test_hostile_metadata_fields_are_corrupt_and_the_remote_copy_is_used(tmp_path, capsys, edit):
    _save(tmp_path, "step-1", "step-2")
    _edit_metadata(tmp_path / "local" / "step-2", edit)
    _loads_from_remote(tmp_path, "metadata.json")
    _verify_reports_one_bad(tmp_path, capsys, "metadata.json")


def test_a_deeply_nested_value_in_a_rank_file_is_corrupt_and_named(tmp_path):
    _save(tmp_path, "step-2")
    step = tmp_path / "local" / "step-2"
    data = step / "rank-00000.dcp.bin"
    deep = b"[" * DEEP + b"]" * DEEP
    start = data.stat().st_size
    with open(data, "ab") as f:
        f.write(deep)
    _edit_metadata(
        step, lambda m: _item(m, "optim.nan").update(offset_bytes=start, length=len(deep), crc=checksum(deep))
    )
    with pytest.raises(CheckpointException) as e:
        dcp.load(
            _fresh(), storage_reader=TierStorageReader(local_dir=tmp_path / "local"), checkpoint_id="step-2"
        )
    err = _inner(e.value)
    assert isinstance(err, CorruptCheckpointError) and "optim.nan" in str(err)


def test_a_value_nested_too_deep_is_refused_at_save_with_its_key(tmp_path):
    """(DCP's own planner walks the state recursively before the writer sees it, so a value much deeper
    than this fails inside torch.distributed.checkpoint itself.)"""
    from ckpt.format import MAX_TREE_DEPTH

    v = 1
    for _ in range(MAX_TREE_DEPTH + 1):
        v = [v]
    state = _state()
    state["optim"]["deep"] = v
    with pytest.raises(CheckpointException) as e:
        dcp.save(state, storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    err = _inner(e.value)
    assert (
        isinstance(err, RefusedStateError)
        and err.path.startswith("optim.deep/0/0")
        and "optim.deep" in str(err)
    )
    assert not (tmp_path / "local" / "step-1" / "COMMIT").exists()


_CAPPED = textwrap.dedent("""
    import json, resource, sys, warnings
    import torch
    cap = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    from ckpt.integrations.dcp import TierStorageReader, list_checkpoints
    root = sys.argv[1]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        reader = TierStorageReader(local_dir=root + "/local", url="file://" + root + "/remote",
                                   checkpoint_id="step-2")
        reader.read_metadata()
        ids = [r["id"] for r in list_checkpoints(root + "/local")]
    print(json.dumps({"source": reader.source, "ids": ids, "warnings": [str(x.message) for x in w]}))
""")


@pytest.mark.parametrize("how", ["sparse-2gib", "dev-zero"])
@pytest.mark.parametrize("name", ["metadata.json", "COMMIT"])
def test_a_huge_or_endless_record_is_refused_unread(tmp_path, name, how):
    _save(tmp_path, "step-1", "step-2")
    p = tmp_path / "local" / "step-2" / name
    if how == "dev-zero":
        p.unlink()
        p.symlink_to("/dev/zero")
    else:
        with open(p, "r+b") as f:
            f.truncate(2 << 30)
    r = subprocess.run(
        [sys.executable, "-c", _CAPPED, str(tmp_path), str(1536 << 20)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["source"] == f"file://{tmp_path}/remote"
    assert any(name in w for w in out["warnings"])
    assert out["ids"] == (["step-1"] if name == "COMMIT" else ["step-1", "step-2"])


# -- non-tensor values (ckpt.values, the engine's encoding): hostile ones, and the tags of before ----------
def _old_to_json(value, where=None):
    """The fixture that writes a checkpoint as the adapter did before it shared the engine's encoding: its
    value encoder of then, with its own tags for non-finite floats ($float) and non-string-key dicts ($dict)
    ($tuple, $bytes and $bytesio were already the same)."""
    if (
        value is None
        or isinstance(value, (bool, int, str))
        or (isinstance(value, float) and math.isfinite(value))
    ):
        return value
    if isinstance(value, float):
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, io.BytesIO):
        return {"$bytesio": base64.b64encode(value.getbuffer()).decode("ascii"), "pos": value.tell()}
    if isinstance(value, (list, tuple)):
        items = [_old_to_json(v) for v in value]
        return items if isinstance(value, list) else {"$tuple": items}
    if all(isinstance(k, str) and not k.startswith("$") for k in value):
        return {k: _old_to_json(v) for k, v in value.items()}
    return {"$dict": [[k, _old_to_json(v)] for k, v in value.items()]}


def _old_from_json(obj):
    """The adapter's value reader of before (its dispatch; base64 and position checks left out): what a
    reader older than the shared encoding does with a value written now."""
    if isinstance(obj, list):
        return [_old_from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and obj.get("$float") in ("nan", "inf", "-inf"):
        return float(obj["$float"])
    if len(obj) == 1 and isinstance(obj.get("$bytes"), str):
        return base64.b64decode(obj["$bytes"])
    if set(obj) == {"$bytesio", "pos"} and isinstance(obj["$bytesio"], str):
        buf = io.BytesIO(base64.b64decode(obj["$bytesio"]))
        buf.seek(obj["pos"])
        return buf
    if len(obj) == 1 and isinstance(obj.get("$tuple"), list):
        return tuple(_old_from_json(v) for v in obj["$tuple"])
    if len(obj) == 1 and isinstance(obj.get("$dict"), list):
        return {k: _old_from_json(v) for k, v in obj["$dict"]}
    if any(k.startswith("$") for k in obj):
        raise CorruptCheckpointError(f"unknown tagged value {sorted(obj)!r}")
    return {k: _old_from_json(v) for k, v in obj.items()}


def _values():
    buf = io.BytesIO(b"\x00loss-history\xff")
    buf.seek(4)
    return {
        "w": torch.arange(6.0).reshape(2, 3),
        "nan": float("nan"),
        "infs": (float("inf"), [float("-inf"), 1.5, "s"]),
        "pairs": ({1: "one", 2: (b"\x00\xff", None), "$k": True},),
        "blob": b"\x01\x02",
        "buf": buf,
    }


def _check_values(out):
    assert torch.equal(out["w"], torch.arange(6.0).reshape(2, 3))
    assert math.isnan(out["nan"]) and out["infs"] == (float("inf"), [float("-inf"), 1.5, "s"])
    assert out["pairs"] == ({1: "one", 2: (b"\x00\xff", None), "$k": True},)
    assert type(out["blob"]) is bytes and out["blob"] == b"\x01\x02"
    assert out["buf"].getvalue() == b"\x00loss-history\xff" and out["buf"].tell() == 4


def _load_values(tmp_path, ckpt_id, **tiers):
    out = {"w": torch.zeros(2, 3), "nan": 0.0, "infs": None, "pairs": None, "blob": b"", "buf": io.BytesIO()}
    dcp.load(out, storage_reader=TierStorageReader(**(tiers or _tiers(tmp_path))), checkpoint_id=ckpt_id)
    return out


def _save_old(tmp_path, ckpt_id):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dcp_adapter, "_to_json", _old_to_json)
        dcp.save(_values(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id=ckpt_id)
    raw = (tmp_path / "local" / ckpt_id / "rank-00000.dcp.bin").read_bytes()
    assert all(t in raw for t in (b'"$float"', b'"$dict"', b'"$bytes"', b'"$bytesio"', b'"$tuple"'))


def test_a_checkpoint_written_with_the_old_value_tags_still_loads(tmp_path):
    _save_old(tmp_path, "step-1")
    _check_values(_load_values(tmp_path, "step-1"))
    # a new save of the same state uses the one encoding only
    dcp.save(_values(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-2")
    raw = (tmp_path / "local" / "step-2" / "rank-00000.dcp.bin").read_bytes()
    assert b'"$float"' not in raw and b'"$dict"' not in raw and b'"$f"' in raw and b'"$d"' in raw
    _check_values(_load_values(tmp_path, "step-2"))


def test_a_reader_of_before_refuses_the_new_tags_rather_than_misreading_them():
    """Why the format version stays 1: a value written now either reads the same with the old reader
    (its tags were already the old ones) or the old reader refuses it (CorruptCheckpointError)."""
    fresh, stale = 0, 0
    for v in _values().values():
        if isinstance(v, torch.Tensor):
            continue
        node = json.loads(json.dumps(dcp_adapter._to_json(v, "x"), allow_nan=False))
        try:
            old = _old_from_json(node)
        except CorruptCheckpointError:
            stale += 1
            continue
        fresh += 1
        new = values.decode(node, "x")
        assert type(old) is type(new)
        if isinstance(new, io.BytesIO):
            assert (old.getvalue(), old.tell()) == (new.getvalue(), new.tell())
        else:
            assert repr(old) == repr(new)
    assert fresh and stale


_HOSTILE_VALUES = {
    "deep-tuples-100k": b'{"$tuple": [' * DEEP + b"]}" * DEEP,
    "bytesio-pos-2^60": {"$bytesio": "AQI=", "pos": 2**60},
    "bytesio-pos-negative": {"$bytesio": "AQI=", "pos": -1},
    "float-payload-int": {"$f": 1},
    "float-payload-word": {"$f": "1e999"},
    "tuple-payload-str": {"$tuple": "ab"},
    "dict-payload-object": {"$d": {"a": 1}},
    "dict-pair-of-one": {"$d": [[1]]},
    "dict-key-list": {"$d": [[[1], 2]]},
    "bytes-payload-int": {"$bytes": 5},
    "bytes-not-base64": {"$bytes": "not base64!"},
    "unknown-tag": {"$code": "os.system"},
    "tag-with-other-keys": {"$f": "nan", "x": 1},
    "two-tags": {"$tuple": [], "$d": []},
    "old-tag-with-other-keys": {"$float": "nan", "pos": 0},
    "nested-unknown-tag": [1, {"a": ({"$tuple": [{"$eval": 1}]})}],
}


@pytest.mark.parametrize("value", list(_HOSTILE_VALUES.values()), ids=list(_HOSTILE_VALUES))
def test_a_hostile_value_in_a_rank_file_is_corrupt_and_named_and_an_old_good_checkpoint_loads(
    tmp_path, value
):
    _save_old(tmp_path, "step-1")
    _save(tmp_path, "step-2")
    step = tmp_path / "local" / "step-2"
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    data = step / "rank-00000.dcp.bin"
    start = data.stat().st_size
    with open(data, "ab") as f:
        f.write(raw)
    _edit_metadata(
        step, lambda m: _item(m, "optim.nan").update(offset_bytes=start, length=len(raw), crc=checksum(raw))
    )
    with hang_detector(), pytest.raises(CheckpointException) as e:
        dcp.load(
            _fresh(), storage_reader=TierStorageReader(local_dir=tmp_path / "local"), checkpoint_id="step-2"
        )
    err = _inner(e.value)
    assert isinstance(err, CorruptCheckpointError) and "optim.nan" in str(err)
    _check_values(_load_values(tmp_path, "step-1", local_dir=tmp_path / "local"))


def test_hostile_nodes_given_to_the_decoder_directly_are_corrupt_without_recursing():
    deep = [1]
    for _ in range(DEEP):
        deep = {"$tuple": [deep]}
    for node in (deep, *(v for v in _HOSTILE_VALUES.values() if not isinstance(v, bytes))):
        with pytest.raises(CorruptCheckpointError):
            values.decode(node, "x", legacy=True)


class _Opaque:
    pass


@pytest.mark.parametrize(
    "value,path",
    [
        (_Opaque(), "v/0"),
        ({1, 2}, "v/0"),
        ({(1, 2): "tuple key"}, "v/0"),
        (io.BytesIO(b"ab"), None),  # positioned past its end below
    ],
    ids=["object", "set", "tuple-key", "bytesio-past-end"],
)
def test_a_value_that_would_need_pickle_is_refused_by_the_one_encoder_with_its_key(value, path):
    if isinstance(value, io.BytesIO):
        value.seek(2**60)
    for encode in (lambda v: dcp_adapter._to_json(v, "v"), lambda v: flatten({"v": v})):
        with pytest.raises(RefusedStateError) as e:
            encode([value])
        assert e.value.path == "v/0"


def test_a_value_100k_levels_deep_is_refused_at_save_by_both_writers():
    deep = 1
    for _ in range(DEEP):
        deep = [deep]
    for encode in (lambda v: dcp_adapter._to_json(v, "v"), lambda v: flatten({"v": v})):
        with pytest.raises(RefusedStateError) as e:
            encode(deep)
        assert e.value.path.startswith("v/0/0") and "levels deep" in str(e.value)

"""Hostile, endless and non-regular files under a DCP checkpoint (:mod:`ckpt.integrations.dcp`): each
is a clear error naming the file, the reader falls back to the next tier, and one bad checkpoint
never breaks ``ckpt ls/verify/gc --dcp`` for the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt.cli import main as cli_main
from ckpt.errors import CorruptCheckpointError
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter
from ckpt.integrity import checksum
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
    assert isinstance(err, ValueError) and "optim.deep" in str(err)
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

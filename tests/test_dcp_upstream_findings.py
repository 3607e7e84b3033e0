"""Defects of :mod:`ckpt.integrations.dcp` found by running PyTorch's own DCP storage tests
(``test/distributed/checkpoint/``) against ``TierStorageWriter`` / ``TierStorageReader``; each test
here is ours, written for the behaviour DCP's ``FileSystemWriter`` / ``FileSystemReader`` have:

* ``bytes`` and ``io.BytesIO`` values (DCP's planners treat them as plain values, like ``str``; the
  upstream e2e test's train state keeps its loss history as a ``BytesIO``) were refused at save;
* the saved metadata had no ``storage_meta`` (checkpoint id, ``save_id``; ``load_id`` on load);
* ``dcp.save(use_collectives=False)`` on several ranks: every rank wrote rank 0's file and its own
  ``COMMIT``, so every rank loaded the last rank's state;
* a save planner's ``resolve_data`` / ``transform_object`` hook was bypassed for values.

Run as ``python test_dcp_upstream_findings.py ROOT RANK WORLD MODE`` it is the child of the
multi-rank test (one gloo rank on the CPU).
"""

from __future__ import annotations

import io
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from ckpt.errors import CorruptCheckpointError
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter

HERE = Path(__file__).parent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tiers(root: Path) -> dict:
    return {"local_dir": root / "local", "url": f"file://{root}/remote"}


def _losses(values) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(values, buf)  # what a torchtitan-style train state keeps (its own bytes, written by the user)
    return buf


@pytest.mark.parametrize("tiers", ["local", "remote", "both"])
def test_bytes_and_bytesio_values_round_trip_as_themselves(tmp_path, tiers):
    kw = _tiers(tmp_path)
    kw = {"local": {"local_dir": kw["local_dir"]}, "remote": {"url": kw["url"]}, "both": kw}[tiers]
    losses = _losses([0.5, 0.25])
    losses.seek(3)  # a position that is not the end: kept, as a torch.save of the BytesIO keeps it
    state = {
        "w": torch.arange(4.0),
        "loader": b"\x00\xff\x80rank-state",
        "empty": b"",
        "train": {"losses": losses, "pairs": [b"a", (b"b", io.BytesIO(b"c"))]},
    }
    dcp.save(state, storage_writer=TierStorageWriter(**kw), checkpoint_id="step-1")

    out = {
        "w": torch.zeros(4),
        "loader": b"",
        "empty": None,
        "train": {"losses": io.BytesIO(), "pairs": None},
    }
    dcp.load(out, storage_reader=TierStorageReader(**kw), checkpoint_id="step-1")
    assert torch.equal(out["w"], torch.arange(4.0))
    assert type(out["loader"]) is bytes and out["loader"] == b"\x00\xff\x80rank-state"
    assert out["empty"] == b""
    got = out["train"]["losses"]
    assert isinstance(got, io.BytesIO) and got.getvalue() == losses.getvalue() and got.tell() == 3
    got.seek(0)
    assert torch.load(got) == [0.5, 0.25]
    pairs = out["train"]["pairs"]
    assert pairs[0] == b"a" and isinstance(pairs[1], tuple) and pairs[1][0] == b"b"
    assert isinstance(pairs[1][1], io.BytesIO) and pairs[1][1].getvalue() == b"c"


def test_bytes_are_stored_as_json_text_and_malformed_base64_is_corrupt(tmp_path):
    from ckpt.integrations.dcp import _from_json

    root = tmp_path / "local"
    dcp.save({"blob": b"\x01\x02"}, storage_writer=TierStorageWriter(local_dir=root), checkpoint_id="c")
    meta = json.loads((root / "c" / "metadata.json").read_text())
    rec = next(i for i in meta["items"] if i["index"]["fqn"] == "blob")
    raw = (root / "c" / "rank-00000.dcp.bin").read_bytes()[
        rec["offset_bytes"] : rec["offset_bytes"] + rec["length"]
    ]
    assert json.loads(raw) == {"$bytes": "AQI="}
    for bad in (
        {"$bytes": "not base64!"},
        {"$bytes": 5},
        {"$bytesio": "AQI=", "pos": -1},
        {"$bytesio": "AQI=", "pos": True},
        {"$bytesio": "AQI="},
    ):
        with pytest.raises(CorruptCheckpointError):
            _from_json(bad, "blob")


def test_the_metadata_records_storage_meta_with_a_save_id_and_a_load_id(tmp_path):
    writer = TierStorageWriter(**_tiers(tmp_path))
    dcp.save({"a": torch.zeros(2)}, storage_writer=writer, checkpoint_id="step-7")
    reader = TierStorageReader(**_tiers(tmp_path), checkpoint_id="step-7")
    md = reader.read_metadata()
    assert md.storage_meta is not None
    assert md.storage_meta.checkpoint_id == "step-7"
    first_save = writer.save_id
    assert md.storage_meta.save_id == first_save
    assert md.storage_meta.load_id == reader.load_id
    # a new save and a new load get new ids (DCP calls reset with each checkpoint_id)
    dcp.save({"a": torch.ones(2)}, storage_writer=writer, checkpoint_id="step-8")
    assert writer.save_id != first_save
    before = reader.load_id
    reader.reset("step-8")
    md = reader.read_metadata()
    assert md.storage_meta.save_id == writer.save_id and md.storage_meta.load_id == reader.load_id != before


class _Redacting(DefaultSavePlanner):
    """A save planner hook of the kind DCP documents: it changes what gets stored for one value."""

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO and write_item.index.fqn == "token":
            object = "<redacted>"
        return super().transform_object(write_item, object)


class _OwnBytes(DefaultSavePlanner):
    """A planner whose value bytes are its own format, not torch.save output."""

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(b"my own format")
        return super().resolve_data(write_item)


def test_a_save_planner_hook_decides_what_a_value_is_stored_as(tmp_path):
    kw = _tiers(tmp_path)
    dcp.save(
        {"token": "secret", "t": torch.ones(2)},
        storage_writer=TierStorageWriter(**kw),
        checkpoint_id="step-1",
        planner=_Redacting(),
    )
    out = {"token": None, "t": torch.zeros(2)}
    dcp.load(out, storage_reader=TierStorageReader(**kw), checkpoint_id="step-1")
    assert out["token"] == "<redacted>" and torch.equal(out["t"], torch.ones(2))
    # bytes that are no torch.save of plain data are refused at save (never stored opaque), by key
    with pytest.raises(CheckpointException) as e:
        dcp.save(
            {"token": "x"},
            storage_writer=TierStorageWriter(**kw),
            checkpoint_id="step-2",
            planner=_OwnBytes(),
        )
    inner = e.value.failures[0][0]
    assert isinstance(inner, ValueError) and "'token'" in str(inner)
    assert not (tmp_path / "local" / "step-2" / "COMMIT").exists()


def test_use_collectives_false_gives_every_rank_its_own_state_back(tmp_path):
    from helpers import assert_ok, run_ranks

    results = run_ranks(Path(__file__), str(tmp_path), "no-collectives", world=2)
    assert_ok(results)
    lines = sorted(l for r in results for l in r.stdout.splitlines() if l.startswith("loaded"))
    assert lines == ["loaded 0 1.0 0 'r0'", "loaded 1 2.0 1 'r1'"]
    for rank in (0, 1):  # each rank committed a checkpoint of its own, locally and remotely
        for tier in ("local", "remote"):
            assert (tmp_path / tier / "step-1" / f"rank-{rank:05d}" / "COMMIT").exists()
    assert not (tmp_path / "local" / "step-1" / "COMMIT").exists()


def _child() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    assert mode == "no-collectives"
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    tiers = _tiers(Path(root))
    try:
        # an earlier collective save under the same id: the rank-local saves below replace it
        dcp.save(
            {"w": torch.full((3,), -1.0), "r": -1, "b": "old"},
            storage_writer=TierStorageWriter(**tiers),
            checkpoint_id="step-1",
        )
        state = {"w": torch.full((3,), float(rank + 1)), "r": rank, "b": f"r{rank}"}
        dcp.save(
            state, storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-1", use_collectives=False
        )
        torch.distributed.barrier()
        out = {"w": torch.zeros(3), "r": None, "b": None}
        dcp.load(out, storage_reader=TierStorageReader(**tiers), checkpoint_id="step-1")
        w = out["w"]
        assert torch.equal(w, torch.full((3,), w[0].item()))
        print(f"loaded {rank} {w[0].item()} {out['r']} {out['b']!r}", flush=True)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _child()

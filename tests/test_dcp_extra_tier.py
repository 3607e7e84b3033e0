"""The DCP adapter over a tier of one's own (issue 37): the second disk of tests/test_extra_tier.py (a
:class:`~ckpt.tiers.LocalTier` subclass registered as ``"disk2"``, nearness 15), given as
``storage=ckpt.Storage(..., extra_tiers={"disk2": DIR})``, gets each rank's file, ``metadata.json`` and
``COMMIT`` like ``local_dir``, keeps its own retention count, serves a load item by item when the nearer
tier is gone or torn, and is listed and verified by the functions and commands of the adapter.

Run as a script (``python test_dcp_extra_tier.py ROOT RANK WORLD MODE``, through :func:`helpers.run_ranks`)
it is one gloo rank of a two-node job: each rank's node has its own ``local_dir`` and second disk, beside a
shared ``file://`` URL.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.cli import main as cli
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter, list_checkpoints, prune, verify
from ckpt.tiers import RemoteTier
from test_extra_tier import SecondDisk, ThirdDisk

HERE = Path(__file__).parent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FILES = ["COMMIT", "metadata.json", "rank-00000.dcp.bin"]


def _storage(root: Path, **more) -> ckpt.Storage:
    return ckpt.Storage(local_dir=root / "nvme", extra_tiers={"disk2": root / "hdd"}, **more)


def _state(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v))
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g) + v,
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "nan": torch.tensor([float("nan"), -0.0, v]),
        },
        "extra": {"step": int(v), "name": "run", "betas": (0.9, 0.95)},
    }


def _zeros() -> dict:
    st = _state(0.0)
    st["model"] = {k: torch.zeros_like(t) for k, t in st["model"].items()}
    st["extra"] = {"step": -1, "name": "", "betas": None}
    return st


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _same_bits(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k, t in want["model"].items():
        assert got["model"][k].dtype == t.dtype and _bits(got["model"][k]) == _bits(t), k
    assert got["extra"] == want["extra"] and isinstance(got["extra"]["betas"], tuple)


def _ids(where) -> list[str]:
    return sorted(r["id"] for r in list_checkpoints(where))


def test_a_registered_tier_gets_each_file_and_commit_and_serves_the_load_when_local_dir_is_gone(
    tmp_path, capsys
):
    nvme, hdd = tmp_path / "nvme", tmp_path / "hdd"
    dcp.save(
        _state(1.0), storage_writer=TierStorageWriter(storage=_storage(tmp_path)), checkpoint_id="step-1"
    )
    # both tiers hold the checkpoint, committed, the rank's file the same bytes
    for root in (nvme, hdd):
        assert sorted(p.name for p in (root / "step-1").iterdir()) == FILES, root
    assert (nvme / "step-1" / FILES[2]).read_bytes() == (hdd / "step-1" / FILES[2]).read_bytes()

    # the node's NVMe is gone: the load reads the second disk, bit for bit
    shutil.rmtree(nvme)
    loaded = _zeros()
    reader = TierStorageReader(storage=_storage(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "TierStorageReader")  # a tier that is simply absent is no corruption
        dcp.load(loaded, storage_reader=reader, checkpoint_id="step-1")
    _same_bits(loaded, _state(1.0))
    assert reader.source == str(hdd) and reader.committed == [str(hdd)]

    # list and verify it: by path, as the engine's tier, and on the command line
    assert _ids(hdd) == _ids(SecondDisk(hdd)) == ["step-1"]
    info = verify(SecondDisk(hdd), "step-1")
    assert info["id"] == "step-1" and info["items"] == 6 and info["bytes"] > 64 * 32 * 4
    assert verify(hdd, "step-1") == info
    assert cli(["ls", str(hdd), "--dcp", "--json"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == ["step-1"]
    assert cli(["verify", str(hdd), "--dcp"]) == 0
    (hdd / "step-1" / FILES[2]).write_bytes(b"\0" * 64)  # a torn copy is named
    with pytest.raises(ckpt.CorruptCheckpointError, match="rank-00000.dcp.bin"):
        verify(hdd, "step-1")
    assert cli(["verify", str(hdd), "--dcp"]) == 1


def test_the_reader_falls_back_to_the_registered_tier_item_by_item(tmp_path):
    """A torn item on local_dir is read from the second disk (with a warning); the others from local_dir. With
    local_dir's COMMIT gone, the metadata comes from the second disk and every item still from local_dir."""
    nvme, hdd = tmp_path / "nvme", tmp_path / "hdd"
    dcp.save(
        _state(2.0), storage_writer=TierStorageWriter(storage=_storage(tmp_path)), checkpoint_id="step-2"
    )
    meta = json.loads((nvme / "step-2" / "metadata.json").read_bytes())
    (w,) = [it for it in meta["items"] if it["index"]["fqn"] == "model.w"]
    data = bytearray((nvme / "step-2" / FILES[2]).read_bytes())
    data[w["offset_bytes"] + 5] ^= 0xFF
    (nvme / "step-2" / FILES[2]).write_bytes(bytes(data))
    reads = []  # (tier, whether its copy was good) for every item read
    from ckpt.integrations import dcp as adapter

    item = adapter._Tier.item

    def spy(self, ckpt_id, rec):
        got = item(self, ckpt_id, rec)
        reads.append((self.name, got[1]))
        return got

    loaded = _zeros()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(adapter._Tier, "item", spy)
        with pytest.warns(UserWarning, match=r"'model.w' .* fails its checksum .* trying the next tier"):
            dcp.load(
                loaded, storage_reader=TierStorageReader(storage=_storage(tmp_path)), checkpoint_id="step-2"
            )
    _same_bits(loaded, _state(2.0))
    assert reads.count(("local", False)) == 1 and reads.count(("disk2", True)) == 1
    assert reads.count(("local", True)) == 5

    (nvme / "step-2" / "COMMIT").unlink()
    reads.clear()
    (nvme / "step-2" / FILES[2]).write_bytes((hdd / "step-2" / FILES[2]).read_bytes())
    reader = TierStorageReader(storage=_storage(tmp_path))
    loaded = _zeros()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(adapter._Tier, "item", spy)
        dcp.load(loaded, storage_reader=reader, checkpoint_id="step-2")
    _same_bits(loaded, _state(2.0))
    assert reader.source == str(hdd) and reads == [("local", True)] * 6


def test_retention_keeps_each_tiers_own_count(tmp_path):
    """Retention(local=1, disk2=2): each save leaves the newest one in local_dir and the newest two on the
    second disk; the older one loads from there."""
    nvme, hdd = tmp_path / "nvme", tmp_path / "hdd"
    keep = ckpt.Retention(local=1, disk2=2)
    for i in range(1, 5):
        writer = TierStorageWriter(storage=_storage(tmp_path), keep=keep)
        dcp.save(_state(float(i)), storage_writer=writer, checkpoint_id=f"step-{i}")
    assert _ids(nvme) == ["step-4"] and sorted(p.name for p in nvme.iterdir()) == ["step-4"]
    assert _ids(hdd) == ["step-3", "step-4"] and sorted(p.name for p in hdd.iterdir()) == ["step-3", "step-4"]
    loaded = _zeros()
    reader = TierStorageReader(storage=_storage(tmp_path))
    dcp.load(loaded, storage_reader=reader, checkpoint_id="step-3")
    _same_bits(loaded, _state(3.0))
    assert reader.source == str(hdd)
    # not named, the second disk keeps what its class takes (a local tier's subclass: local's count)
    for i in range(5, 7):
        writer = TierStorageWriter(storage=_storage(tmp_path), keep=ckpt.Retention(local=1))
        dcp.save(_state(float(i)), storage_writer=writer, checkpoint_id=f"step-{i}")
    assert _ids(nvme) == _ids(hdd) == ["step-6"]
    assert prune(SecondDisk(hdd), keep=1) == []


def test_a_durable_tier_of_a_kind_of_its_own_keeps_what_its_class_says(tmp_path, monkeypatch):
    """A registered directory tier whose retention is the base tier's (``keep_of``: Retention.others):
    keep=N as Retention.every_tier(N) bounds it, a Retention that does not name it keeps all of it."""
    from ckpt.tiers import base

    monkeypatch.setitem(base._REGISTRY, "disk3", ThirdDisk)
    for keep, want in ((ckpt.Retention.every_tier(2), ["step-3", "step-4"]), (ckpt.Retention(local=2), None)):
        root = tmp_path / repr(keep)
        storage = ckpt.Storage(local_dir=root / "nvme", extra_tiers={"disk3": root / "hdd"})
        for i in range(1, 5):
            dcp.save(
                _state(float(i)),
                storage_writer=TierStorageWriter(storage=storage, keep=keep),
                checkpoint_id=f"step-{i}",
            )
        assert _ids(root / "nvme") == ["step-3", "step-4"]
        assert _ids(root / "hdd") == (want or [f"step-{i}" for i in range(1, 5)]), keep


class FarStore(RemoteTier):
    """A second store, farther than the url."""

    name = "far2"
    nearness = 35
    needs = "Storage(extra_tiers={'far2': URL})"


def test_what_the_adapter_cannot_do_is_refused_by_name_and_other_kinds_of_tier_work(tmp_path, monkeypatch):
    from ckpt.tiers import base

    with pytest.raises(ValueError, match=r"Storage\(peers=True\): the DCP adapter has no peer tier"):
        TierStorageWriter(storage=_storage(tmp_path, peers=True))
    with pytest.raises(ValueError, match=r"Storage\(compression='zstd'\)"):
        TierStorageReader(storage=_storage(tmp_path, url=f"file://{tmp_path}/r", compression="zstd"))
    with pytest.raises(
        ValueError, match=r"Storage\(max_in_flight=2\): the DCP adapter has no host-memory tier"
    ):
        TierStorageWriter(storage=_storage(tmp_path, max_in_flight=2))
    with pytest.raises(ValueError, match="'disk9'.*no registered tier"):
        TierStorageWriter(
            storage=ckpt.Storage(local_dir=tmp_path / "a", extra_tiers={"disk9": tmp_path / "b"})
        )
    with pytest.raises(ValueError, match="'memory' tier, which keeps its copies in memory"):
        TierStorageWriter(
            storage=ckpt.Storage(local_dir=tmp_path / "a", extra_tiers={"memory": tmp_path / "b"})
        )
    with pytest.raises(ValueError, match="local_dir= sets"):
        TierStorageWriter(storage=ckpt.Storage(extra_tiers={"local": tmp_path / "b"}))
    with pytest.raises(ValueError, match="one directory"):
        TierStorageWriter(
            storage=ckpt.Storage(local_dir=tmp_path / "a", extra_tiers={"disk2": tmp_path / "a"})
        )
    with pytest.raises(ValueError, match="local_dir is given twice"):
        TierStorageWriter(local_dir=tmp_path / "x", storage=_storage(tmp_path))
    with pytest.raises(TypeError, match="storage= takes a ckpt.Storage"):
        TierStorageReader(storage={"local_dir": tmp_path})
    with pytest.raises(ValueError, match="keep names the tier 'disk2'"):
        TierStorageWriter(local_dir=tmp_path / "a", keep=ckpt.Retention(disk2=1))
    # the keywords and storage= together, each field once: one tier list
    w = TierStorageWriter(url=f"file://{tmp_path}/r", storage=_storage(tmp_path))
    assert [t.name for t in w.tiers] == ["local", "disk2", "remote"]
    # a registered tier of the remote kind is a URL the rank's file is uploaded to, after the nearer ones
    monkeypatch.setitem(base._REGISTRY, "far2", FarStore)
    far = f"file://{tmp_path}/far"
    both = {"disk2": tmp_path / "hdd", "far2": far}
    w = TierStorageWriter(
        local_dir=tmp_path / "nvme", url=f"file://{tmp_path}/r", storage=ckpt.Storage(extra_tiers=both)
    )
    assert [t.name for t in w.tiers] == ["local", "disk2", "remote", "far2"]
    dcp.save(_state(3.0), storage_writer=w, checkpoint_id="s")
    assert _ids(far) == _ids(tmp_path / "hdd") == _ids(tmp_path / "nvme") == ["s"]
    loaded = _zeros()
    shutil.rmtree(tmp_path / "nvme")
    shutil.rmtree(tmp_path / "hdd")
    shutil.rmtree(tmp_path / "r")
    dcp.load(
        loaded,
        storage_reader=TierStorageReader(storage=ckpt.Storage(extra_tiers={"far2": far})),
        checkpoint_id="s",
    )
    _same_bits(loaded, _state(3.0))
    with pytest.raises(ValueError, match="are all URLs"):
        TierStorageWriter(storage=ckpt.Storage(url=f"file://{tmp_path}/r", extra_tiers={"far2": far}))
    # the second disk alone is a writer's nearest directory
    alone = ckpt.Storage(extra_tiers={"disk2": tmp_path / "hdd"}, url=f"file://{tmp_path}/r")
    dcp.save(_state(3.0), storage_writer=TierStorageWriter(storage=alone), checkpoint_id="s")
    assert _ids(tmp_path / "hdd") == _ids(f"file://{tmp_path}/r") == ["s"]


def test_a_two_node_job_writes_each_nodes_second_disk_and_reads_a_lost_nodes_items_from_it(tmp_path):
    """Two gloo ranks, one node each (local_dir and second disk of their own) and a shared URL: each node's
    second disk gets its rank's file, the coordinator's also the metadata and COMMIT. Node 1 loses its NVMe
    and the URL loses rank 1's file: rank 1's items come from its second disk."""
    from helpers import assert_ok, run_ranks

    assert_ok(run_ranks(Path(__file__), str(tmp_path), "save", world=2))
    assert sorted(p.name for p in (tmp_path / "hdd-0" / "step-1").iterdir()) == FILES
    assert [p.name for p in (tmp_path / "hdd-1" / "step-1").iterdir()] == ["rank-00001.dcp.bin"]
    assert (tmp_path / "remote" / "step-1" / "COMMIT").exists()
    shutil.rmtree(tmp_path / "node-1")
    (tmp_path / "remote" / "step-1" / "rank-00001.dcp.bin").unlink()
    results = run_ranks(Path(__file__), str(tmp_path), "load", world=2)
    assert_ok(results)
    assert [r.stdout.split() for r in results] == [["loaded", "0"], ["loaded", "1"]]


# -- one rank of the two-node job ---------------------------------------------------------------------------
def _rank_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {"shared": torch.arange(12.0), f"own-{rank}": torch.randn(256, generator=g)}


def _rank_main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    storage = ckpt.Storage(
        local_dir=f"{root}/node-{rank}",
        url=f"file://{root}/remote",
        extra_tiers={"disk2": f"{root}/hdd-{rank}"},
    )
    try:
        want = _rank_state(rank)
        if mode == "save":
            dcp.save(want, storage_writer=TierStorageWriter(storage=storage), checkpoint_id="step-1")
            return
        got = {k: torch.zeros_like(t) for k, t in want.items()}
        dcp.load(got, storage_reader=TierStorageReader(storage=storage), checkpoint_id="step-1")
        for k, t in want.items():
            assert _bits(got[k]) == _bits(t), k
        print("loaded", rank)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _rank_main()

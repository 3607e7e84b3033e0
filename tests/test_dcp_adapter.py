"""``dcp.save`` / ``dcp.load`` through the tiers (:mod:`ckpt.integrations.dcp`): real DCP, real
multi-process gloo jobs (tests/dcp_worker.py) and single-process checkpoints on real files."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, RefusedStateError
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter
from ckpt.integrity import checksum
from helpers import assert_ok, run_ranks

HERE = Path(__file__).parent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _inner(exc: CheckpointException) -> BaseException:
    """Rank 0's own exception inside DCP's wrapper (``failures``: rank -> (exception, trace))."""
    return exc.failures[0][0]


def _line(results, prefix):
    assert_ok(results)
    return [l for r in results for l in r.stdout.splitlines() if l.startswith(prefix)]


@pytest.mark.parametrize(
    "backend,load_world",
    [("gloo", 2), ("gloo", 3), pytest.param("nccl", 2, marks=pytest.mark.multigpu, id="nccl-two-gpus")],
)
def test_fsdp2_model_and_optimizer_saved_on_2_ranks_load_on_any_number(tmp_path, backend, load_world):
    env = {"CKPT_TEST_BACKEND": backend}
    saved = _line(run_ranks(HERE / "dcp_worker.py", str(tmp_path), "save", world=2, env=env), "digest")
    assert len(saved) == 1
    # one node per rank: each local tier holds its own rank's file, the coordinator's also the commit
    assert sorted(p.name for p in (tmp_path / "node-0" / "step-3").iterdir()) == [
        "COMMIT",
        "metadata.json",
        "rank-00000.dcp.bin",
    ]
    assert [p.name for p in (tmp_path / "node-1" / "step-3").iterdir()] == ["rank-00001.dcp.bin"]
    assert (tmp_path / "remote" / "step-3" / "COMMIT").exists()
    results = run_ranks(HERE / "dcp_worker.py", str(tmp_path), "load", world=load_world, env=env)
    assert _line(results, "digest") == saved
    extra = _line(results, "extra")
    assert (
        extra
        == ["extra {'step': 3, 'betas': (0.9, 0.95), 'name': 'run-a', 'lrs': [0.01, None, True], 'inf': inf}"]
        * load_world
    )


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(5, 3, generator=g),
            "b": torch.randn(4, generator=g).to(torch.bfloat16),
            "i": torch.arange(6).reshape(2, 3),
            "flag": torch.tensor(True),
            "s": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
        },
        "optim": {
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["w", "b"], "fused": None}],
            "nan": float("nan"),
            "ids": {"a": -1, "b": [1, 2]},
        },
    }


def _fresh():
    st = _state()
    st["model"] = {k: torch.zeros_like(v) for k, v in st["model"].items()}
    st["optim"] = {
        "param_groups": [{"lr": 0.0, "betas": None, "params": None, "fused": 1}],
        "nan": 0.0,
        "ids": {"a": 0, "b": None},
    }
    return st


def _tiers(root: Path) -> dict:
    return {"local_dir": root / "local", "url": f"file://{root}/remote"}


def _check(loaded, ref=None):
    ref = ref or _state()
    for k, v in ref["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    pg = loaded["optim"]["param_groups"][0]
    assert pg == {"lr": 1e-3, "betas": (0.9, 0.999), "params": ["w", "b"], "fused": None}
    assert isinstance(pg["betas"], tuple) and math.isnan(loaded["optim"]["nan"])
    assert loaded["optim"]["ids"] == {"a": -1, "b": [1, 2]}


def test_round_trip_in_one_process_keeps_dtypes_shapes_and_plain_values(tmp_path):
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    loaded = _fresh()
    reader = TierStorageReader(**_tiers(tmp_path))
    dcp.load(loaded, storage_reader=reader, checkpoint_id="step-1")
    _check(loaded)
    assert reader.source == str(tmp_path / "local")
    # nothing on disk is a pickle: the metadata is JSON and its records parse
    meta = json.loads((tmp_path / "local" / "step-1" / "metadata.json").read_text())
    assert meta["format"] == "ckpt.dcp" and {i["kind"] for i in meta["items"]} == {"tensor", "bytes"}


def _stored_value(root: Path, fqn: str, ckpt_id: str = "step-1"):
    """The JSON that value item ``fqn`` is stored as, read from the rank file."""
    meta = json.loads((root / ckpt_id / "metadata.json").read_text())
    rec = next(i for i in meta["items"] if i["index"]["fqn"] == fqn)
    raw = (root / ckpt_id / f"rank-{rec['rank']:05d}.dcp.bin").read_bytes()
    return json.loads(raw[rec["offset_bytes"] : rec["offset_bytes"] + rec["length"]])


def test_values_are_stored_in_the_engines_encoding(tmp_path):
    """One encoding (ckpt.values) for the engine's state tree and DCP values: the same tags for the same
    values, so a value reads the same whichever wrote it."""
    from ckpt.plan import flatten

    values = {
        "inf": float("-inf"),
        # DCP flattens nested dicts (and lists) into dotted keys, not tuples: a dict inside one stays a value
        "pair": ({1: "a", "$x": 2}, [2.5, None, float("nan")]),
        "betas": (0.9, 0.95),
    }
    dcp.save(dict(values), storage_writer=TierStorageWriter(local_dir=tmp_path), checkpoint_id="step-1")
    engine = flatten(values).tree
    for fqn in values:
        assert _stored_value(tmp_path, fqn) == engine[fqn], fqn
    assert _stored_value(tmp_path, "inf") == {"$f": "-inf"}
    assert _stored_value(tmp_path, "pair") == {
        "$tuple": [{"$d": [[1, "a"], ["$x", 2]]}, [2.5, None, {"$f": "nan"}]]
    }
    out = {"inf": 0.0, "pair": None, "betas": None}
    dcp.load(out, storage_reader=TierStorageReader(local_dir=tmp_path), checkpoint_id="step-1")
    assert out["inf"] == float("-inf") and out["betas"] == (0.9, 0.95)
    assert out["pair"][0] == {1: "a", "$x": 2} and out["pair"][1][:2] == [2.5, None]
    assert math.isnan(out["pair"][1][2])


def _corrupt_item(root: Path, fqn: str, ckpt_id: str = "step-1") -> None:
    meta = json.loads((root / ckpt_id / "metadata.json").read_text())
    rec = next(i for i in meta["items"] if i["index"]["fqn"] == fqn)
    data = root / ckpt_id / f"rank-{rec['rank']:05d}.dcp.bin"
    raw = bytearray(data.read_bytes())
    raw[rec["offset_bytes"]] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_a_corrupt_local_item_is_read_from_the_remote_tier_with_a_warning(tmp_path):
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    _corrupt_item(tmp_path / "local", "model.w")
    loaded = _fresh()
    with pytest.warns(UserWarning, match="copy of 'model.w' .* fails its checksum"):
        dcp.load(loaded, storage_reader=TierStorageReader(**_tiers(tmp_path)), checkpoint_id="step-1")
    _check(loaded)


def test_a_lost_local_tier_loads_from_remote_and_corruption_everywhere_is_named(tmp_path):
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    shutil.rmtree(tmp_path / "local")
    loaded = _fresh()
    dcp.load(loaded, storage_reader=TierStorageReader(**_tiers(tmp_path)), checkpoint_id="step-1")
    _check(loaded)
    _corrupt_item(tmp_path / "remote", "optim.nan")
    with pytest.raises(CheckpointException) as e:  # DCP wraps each rank's error (a BaseException)
        dcp.load(_fresh(), storage_reader=TierStorageReader(**_tiers(tmp_path)), checkpoint_id="step-1")
    err = _inner(e.value)
    assert isinstance(err, CorruptCheckpointError)
    assert "no tier holds a valid copy of 'optim.nan'" in str(err) and "do not match their checksum" in str(
        err
    )


def test_an_uncommitted_or_missing_checkpoint_is_refused_with_every_tier_named(tmp_path):
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    for tier in ("local", "remote"):
        (tmp_path / tier / "step-1" / "COMMIT").unlink()
    reader = TierStorageReader(**_tiers(tmp_path), checkpoint_id="step-1")
    with pytest.raises(
        IncompleteCheckpointError, match="no tier holds a valid committed checkpoint 'step-1'"
    ):
        reader.read_metadata()
    with pytest.raises(IncompleteCheckpointError, match="remote"):
        TierStorageReader(**_tiers(tmp_path), checkpoint_id="step-9").read_metadata()


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(format="other"),
        lambda m: m["state"]["model.w"].update(size=[5, -3]),
        lambda m: m["state"]["model.w"]["chunks"][0].update(offsets=[4, 0]),  # outside the tensor
        lambda m: m["state"]["model.w"].update(dtype="object"),
        lambda m: next(i for i in m["items"] if i["index"]["fqn"] == "model.w").update(length=7),
        lambda m: next(i for i in m["items"] if i["index"]["fqn"] == "model.w").update(rank="0; rm -rf /"),
        lambda m: m.update(planner_data={"x": {"$code": "os.system"}}),
        lambda m: next(i for i in m["items"] if i["index"]["fqn"] == "model.w").update(rank=3),
    ],
    ids=[
        "format",
        "negative-size",
        "chunk-outside",
        "dtype",
        "length",
        "rank-type",
        "tagged-value",
        "rank-range",
    ],
)
def test_hostile_metadata_is_refused_field_by_field(tmp_path, edit):
    dcp.save(_state(), storage_writer=TierStorageWriter(local_dir=tmp_path), checkpoint_id="step-1")
    step = tmp_path / "step-1"
    meta = json.loads((step / "metadata.json").read_text())
    edit(meta)
    raw = json.dumps(meta).encode()
    (step / "metadata.json").write_bytes(raw)
    commit = json.loads((step / "COMMIT").read_text())  # the attacker fixes the checksum too
    commit.update(metadata_bytes=len(raw), metadata_checksum=checksum(raw))
    (step / "COMMIT").write_text(json.dumps(commit))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((CorruptCheckpointError, IncompleteCheckpointError)) as e:
            TierStorageReader(local_dir=tmp_path, checkpoint_id="step-1").read_metadata()
    assert "metadata.json" in str(e.value)


def test_a_metadata_file_that_does_not_match_its_commit_is_skipped_for_the_next_tier(tmp_path):
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    p = tmp_path / "local" / "step-1" / "metadata.json"
    p.write_bytes(p.read_bytes().replace(b'"lr"', b'"LR"', 1))
    reader = TierStorageReader(**_tiers(tmp_path))
    loaded = _fresh()
    with pytest.warns(UserWarning, match="does not match the checksum its COMMIT records"):
        dcp.load(loaded, storage_reader=reader, checkpoint_id="step-1")
    assert reader.source == f"file://{tmp_path}/remote"
    _check(loaded)


def test_a_value_that_would_need_pickle_is_refused_by_name_and_nothing_is_committed(tmp_path):
    class Opaque:
        pass

    state = _state()
    state["optim"]["hook"] = Opaque()
    with pytest.raises(CheckpointException) as e:  # DCP wraps each rank's error (a BaseException)
        dcp.save(state, storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    err = _inner(e.value)
    assert isinstance(err, RefusedStateError) and err.path == "optim.hook"
    assert "'optim.hook' is a " in str(err) and "Opaque, which cannot be stored without pickle" in str(err)
    assert not (tmp_path / "local" / "step-1" / "COMMIT").exists()
    assert not (tmp_path / "remote" / "step-1" / "COMMIT").exists()


def test_an_unreachable_remote_tier_leaves_a_local_checkpoint_and_says_so(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the remote directory should be")
    writer = TierStorageWriter(local_dir=tmp_path / "local", url=f"file://{blocker}/remote")
    with pytest.warns(UserWarning, match="could not write rank-00000.dcp.bin .* local tier only"):
        dcp.save(_state(), storage_writer=writer, checkpoint_id="step-1")
    assert (tmp_path / "local" / "step-1" / "COMMIT").exists()
    loaded = _fresh()
    dcp.load(loaded, storage_reader=TierStorageReader(local_dir=tmp_path / "local"), checkpoint_id="step-1")
    _check(loaded)


def test_saving_again_under_the_same_id_replaces_it_and_leaves_other_ids_alone(tmp_path):
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    newer = _state()
    newer["model"]["w"] += 1
    dcp.save(newer, storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-2")
    dcp.save(newer, storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    for ckpt_id in ("step-1", "step-2"):
        loaded = _fresh()
        dcp.load(loaded, storage_reader=TierStorageReader(**_tiers(tmp_path)), checkpoint_id=ckpt_id)
        _check(loaded, newer)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="give local_dir"):
        TierStorageWriter()
    with pytest.raises(ValueError, match="relative name"):
        TierStorageWriter(local_dir="/tmp").reset("../escape")
    with pytest.raises(ValueError, match="no checkpoint_id"):
        TierStorageReader(local_dir="/tmp").read_metadata()


@pytest.mark.s3
def test_s3_through_s3fs_with_a_lost_local_tier_and_a_corrupted_object(tmp_path, s3_bucket):
    from s3server import storage_options
    import s3fs

    bucket, port = s3_bucket
    opts = storage_options(port)
    tiers = {"local_dir": tmp_path / "local", "url": f"s3://{bucket}/run", "storage_options": opts}
    dcp.save(_state(), storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-1")
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/run/step-1")) == [
        "COMMIT",
        "metadata.json",
        "rank-00000.dcp.bin",
    ]
    shutil.rmtree(tmp_path / "local")  # a replaced node
    loaded = _fresh()
    reader = TierStorageReader(**tiers)
    dcp.load(loaded, storage_reader=reader, checkpoint_id="step-1")
    assert reader.source == f"s3://{bucket}/run"
    _check(loaded)
    meta = json.loads(fs.cat_file(f"{bucket}/run/step-1/metadata.json"))
    rec = next(i for i in meta["items"] if i["index"]["fqn"] == "model.b")
    key = f"{bucket}/run/step-1/rank-00000.dcp.bin"
    raw = bytearray(fs.cat_file(key))
    raw[rec["offset_bytes"]] ^= 0x01
    fs.pipe_file(key, bytes(raw))
    with pytest.raises(CheckpointException) as e:
        dcp.load(_fresh(), storage_reader=TierStorageReader(**tiers), checkpoint_id="step-1")
    assert "no tier holds a valid copy of 'model.b'" in str(_inner(e.value))


def test_async_save_through_the_writer(tmp_path):
    future = dcp.async_save(
        _state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1"
    )
    future.result(timeout=120)
    assert (tmp_path / "remote" / "step-1" / "COMMIT").exists()
    loaded = _fresh()
    dcp.load(loaded, storage_reader=TierStorageReader(**_tiers(tmp_path)), checkpoint_id="step-1")
    _check(loaded)


def test_the_command_line_lists_and_verifies_dcp_checkpoints(tmp_path, capsys):
    from ckpt.cli import main

    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-1")
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-2")
    (tmp_path / "local" / "junk").mkdir()  # not a checkpoint: not listed
    assert main(["ls", str(tmp_path / "local"), "--dcp", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["world_size"]) for r in rows] == [("step-1", 1), ("step-2", 1)] and rows[0][
        "bytes"
    ] > 0
    assert main(["verify", f"file://{tmp_path}/remote", "--dcp"]) == 0
    assert capsys.readouterr().out.count(": OK") == 2
    _corrupt_item(tmp_path / "remote", "model.i", "step-2")
    assert main(["verify", f"file://{tmp_path}/remote", "--dcp"]) == 1
    out = capsys.readouterr().out
    assert "step-1: OK" in out and "step-2: FAILED" in out and "'model.i'" in out
    assert main(["verify", str(tmp_path / "local"), "--dcp", "--id", "step-2"]) == 0  # the local copy is fine


def test_gc_keeps_the_newest_committed_checkpoints_and_leaves_uncommitted_ones(tmp_path, capsys):
    from ckpt.cli import main
    from ckpt.integrations.dcp import list_checkpoints, prune

    for name in ("b-first", "a-second", "c-third"):  # names deliberately not in time order
        dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id=name)
    (tmp_path / "local" / "in-progress").mkdir()  # no COMMIT: a save under way
    (tmp_path / "local" / "in-progress" / "rank-00000.dcp.bin").write_bytes(b"x")
    assert prune(tmp_path / "local", 2, dry_run=True) == ["b-first"]
    assert len(list_checkpoints(tmp_path / "local")) == 3
    assert main(["gc", f"file://{tmp_path}/remote", "--dcp", "--keep", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed a-second", "removed b-first"]
    assert [r["id"] for r in list_checkpoints(f"file://{tmp_path}/remote")] == ["c-third"]
    assert not (tmp_path / "remote" / "a-second").exists()
    assert prune(tmp_path / "local", 2) == ["b-first"]
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["a-second", "c-third", "in-progress"]
    loaded = _fresh()
    dcp.load(loaded, storage_reader=TierStorageReader(**_tiers(tmp_path)), checkpoint_id="c-third")
    _check(loaded)
    with pytest.raises(ValueError, match="keep must be at least 1"):
        prune(tmp_path / "local", 0)


def test_gc_keeps_the_newest_checkpoint_that_verifies_and_deletes_nothing_when_none_does(tmp_path):
    from ckpt.errors import NoCheckpointError
    from ckpt.integrations.dcp import prune

    for name in ("a", "b", "c"):
        dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id=name)
    _corrupt_item(tmp_path / "local", "model.w", "c")
    with pytest.warns(UserWarning, match="'c' does not verify"):
        assert prune(tmp_path / "local", 1, verify=True) == ["a"]  # c, the newest, stays; b verifies
    _corrupt_item(tmp_path / "local", "model.w", "b")
    with pytest.warns(UserWarning), pytest.raises(NoCheckpointError):
        prune(tmp_path / "local", 1, verify=True)
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["b", "c"]


def test_gc_neither_counts_nor_deletes_a_linked_checkpoint(tmp_path):
    from ckpt.integrations.dcp import list_checkpoints, prune

    dcp.save(_state(), storage_writer=TierStorageWriter(local_dir=tmp_path / "base"), checkpoint_id="base")
    for name in ("a", "b"):
        dcp.save(_state(), storage_writer=TierStorageWriter(local_dir=tmp_path / "run"), checkpoint_id=name)
    (tmp_path / "run" / "shared").symlink_to(tmp_path / "base" / "base")  # linked in, newest by its COMMIT
    dcp.save(_state(), storage_writer=TierStorageWriter(local_dir=tmp_path / "base"), checkpoint_id="base")
    assert [r["id"] for r in list_checkpoints(tmp_path / "run")] == ["a", "b", "shared"]
    assert prune(tmp_path / "run", 1) == ["a"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["b", "shared"]
    assert (tmp_path / "base" / "base" / "COMMIT").is_file()


def _big_state(seed: int, mib: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4 // 3
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(3)}}


def _zeros_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}


def test_a_remote_only_save_streams_the_rank_file_instead_of_building_it_in_memory(tmp_path):
    import tracemalloc

    state = _big_state(0, mib=24)
    url = f"file://{tmp_path}/remote"
    tracemalloc.start()
    try:
        dcp.save(state, storage_writer=TierStorageWriter(url=url), checkpoint_id="step-1")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = (tmp_path / "remote" / "step-1" / "rank-00000.dcp.bin").stat().st_size
    assert size >= 24 << 20
    assert peak < size // 4, f"Python allocations peaked at {peak} bytes for a {size}-byte file"
    loaded = _zeros_like(state)
    dcp.load(loaded, storage_reader=TierStorageReader(url=url), checkpoint_id="step-1")
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())


@contextlib.contextmanager
def _faulty_s3(s3_bucket):
    """(bucket, proxy, storage_options through the proxy, an s3fs client past it): a store whose faults the test
    injects (``proxy.faults``), parts of 5 MiB, two attempts per request."""
    from s3server import FaultProxy, storage_options
    import s3fs

    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        opts = storage_options(
            proxy.port,
            default_block_size=5 << 20,
            config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}},
        )
        yield bucket, proxy, opts, s3fs.S3FileSystem(**storage_options(port), skip_instance_cache=True)
    finally:
        proxy.close()


@pytest.mark.s3
def test_a_remote_only_s3_save_goes_up_in_parts_and_an_outage_mid_upload_publishes_nothing(
    tmp_path, s3_bucket
):
    with _faulty_s3(s3_bucket) as (bucket, proxy, opts, fs):
        url = f"s3://{bucket}/run"
        first = _big_state(1)
        dcp.save(
            first, storage_writer=TierStorageWriter(url=url, storage_options=opts), checkpoint_id="step-1"
        )
        assert fs.info(f"{bucket}/run/step-1/rank-00000.dcp.bin")["size"] >= 12 << 20
        proxy.faults.fail_parts_from = 2  # the store fails from the second part on
        with pytest.raises(CheckpointException) as e:
            dcp.save(
                _big_state(2),
                storage_writer=TierStorageWriter(url=url, storage_options=opts),
                checkpoint_id="step-2",
            )
        err = _inner(e.value)
        assert isinstance(err, OSError) and proxy.faults.injected > 0
        assert f"could not write rank-00000.dcp.bin of 'step-2' to {url}" in str(err)
        assert "storage_options" in str(err) and "earlier checkpoints are untouched" in str(err)
        proxy.faults.fail_parts_from = None
        assert not fs.exists(f"{bucket}/run/step-2/COMMIT")
        assert not fs.exists(f"{bucket}/run/step-2/rank-00000.dcp.bin")  # the multipart upload was aborted
        assert fs.list_multipart_uploads(bucket) == []
        loaded = _zeros_like(first)
        dcp.load(
            loaded, storage_reader=TierStorageReader(url=url, storage_options=opts), checkpoint_id="step-1"
        )
        assert all(torch.equal(loaded["model"][k], v) for k, v in first["model"].items())


@pytest.mark.s3
def test_an_outage_during_the_parallel_multipart_upload_from_local_dir_aborts_it_and_commits_the_local_copy(
    tmp_path, s3_bucket
):
    # the rank's file goes up from local_dir in parallel parts of one multipart upload (ckpt.tiers.remote_file):
    # failed parts abort the upload (no object, no pending upload), the remote's previous checkpoint still loads
    with _faulty_s3(s3_bucket) as (bucket, proxy, opts, fs):
        tiers = {"local_dir": tmp_path / "local", "url": f"s3://{bucket}/run", "storage_options": opts}
        first, second = _big_state(1), _big_state(2)
        dcp.save(first, storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-1")
        proxy.faults.fail_parts_from = 2
        with pytest.warns(UserWarning):
            dcp.save(second, storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-2")
        assert proxy.faults.injected > 0
        proxy.faults.fail_parts_from = None
        assert not fs.exists(f"{bucket}/run/step-2/COMMIT")
        assert not fs.exists(f"{bucket}/run/step-2/rank-00000.dcp.bin")
        assert fs.list_multipart_uploads(bucket) == []
        assert (tmp_path / "local" / "step-2" / "COMMIT").is_file()
        for ckpt_id, ref, kw in [
            ("step-1", first, {"url": tiers["url"], "storage_options": opts}),
            ("step-2", second, {"local_dir": tiers["local_dir"]}),
        ]:
            loaded = _zeros_like(ref)
            dcp.load(loaded, storage_reader=TierStorageReader(**kw), checkpoint_id=ckpt_id)
            assert all(torch.equal(loaded["model"][k], v) for k, v in ref["model"].items())


@pytest.mark.parametrize("with_local", [False, True], ids=["url-only", "local+url"])
def test_a_file_url_write_that_fails_mid_file_publishes_no_file_and_the_previous_checkpoint_loads(
    tmp_path, monkeypatch, with_local
):
    import errno

    from ckpt import knobs
    from ckpt.tiers.remote_store import OnHost

    tiers = _tiers(tmp_path) if with_local else {"url": f"file://{tmp_path}/remote"}
    first = _big_state(1, mib=3)
    with knobs.override(CKPT_CHUNK_BYTES=1 << 20):
        dcp.save(first, storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-1")
        write_at = OnHost.write_at

        def full_from_1_mib(path, data, offset):  # the mounted store's disk fills up mid-file
            if offset >= 1 << 20:
                raise OSError(errno.ENOSPC, "no space left on the mount (injected)", path)
            write_at(path, data, offset)

        monkeypatch.setattr(OnHost, "write_at", staticmethod(full_from_1_mib))
        if with_local:  # the local copy is committed, the remote tier gets nothing of it
            with pytest.warns(UserWarning):
                dcp.save(
                    _big_state(2, mib=3), storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-2"
                )
            assert (tmp_path / "local" / "step-2" / "COMMIT").is_file()
        else:
            with pytest.raises(CheckpointException) as e:
                dcp.save(
                    _big_state(2, mib=3), storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-2"
                )
            assert isinstance(_inner(e.value), OSError) and _inner(e.value).errno == errno.ENOSPC
    remote = tmp_path / "remote" / "step-2"
    assert not remote.exists() or sorted(p.name for p in remote.iterdir()) == []  # no file, no temporary one
    loaded = _zeros_like(first)
    dcp.load(
        loaded, storage_reader=TierStorageReader(url=f"file://{tmp_path}/remote"), checkpoint_id="step-1"
    )
    assert all(torch.equal(loaded["model"][k], v) for k, v in first["model"].items())


def test_retention_during_saves_keeps_the_newest_per_tier(tmp_path):
    from ckpt import Retention
    from ckpt.integrations.dcp import list_checkpoints

    for i in range(1, 5):
        st = _state()
        st["model"]["w"] += i
        dcp.save(
            st,
            storage_writer=TierStorageWriter(**_tiers(tmp_path), keep=Retention(local=2, remote=1)),
            checkpoint_id=f"step-{i}",
        )
    assert [r["id"] for r in list_checkpoints(tmp_path / "local")] == ["step-3", "step-4"]
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step-3", "step-4"]
    assert [r["id"] for r in list_checkpoints(f"file://{tmp_path}/remote")] == ["step-4"]
    loaded = _fresh()
    dcp.load(loaded, storage_reader=TierStorageReader(**_tiers(tmp_path)), checkpoint_id="step-3")
    ref = _state()
    ref["model"]["w"] += 3
    _check(loaded, ref)
    # without keep nothing is deleted; a bad keep is named
    dcp.save(_state(), storage_writer=TierStorageWriter(**_tiers(tmp_path)), checkpoint_id="step-5")
    assert len(list_checkpoints(tmp_path / "local")) == 3
    with pytest.raises(TypeError, match="keep must be a ckpt.Retention"):
        TierStorageWriter(**_tiers(tmp_path), keep=2)


def test_retention_on_a_two_node_job_prunes_each_nodes_own_files(tmp_path):
    assert_ok(run_ranks(HERE / "dcp_worker.py", str(tmp_path), "retain", world=2))
    # the coordinator's node: whole committed checkpoints; the other node: its rank's files only
    assert sorted(p.name for p in (tmp_path / "node-0").iterdir()) == ["step-3", "step-4"]
    assert sorted(p.name for p in (tmp_path / "node-0" / "step-4").iterdir()) == [
        "COMMIT",
        "metadata.json",
        "rank-00000.dcp.bin",
    ]
    assert sorted(p.name for p in (tmp_path / "node-1").iterdir()) == ["step-3", "step-4"]
    assert [p.name for p in (tmp_path / "node-1" / "step-3").iterdir()] == ["rank-00001.dcp.bin"]
    assert sorted(p.name for p in (tmp_path / "remote").iterdir()) == ["step-2", "step-3", "step-4"]


@pytest.mark.parametrize("with_local", [True, False], ids=["local+url", "url-only"])
def test_a_file_url_commit_reaches_the_disk_after_the_files_it_vouches_for(tmp_path, monkeypatch, with_local):
    from helpers import DiskLog
    from test_remote import _vouched_files_synced_before_commit

    log = DiskLog(monkeypatch)
    tiers = _tiers(tmp_path) if with_local else {"url": f"file://{tmp_path}/remote"}
    dcp.save(_state(), storage_writer=TierStorageWriter(**tiers), checkpoint_id="step-1")
    _vouched_files_synced_before_commit(log, tmp_path / "remote" / "step-1")

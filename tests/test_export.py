"""``ckpt.export``: committed checkpoints of every tier out to safetensors, a Hugging Face model directory
and a ``torch.save`` file, each loaded back with its own library and compared bit for bit; a job tier
saved by two real gloo ranks consolidated; corrupt sources refused with nothing left behind."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ckpt
from ckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError, IncompleteCheckpointError
from helpers import assert_ok, run_ranks

safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

HERE = Path(__file__).parent


class Tied(nn.Module):
    """Embedding and output head sharing one weight, a buffer, a bf16 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.BatchNorm1d(6)
        self.low = nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.norm(model.emb(torch.arange(8))).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "extra": {
            "ints": torch.arange(7, dtype=torch.int64),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "np": np.arange(6, dtype=np.int16).reshape(2, 3),
            "flag": torch.tensor([True, False]),
            "f8": torch.linspace(-2, 2, 9).to(torch.float8_e4m3fn),
        },
        "meta": {"epoch": 3, "name": "run", "inf": float("inf"), "pair": (1, 2), "none": None},
    }


def _save(local_dir: Path, state: dict, steps=(5,), url: str | None = None) -> None:
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir, url=url),
        policy=ckpt.Policy(keep=ckpt.Retention(local=None, remote=None)),
    ) as ck:
        for s in steps:
            ck.save(s, state).wait()


def _expected(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by the name export gives it."""
    out = {f"model/{k}": v for k, v in state["model"].state_dict().items()}
    osd = state["optim"].state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/state/{pid}/{k}"] = v
    for k, v in state["extra"].items():
        out[f"extra/{k}"] = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------------------------
# safetensors


def test_safetensors_round_trip_is_bit_exact_with_the_values_in_the_metadata(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    info = ckpt.export(tmp_path / "ck", tmp_path / "out")
    assert info.step == 5 and info.files == ["model.safetensors"] and info.dropped == []
    got = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    want = _expected(state)
    assert set(got) == set(want)
    for k in want:
        assert _same(got[k], want[k]), k
    assert _same(got["model/head.weight"], got["model/emb.weight"])  # tied: each name its own bytes
    assert info.tensors == len(want) and info.nbytes == sum(
        t.numel() * t.element_size() for t in want.values()
    )
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["ckpt.step"] == "5"
    values = json.loads(meta["ckpt.values"])
    assert values["meta/epoch"] == 3 and values["meta/name"] == "run" and values["meta/inf"] == float("inf")
    assert values["meta/pair/1"] == 2 and values["meta/none"] is None
    assert values["optim/param_groups/0/lr"] == 1e-2


def test_a_key_exports_a_module_whose_state_dict_loads_back(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    info = ckpt.export(tmp_path / "ck", tmp_path / "out", key="model")
    got = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert info.key == "model" and set(got) == set(state["model"].state_dict())
    fresh = Tied()
    fresh.load_state_dict(got)
    for k, v in state["model"].state_dict().items():
        assert _same(fresh.state_dict()[k], v), k


def test_shards_stay_under_the_limit_and_the_index_maps_every_tensor(tmp_path):
    torch.manual_seed(1)
    state = {"w": {f"t{i}": torch.randn(300 + 7 * i) for i in range(12)}, "big": torch.randn(2000)}
    _save(tmp_path / "ck", state)
    limit = 4000
    info = ckpt.export(tmp_path / "ck", tmp_path / "out", max_shard_size=limit)
    n = len(info.files) - 1
    assert n > 3 and info.files[-1] == "model.safetensors.index.json"
    assert info.files[:-1] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for name in info.files[:-1]:
        part = safetensors_torch.load_file(tmp_path / "out" / name)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= limit or len(part) == 1, (name, size)  # a tensor larger than the limit sits alone
        assert all(index["weight_map"][k] == name for k in part)
        got.update(part)
    assert set(index["weight_map"]) == set(got) == {f"w/t{i}" for i in range(12)} | {"big"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    for i in range(12):
        assert _same(got[f"w/t{i}"], state["w"][f"t{i}"])
    assert _same(got["big"], state["big"])


def test_max_shard_size_reads_units_and_refuses_nonsense():
    from ckpt.export import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size(123) == 123
    assert parse_size("1.5 MB") == 1_500_000
    for bad in ("lots", "5 parsecs", 0, -3, "", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_dtype_casts_floating_tensors_only(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    ckpt.export(tmp_path / "ck", tmp_path / "out", dtype="bfloat16")
    got = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    want = _expected(state)
    for k, v in want.items():
        if v.is_floating_point():
            assert _same(got[k], v.to(torch.bfloat16)), k
        else:
            assert _same(got[k], v), k
    with pytest.raises(ValueError, match="dtype"):
        ckpt.export(tmp_path / "ck", tmp_path / "bad", dtype="int8")
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------
# torch.save


def test_torch_format_loads_with_weights_only_and_restores_the_optimizer(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    info = ckpt.export(tmp_path / "ck", tmp_path / "state.pt", format="torch")
    assert info.path == str(tmp_path / "state.pt") and info.dropped == []
    got = torch.load(tmp_path / "state.pt", weights_only=True)
    assert set(got) == {"model", "optim", "extra", "meta"}
    assert got["meta"] == {"epoch": 3, "name": "run", "inf": float("inf"), "pair": (1, 2), "none": None}
    assert got["model"]["head.weight"] is got["model"]["emb.weight"]  # tied stays tied
    fresh = Tied()
    fresh.load_state_dict(got["model"])
    opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    opt.load_state_dict(got["optim"])
    assert opt.param_groups[0]["lr"] == 1e-2
    for k, v in _expected(state).items():
        node = got
        for part in k.split("/"):
            node = (
                node[int(part)]
                if isinstance(node, dict) and part.isdigit() and int(part) in node
                else node[part]
            )
        assert _same(node, v), k
    assert isinstance(got["extra"]["np"], torch.Tensor)  # a numpy array comes out as a tensor


def test_a_key_reaches_into_an_optimizers_state_by_parameter_id(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    ckpt.export(tmp_path / "ck", tmp_path / "o", key="optim/state/1")
    got = safetensors_torch.load_file(tmp_path / "o" / "model.safetensors")
    want = state["optim"].state_dict()["state"][1]
    assert set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    ckpt.export(tmp_path / "ck", tmp_path / "g.pt", format="torch", key="optim/param_groups/0")
    assert torch.load(tmp_path / "g.pt", weights_only=True)["lr"] == 1e-2
    with pytest.raises(ValueError, match="optim/state"):
        ckpt.export(tmp_path / "ck", tmp_path / "x", key="optim/state/99")


def test_torch_format_of_a_module_key_is_its_state_dict(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    ckpt.export(tmp_path / "ck", tmp_path / "m.pt", format="torch", key="model")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(got) == list(state["model"].state_dict())
    Tied().load_state_dict(got)


def test_nothing_is_unpickled_while_exporting(tmp_path, monkeypatch):
    state = _state()
    _save(tmp_path / "ck", state)

    def refuse(*a, **k):
        raise AssertionError("unpickling during export")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    ckpt.export(tmp_path / "ck", tmp_path / "a")
    ckpt.export(tmp_path / "ck", tmp_path / "b.pt", format="torch")


# ---------------------------------------------------------------------------------------------
# Step, key and source selection


def test_default_step_is_the_newest_of_the_live_branch_and_step_picks_another(tmp_path):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tmp_path / "ck"), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((4,), float(s))}).wait()
        ck.restore({"w": torch.zeros(4)}, step=1)  # a rollback: 2 and 3 become the abandoned branch
        ck.save(2, {"w": torch.full((4,), 20.0)}).wait()
    info = ckpt.export(tmp_path / "ck", tmp_path / "a")
    assert info.step == 2
    assert safetensors_torch.load_file(tmp_path / "a" / "model.safetensors")["w"][0] == 20.0
    assert ckpt.export(tmp_path / "ck", tmp_path / "b", step=1).step == 1
    with pytest.raises(FileNotFoundError, match="step 9"):
        ckpt.export(tmp_path / "ck", tmp_path / "c", step=9)
    with pytest.raises(ValueError, match="'nope'"):
        ckpt.export(tmp_path / "ck", tmp_path / "c", key="nope")
    with pytest.raises(FileNotFoundError):
        ckpt.export(tmp_path / "missing", tmp_path / "c")
    assert not (tmp_path / "c").exists() and not (tmp_path / "missing").exists()


def test_a_file_url_and_a_compressed_remote_copy_export_the_same_bytes(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    for name, compression in (("raw", None), ("zstd", "zstd")):
        url = f"file://{tmp_path}/{name}"
        ckpt.promote(5, "remote", local_dir=tmp_path / "ck", url=url, compression=compression)
        ckpt.export(url, tmp_path / f"out-{name}")
    a = safetensors_torch.load_file(tmp_path / "out-raw" / "model.safetensors")
    b = safetensors_torch.load_file(tmp_path / "out-zstd" / "model.safetensors")
    want = _expected(state)
    assert set(a) == set(b) == set(want)
    assert all(_same(a[k], want[k]) and _same(b[k], want[k]) for k in want)


@pytest.mark.s3
def test_export_from_s3(tmp_path, s3_bucket):
    from s3server import storage_options

    bucket, port = s3_bucket
    opts = storage_options(port)
    url = f"s3://{bucket}/run"
    state = _state()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=tmp_path / "ck", storage_options=opts)
    ) as ck:
        ck.save(5, state).wait()
    info = ckpt.export(url, tmp_path / "out", storage_options=opts, format="torch", key="model")
    assert info.source == url
    got = torch.load(tmp_path / "out", weights_only=True)
    for k, v in state["model"].state_dict().items():
        assert _same(got[k], v), k


# ---------------------------------------------------------------------------------------------
# A job tier saved by two gloo ranks


def test_a_job_tier_saved_by_two_ranks_is_consolidated(tmp_path):
    sys.path.insert(0, str(HERE))
    try:
        from reshard_worker import GLOBALS, global_tensor
    finally:
        sys.path.remove(str(HERE))
    assert_ok(
        run_ranks(
            HERE / "reshard_worker.py",
            str(tmp_path),
            "save-dt",
            world=2,
            env={"CKPT_TEST_BACKEND": "gloo", "CKPT_CHUNK_BYTES": "4096"},
        )
    )
    url = f"file://{tmp_path}/job"
    info = ckpt.export(url, tmp_path / "st")
    got = safetensors_torch.load_file(tmp_path / "st" / "model.safetensors")
    assert set(got) == set(GLOBALS) | {"plain"}
    for name in GLOBALS:  # Shard(0), Shard(1) in bf16, Replicate, shards that are empty on one rank
        assert _same(got[name], global_tensor(name)), name
    assert _same(got["plain"], torch.tensor([1.0, 2.0, 3.0]))
    with safe_open(tmp_path / "st" / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ckpt.values"]) == {"meta/epoch": 7, "meta/name": "run"}
    # every chunk read was verified: replicas of a shard are read once, so less than both ranks' data
    job = [
        ckpt.format.Manifest.from_bytes(p.read_bytes(), str(p))
        for p in sorted((tmp_path / "job" / "step-000000005").glob("rank-*.manifest.json"))
    ]
    assert 0 < info.read_bytes <= sum(m.data_bytes for m in job)
    ckpt.export(url, tmp_path / "t.pt", format="torch", key="b")
    assert _same(torch.load(tmp_path / "t.pt", weights_only=True), global_tensor("b"))
    # one rank's own copy holds only its shards: refused, naming what to export instead
    with pytest.raises(IncompatibleCheckpointError, match="job tier"):
        ckpt.export(tmp_path / "local-2" / "rank-1", tmp_path / "own")
    assert not (tmp_path / "own").exists() and _leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Corruption, existing destinations, kills


def test_a_flipped_bit_is_refused_naming_the_file_and_leaves_nothing(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    data = tmp_path / "ck" / "step-000000005" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    out.mkdir()
    for fmt, dest in (("safetensors", out / "st"), ("torch", out / "t.pt")):
        with pytest.raises(CorruptCheckpointError, match="rank-00000.bin"):
            ckpt.export(tmp_path / "ck", dest, format=fmt)
    assert list(out.iterdir()) == []  # no destination, no staging directory


def test_a_corrupt_remote_part_is_refused_naming_the_part(tmp_path):
    _save(tmp_path / "ck", _state())
    url = f"file://{tmp_path}/r"
    ckpt.promote(5, "remote", local_dir=tmp_path / "ck", url=url)
    part = tmp_path / "r" / "step-000000005" / "rank-00000" / "part-000000"
    raw = bytearray(part.read_bytes())
    raw[100] ^= 1
    part.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="part-000000"):
        ckpt.export(url, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_a_truncated_data_file_is_incomplete(tmp_path):
    _save(tmp_path / "ck", _state())
    with open(tmp_path / "ck" / "step-000000005" / "rank-00000.bin", "r+b") as f:
        f.truncate(4096)
    with pytest.raises(IncompleteCheckpointError, match="rank-00000.bin"):
        ckpt.export(tmp_path / "ck", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_existing_destination_is_kept_unless_force(tmp_path):
    state = _state()
    _save(tmp_path / "ck", state)
    for fmt, dest in (("safetensors", tmp_path / "dir"), ("torch", tmp_path / "f.pt")):
        if fmt == "torch":
            dest.write_text("precious")
        else:
            dest.mkdir()
            (dest / "precious").write_text("x")
        with pytest.raises(FileExistsError) as e:
            ckpt.export(tmp_path / "ck", dest, format=fmt)
        assert e.value.errno == 17 and e.value.filename == str(dest) and "force" in str(e.value)
        assert (dest.read_text() if fmt == "torch" else (dest / "precious").read_text()) in ("precious", "x")
        ckpt.export(tmp_path / "ck", dest, format=fmt, force=True)
        if fmt == "torch":
            assert "model" in torch.load(dest, weights_only=True)
        else:
            assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    assert _leftovers(tmp_path) == []


def test_a_failed_forced_export_leaves_the_old_destination(tmp_path):
    _save(tmp_path / "ck", _state())
    ckpt.export(tmp_path / "ck", tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    data = tmp_path / "ck" / "step-000000005" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        ckpt.export(tmp_path / "ck", tmp_path / "out", force=True)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before and _leftovers(tmp_path) == []


_SLOW_EXPORT = """
import sys, time
import ckpt
ex = sys.modules["ckpt.export"]
real = ex._write_safetensors
count = [0]
def slow(*a, **k):
    real(*a, **k)
    count[0] += 1
    if count[0] == 2:
        print("two shards written", flush=True)
        time.sleep(60)
ex._write_safetensors = slow
ckpt.export(sys.argv[1], sys.argv[2], max_shard_size=2000)
"""


def test_an_export_killed_midway_leaves_no_destination(tmp_path):
    torch.manual_seed(0)
    _save(tmp_path / "ck", {f"t{i}": torch.randn(400) for i in range(8)})
    out = tmp_path / "out"
    p = subprocess.Popen(
        [sys.executable, "-c", _SLOW_EXPORT, str(tmp_path / "ck"), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "two shards written", p.stderr.read()
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=60)
    assert not out.exists()
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".out.export-")]
    assert len(staged) == 1 and len(list(staged[0].iterdir())) == 2  # the hidden staging directory only
    info = ckpt.export(tmp_path / "ck", out, max_shard_size=2000)  # a later export is not disturbed by it
    assert len(info.files) == 9  # 8 shards of one 1600-byte tensor each, and the index


# ---------------------------------------------------------------------------------------------
# Hugging Face


transformers = pytest.importorskip("transformers")


def _llama(tie: bool, dtype: torch.dtype = torch.float32, seed: int = 0):
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert _same(sa[k], sb[k]), k


@pytest.mark.parametrize("tie,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)])
def test_hf_directory_loads_with_from_pretrained_bit_exact(tmp_path, tie, dtype):
    model = _llama(tie, dtype)
    _save(tmp_path / "ck", {"model": model, "hf_config": model.config.to_dict(), "step_count": 7})
    info = ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf")
    assert info.key == "model" and info.files[0] == "config.json"
    assert any(d.startswith("lm_head.weight: tied") for d in info.dropped) == tie
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    _assert_same_model(model, loaded)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
        assert ("lm_head.weight" in f.keys()) != tie


def test_hf_export_removes_a_wrappers_prefix(tmp_path):
    model = _llama(True)
    wrapper = nn.Module()
    wrapper.module = model  # as DistributedDataParallel names it: module.model.embed_tokens.weight, ...
    _save(tmp_path / "ck", {"model": wrapper})
    info = ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config=model.config)
    assert any("'module.'" in d for d in info.dropped)
    _assert_same_model(model, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"))


def test_hf_config_from_a_directory_a_config_object_or_a_file(tmp_path):
    model = _llama(False)
    _save(tmp_path / "ck", {"model": model})
    model.config.save_pretrained(tmp_path / "cfgdir")
    with pytest.raises(ValueError, match="config"):
        ckpt.export(tmp_path / "ck", tmp_path / "none", format="hf")
    for i, config in enumerate((tmp_path / "cfgdir", model.config, str(tmp_path / "cfgdir" / "config.json"))):
        ckpt.export(tmp_path / "ck", tmp_path / f"hf{i}", format="hf", config=config)
        _assert_same_model(model, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf{i}"))
    assert not (tmp_path / "none").exists()


def test_hf_export_refuses_weights_that_do_not_fit_the_config(tmp_path):
    model = _llama(False)
    _save(tmp_path / "ck", {"model": model, "other": {"w": torch.zeros(3)}})
    bigger = _llama(False).config
    bigger.num_hidden_layers = 3
    with pytest.raises(IncompatibleCheckpointError, match="not in the checkpoint"):
        ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config=bigger)
    wider = _llama(False).config
    wider.intermediate_size = 48
    with pytest.raises(IncompatibleCheckpointError, match="shape"):
        ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config=wider)
    with pytest.raises(IncompatibleCheckpointError, match="--key"):
        ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config=model.config, key="other")
    tied = _llama(True).config  # the checkpoint holds lm_head apart from the embedding
    with pytest.raises(IncompatibleCheckpointError, match="tie_word_embeddings"):
        ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config=tied)
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []


@pytest.mark.usefixtures("frozen_heap")  # Trainer.train() collects garbage three times (conftest.py)
def test_a_real_trainer_run_through_the_callback_exports_to_from_pretrained(tmp_path):
    pytest.importorskip("accelerate")
    from ckpt.integrations.hf import CheckpointCallback

    sys.path.insert(0, str(HERE))
    try:
        from hf_worker import Tokens, tiny_llama
    finally:
        sys.path.remove(str(HERE))
    model = tiny_llama()
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model, args, train_dataset=Tokens(16, 1))
    CheckpointCallback(local_dir=tmp_path / "ck", every_steps=2).attach(trainer)
    trainer.train()
    info = ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config=model.config)
    assert info.step == 4 and info.dropped == []
    _assert_same_model(trainer.model, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"))


# ---------------------------------------------------------------------------------------------
# docs/export.md


def _doc_examples() -> dict[str, str]:
    import re

    text = (HERE.parent / "docs" / "export.md").read_text()
    return {
        name: code for code, name in re.findall(r"```python\n(# runnable-example: (\w+)\n.*?)```", text, re.S)
    }


@pytest.mark.parametrize(
    "name, expected",
    [
        ("export", ["100 ['model.safetensors']", "['meta', 'model', 'optim'] {'epoch': 3}"]),
        ("export_hf", ["torch.bfloat16 True"]),
    ],
)
def test_the_docs_examples_run(tmp_path, name, expected):
    script = tmp_path / f"{name}.py"
    script.write_text(_doc_examples()[name])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for line in expected:
        assert line in out.stdout, out.stdout


class _LitLike(nn.Module):
    """What a LightningModule wrapping a Hugging Face model saves: its weights under ``model.``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


@pytest.mark.parametrize("layout", ["module", "state_dict"])
def test_hf_export_finds_the_model_under_the_lightning_keys(tmp_path, layout):
    """The Lightning callback keeps the model at ``module``, a ``TieredCheckpointIO`` checkpoint at
    ``state_dict`` (prefixed by the LightningModule's attribute): ``format="hf"`` finds it without ``key``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(config)
    lit = _LitLike(model)
    state = (
        {"module": lit, "fit_loop": {"epoch": 1}}
        if layout == "module"
        else {"state_dict": lit.state_dict(), "epoch": 1, "global_step": 3}
    )
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "ck")) as ck:
        ck.save(3, state).wait()
    info = ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config=config)
    assert info.key == layout
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_hf_export_without_any_model_key_names_the_key_to_pass(tmp_path):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "ck")) as ck:
        ck.save(1, {"net": nn.Linear(2, 2)}).wait()
    with pytest.raises(ValueError):
        ckpt.export(tmp_path / "ck", tmp_path / "hf", format="hf", config={"model_type": "llama"})
    assert not os.path.lexists(tmp_path / "hf")

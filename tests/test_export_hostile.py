"""``ckpt.export`` against everything that tries to break its guarantees (docs/export.md):

* output: every dtype and odd shape bit for bit, headers checked byte by byte against the safetensors
  layout, shards and their index, tied weights, names with odd characters or that collide once joined;
* destinations: symlinks, FIFOs, files where a directory goes, a read-only parent, a 255-byte name, ``.``,
  the source itself, one that appears or goes away while the export runs, two processes at once;
* failures: SIGKILL of a real export process at every stage, a full disk (``RLIMIT_FSIZE``), a fallback
  rename that fails half way;
* hostile checkpoints: a manifest claiming 2**60 bytes, JSON nested 100k deep (records, ``hf_config``,
  a config file), a FIFO for a config.

Outputs are read back with the ``safetensors`` package (and ``torch.load(weights_only=True)``) and
compared bit for bit: NaN payloads, negative zeros and every float8 pattern included."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt
from ckpt.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckpt.integrity import checksum

safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

ex = sys.modules["ckpt.export"]
REPO = Path(__file__).resolve().parent.parent
_ST_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "C64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_STAGE_RE = re.compile(r"^\.out\.export-\d+-[0-9a-f]{8}$")


# ---------------------------------------------------------------------------------------------
# Helpers


def _save(local_dir: Path, state: dict, step: int = 5) -> None:
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        ck.save(step, state).wait()


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


def _header(path: Path) -> dict:
    """The safetensors header of ``path``, checked against the format byte by byte: an 8-byte
    little-endian length, JSON padded to it, tensors laid end to end covering the rest of the file
    exactly, each of its dtype's size times its shape's elements and aligned to its element size."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert 8 + n <= len(raw) and n % 8 == 0, (path, n)
    text = raw[8 : 8 + n]
    header = json.loads(text.decode("utf-8"))
    assert text == text.rstrip(b" ") + b" " * (len(text) - len(text.rstrip(b" ")))
    meta = header.pop("__metadata__", {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    spans = []
    for name, e in header.items():
        assert set(e) == {"dtype", "shape", "data_offsets"}, (name, e)
        a, b = e["data_offsets"]
        assert b - a == math.prod(e["shape"]) * _ST_SIZES[e["dtype"]], (name, e)
        assert a % _ST_SIZES[e["dtype"]] == 0, (name, e)  # aligned to its element size
        spans.append((a, b))
    spans.sort()
    end = 0
    for a, b in spans:
        assert a == end, (path, spans)
        end = b
    assert 8 + n + end == len(raw), (path, end, len(raw))
    return {"meta": meta, "tensors": header}


def _snapshot(path: Path) -> dict | bytes | str | None:
    """Everything at ``path`` (not following links): to tell a destination stayed whole."""
    if not os.path.lexists(path):
        return None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"link:{os.readlink(path)}"
    if stat.S_ISDIR(st.st_mode):
        return {p.name: _snapshot(p) for p in sorted(path.iterdir())}
    if stat.S_ISREG(st.st_mode):
        return path.read_bytes()
    return f"mode:{stat.S_IFMT(st.st_mode)}"


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _load_dir(d: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of a safetensors export directory (through its index when sharded), each file's
    header checked; returns the tensors and the first file's metadata."""
    names = sorted(p.name for p in d.iterdir())
    if "model.safetensors.index.json" in names:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert sorted(files + ["model.safetensors.index.json"]) == names
    else:
        assert names == ["model.safetensors"], names
        index, files = None, names
    got: dict[str, torch.Tensor] = {}
    first = None
    for f in files:
        h = _header(d / f)
        first = first if first is not None else h["meta"]
        part = safetensors_torch.load_file(d / f)
        assert set(part) == set(h["tensors"])
        assert not set(part) & set(got)
        if index is not None:
            assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    if index is not None:
        assert set(index["weight_map"]) == set(got)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    return got, first


def _weird_floats(dtype: torch.dtype) -> torch.Tensor:
    """NaNs with payloads, both zeros, infinities, subnormals, extremes of ``dtype``, as raw bit patterns."""
    int_of = {
        torch.float64: torch.int64,
        torch.float32: torch.int32,
        torch.float16: torch.int16,
        torch.bfloat16: torch.int16,
    }[dtype]
    info = torch.finfo(dtype)
    vals = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            info.max,
            info.min,
            info.tiny,
            info.tiny / 4,
            1.0 / 3.0,
            -1e-30,
        ],
        dtype=torch.float64,
    ).to(dtype)
    bits = vals.view(int_of).clone()
    nan = torch.tensor([float("nan")], dtype=dtype).view(int_of)
    payloads = torch.cat([nan, nan | 1, nan | 3, nan ^ 5])
    return torch.cat([bits, payloads]).view(dtype)


def _all_dtypes_state() -> dict:
    torch.manual_seed(3)
    base = torch.randn(6, 5, dtype=torch.float64)
    return {
        "f": {
            str(d).removeprefix("torch."): _weird_floats(d)
            for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        },
        "f8": {
            "e4m3": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),
            "e5m2": torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2),
        },
        "c64": torch.complex(torch.randn(4), torch.tensor([float("nan"), -0.0, float("inf"), 1.0])),
        "ints": {
            "i64": torch.tensor([-(2**63), 2**63 - 1, 0, -1]),
            "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
            "i16": torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16),
            "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "u8": torch.arange(256, dtype=torch.uint8),
            "u16": torch.tensor([0, 2**16 - 1], dtype=torch.int32).to(torch.uint16),
            "u32": torch.tensor([0, 2**32 - 1], dtype=torch.int64).to(torch.uint32),
            "u64": torch.tensor([0, 2**63 - 1], dtype=torch.int64).to(torch.uint64),
        },
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "shapes": {
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0),
            "empty3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
            "ones": torch.ones([1] * 20),
            "scalar_bool": torch.tensor(True),
            "empty_bool": torch.empty(0, 7, dtype=torch.bool),
        },
        "views": {
            "t": base.t(),  # non-contiguous
            "strided": base[::2, 1::2].to(torch.float32),
            "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
            "neg": base.flip(0),
        },
        "np": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
    }


def _flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, name + "/"))
        elif isinstance(v, np.ndarray):
            out[name] = torch.from_numpy(np.ascontiguousarray(v))
        elif isinstance(v, torch.Tensor):
            out[name] = v
    return out


_CHILD_PRELUDE = r"""
import json, os, sys, time
import ckpt
ex = sys.modules["ckpt.export"]
import torch, ckpt.tiers, ckpt.tiers.local, ckpt.tiers.remote, safetensors.torch   # imported before any limit below

def report(fn):
    try:
        fn()
    except BaseException as e:
        print(json.dumps({"ok": False, "type": type(e).__name__, "oserror": isinstance(e, OSError),
                          "errno": getattr(e, "errno", None)}), flush=True)
        return
    print(json.dumps({"ok": True}), flush=True)
"""


def _child(code: str, *args: str, timeout: float = 60) -> list[dict]:
    """Run ``code`` after the prelude in a fresh interpreter; what each ``report`` said, in order."""
    p = subprocess.run(
        [sys.executable, "-c", _CHILD_PRELUDE + code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


# ---------------------------------------------------------------------------------------------
# Fidelity: dtypes, shapes, headers, shards, tied weights, names


def test_every_dtype_and_odd_shape_comes_back_bit_for_bit_with_exact_headers(tmp_path):
    state = _all_dtypes_state()
    _save(tmp_path / "ck", state)
    want = _flat(state)
    info = ckpt.export(tmp_path / "ck", tmp_path / "out")
    got, meta = _load_dir(tmp_path / "out")
    assert set(got) == set(want) and info.tensors == len(want)
    for k in want:
        assert _same_bits(got[k], want[k]), k
    assert info.nbytes == sum(t.numel() * t.element_size() for t in want.values())
    assert meta["format"] == "pt" and meta["ckpt.step"] == "5"
    # the same through safe_open, tensor by tensor, and through torch.load of the torch format
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        for k in want:
            assert _same_bits(f.get_tensor(k), want[k]), k
    ckpt.export(tmp_path / "ck", tmp_path / "s.pt", format="torch")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    for k, v in want.items():
        node = loaded
        for part in k.split("/"):
            node = node[part]
        assert _same_bits(node, v), k


def test_a_cast_changes_floats_only_and_keeps_every_other_dtype_bit_for_bit(tmp_path):
    state = _all_dtypes_state()
    _save(tmp_path / "ck", state)
    ckpt.export(tmp_path / "ck", tmp_path / "out", dtype="float16")
    got, _ = _load_dir(tmp_path / "out")
    for k, v in _flat(state).items():
        if v.is_floating_point():
            assert _same_bits(got[k], v.to(torch.float16)), k
        else:
            assert _same_bits(got[k], v), k


def test_complex128_has_no_safetensors_dtype_refused_before_reading_kept_by_torch(tmp_path, monkeypatch):
    z = torch.complex(
        torch.randn(5, dtype=torch.float64),
        torch.tensor([0.0, -0.0, float("nan"), 1e300, -1.0], dtype=torch.float64),
    )
    _save(tmp_path / "ck", {"z": z, "w": torch.ones(3)})
    reads = []
    real = ex._scatter_from
    monkeypatch.setattr(ex, "_scatter_from", lambda *a: (reads.append(1), real(*a))[1])
    with pytest.raises(ValueError):
        ckpt.export(tmp_path / "ck", tmp_path / "out")
    assert reads == [] and not os.path.lexists(tmp_path / "out") and _hidden(tmp_path) == []
    ckpt.export(tmp_path / "ck", tmp_path / "w", key="w")  # without it, the rest exports
    assert _same_bits(safetensors_torch.load_file(tmp_path / "w" / "model.safetensors")["w"], torch.ones(3))
    ckpt.export(tmp_path / "ck", tmp_path / "z.pt", format="torch")
    assert _same_bits(torch.load(tmp_path / "z.pt", weights_only=True)["z"], z)


def test_shards_each_file_exact_the_index_complete_the_values_in_the_first_and_the_index(tmp_path):
    torch.manual_seed(2)
    emb = torch.randn(40, 8)
    state = {
        "a": {f"t{i}": torch.randn(17 * i + 1) for i in range(9)},
        "tied1": emb,
        "tied2": emb,
        "zero": torch.empty(0, 3),
        "huge": torch.randn(1500).to(torch.bfloat16),
        "u8": torch.arange(200, dtype=torch.uint8),
        "meta": {"epoch": 7, "nan": float("nan"), "name": 'ru"n\n'},
    }
    _save(tmp_path / "ck", state)
    want = {k: v for k, v in _flat(state).items()}
    for limit in (1, 700, 2999):
        out = tmp_path / f"out{limit}"
        info = ckpt.export(tmp_path / "ck", out, max_shard_size=limit)
        got, _ = _load_dir(out)
        assert set(got) == set(want)
        for k in want:
            assert _same_bits(got[k], want[k]), k
        shards = [f for f in info.files if f.endswith(".safetensors")]
        n = len(shards)
        assert n > 2 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        assert info.files == sorted(p.name for p in out.iterdir())
        order = list(want)
        seen: list[str] = []
        for k, f in enumerate(shards):
            h = _header(out / f)
            size = sum(b - a for a, b in (e["data_offsets"] for e in h["tensors"].values()))
            assert size <= limit or len([e for e in h["tensors"].values() if math.prod(e["shape"])]) == 1, (
                f,
                size,
            )
            assert h["meta"]["format"] == "pt" and h["meta"]["ckpt.step"] == "5"
            assert ("ckpt.values" in h["meta"]) == (k == 0)  # the values: in the first shard only
            names = [t for t in order if t in h["tensors"]]
            seen += names
        assert seen == order  # cut in state order
        index = json.loads((out / "model.safetensors.index.json").read_text())
        values = index["metadata"]["ckpt.values"]  # an object in the index, as JSON text in the shard
        first = json.loads(_header(out / shards[0])["meta"]["ckpt.values"])
        assert values["meta/epoch"] == first["meta/epoch"] == 7 and values["meta/name"] == 'ru"n\n'
        assert math.isnan(values["meta/nan"]) and math.isnan(first["meta/nan"])
        assert not _same_bits(got["tied1"], torch.zeros_like(emb)) and _same_bits(got["tied1"], got["tied2"])


def test_tied_weights_in_torch_format_stay_one_tensor_and_cast_together(tmp_path):
    emb = torch.randn(6, 4)
    _save(tmp_path / "ck", {"m": {"emb": emb, "head": emb}})
    ckpt.export(tmp_path / "ck", tmp_path / "a.pt", format="torch", dtype="bfloat16")
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    assert got["m"]["emb"] is got["m"]["head"] and _same_bits(got["m"]["emb"], emb.to(torch.bfloat16))


def test_names_with_odd_characters_round_trip_and_top_level_keys_that_look_like_tags(tmp_path):
    odd = [
        "sp ace",
        'quo"te',
        "back\\slash",
        "new\nline",
        "tab\t",
        "nul\x00",
        "é",
        "😀",
        "日本",
        "\u2028",
        "..",
        ".",
        "-",
        "a.b.c",
        "{}",
        "[0]",
        "$t",
        "$obj",
        "$d",
    ]
    state = {
        "n": {k: torch.full((2,), float(i)) for i, k in enumerate(odd)},
        "$t": torch.arange(3.0),
        "$obj": {"x": torch.arange(2)},
        "": torch.ones(1),
        "v": {k: i for i, k in enumerate(odd)},
    }
    _save(tmp_path / "ck", state)
    info = ckpt.export(tmp_path / "ck", tmp_path / "out")
    got, meta = _load_dir(tmp_path / "out")
    want = {f"n/{k}": torch.full((2,), float(i)) for i, k in enumerate(odd)}
    want.update({"$t": torch.arange(3.0), "$obj/x": torch.arange(2), "": torch.ones(1)})
    assert set(got) == set(want) and info.tensors == len(want)
    assert all(_same_bits(got[k], want[k]) for k in want)
    values = json.loads(meta["ckpt.values"])
    assert {k: values[f"v/{k}"] for k in odd} == {k: i for i, k in enumerate(odd)}
    # a top-level key that looks like a tag is selected as the key it is
    ckpt.export(tmp_path / "ck", tmp_path / "obj", key="$obj")
    assert set(safetensors_torch.load_file(tmp_path / "obj" / "model.safetensors")) == {"x"}
    ckpt.export(tmp_path / "ck", tmp_path / "all.pt", format="torch")
    t = torch.load(tmp_path / "all.pt", weights_only=True)
    assert _same_bits(t["$t"], torch.arange(3.0)) and _same_bits(t["$obj"]["x"], torch.arange(2))


@pytest.mark.parametrize("case", ["slash", "int-and-str", "values", "reserved", "surrogate"])
def test_names_that_safetensors_cannot_hold_apart_are_refused_before_writing(tmp_path, case):
    a, b = torch.arange(3.0), torch.arange(3.0) + 10
    state = {
        "slash": {"a/b": a, "a": {"b": b}},
        "int-and-str": {"d": {1: a, "1": b}},
        "values": {"w": a, "m": {"x/y": 1, "x": {"y": 2}}},
        "reserved": {"__metadata__": a, "w": b},
        "surrogate": {"\ud800": a},
    }[case]
    _save(tmp_path / "ck", state)
    with pytest.raises(ValueError):
        ckpt.export(tmp_path / "ck", tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out") and _hidden(tmp_path) == []
    ckpt.export(tmp_path / "ck", tmp_path / "t.pt", format="torch")  # the structure keeps them apart
    got = torch.load(tmp_path / "t.pt", weights_only=True)
    if case == "slash":
        assert _same_bits(got["a/b"], a) and _same_bits(got["a"]["b"], b)
    elif case == "int-and-str":
        assert _same_bits(got["d"][1], a) and _same_bits(got["d"]["1"], b)


# ---------------------------------------------------------------------------------------------
# Hostile checkpoints


def _rewrite_manifest(step_dir: Path, edit, manifest_path: Path | None = None) -> None:
    """Edit a manifest, then put its checksum (and data size) in COMMIT: a record set that validates."""
    mp = manifest_path or step_dir / "rank-00000.manifest.json"
    m = json.loads(mp.read_bytes())
    edit(m)
    raw = json.dumps(m).encode()
    mp.write_bytes(raw)
    c = json.loads((step_dir / "COMMIT").read_bytes())
    c["manifests"]["rank-00000.manifest.json"] = checksum(raw)
    c["data"]["rank-00000.bin"] = m["data_bytes"]
    (step_dir / "COMMIT").write_bytes(json.dumps(c).encode())


def _huge(m: dict, raw_parts: bool) -> None:
    n = 2**60
    m["data_bytes"], m["chunk_bytes"], m["chunks"] = n, n, [0]
    m["items"] = [
        {
            "key": "w",
            "dtype": "uint8",
            "shape": [n],
            "device": "cpu",
            "offset": 0,
            "nbytes": n,
            "alias_of": None,
        }
    ]
    m["tree"] = {"w": {"$t": 0}}
    if raw_parts:
        m["codecs"], m["stored_sizes"] = ["raw"], [n]


def _source(tmp_path, tier: str):
    """Step 5 saved in ``tmp_path / "ck"``, as export's source: that local tier, or promoted to a remote one;
    and the step's directory there."""
    if tier == "local":
        return tmp_path / "ck", tmp_path / "ck" / "step-000000005"
    src = f"file://{tmp_path}/r"
    ckpt.promote(5, "remote", local_dir=tmp_path / "ck", url=src)
    return src, tmp_path / "r" / "step-000000005"


@pytest.mark.parametrize("tier", ["local", "remote"])
def test_a_manifest_claiming_2_60_bytes_is_refused_before_anything_is_allocated(tmp_path, tier, monkeypatch):
    _save(tmp_path / "ck", {"w": torch.arange(10.0)})
    src, step_dir = _source(tmp_path, tier)
    _rewrite_manifest(step_dir, lambda m: _huge(m, tier == "remote"))
    allocations = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (allocations.append(a), real_empty(*a, **k))[1])
    with pytest.raises(IncompleteCheckpointError):  # the stored bytes cannot back the size: nothing allocated
        ckpt.export(src, tmp_path / "out")
    assert not any(a and (a[0] == [2**60] or a[0] == (2**60,)) for a in allocations)
    assert not os.path.lexists(tmp_path / "out") and _hidden(tmp_path) == []


def _claim_layout(m: dict, layout: dict) -> None:
    m["tree"]["w"]["$dt"] = layout


_HUGE_LAYOUTS = {
    # one rank's plain tensor of 10 elements claimed as a replicated DTensor of 2**40
    "replicated": {"shape": [2**40], "mesh": [1], "coord": [0], "placements": ["R"]},
    # a shard of 10 elements whose layout makes it 10 of 2**40 / 4096 rows
    "sharded": {"shape": [2**40], "mesh": [4096], "coord": [0], "placements": ["S0"]},
}


@pytest.mark.parametrize("tier", ["local", "remote"])
@pytest.mark.parametrize("claim", sorted(_HUGE_LAYOUTS))
def test_a_layout_claiming_a_huge_global_shape_is_corrupt_before_anything_is_allocated(
    tmp_path, tier, claim, monkeypatch
):
    _save(tmp_path / "ck", {"w": torch.arange(10.0)})
    src, step_dir = _source(tmp_path, tier)
    _rewrite_manifest(step_dir, lambda m: _claim_layout(m, _HUGE_LAYOUTS[claim]))
    allocations = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (allocations.append(a), real_empty(*a, **k))[1])
    with pytest.raises(CorruptCheckpointError) as e:
        ckpt.export(src, tmp_path / "out")
    assert "'w'" in str(e.value)  # names the tensor
    assert not any(a and isinstance(a[0], int) and a[0] > 10**6 for a in allocations)
    assert not os.path.lexists(tmp_path / "out") and _hidden(tmp_path) == []


def test_a_job_tier_whose_layout_claims_a_huge_global_shape_is_skipped_by_restore_and_ls(tmp_path):
    """The sibling in restore: a job tier's layouts are checked with its records, before a resharding
    restore binds (and allocates) the global tensor, so a restore passes over the step like any corrupt one."""
    _save(tmp_path / "ck", {"w": torch.arange(10.0)})
    url = f"file://{tmp_path}/r"
    ckpt.promote(5, "remote", local_dir=tmp_path / "ck", url=url)
    _rewrite_manifest(tmp_path / "r" / "step-000000005", lambda m: _claim_layout(m, _HUGE_LAYOUTS["sharded"]))
    from ckpt.tiers import RemoteTier

    with pytest.raises(CorruptCheckpointError):
        RemoteTier(url).check(5)


def test_json_nested_100k_deep_is_refused_as_corrupt_never_a_recursion_error(tmp_path):
    _save(tmp_path / "ck", {"w": torch.arange(4.0)})
    deep = "[" * 100_000 + "]" * 100_000
    step_dir = tmp_path / "ck" / "step-000000005"
    mp = step_dir / "rank-00000.manifest.json"
    raw = mp.read_bytes().replace(b'"tree":{', b'"deep":' + deep.encode() + b',"tree":{', 1)
    assert raw != mp.read_bytes()
    mp.write_bytes(raw)
    c = json.loads((step_dir / "COMMIT").read_bytes())
    c["manifests"]["rank-00000.manifest.json"] = checksum(raw)
    (step_dir / "COMMIT").write_bytes(json.dumps(c).encode())
    with pytest.raises(CorruptCheckpointError):
        ckpt.export(tmp_path / "ck", tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out") and _hidden(tmp_path) == []


def test_an_hf_config_nested_100k_deep_in_the_state_or_a_file_and_a_fifo_config_are_refused(tmp_path):
    pytest.importorskip("transformers")
    deep = "[" * 100_000 + "]" * 100_000
    _save(tmp_path / "ck", {"model": {"w": torch.ones(2)}, "hf_config": deep})
    with pytest.raises(CorruptCheckpointError):
        ckpt.export(tmp_path / "ck", tmp_path / "out", format="hf")
    (tmp_path / "config.json").write_text('{"model_type": ' + deep + "}")
    with pytest.raises(ValueError):
        ckpt.export(tmp_path / "ck", tmp_path / "out", format="hf", config=tmp_path / "config.json")
    os.mkfifo(tmp_path / "fifo")  # never opened: a read would block for ever
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("blocked on the FIFO")))
    signal.alarm(20)
    try:
        with pytest.raises(ValueError):
            ckpt.export(tmp_path / "ck", tmp_path / "out", format="hf", config=tmp_path / "fifo")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not os.path.lexists(tmp_path / "out") and _hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Destinations


def _ck(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    _save(tmp_path / "ck", {"w": torch.randn(30), "b": torch.arange(5)})
    return tmp_path / "ck"


def _is_export(d: Path) -> bool:
    got, _ = _load_dir(d)
    return set(got) == {"w", "b"}


def test_nothing_is_read_before_an_existing_dest_or_a_bad_parent_is_refused(tmp_path, monkeypatch):
    src = _ck(tmp_path)
    (tmp_path / "there").mkdir()
    (tmp_path / "file").write_text("x")

    def no(*a, **k):
        raise AssertionError("the source was opened")

    monkeypatch.setattr(ex._Source, "open", no)
    with pytest.raises(FileExistsError) as e:
        ckpt.export(src, tmp_path / "there")
    assert e.value.errno == errno.EEXIST
    with pytest.raises(NotADirectoryError) as e:  # a file where the parent directory goes
        ckpt.export(src, tmp_path / "file" / "out")
    assert e.value.errno == errno.ENOTDIR
    with pytest.raises(FileNotFoundError) as e:
        ckpt.export(src, tmp_path / "missing" / "out")
    assert e.value.errno == errno.ENOENT and not (tmp_path / "missing").exists()
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("kind", ["link-to-dir", "link-to-file", "dangling-link", "fifo", "file", "dir"])
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_existing_dest_of_any_kind_is_refused_and_replaced_itself_with_force(tmp_path, kind, fmt):
    src = _ck(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious").write_bytes(b"keep me")
    (tmp_path / "tfile").write_bytes(b"keep me too")
    dest = tmp_path / "out"
    if kind == "link-to-dir":
        dest.symlink_to(target)
    elif kind == "link-to-file":
        dest.symlink_to(tmp_path / "tfile")
    elif kind == "dangling-link":
        dest.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(dest)
    elif kind == "file":
        dest.write_bytes(b"old")
    else:
        dest.mkdir()
        (dest / "old").write_bytes(b"old")
    before = _snapshot(dest)
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("blocked")))
    signal.alarm(30)  # a FIFO opened by mistake would block
    try:
        with pytest.raises(FileExistsError) as e:
            ckpt.export(src, dest, format=fmt)
        assert e.value.errno == errno.EEXIST and _snapshot(dest) == before
        ckpt.export(src, dest, format=fmt, force=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not dest.is_symlink()  # the link itself replaced, never written through
    if fmt == "torch":
        assert stat.S_ISREG(os.lstat(dest).st_mode) and set(torch.load(dest, weights_only=True)) == {"w", "b"}
    else:
        assert _is_export(dest)
    assert (target / "precious").read_bytes() == b"keep me" and (
        tmp_path / "tfile"
    ).read_bytes() == b"keep me too"
    assert _hidden(tmp_path) == [] and not (tmp_path / "nowhere").exists()


def test_a_dest_name_of_255_bytes_exports_and_is_replaced(tmp_path):
    src = _ck(tmp_path)
    dest = tmp_path / ("é" * 127 + "x")  # 255 bytes in UTF-8
    assert len(os.fsencode(dest.name)) == 255
    ckpt.export(src, dest)
    assert _is_export(dest)
    ckpt.export(src, dest, force=True)
    ckpt.export(src, tmp_path / ("y" * 255), format="torch")
    assert _is_export(dest) and _hidden(tmp_path) == []


def test_dot_as_dest_means_the_directory_itself(tmp_path, monkeypatch):
    src = _ck(tmp_path)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "old").write_text("x")
    monkeypatch.chdir(tmp_path / "w")
    with pytest.raises(FileExistsError):
        ckpt.export(src, ".")
    info = ckpt.export(src, ".", force=True)
    assert info.path == "." and _is_export(tmp_path / "w")
    assert _hidden(tmp_path) == [] and _hidden(tmp_path / "w") == []


def test_a_dest_that_is_holds_or_lies_inside_the_source_is_refused_even_with_force(tmp_path):
    src = _ck(tmp_path)
    before = _snapshot(src)
    for dest in (
        src,
        src / "..",
        tmp_path,
        src / "step-000000005",
        src / "step-000000005" / "x.pt",
        src / "latest",
    ):
        with pytest.raises(ValueError):
            ckpt.export(src, dest, force=True, format="torch")
        with pytest.raises(ValueError):
            ckpt.export(f"file://{src}", dest, force=True)
    assert _snapshot(src) == before
    (tmp_path / "link").symlink_to(src)  # a link to it is replaced itself, the checkpoint is untouched
    ckpt.export(src, tmp_path / "link", force=True)
    assert _snapshot(src) == before and _is_export(tmp_path / "link")
    ckpt.export(src, src / "exported")  # a new name inside the tier, beside its steps, is fine
    assert _is_export(src / "exported")


def test_a_read_only_parent_is_refused_with_eacces_and_the_old_dest_stays(tmp_path):
    if not hasattr(os, "setuid"):
        pytest.skip("POSIX only")
    base = Path(tempfile.mkdtemp(prefix="ckpt-ro-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        src = _ck(base)
        for p in src.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        ro = base / "ro"
        ro.mkdir()
        ckpt.export(src, ro / "old")
        before = _snapshot(ro)
        os.chmod(ro, 0o555)
        drop = "os.setgid(65534); os.setuid(65534)\n" if os.geteuid() == 0 else ""
        code = drop + (
            "for dest, force, fmt in json.loads(sys.argv[2]):\n"
            "    report(lambda: ckpt.export(sys.argv[1], dest, force=force, format=fmt))\n"
        )
        cases = [
            (str(ro / "new"), False, "safetensors"),
            (str(ro / "old"), True, "safetensors"),
            (str(ro / "new.pt"), False, "torch"),
            (str(ro / "old"), True, "torch"),
        ]
        results = _child(code, src, json.dumps(cases))
        assert len(results) == len(cases)
        for case, r in zip(cases, results):
            assert r["oserror"] and r["errno"] == errno.EACCES, (case, r)
        assert _snapshot(ro) == before
    finally:
        for p in [base, *base.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                os.chmod(p, 0o755)
        shutil.rmtree(base)


class _Race:
    """Makes ``dest`` appear (``create``) or go away (``delete``) the moment the export's publish has
    checked it and before it renames: the window another process may hit."""

    def __init__(self, monkeypatch, dest: Path, action) -> None:
        self.dest, self.action, self.fired = str(dest), action, False
        real = os.path.lexists

        def lexists(p):
            out = real(p)
            if (
                os.fspath(p) == self.dest
                and not self.fired
                and any(_STAGE_RE.match(n) for n in os.listdir(os.path.dirname(self.dest)))
            ):
                self.fired = True
                self.action()
            return out

        monkeypatch.setattr(os.path, "lexists", lexists)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_dest_that_appears_while_exporting_is_never_replaced_even_an_empty_dir(tmp_path, monkeypatch, fmt):
    src = _ck(tmp_path)
    dest = tmp_path / "out"
    race = _Race(monkeypatch, dest, lambda: dest.mkdir())
    with pytest.raises(FileExistsError) as e:
        ckpt.export(src, dest, format=fmt)
    assert race.fired and e.value.errno == errno.EEXIST
    assert _snapshot(dest) == {} and _hidden(tmp_path) == []


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("action", ["appears", "goes-away"])
def test_with_force_a_dest_that_appears_or_goes_away_meanwhile_is_still_replaced(
    tmp_path, monkeypatch, fmt, action
):
    src = _ck(tmp_path)
    dest = tmp_path / "out"
    if action == "goes-away":
        dest.mkdir()
        (dest / "old").write_text("x")
        race = _Race(monkeypatch, dest, lambda: shutil.rmtree(dest))
    else:
        race = _Race(monkeypatch, dest, lambda: (dest.mkdir(), (dest / "old").write_text("x")))
    ckpt.export(src, dest, format=fmt, force=True)
    assert race.fired
    if fmt == "torch":
        assert set(torch.load(dest, weights_only=True)) == {"w", "b"}
    else:
        assert _is_export(dest)
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_without_an_atomic_exchange_a_failed_second_rename_puts_the_old_dest_back(tmp_path, monkeypatch, fmt):
    src = _ck(tmp_path)
    dest = tmp_path / "out"
    dest.mkdir()  # a directory: even a file replacing it takes two renames without an exchange
    (dest / "old").write_bytes(b"old")
    before = _snapshot(dest)

    def no_renameat2(a, b, flags):
        raise OSError(errno.ENOSYS, "no renameat2")

    real_rename = os.rename
    calls = []

    def rename(a, b):  # the new one into place fails, once
        calls.append((a, b))
        if Path(b) == dest and Path(a).name != "out" and not any(Path(c[1]) == dest for c in calls[:-1]):
            raise OSError(errno.EIO, "injected", str(b))
        return real_rename(a, b)

    monkeypatch.setattr(ex, "_renameat2", no_renameat2)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError) as e:
        ckpt.export(src, dest, format=fmt, force=True)
    assert e.value.errno == errno.EIO and len(calls) >= 2
    assert _snapshot(dest) == before and _hidden(tmp_path) == []
    monkeypatch.setattr(os, "rename", real_rename)
    ckpt.export(src, dest, format=fmt, force=True)  # and without the fault, it replaces it
    assert _hidden(tmp_path) == []


def test_without_an_atomic_exchange_a_file_replaces_a_file_in_one_rename(tmp_path, monkeypatch):
    src = _ck(tmp_path)
    (tmp_path / "a.pt").write_bytes(b"old")
    monkeypatch.setattr(ex, "_renameat2", lambda a, b, f: (_ for _ in ()).throw(OSError(errno.EINVAL, "no")))
    real_rename, calls = os.rename, []
    monkeypatch.setattr(os, "rename", lambda a, b: (calls.append(b), real_rename(a, b))[1])
    ckpt.export(src, tmp_path / "a.pt", format="torch", force=True)
    assert calls == [] and set(torch.load(tmp_path / "a.pt", weights_only=True)) == {"w", "b"}
    ckpt.export(src, tmp_path / "d")  # and a new directory still goes in with no replace
    assert _is_export(tmp_path / "d") and _hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Two processes, kills, a full disk


_PAUSE = r"""
src, dest, fmt, force, point = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5]

def at(name):
    print("at " + name, flush=True)
    time.sleep(120)

def before(obj, attr, name):
    real = getattr(obj, attr)
    def f(*a, **k):
        at(name)
        return real(*a, **k)
    setattr(obj, attr, f)

if point == "read":
    before(ex._Plan, "load", point)
elif point == "shard2":
    real_write, n = ex._write_safetensors, [0]
    def w(*a, **k):
        real_write(*a, **k)
        n[0] += 1
        if n[0] == 2:
            at(point)
    ex._write_safetensors = w
elif point == "written":
    before(ex, "_publish", point)
elif point == "rename":
    before(ex, "_renameat2", point)
elif point == "remove":
    before(ex, "_remove", point)
elif point == "wait":   # until stdin says go, then publish
    real_publish = ex._publish
    def p(*a, **k):
        print("at wait", flush=True)
        sys.stdin.readline()
        return real_publish(*a, **k)
    ex._publish = p
kw = {"max_shard_size": 2000} if fmt == "safetensors" else {}
report(lambda: ckpt.export(src, dest, format=fmt, force=force, **kw))
"""


def _kill_state(tmp_path: Path) -> tuple[Path, dict, dict]:
    torch.manual_seed(0)
    old = {f"t{i}": torch.randn(400) for i in range(8)}
    new = {k: v + 1 for k, v in old.items()}
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tmp_path / "ck"), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        ck.save(3, old).wait()
        ck.save(5, new).wait()
    return tmp_path / "ck", old, new


def _check_whole(dest: Path, fmt: str, want: dict) -> None:
    if fmt == "torch":
        got = torch.load(dest, weights_only=True)
    else:
        got, _ = _load_dir(dest)
    assert set(got) == set(want) and all(_same_bits(got[k], want[k]) for k in want)


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD_PRELUDE + _PAUSE, *map(str, args)],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize(
    "fmt,force,point",
    [
        ("safetensors", False, "read"),
        ("safetensors", True, "shard2"),
        ("safetensors", True, "written"),
        ("safetensors", False, "rename"),
        ("safetensors", True, "rename"),
        ("safetensors", True, "remove"),
        ("torch", True, "written"),
        ("torch", False, "rename"),
        ("torch", True, "rename"),
        ("torch", True, "remove"),
    ],
)
def test_sigkill_at_every_stage_leaves_the_old_dest_whole_or_the_new_one_complete(
    tmp_path, fmt, force, point
):
    src, old, new = _kill_state(tmp_path)
    dest = tmp_path / "out"
    if force:
        ckpt.export(src, dest, step=3, format=fmt, max_shard_size=2000)
    before = _snapshot(dest)
    p = _start(src, dest, fmt, "1" if force else "0", point)
    try:
        line = p.stdout.readline().strip()
        assert line == f"at {point}", (line, p.stderr.read() if p.poll() is not None else "")
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait(timeout=30)
    hidden = _hidden(tmp_path)
    assert len(hidden) == 1 and _STAGE_RE.match(hidden[0]), hidden  # only the hidden directory
    if point == "remove":  # exchanged: the new one complete, the old one whole in the hidden directory
        _check_whole(dest, fmt, new)
        held = tmp_path / hidden[0] / ("state.pt" if fmt == "torch" else "")
        assert _snapshot(held if fmt == "torch" else tmp_path / hidden[0]) == before
    else:
        assert _snapshot(dest) == before  # untouched (absent, or the old one whole)
    ckpt.export(src, dest, format=fmt, force=True)  # a later export is not disturbed by what was left,
    _check_whole(dest, fmt, new)
    assert _hidden(tmp_path) == []  # and removes it: its process is dead


def _leftover(parent: Path, name: str, pid: int, age_s: float = 0.0, kind: str = "export") -> Path:
    p = parent / f".{name}.{kind}-{pid}-0123abcd"
    p.mkdir()
    (p / "model.safetensors").write_bytes(b"partial")
    if age_s:
        t = os.stat(p).st_mtime - age_s
        os.utime(p, (t, t))
    return p


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_a_live_export_are_kept_of_a_dead_or_reused_pid_removed(tmp_path):
    src, old, new = _kill_state(tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        mine = _leftover(tmp_path, "out", live.pid)  # a live export's staging directory
        dead = _leftover(tmp_path, "out", _dead_pid())
        other = _leftover(tmp_path, "other", _dead_pid())  # another destination's: not this export's
        ckpt.export(src, tmp_path / "out")
        _check_whole(tmp_path / "out", "safetensors", new)
        assert mine.is_dir() and not os.path.lexists(dead) and other.is_dir()
        shutil.rmtree(mine)
        # the pid lives, but its process started after the leftover was last written: the pid was reused
        reused = _leftover(tmp_path, "out", live.pid, age_s=3600)
        ckpt.export(src, tmp_path / "out", force=True)
        assert not os.path.lexists(reused)
    finally:
        live.kill()
        live.wait()


def test_an_old_dest_moved_aside_is_kept_until_a_dest_exists_again(tmp_path):
    src, old, new = _kill_state(tmp_path)
    aside = _leftover(tmp_path, "out", _dead_pid(), kind="replaced")  # killed between the two renames
    assert ex.leftovers(tmp_path) == []  # the only copy of "out": kept
    ckpt.export(src, tmp_path / "out")
    assert not os.path.lexists(aside)  # a new "out" took its place


def test_ckpt_gc_exports_removes_the_leftovers_of_dead_exports(tmp_path, capsys):
    from ckpt.cli import main

    dead = [_leftover(tmp_path, n, _dead_pid()) for n in ("a", "b")]
    live = _leftover(tmp_path, "c", os.getpid())
    capsys.readouterr()
    assert main(["gc", "--exports", str(tmp_path), "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"dry_run": True, "removed": [str(p) for p in dead]}
    assert all(p.is_dir() for p in dead)
    assert main(["gc", "--exports", str(tmp_path)]) == 0
    assert not any(os.path.lexists(p) for p in dead) and live.is_dir()


@pytest.mark.parametrize("force", [False, True])
def test_two_processes_exporting_to_one_dest_one_waiting_at_publish(tmp_path, force):
    src, old, new = _kill_state(tmp_path)
    dest = tmp_path / "out"
    p = _start(src, dest, "safetensors", "1" if force else "0", "wait")  # exports step 5 (new)
    try:
        assert p.stdout.readline().strip() == "at wait", p.stderr.read() if p.poll() is not None else ""
        ckpt.export(src, dest, step=3, max_shard_size=2000)  # the other one publishes first
        out, err = p.communicate("go\n", timeout=60)
    finally:
        p.kill()
        p.wait(timeout=30)
    r = json.loads(out.strip().splitlines()[-1])
    if force:
        assert r["ok"], err
        _check_whole(dest, "safetensors", new)
    else:
        assert r["type"] == "FileExistsError" and r["errno"] == errno.EEXIST, r
        _check_whole(dest, "safetensors", old)
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("force", [False, True])
def test_two_processes_racing_for_one_dest(tmp_path, force):
    src, old, new = _kill_state(tmp_path)
    dest = tmp_path / "out"
    code = (
        "print('ready', flush=True)\nsys.stdin.readline()\n"
        "report(lambda: ckpt.export(sys.argv[1], sys.argv[2], force=sys.argv[3] == '1', max_shard_size=2000))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD_PRELUDE + code, str(src), str(dest), "1" if force else "0"],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:  # both imported: start them together
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    if force:
        assert all(r["ok"] for r in results), results
    else:
        assert sum(r["ok"] for r in results) == 1, results
        assert all(
            r["ok"] or (r["type"] == "FileExistsError" and r["errno"] == errno.EEXIST) for r in results
        )
    _check_whole(dest, "safetensors", new)
    assert _hidden(tmp_path) == []


def test_a_full_disk_is_the_oserror_with_its_errno_and_the_old_dest_stays_whole(tmp_path):
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(400) for i in range(3)}
    state["big"] = torch.randn(4000)  # 16 kB: over the file size limit below, after smaller shards
    _save(tmp_path / "ck", state)
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old").write_bytes(b"old")
    before = _snapshot(dest)
    # under an 8000-byte file size limit (EFBIG, as a full disk gives ENOSPC): the API, then the command line
    code = (
        "import contextlib, io, resource\n"
        "from ckpt.cli import main\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000))\n"
        "for fmt, shard in (('safetensors', None), ('safetensors', 2000), ('torch', None)):\n"
        "    kw = {'max_shard_size': shard} if shard else {}\n"
        "    report(lambda: ckpt.export(sys.argv[1], sys.argv[2], format=fmt, force=True, **kw))\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(['export', sys.argv[1], sys.argv[2], '--format', fmt, '--force', '--no-progress'])\n"
        "    print(json.dumps({'rc': rc, 'lines': len(err.getvalue().strip().splitlines())}), flush=True)\n"
    )
    results = _child(code, tmp_path / "ck", dest)
    assert len(results) == 6, results
    for r, cli in zip(results[::2], results[1::2]):
        assert not r["ok"] and r["oserror"] and r["errno"] == errno.EFBIG, r
        assert cli == {"rc": 1, "lines": 1}, cli
    assert _snapshot(dest) == before and _hidden(tmp_path) == []

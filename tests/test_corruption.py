"""Corrupt, torn, partial and hostile checkpoints are detected; restore falls back to an older one."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
from ckpt import knobs


def _save_steps(local_dir, steps=(1, 2), numel=50_000):
    with (
        knobs.override(CKPT_CHUNK_BYTES=64 << 10),
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
        ) as ck,
    ):
        for s in steps:
            ck.save(s, {"w": torch.full((numel,), float(s)), "step": s}).wait()


def _restore(local_dir):
    target = {"w": torch.zeros(50_000), "step": None}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        step = ck.restore(target)
        return step, target, ck.last_restore


def _newest(local_dir):
    return local_dir / "step-000000002"


def test_a_flipped_bit_in_the_data_file_is_caught_and_the_older_step_is_used(local_dir):
    _save_steps(local_dir)
    data = _newest(local_dir) / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[123_457] ^= 0x04
    data.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match=r"rank-00000\.bin.*checksum"):
        step, target, info = _restore(local_dir)
    assert step == 1 and target["step"] == 1 and torch.equal(target["w"], torch.full((50_000,), 1.0))
    assert any("step-000000002" in s for s in info.skipped)


def test_a_truncated_data_file_is_caught(local_dir):
    _save_steps(local_dir)
    data = _newest(local_dir) / "rank-00000.bin"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.warns(RuntimeWarning, match=r"rank-00000\.bin"):
        assert _restore(local_dir)[0] == 1


@pytest.mark.parametrize("name", ["rank-00000.bin", "rank-00000.manifest.json"])
def test_a_missing_file_is_caught(local_dir, name):
    _save_steps(local_dir)
    (_newest(local_dir) / name).unlink()
    with pytest.warns(RuntimeWarning, match=name.replace(".", r"\.")):
        assert _restore(local_dir)[0] == 1


def test_a_step_without_commit_is_invisible(local_dir):
    _save_steps(local_dir)
    (_newest(local_dir) / "COMMIT").unlink()
    assert _restore(local_dir)[0] == 1


def test_an_edited_manifest_fails_its_recorded_checksum(local_dir):
    _save_steps(local_dir)
    m = _newest(local_dir) / "rank-00000.manifest.json"
    m.write_bytes(m.read_bytes().replace(b'"step":2', b'"step":3'))
    with pytest.warns(RuntimeWarning, match="checksum does not match"):
        assert _restore(local_dir)[0] == 1


@pytest.mark.parametrize(
    "commit",
    [b"not json", b"[]", b'{"step": 2}', b'{"step":2,"world_size":1,"manifests":{"x":-1},"data":{}}'],
)
def test_a_garbage_commit_record_is_caught(local_dir, commit):
    _save_steps(local_dir)
    (_newest(local_dir) / "COMMIT").write_bytes(commit)
    with pytest.warns(RuntimeWarning, match="COMMIT"):
        assert _restore(local_dir)[0] == 1


def test_a_hostile_manifest_with_consistent_checksums_is_refused_before_any_read(local_dir):
    """A crafted manifest (offsets past the file) whose COMMIT matches it must still be refused."""
    _save_steps(local_dir)
    d = _newest(local_dir)
    m = json.loads((d / "rank-00000.manifest.json").read_bytes())
    m["items"][0]["offset"] = 1 << 40
    raw = json.dumps(m).encode()
    (d / "rank-00000.manifest.json").write_bytes(raw)
    c = json.loads((d / "COMMIT").read_bytes())
    from ckpt.integrity import checksum

    c["manifests"]["rank-00000.manifest.json"] = checksum(raw)
    (d / "COMMIT").write_bytes(json.dumps(c).encode())
    with pytest.warns(RuntimeWarning, match="does not fit"):
        assert _restore(local_dir)[0] == 1


def test_when_every_checkpoint_is_corrupt_restore_raises_and_lists_them(local_dir):
    _save_steps(local_dir)
    for s in (1, 2):
        (local_dir / f"step-00000000{s}" / "rank-00000.bin").write_bytes(b"")
    with pytest.warns(RuntimeWarning):
        with pytest.raises(ckpt.NoCheckpointError, match=r"local:2.*\n.*local:1"):
            _restore(local_dir)


def test_a_checkpoint_from_another_world_size_is_incompatible(local_dir):
    _save_steps(local_dir, steps=(1,))
    d = local_dir / "step-000000001"
    c = json.loads((d / "COMMIT").read_bytes())
    c["world_size"] = 2
    c["manifests"]["rank-00001.manifest.json"] = 0
    (d / "COMMIT").write_bytes(json.dumps(c).encode())
    with pytest.raises(ckpt.IncompatibleCheckpointError, match="world size 2"):
        _restore(local_dir)


# ---------------------------------------------------------------------------------------------
# Hostile records: the attacker (or a broken tool) also fixes the checksum COMMIT records, so the
# hostile field passes the checksum layer and reaches the validation under test.

import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager

from ckpt.cli import main as cli_main
from ckpt.integrity import checksum as _crc

MANIFEST = "rank-00000.manifest.json"
DEEP = 100_000


class Hang(BaseException):
    """Raised by the hang detector; a BaseException so that no library code swallows it."""


@contextmanager
def hang_detector(seconds=60):
    """Fail (instead of blocking the suite forever) when the body is still running after ``seconds``:
    SIGALRM interrupts a blocking open() of a FIFO in this thread."""

    def fire(signum, frame):
        raise Hang(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _put_manifest(d, raw: bytes) -> None:
    """Replace step ``d``'s manifest with ``raw`` and make COMMIT vouch for it."""
    (d / MANIFEST).write_bytes(raw)
    c = json.loads((d / "COMMIT").read_bytes())
    c["manifests"][MANIFEST] = _crc(raw)
    (d / "COMMIT").write_bytes(json.dumps(c).encode())


def _edit_manifest(d, edit) -> None:
    m = json.loads((d / MANIFEST).read_bytes())
    edit(m)
    _put_manifest(d, json.dumps(m).encode())


def _deep(n=DEEP) -> str:
    return "[" * n + "]" * n


def _restore_falls_back(local_dir, name):
    """restore() skips the newest step with a warning naming ``name`` and loads step 1."""
    with hang_detector():
        with pytest.warns(RuntimeWarning, match=name.replace(".", r"\.")) as rec:
            step, target, info = _restore(local_dir)
    assert step == 1 and target["step"] == 1 and torch.equal(target["w"], torch.full((50_000,), 1.0))
    assert any("step-000000002" in s for s in info.skipped)
    return [str(w.message) for w in rec]


def _cli_verify(local_dir, capsys):
    """``ckpt verify --json``: exit status and step -> result."""
    capsys.readouterr()
    with hang_detector():
        rc = cli_main(["verify", str(local_dir), "--json"])
    return rc, {r["step"]: r for r in json.loads(capsys.readouterr().out)}


def test_a_deeply_nested_manifest_value_is_corrupt_and_the_older_step_is_used(local_dir, capsys):
    _save_steps(local_dir)
    d = _newest(local_dir)
    m = json.loads((d / MANIFEST).read_bytes())
    m["tree"]["step"] = "@DEEP@"
    _put_manifest(d, json.dumps(m).replace('"@DEEP@"', _deep()).encode())
    _restore_falls_back(local_dir, MANIFEST)
    rc, res = _cli_verify(local_dir, capsys)
    assert rc == 1 and res[1]["ok"] and not res[2]["ok"] and MANIFEST in res[2]["error"]
    assert cli_main(["inspect", str(local_dir), "--step", "2"]) == 1  # one "ckpt: error:" line naming it
    err = capsys.readouterr().err
    assert err.startswith("ckpt: error:") and MANIFEST in err and "CorruptCheckpointError" in err


def test_a_deeply_nested_commit_record_is_corrupt_and_the_older_step_is_used(local_dir, capsys):
    _save_steps(local_dir)
    d = _newest(local_dir)
    c = (d / "COMMIT").read_bytes()
    (d / "COMMIT").write_bytes(c[:-1] + b',"x":' + _deep().encode() + b"}")
    _restore_falls_back(local_dir, "COMMIT")
    rc, res = _cli_verify(local_dir, capsys)
    assert rc == 1 and res[1]["ok"] and not res[2]["ok"] and "COMMIT" in res[2]["error"]


@pytest.mark.parametrize(
    "edit",
    [
        # a zero-element tensor whose other dimension overflows int64
        lambda m: m["items"][0].update(shape=[2**70, 0], nbytes=0),
        lambda m: m["items"][0].update(shape=[2**40, 2**40, 0], nbytes=0),
        lambda m: m["items"][0].update(shape=[-1, -50_000], nbytes=200_000),
        # two items over the same bytes (every destination would be allocated again)
        lambda m: m["items"].append(dict(m["items"][0], key="w2")) or m["tree"].update(w2={"$t": 1}),
        # aliases: to a later item, to itself, to an item of another shape
        lambda m: m["items"][0].update(alias_of=0),
        lambda m: (
            m["items"].append(dict(m["items"][0], key="w2", shape=[7], alias_of=0, offset=0, nbytes=0))
            or m["tree"].update(w2={"$t": 1})
        ),
        # malformed tree nodes
        lambda m: m["tree"].update(w={"$t": "0"}),
        lambda m: m["tree"].update(w={"$t": 5}),
        lambda m: m["tree"].update(step={"$f": "not a float"}),
        lambda m: m["tree"].update(step={"$tuple": 7}),
        lambda m: m["tree"].update(step={"$d": [[1]]}),
        lambda m: m["tree"].update(step={"$d": [[[1], 2]]}),
        lambda m: m["tree"].update(step={"$dtype": "torch.object"}),
        lambda m: m["tree"].update(step={"$obj": "module"}),
        lambda m: m["tree"].update(
            w={"$t": 0, "$dt": {"shape": [2**70], "mesh": [0], "coord": [0], "placements": ["S0"]}}
        ),
        lambda m: m.update(tree=[1, 2]),
        lambda m: m["items"][0].update(dtype=["float32"]),
        lambda m: m.update(items={"0": 1}),
        lambda m: m.update(created_unix="yesterday"),
    ],
    ids=[
        "shape-2^70x0",
        "shape-2^40x2^40x0",
        "negative-shape",
        "overlapping-items",
        "self-alias",
        "alias-other-shape",
        "index-str",
        "index-range",
        "float-tag",
        "tuple-tag",
        "dict-tag-pair",
        "dict-tag-key",
        "dtype-tag",
        "obj-without-sd",
        "dtensor-layout",
        "tree-list",
        "dtype-list",
        "items-dict",
        "created",
    ],
)
def test_a_hostile_manifest_field_is_corrupt_and_the_older_step_is_used(local_dir, capsys, edit):
    _save_steps(local_dir)
    _edit_manifest(_newest(local_dir), edit)
    _restore_falls_back(local_dir, MANIFEST)
    rc, res = _cli_verify(local_dir, capsys)
    assert rc == 1 and res[1]["ok"] and not res[2]["ok"] and MANIFEST in res[2]["error"]


def test_a_chunk_of_2_to_the_45_bytes_over_a_small_file_allocates_nothing_of_that_size(local_dir):
    """One chunk of 32 TiB declared over a 200 kB file, with a checksum that is wrong for it: the
    data file fails its checksum (nothing of 32 TiB is allocated) and the older step is used."""
    _save_steps(local_dir)
    _edit_manifest(_newest(local_dir), lambda m: m.update(chunk_bytes=2**45, chunks=[0]))
    _restore_falls_back(local_dir, "rank-00000.bin")


def test_a_chunk_size_larger_than_the_data_file_reads_only_the_file(local_dir):
    """One chunk of 2**45 bytes whose checksum is right: a valid checkpoint, loaded with buffers the size
    of the data file (never of the declared chunk)."""
    _save_steps(local_dir)
    d = _newest(local_dir)
    data = (d / "rank-00000.bin").read_bytes()
    _edit_manifest(d, lambda m: m.update(chunk_bytes=2**45, chunks=[_crc(data)]))
    step, target, _ = _restore(local_dir)
    assert step == 2 and torch.equal(target["w"], torch.full((50_000,), 2.0))


def test_a_fifo_in_place_of_the_manifest_is_refused_without_blocking(local_dir, capsys):
    _save_steps(local_dir)
    (_newest(local_dir) / MANIFEST).unlink()
    os.mkfifo(_newest(local_dir) / MANIFEST)
    _restore_falls_back(local_dir, MANIFEST)
    rc, res = _cli_verify(local_dir, capsys)
    assert rc == 1 and res[1]["ok"] and not res[2]["ok"] and MANIFEST in res[2]["error"]
    with hang_detector():
        assert cli_main(["inspect", str(local_dir), "--step", "2"]) == 1  # one "ckpt: error:" line naming it
    err = capsys.readouterr().err
    assert err.startswith("ckpt: error:") and MANIFEST in err and "CorruptCheckpointError" in err


def test_a_fifo_in_place_of_the_data_file_is_refused_without_blocking(local_dir, capsys):
    _save_steps(local_dir)
    (_newest(local_dir) / "rank-00000.bin").unlink()
    os.mkfifo(_newest(local_dir) / "rank-00000.bin")
    _restore_falls_back(local_dir, "rank-00000.bin")
    rc, res = _cli_verify(local_dir, capsys)
    assert rc == 1 and res[1]["ok"] and not res[2]["ok"] and "rank-00000.bin" in res[2]["error"]


def test_a_directory_in_place_of_the_manifest_is_corrupt(local_dir):
    _save_steps(local_dir)
    (_newest(local_dir) / MANIFEST).unlink()
    (_newest(local_dir) / MANIFEST).mkdir()
    _restore_falls_back(local_dir, MANIFEST)


# Records too large or endless are refused before they are read. These run in a child process
# whose address space is capped, so that the defect (reading it all) fails the test with a
# MemoryError instead of bringing the OOM killer onto the machine.
_LIMITED_RESTORE = textwrap.dedent("""
    import json, resource, sys, warnings
    import torch, ckpt
    cap = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    target = {"w": torch.zeros(50_000), "step": None}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=sys.argv[1])) as ck:
            step = ck.restore(target)
            skipped = ck.last_restore.skipped
    print(json.dumps({"step": step, "w": float(target["w"][0]), "skipped": skipped,
                      "warnings": [str(x.message) for x in w]}))
""")


def _restore_in_capped_child(local_dir, cap=1536 << 20, timeout=120):
    r = subprocess.run(
        [sys.executable, "-c", _LIMITED_RESTORE, str(local_dir), str(cap)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_a_2gib_sparse_manifest_is_refused_unread(local_dir):
    _save_steps(local_dir)
    m = _newest(local_dir) / MANIFEST
    with open(m, "r+b") as f:
        f.truncate(2 << 30)  # sparse: costs no disk
    out = _restore_in_capped_child(local_dir)
    assert out["step"] == 1 and out["w"] == 1.0
    assert any(MANIFEST in s and "step-000000002" in s for s in out["skipped"])


def test_a_manifest_symlinked_to_dev_zero_is_refused_unread(local_dir):
    _save_steps(local_dir)
    m = _newest(local_dir) / MANIFEST
    m.unlink()
    m.symlink_to("/dev/zero")
    out = _restore_in_capped_child(local_dir)
    assert out["step"] == 1 and out["w"] == 1.0
    assert any(MANIFEST in s for s in out["skipped"])


def test_a_record_whose_size_lies_is_read_no_further_than_the_limit():
    """/proc files are regular files that stat as 0 bytes and then read on: the bound holds on the read
    itself, not only on the size the file system reports."""
    from ckpt.format import read_record

    assert os.stat("/proc/self/maps").st_size == 0
    with pytest.raises(ckpt.CorruptCheckpointError, match="/proc/self/maps"):
        read_record("/proc/self/maps", limit=1000)

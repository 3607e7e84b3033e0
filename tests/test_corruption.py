"""Corrupt, torn, partial and hostile checkpoints are detected; restore falls back to an older one."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
from ckpt import knobs


def _save_steps(local_dir, steps=(1, 2), numel=50_000):
    with knobs.override(CKPT_CHUNK_BYTES=64 << 10), \
            ckpt.Checkpointer(local_dir=local_dir, keep=ckpt.Retention(local=None)) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((numel,), float(s)), "step": s}).wait()


def _restore(local_dir):
    target = {"w": torch.zeros(50_000), "step": None}
    with ckpt.Checkpointer(local_dir=local_dir) as ck:
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


@pytest.mark.parametrize("commit", [b"not json", b"[]", b'{"step": 2}',
                                    b'{"step":2,"world_size":1,"manifests":{"x":-1},"data":{}}'])
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

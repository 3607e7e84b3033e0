"""The ``ckpt`` command line on a real local tier."""

from __future__ import annotations

import json

import torch

import ckpt
from ckpt.cli import main


def _two_steps(local_dir):
    with ckpt.Checkpointer(local_dir=local_dir, keep=ckpt.Retention(local=None)) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((1000,), float(s)), "note": "x"}).wait()


def test_ls_lists_committed_steps_newest_first(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["ls", str(local_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [2, 1]


def test_inspect_shows_the_tensors(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["inspect", str(local_dir)]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and "float32" in out and "[1000]" in out


def test_verify_fails_on_a_flipped_bit(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["verify", str(local_dir)]) == 0
    data = local_dir / "step-000000001" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 1
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(local_dir), "--json"]) == 1
    res = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert res[2]["ok"] and not res[1]["ok"] and "checksum" in res[1]["error"]


def test_gc_keeps_the_newest(local_dir, capsys):
    _two_steps(local_dir)
    assert main(["gc", str(local_dir), "--keep", "1"]) == 0
    assert [p.name for p in local_dir.glob("step-*")] == ["step-000000002"]


def test_promote_to_a_file_url_and_back(local_dir, tmp_path, capsys):
    _two_steps(local_dir)
    url = f"file://{tmp_path}/remote"
    assert main(["promote", str(local_dir), url, "--step", "2", "--to", "remote"]) == 0
    other = tmp_path / "other"
    assert main(["promote", str(other), url, "--step", "2", "--to", "local"]) == 0
    assert main(["verify", str(other), "--step", "2"]) == 0

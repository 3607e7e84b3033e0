"""Retention and ``ckpt gc`` never delete the last checkpoint that verifies.

Steps 10/20/30 are committed and one bit of step 30's data is flipped: ``ckpt gc --keep 1`` must
keep 20 (the newest that verifies) besides 30, so that a restore still finds a good step.
In-process retention cannot re-read every step at each save; it counts as verified what this
process committed itself or read back in full, and never a step it saw fail verification.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.cli import main
from ckpt.format import COMMIT_NAME, data_name
from ckpt.policy import prune
from ckpt.tiers import LocalTier
from helpers import verifies

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _write(local_dir: Path, *steps: int, url: str | None = None) -> None:
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=local_dir),
        policy=ckpt.Policy(keep=ckpt.Retention(local=None, remote=None)),
    ) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((1000,), float(s))}).wait()


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x10
    path.write_bytes(bytes(raw))


def _data(d: Path, step: int) -> Path:
    return d / f"step-{step:09d}" / data_name(0)


def _committed(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.glob("step-*") if (p / COMMIT_NAME).exists())


def test_gc_keeps_the_newest_checkpoint_that_verifies(local_dir, capsys):
    _write(local_dir, 10, 20, 30)
    _flip(_data(local_dir, 30))
    assert main(["gc", str(local_dir), "--keep", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["removed step 10"]
    assert "step 30" in captured.err and "kept step 20" in captured.err
    assert _committed(local_dir) == [20, 30]
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        state = {"w": torch.zeros(1000)}
        with pytest.warns(RuntimeWarning):
            assert ck.restore(state) == 20


def test_gc_dry_run_says_the_same_and_deletes_nothing(local_dir, capsys):
    _write(local_dir, 10, 20, 30)
    _flip(_data(local_dir, 30))
    assert main(["gc", str(local_dir), "--keep", "1", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == ["would remove step 10"]
    assert _committed(local_dir) == [10, 20, 30]


def test_gc_deletes_no_committed_step_when_none_verifies(local_dir, capsys):
    _write(local_dir, 10, 20, 30)
    for s in (10, 20, 30):
        _flip(_data(local_dir, s))
    assert main(["gc", str(local_dir), "--keep", "1"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    assert _committed(local_dir) == [10, 20, 30]


def test_gc_of_a_remote_tier_keeps_the_newest_that_verifies(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    _write(tmp_path / "local", 10, 20, 30, url=url)
    _flip(tmp_path / "remote" / "step-000000030" / "rank-00000" / "part-000000")
    assert main(["gc", url, "--keep", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed step 10"]
    assert _committed(tmp_path / "remote") == [20, 30]


def test_gc_dcp_keeps_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    from ckpt.integrations.dcp import TierStorageWriter, list_checkpoints

    local = tmp_path / "local"
    for name in ("a", "b", "c"):
        dcp.save(
            {"w": torch.arange(1000.0)}, storage_writer=TierStorageWriter(local_dir=local), checkpoint_id=name
        )
    _flip(local / "c" / "rank-00000.dcp.bin")
    with pytest.warns(UserWarning, match="'c' does not verify"):
        assert main(["gc", str(local), "--dcp", "--keep", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed a"]
    assert [r["id"] for r in list_checkpoints(local)] == ["b", "c"]


def test_retention_keeps_the_newest_step_this_process_verified(local_dir):
    """The hostile case in-process: the newest step is corrupt on disk and retention runs."""
    _write(local_dir, 10, 20, 30)
    _flip(_data(local_dir, 30))
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    ) as ck:
        with pytest.warns(RuntimeWarning), pytest.raises(ckpt.errors.NoCheckpointError):
            ck.restore({"w": torch.zeros(1000)}, step=30)
        assert ck.restore({"w": torch.zeros(1000)}, step=20) == 20
        # this process saw 30 fail and read 20 in full; it never read 10
        assert ck.local.verified == {30: False, 20: True}
        # retention with what the process knows: 30 stays (the newest), and so does 20, the newest
        # this process knows to verify; 10 goes
        assert prune(ck.local, 1, verified=lambda s: ck.local.verified.get(s) is True) == [10]
    assert _committed(local_dir) == [20, 30]


def test_retention_after_each_save_always_leaves_a_step_that_verifies(local_dir):
    _write(local_dir, 10, 20, 30)
    _flip(_data(local_dir, 30))
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    ) as ck:
        state = {"w": torch.zeros(1000)}
        with pytest.warns(RuntimeWarning):
            assert ck.restore(state) == 20
        for s in (21, 22):
            state["w"].fill_(s)
            ck.save(s, state).wait()
            good = [x for x in _committed(local_dir) if verifies(local_dir, x)]
            assert s in good
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"w": torch.zeros(1000)}) == 22


def test_prune_without_anything_verified_deletes_no_committed_step(local_dir):
    _write(local_dir, 10, 20, 30)
    (local_dir / "step-000000005").mkdir()  # an uncommitted leftover: always safe to remove
    tier = LocalTier(local_dir)
    assert prune(tier, 1, verified=lambda s: False) == [5]
    assert _committed(local_dir) == [10, 20, 30]
    assert json.loads((local_dir / "step-000000030" / COMMIT_NAME).read_bytes())["step"] == 30

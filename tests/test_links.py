"""Symbolic links into a checkpoint directory: listed and restorable, never deleted through.

People link a shared baseline into a run's directory (``step-000000005 -> /shared/base/...``).
Retention, ``ckpt gc``, a save of the same step and the DCP adapter's pruning must leave the
link's target byte for byte as it was, including when the link is swapped in mid-delete.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.cli import main
from ckpt.format import data_name
from ckpt.tiers import LocalTier, RemoteTier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (not following links), by relative path, with its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def _write(local_dir: Path, *steps: int) -> None:
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((1000,), float(s))}).wait()


def _baseline(tmp_path: Path, *steps: int) -> Path:
    base = tmp_path / "shared"
    _write(base, *steps)
    return base


def _link(local_dir: Path, base: Path, step: int) -> Path:
    name = f"step-{step:09d}"
    (local_dir / name).symlink_to(base / name, target_is_directory=True)
    return local_dir / name


def test_retention_never_deletes_a_linked_step_nor_anything_in_its_target(local_dir, tmp_path):
    base = _baseline(tmp_path, 5)
    before = _tree(base)
    link = _link(local_dir, base, 5)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    ) as ck:
        for s in (10, 20, 30):
            ck.save(s, {"w": torch.full((1000,), float(s))}).wait()
    assert _tree(base) == before
    assert link.is_symlink() and sorted(p.name for p in local_dir.glob("step-*")) == [
        "step-000000005",
        "step-000000030",
    ]
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir)
    ) as ck:  # listed and restorable, read-only
        assert 5 in [i.step for i in ck.list()]
        state = {"w": torch.zeros(1000)}
        assert ck.restore(state, step=5) == 5 and float(state["w"][0]) == 5.0
    assert _tree(base) == before


def test_gc_never_deletes_a_linked_step(local_dir, tmp_path, capsys):
    base = _baseline(tmp_path, 5)
    before = _tree(base)
    _link(local_dir, base, 5)
    _write(local_dir, 10, 20)
    assert main(["gc", str(local_dir), "--keep", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed step 10"]
    assert _tree(base) == before
    assert sorted(p.name for p in local_dir.glob("step-*")) == ["step-000000005", "step-000000020"]


def test_a_step_whose_commit_is_a_link_is_not_owned(local_dir, tmp_path):
    base = _baseline(tmp_path, 5)
    before = _tree(base)
    farm = local_dir / "step-000000005"  # a real directory of links to the baseline's files
    farm.mkdir()
    for f in (base / "step-000000005").iterdir():
        (farm / f.name).symlink_to(f)
    _write(local_dir, 10, 20)
    assert main(["gc", str(local_dir), "--keep", "1"]) == 0
    assert sorted(p.name for p in farm.iterdir()) == sorted(
        p.name for p in (base / "step-000000005").iterdir()
    )
    assert _tree(base) == before


def test_deleting_an_own_step_removes_its_links_not_their_targets(local_dir, tmp_path):
    _write(local_dir, 10, 20)
    outside = tmp_path / "outside.bin"
    data = local_dir / "step-000000010" / data_name(0)
    shutil.copyfile(data, outside)
    data.unlink()
    data.symlink_to(outside)
    before = outside.read_bytes()
    assert main(["gc", str(local_dir), "--keep", "1"]) == 0
    assert not (local_dir / "step-000000010").exists()
    assert outside.read_bytes() == before


def test_delete_refuses_a_step_that_became_a_link(local_dir, tmp_path):
    base = _baseline(tmp_path, 10)
    before = _tree(base)
    _write(local_dir, 10)
    tier = LocalTier(local_dir)
    shutil.rmtree(local_dir / "step-000000010")
    _link(local_dir, base, 10)
    with pytest.raises(OSError) as e:
        tier.delete(10)
    assert e.value.errno == errno.ELOOP and "step-000000010" in str(e.value)
    assert _tree(base) == before


def test_a_link_swapped_in_mid_delete_cannot_redirect_it(local_dir, tmp_path, monkeypatch):
    base = _baseline(tmp_path, 10)
    before = _tree(base)
    _write(local_dir, 10)
    tier = LocalTier(local_dir)
    real_unlink = os.unlink
    swapped = []

    def unlink(path, *a, **kw):  # the attacker's move lands just before the first unlink of the delete
        if not swapped:
            swapped.append(True)
            os.rename(local_dir / "step-000000010", tmp_path / "moved-away")
            _link(local_dir, base, 10)
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError):
        tier.delete(10)
    monkeypatch.undo()
    assert swapped and _tree(base) == before
    assert (local_dir / "step-000000010").is_symlink()


def test_a_save_never_writes_into_a_linked_step(local_dir, tmp_path):
    base = _baseline(tmp_path, 5)
    before = _tree(base)
    _link(local_dir, base, 5)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(5, {"w": torch.full((1000,), -1.0)})
        with pytest.raises(OSError) as e:
            h.wait("local")
        assert e.value.errno == errno.ELOOP and "step-000000005" in str(e.value)
        with pytest.raises(OSError):
            ck.wait()
    assert _tree(base) == before


def test_remote_retention_on_a_file_url_never_deletes_through_a_link(tmp_path):
    base = _baseline(tmp_path, 5)
    remote = tmp_path / "remote"
    remote.mkdir()
    url = f"file://{remote}"
    ckpt.promote(5, "remote", local_dir=base, url=url)  # a baseline on the shared file system
    shared = tmp_path / "shared-remote"
    (remote / "step-000000005").rename(shared)
    (remote / "step-000000005").symlink_to(shared, target_is_directory=True)
    before = _tree(shared)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=tmp_path / "local"),
        policy=ckpt.Policy(keep=ckpt.Retention(local=1, remote=1)),
    ) as ck:
        for s in (10, 20):
            ck.save(s, {"w": torch.full((1000,), float(s))}).wait()
    assert _tree(shared) == before
    assert sorted(p.name for p in remote.glob("step-*")) == ["step-000000005", "step-000000020"]
    tier = RemoteTier(url)
    with pytest.raises(OSError) as e:
        tier.delete(5)
    assert e.value.errno == errno.ELOOP
    assert _tree(shared) == before


def _dcp_save(local: Path, name: str) -> None:
    from ckpt.integrations.dcp import TierStorageWriter

    dcp.save(
        {"w": torch.arange(1000.0)}, storage_writer=TierStorageWriter(local_dir=local), checkpoint_id=name
    )


def test_dcp_prune_and_gc_never_delete_through_a_linked_checkpoint(tmp_path, capsys):
    from ckpt.integrations.dcp import list_checkpoints, prune

    shared, local = tmp_path / "shared", tmp_path / "local"
    _dcp_save(shared, "base")
    before = _tree(shared)
    local.mkdir()
    (local / "base").symlink_to(shared / "base", target_is_directory=True)
    for name in ("a", "b", "c"):
        _dcp_save(local, name)
    assert "base" in [r["id"] for r in list_checkpoints(local)]  # listed, so it can be loaded
    assert prune(local, 2) == ["a"]
    assert main(["gc", str(local), "--dcp", "--keep", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed b"]
    assert _tree(shared) == before and (local / "base").is_symlink()
    assert sorted(p.name for p in local.iterdir()) == ["base", "c"]


def test_dcp_retention_of_a_nodes_own_files_never_follows_a_link(tmp_path):
    from ckpt.integrations.dcp import TierStorageWriter

    shared, local = tmp_path / "shared", tmp_path / "local"
    shared.mkdir(parents=True)
    (shared / "old").mkdir()
    (shared / "old" / "rank-00000.dcp.bin").write_bytes(b"someone else's bytes")
    before = _tree(shared)
    local.mkdir()
    (local / "old").symlink_to(shared / "old", target_is_directory=True)
    w = TierStorageWriter(local_dir=local, keep=ckpt.Retention(local=1))
    dcp.save({"w": torch.arange(10.0)}, storage_writer=w, checkpoint_id="new")
    assert _tree(shared) == before and (local / "old").is_symlink()


def test_a_dcp_save_never_writes_into_a_linked_checkpoint(tmp_path):
    """dcp.save under an id whose directory is a link (a baseline linked in) used to unlink the
    target's COMMIT and write its files into the target; it is refused and the target stays."""
    shared, local = tmp_path / "shared", tmp_path / "local"
    _dcp_save(shared, "base")
    before = _tree(shared)
    local.mkdir()
    (local / "base").symlink_to(shared / "base", target_is_directory=True)
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        _dcp_save(local, "base")
    assert _errnos(e.value) & {errno.ELOOP}, e.value
    assert _tree(shared) == before and (local / "base").is_symlink()


def _errnos(e: BaseException) -> set[int]:
    """Every errno in ``e``, its causes and (DCP's CheckpointException) the failures it wraps."""
    out, todo = set(), [e]
    while todo:
        x = todo.pop()
        if isinstance(x, OSError) and x.errno is not None:
            out.add(x.errno)
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        for nxt in (x.__cause__, x.__context__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)
    return out

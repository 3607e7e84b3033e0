"""A tier of one's own: one class and its registration, nothing else changed.

The tier here is a second disk directory (a slower, larger disk beside the NVMe one, say): a subclass of the
local tier under another name and nearness, made from ``Storage(extra_tiers={"disk2": DIR})``. Saves reach it
at its own cadence, retention applies to it, a restore falls back to it when the nearer tiers are gone (and
says so), and ``ckpt ls`` / ``inspect`` / ``verify`` / ``gc`` and export read its directory as they read any
local tier. Save metrics name it, and it can be the drain tier of a preemption.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

import ckpt
from ckpt import shm
from ckpt.cli import main as cli
from ckpt.tiers import LocalTier, register


@register
class SecondDisk(LocalTier):
    """Committed checkpoints on a second, farther disk."""

    name = "disk2"
    nearness = 15
    needs = "Storage(extra_tiers={'disk2': DIR})"


def _state(v: float) -> dict:
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(v)
    return {"model": model, "meta": {"v": v}}


def _storage(tmp_path) -> ckpt.Storage:
    return ckpt.Storage(local_dir=tmp_path / "nvme", extra_tiers={"disk2": tmp_path / "hdd"})


def test_a_registered_tier_gets_saves_retention_and_restores_with_no_other_change(tmp_path, capsys):
    policy = ckpt.Policy(every_steps=1, persist_every={"disk2": 2}, keep=ckpt.Retention(local=2))
    with ckpt.Checkpointer(storage=_storage(tmp_path), policy=policy) as ck:
        assert ck.tiers == ["memory", "local", "disk2"]
        for step in range(7):
            h = ck.maybe_save(step, _state(float(step)))
            h.wait()
            assert h.tier_status("disk2") == ("done" if step % 2 == 0 else "skipped")
        assert "disk2" in ck.tier_figures() and ck.tier_counts["disk2"].persisted >= 3
    disk2 = SecondDisk(tmp_path / "hdd")
    assert disk2.committed_steps() == [6, 4]  # its cadence, and retention (keep=2 as the local tier's)

    # the node's NVMe and RAM are gone: the restore falls back to the second disk
    shutil.rmtree(tmp_path / "nvme")
    for o in shm.orphans():
        shm.free(None, o.group.prefix)
    st = _state(-1.0)
    with ckpt.Checkpointer(storage=_storage(tmp_path), every_steps=1) as ck:
        assert ck.restore(st) == 6 and ck.last_restore.tier == "disk2"
        assert st["meta"] == {"v": 6.0} and torch.equal(st["model"].weight, torch.full((4, 8), 6.0))

    # the command line and export read its directory as any local tier's
    assert cli(["ls", str(tmp_path / "hdd"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {row["step"] for row in listed} == {4, 6}
    assert cli(["inspect", str(tmp_path / "hdd"), "--step", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6
    assert cli(["verify", str(tmp_path / "hdd"), "--step", "6"]) == 0
    assert cli(["gc", str(tmp_path / "hdd"), "--keep", "1"]) == 0
    assert SecondDisk(tmp_path / "hdd").committed_steps() == [6]
    info = ckpt.export(tmp_path / "hdd", tmp_path / "out", format="torch", key="model")
    assert info.step == 6
    got = torch.load(tmp_path / "out", weights_only=True)
    assert torch.equal(got["weight"], torch.full((4, 8), 6.0))


def test_settings_that_name_tiers_know_the_registered_one(tmp_path):
    """persist_every and a per-tier mtbf may name it when the Checkpointer has it; a name no registered tier
    has, in extra_tiers or persist_every, is refused at construction naming the tiers there are."""
    with pytest.raises(ValueError):
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=tmp_path / "a", extra_tiers={"disk3": tmp_path / "x"})
        )

    with pytest.raises(ValueError):  # not configured here
        ckpt.Checkpointer(local_dir=tmp_path / "b", every_steps=1, persist_every={"disk2": 5})
    ck = ckpt.Checkpointer(
        storage=_storage(tmp_path), interval="auto", mtbf={"memory": 600.0, "disk2": 3600.0}
    )
    try:
        assert ck.tiers == ["memory", "local", "disk2"]
    finally:
        ck.close()


def test_retention_per_tier_names_the_registered_tier(tmp_path):
    """keep= names the extra tier as it names the local one (a Retention keyword or a dict), each tier keeping
    its own count; a tier not named keeps its class's (a local tier's subclass: local's). A name the
    Checkpointer has no durable tier for is refused at construction."""
    policy = ckpt.Policy(every_steps=1, keep=ckpt.Retention(local=3, disk2=1), if_busy="wait")
    with ckpt.Checkpointer(storage=_storage(tmp_path), policy=policy) as ck:
        for step in range(5):
            ck.save(step, _state(float(step))).wait()
    assert LocalTier(tmp_path / "nvme").committed_steps() == [4, 3, 2]
    assert SecondDisk(tmp_path / "hdd").committed_steps() == [4]

    other = ckpt.Storage(local_dir=tmp_path / "nvme2", extra_tiers={"disk2": tmp_path / "hdd2"})
    with ckpt.Checkpointer(storage=other, keep={"local": 1, "disk2": 3}, if_busy="wait") as ck:
        for step in range(5):
            ck.save(step, _state(float(step))).wait()
    assert LocalTier(tmp_path / "nvme2").committed_steps() == [4]
    assert SecondDisk(tmp_path / "hdd2").committed_steps() == [4, 3, 2]

    with pytest.raises(ValueError):  # no such tier registered
        ckpt.Checkpointer(storage=_storage(tmp_path), keep=ckpt.Retention(disk3=2))
    with pytest.raises(ValueError):  # registered, but this Checkpointer has no second disk
        ckpt.Checkpointer(local_dir=tmp_path / "c", keep=ckpt.Retention(disk2=2))


def test_the_registered_tier_gets_save_metrics_and_a_log_line(tmp_path, caplog):
    """Metrics follow the tiers the Checkpointer has: the extra tier's persist time and throughput are in
    each save's record, and the per-save log line names it."""
    records = []
    with caplog.at_level("INFO", logger="ckpt.metrics"):
        with ckpt.Checkpointer(storage=_storage(tmp_path), every_steps=1, on_metrics=records.append) as ck:
            ck.save(3, _state(3.0)).wait()
            ck.metrics()  # the record is made on the thread that drives the Checkpointer
    (r,) = [r for r in records if "ckpt/save/step" in r]
    assert r["ckpt/save/step"] == 3 and r["ckpt/save/failed"] == 0
    assert r["ckpt/save/disk2_s"] > 0 and r["ckpt/save/disk2_gbps"] > 0 and "ckpt/save/local_s" in r
    (line,) = [x.getMessage() for x in caplog.records if x.name == "ckpt.metrics"]
    assert "disk2 " in line and "local " in line


def test_the_registered_tier_can_be_the_drain_tier(tmp_path):
    """A preemption waits until its save is durable on the extra tier, though it writes only every 1000th step;
    a Checkpointer without that tier refuses it as the drain tier, naming what makes it exist."""
    policy = ckpt.Policy(every_steps=1000, persist_every={"disk2": 1000})
    signals = ckpt.Signals(preempt=(signal.SIGUSR1,), drain_tier="disk2", on_preempt="raise")
    with ckpt.Checkpointer(storage=_storage(tmp_path), policy=policy, signals=signals) as ck:
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only sets the flag
        with pytest.raises(ckpt.Preempted) as info:
            ck.maybe_save(7, _state(7.0))
        assert info.value.durable and info.value.step == 7
    assert SecondDisk(tmp_path / "hdd").committed_steps() == [7]

    with pytest.raises(ValueError, match="drain_tier='disk2'.*extra_tiers"):
        ckpt.Checkpointer(local_dir=tmp_path / "other", signals=signals)

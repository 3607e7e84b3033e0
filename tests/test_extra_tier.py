"""A tier of one's own: one class and its registration, nothing else changed.

The tier here is a second disk directory (a slower, larger disk beside the NVMe one, say): a subclass of the
local tier under another name and nearness, made from ``Storage(extra_tiers={"disk2": DIR})``. Saves reach it
at its own cadence, retention applies to it, a restore falls back to it when the nearer tiers are gone (and
says so), and ``ckpt ls`` / ``inspect`` / ``verify`` / ``gc`` and export read its directory as they read any
local tier. Save metrics name it, and it can be the drain tier of a preemption.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal

import pytest
import torch

import ckpt
from ckpt import knobs, shm
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
    policy = ckpt.Policy(
        every_steps=1, persist_every={"disk2": 2}, keep=ckpt.Retention(local=2), if_busy="wait"
    )
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


# -- promote to and from the registered tier ------------------------------------------------------------
def _big(v: float) -> dict:
    return {"w": torch.arange(40_000, dtype=torch.float32).add_(v), "meta": {"v": v}}


def _files(root) -> dict:
    """Every file under ``root`` with its bytes, but the owner lock (rewritten by each Checkpointer that owns it)."""
    return {
        p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".ckpt-lock"
    }


def _restored_from(tmp_path, name: str, **tiers) -> tuple[str, float]:
    """Restore step 3 through a Checkpointer with a fresh local_dir and only ``tiers``: (tier, value)."""
    st = {"w": torch.empty(40_000), "meta": None}
    storage = ckpt.Storage(local_dir=tmp_path / name, **tiers)
    with ckpt.Checkpointer(storage=storage) as ck:
        assert ck.restore(st, step=3) == 3
        tier = ck.last_restore.tier
    assert torch.equal(st["w"], _big(st["meta"]["v"])["w"])
    return tier, st["meta"]["v"]


def test_promote_copies_to_and_from_the_registered_tier(tmp_path):
    """ck.promote(step, to) copies from the nearest other tier that stores the step to any durable tier: the
    local tier to the second disk, to the URL, and back from the second disk to a local_dir that lost it."""
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(local_dir=tmp_path / "nvme") as ck:
        ck.save(3, _big(1.0)).wait()
    storage = ckpt.Storage(url=url, local_dir=tmp_path / "nvme", extra_tiers={"disk2": tmp_path / "hdd"})
    with ckpt.Checkpointer(storage=storage) as ck:
        assert ck.promote(3, "disk2") is True and ck.promote(3, "disk2") is False  # the second: nothing to do
        assert ck.promote(3, "remote") is True
        with pytest.raises(ValueError):  # not a durable tier
            ck.promote(3, "memory")
        with pytest.raises(ValueError):  # not a tier at all
            ck.promote(3, "disk3")
        with pytest.raises(FileNotFoundError):  # no tier holds it
            ck.promote(4, "disk2")
    assert SecondDisk(tmp_path / "hdd").committed_steps() == [3]
    assert _restored_from(tmp_path, "e1", url=url) == ("remote", 1.0)

    shutil.rmtree(tmp_path / "nvme" / "step-000000003")
    shutil.rmtree(tmp_path / "remote")  # so that the copy back can only come from the second disk
    with ckpt.Checkpointer(storage=storage) as ck:
        assert ck.promote(3, "local") is True
    assert LocalTier(tmp_path / "nvme").committed_steps() == [3]
    assert _restored_from(tmp_path, "e2", extra_tiers={"disk2": tmp_path / "hdd"}) == ("disk2", 1.0)


@pytest.mark.parametrize("to", ["disk2", "local"])
def test_a_promote_failing_on_a_full_disk_leaves_the_destination_as_it_was(tmp_path, monkeypatch, to):
    """Step 3 is A on the destination and B on the source; the destination's disk fills up after the first
    chunk of the copy (ENOSPC). The promote raises that OSError, the destination holds A unchanged (no
    leftovers beside it), A still restores from it, and a promote once there is room puts B there."""
    src, dst = ("nvme", "hdd") if to == "disk2" else ("hdd", "nvme")
    both = {"nvme": tmp_path / "nvme", "hdd": tmp_path / "hdd"}
    with knobs.override(CKPT_CHUNK_BYTES=64 << 10):  # 160 kB of data: three chunks
        policy = ckpt.Policy(if_busy="wait")
        with ckpt.Checkpointer(storage=_storage(tmp_path), policy=policy) as ck:  # A on both disks
            ck.save(3, _big(1.0)).wait()
        shutil.rmtree(both[src])
        tier = SecondDisk(both[src]) if src == "hdd" else LocalTier(both[src])
        with ckpt.Checkpointer(local_dir=tmp_path / "scratch") as ck:  # B on the source only
            ck.save(3, _big(2.0)).wait()
        shutil.copytree(tmp_path / "scratch" / "step-000000003", tier.step_dir(3))
        before = _files(both[dst])

        written = []
        real = os.pwrite

        def full_after_one_chunk(fd, data, offset):
            written.append(offset)
            if len(written) > 1:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real(fd, data, offset)

        with ckpt.Checkpointer(storage=_storage(tmp_path)) as ck:
            with monkeypatch.context() as m:
                m.setattr(os, "pwrite", full_after_one_chunk)
                with pytest.raises(OSError) as e:
                    ck.promote(3, to)
            assert e.value.errno == errno.ENOSPC and len(written) > 1  # it failed mid-copy
            assert _files(both[dst]) == before  # byte for byte, and nothing left beside it
        only = {"extra_tiers": {"disk2": both["hdd"]}} if to == "disk2" else {}
        if to == "disk2":
            assert _restored_from(tmp_path, "fresh1", **only) == ("disk2", 1.0)
        else:
            assert SecondDisk(both["hdd"]).committed_steps() == [3]
            with ckpt.Checkpointer(local_dir=both["nvme"]) as ck:
                st = {"w": torch.empty(40_000), "meta": None}
                assert ck.restore(st, step=3) == 3 and st["meta"] == {"v": 1.0}

        with ckpt.Checkpointer(storage=_storage(tmp_path)) as ck:  # room again: the copy goes through
            assert ck.promote(3, to) is True
        dest = SecondDisk(both["hdd"]) if to == "disk2" else LocalTier(both["nvme"])
        st = {"w": torch.empty(40_000), "meta": None}
        dest.restore_into(st, 3, None, True, None)  # the destination now holds B
        assert st["meta"] == {"v": 2.0} and torch.equal(st["w"], _big(2.0)["w"])


class ThirdDisk(LocalTier):
    """A durable tier of a kind of its own: retention knows it by name only (not as a local tier)."""

    name = "disk3"
    nearness = 16
    needs = "Storage(extra_tiers={'disk3': DIR})"
    keep_of = ckpt.tiers.Tier.keep_of


def test_keep_as_an_int_bounds_a_durable_tier_of_any_kind(tmp_path, monkeypatch):
    """``keep=N`` is N checkpoints on every durable tier, a registered tier that is neither a local nor a remote
    one included; a Retention that does not name such a tier keeps all of it (nothing is deleted that no
    setting asked for)."""
    from ckpt.tiers import base

    monkeypatch.setitem(base._REGISTRY, "disk3", ThirdDisk)
    for keep, want in ((2, [4, 3]), (ckpt.Retention(local=2), [4, 3, 2, 1, 0])):
        root = tmp_path / str(len(want))
        storage = ckpt.Storage(local_dir=root / "nvme", extra_tiers={"disk3": root / "hdd"})
        with ckpt.Checkpointer(storage=storage, keep=keep, if_busy="wait") as ck:
            assert ck.tiers == ["memory", "local", "disk3"]
            for step in range(5):
                ck.save(step, _state(float(step))).wait()
        assert LocalTier(root / "nvme").committed_steps() == [4, 3]
        assert ThirdDisk(root / "hdd").committed_steps() == want, keep
    assert ckpt.Policy(keep=2).keep.count(ThirdDisk(tmp_path / "x")) == 2
    assert ckpt.Retention(local=2).count(ThirdDisk(tmp_path / "y")) is None

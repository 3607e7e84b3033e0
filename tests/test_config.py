"""The grouped options (ckpt.Storage, ckpt.Policy) and the flat keyword arguments are one set."""

from __future__ import annotations

import dataclasses

import pytest

import ckpt
from helpers import make_state


def test_config_objects_drive_the_checkpointer_like_the_keywords(tmp_path):
    policy = ckpt.Policy(
        every_steps=2, persist_every={"local": 4}, keep=ckpt.Retention(local=1), if_busy="wait"
    )
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path, max_in_flight=1), policy=policy) as ck:
        assert ck.policy == policy and ck.storage.local_dir == tmp_path and ck.pool.slots == 1
        state = make_state()
        saved = [s for s in range(1, 9) if ck.maybe_save(s, state) is not None]
        ck.wait()
    assert saved == [2, 4, 6, 8]
    assert ck.tier_counts["local"].persisted >= 2 and ck.local.committed_steps() == [8]


def test_an_option_given_twice_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError) as e:
        ckpt.Checkpointer(local_dir=tmp_path, every_steps=5, policy=ckpt.Policy(every_steps=10))
    assert "every_steps" in str(e.value)
    with pytest.raises(ValueError):
        ckpt.Checkpointer(
            tmp_path.as_uri(), storage=ckpt.Storage(local_dir=tmp_path / "l", url="memory://other")
        )
    with pytest.raises(TypeError):
        ckpt.Checkpointer(local_dir=tmp_path, policy={"every_steps": 3})


def test_the_same_value_both_ways_is_one_option(tmp_path):
    with ckpt.Checkpointer(local_dir=tmp_path, every_steps=3, policy=ckpt.Policy(every_steps=3)) as ck:
        assert ck.interval.every_steps == 3


def test_keywords_alone_show_up_in_the_config_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_LOCAL_DIR", str(tmp_path))
    with ckpt.Checkpointer(every_seconds=60.0, replicated=["model"]) as ck:
        assert ck.policy.every_seconds == 60.0 and ck.storage.replicated == ("model",)
        assert ck.storage.local_dir == str(tmp_path)
    variant = dataclasses.replace(ck.policy, every_seconds=None, every_steps=7)
    with ckpt.Checkpointer(local_dir=tmp_path, policy=variant) as ck2:
        assert ck2.interval.every_steps == 7 and ck2.interval.every_seconds is None


def test_tier_figures_report_what_each_tier_holds_and_measured(tmp_path):
    with ckpt.Checkpointer(
        tmp_path.joinpath("remote").as_uri(), local_dir=tmp_path / "local", if_busy="wait"
    ) as ck:
        state = make_state()
        ck.save(1, state).wait()
        ck.restore(make_state(1))
        figs = ck.tier_figures()
        assert list(figs) == ["memory", "local", "remote"]
        assert figs["local"].committed == 1 and figs["local"].writes == 1 and figs["local"].write_gbps > 0
        assert figs["remote"].writes == 1 and figs["local"].bytes_held > 0
        assert figs["local"].capacity_bytes >= figs["local"].bytes_held
        assert figs[ck.last_restore.tier].reads == 1

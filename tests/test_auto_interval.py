"""interval='auto': the Young/Daly optimum from measured save costs, with an injected clock."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from ckpt.policy import AutoInterval, daly_interval


def test_daly_matches_young_to_first_order_and_caps_at_mtbf():
    assert daly_interval(10.0, 86_400) == pytest.approx(math.sqrt(2 * 10 * 86_400), rel=0.01)
    assert daly_interval(10.0, 86_400) > math.sqrt(2 * 10 * 86_400) - 10
    assert daly_interval(500.0, 100.0) == 100.0


def test_interval_follows_the_median_of_recent_costs():
    now = [0.0]
    ai = AutoInterval(mtbf=3600, clock=lambda: now[0])
    assert ai.due(0) and ai.seconds is None
    for c in (1.0, 100.0, 1.0):  # one outlier does not move the median
        ai.record(c)
    assert ai.cost == 1.0
    assert ai.seconds == pytest.approx(daly_interval(1.0, 3600))
    ai.saved(0)
    now[0] = ai.seconds - 1
    assert not ai.due(1)
    now[0] = ai.seconds + 0.1
    assert ai.due(2)


def test_interval_is_never_shorter_than_the_persist_time():
    ai = AutoInterval(mtbf=3600)
    ai.record(0.001, persist_s=30.0)
    assert ai.seconds == 30.0


def test_expected_loss_fraction():
    ai = AutoInterval(mtbf=1000, restart=20)
    ai.record(2.0)
    tau = ai.seconds
    assert ai.expected_loss() == pytest.approx(2.0 / tau + (tau / 2 + 20) / 1000)


def test_checkpointer_with_auto_interval_saves_by_the_injected_clock(local_dir):
    now = [0.0]
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(interval="auto", mtbf=10_000, keep=ckpt.Retention(local=None)),
        clock=lambda: now[0],
    ) as ck:
        w = torch.zeros(10)
        assert ck.maybe_save(0, {"w": w}) is not None  # the first save measures the cost
        ck.wait()
        report = ck.interval_report()
        tau = report["interval_s"]
        assert tau is not None and tau > 0 and 0 < report["expected_loss_fraction"] < 1
        now[0] = tau * 0.5
        assert ck.maybe_save(1, {"w": w}) is None
        now[0] = tau * 1.01 + 1
        assert ck.maybe_save(2, {"w": w}) is not None


def test_auto_interval_arguments(local_dir):
    with pytest.raises(ValueError, match="mtbf"):
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(interval="auto"))
    with pytest.raises(ValueError, match="every_steps"):
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir),
            policy=ckpt.Policy(interval="auto", mtbf=10, every_steps=5),
        )
    with pytest.raises(ValueError, match="interval_report"):
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)).interval_report()


def test_a_tiers_cadence_comes_from_the_slowdown_its_writes_cause():
    from ckpt.policy import TierCadence

    c = TierCadence("local", mtbf=3600)
    assert c.seconds is None  # nothing measured: write as soon as possible
    c.wrote(5.0)
    for _ in range(5):
        c.step(1.2, writing=True)
        c.step(1.0, writing=False)
    assert c.cost == pytest.approx(0.2 * 5.0 / 1.2)
    assert c.seconds == pytest.approx(daly_interval(0.2 * 5.0 / 1.2, 3600))
    free = TierCadence("remote", mtbf=3600)
    free.wrote(40.0)
    for _ in range(5):
        free.step(1.0, writing=True)
        free.step(1.0, writing=False)
    assert free.cost == 0.0 and free.seconds == 40.0  # costs the loop nothing: as often as it keeps up
    with pytest.raises(ValueError):
        TierCadence("local", mtbf=0)


def test_interval_auto_gives_each_tier_without_a_cadence_its_own(tmp_path):
    now = [0.0]
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=tmp_path.joinpath("remote").as_uri(), local_dir=tmp_path / "local"),
        policy=ckpt.Policy(
            interval="auto",
            mtbf={"memory": 600, "remote": 86_400},
            persist_every={"remote": 1000},
            if_busy="wait",
        ),
        clock=lambda: now[0],
    ) as ck:
        w = torch.zeros(10)
        for step in range(30):
            now[0] += 1.0
            h = ck.maybe_save(step, {"w": w})
            if h is not None:
                h.wait()
        tiers = ck.interval_report()["tiers"]
        assert list(tiers) == ["local"]  # the remote tier has its persist_every cadence
        assert tiers["local"]["mtbf_s"] == 600  # not named in mtbf: the memory tier's
        assert tiers["local"]["write_s"] is not None and tiers["local"]["write_s"] > 0
        assert ck.tier_counts["local"].persisted >= 1


def test_mtbf_per_tier_is_checked(local_dir):
    with pytest.raises(ValueError):
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir),
            policy=ckpt.Policy(interval="auto", mtbf={"local": 100}),
        )  # no "memory"
    with pytest.raises(ValueError):
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir),
            policy=ckpt.Policy(interval="auto", mtbf={"memory": 100, "disk": 5}),
        )

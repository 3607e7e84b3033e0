"""Metrics records (ckpt.metrics): one flat record per finished save and per restore, with the documented
keys and values that agree with what the saves measured; one INFO line per save; the on_metrics callback."""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

import ckpt
from ckpt.tiers import LocalTier

SAVE_KEYS = {
    "ckpt/save/step",
    "ckpt/save/bytes",
    "ckpt/save/stall_ms",
    "ckpt/save/wait_ms",
    "ckpt/save/stage_ms",
    "ckpt/save/stage_gbps",
    "ckpt/save/skipped",
    "ckpt/save/failed",
}


def _state(scale: float = 1.0) -> dict:
    return {"w": torch.full((256, 1024), scale), "b": torch.arange(100, dtype=torch.float64), "step": 0}


def _numbers(record: dict) -> bool:
    return all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in record.values()
    )


def test_save_records_have_the_documented_keys_and_agree_with_the_measurements(tmp_path):
    # if_busy="wait": every save reaches every tier (no newest-wins superseding), so each record has both
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=f"file://{tmp_path}/remote", local_dir=tmp_path / "local"),
        policy=ckpt.Policy(every_steps=1, if_busy="wait"),
    ) as ck:
        handles = [ck.save(s, _state(s)) for s in (10, 20, 30)]
        ck.wait()
        records = ck.metrics()
        assert ck.metrics() == []  # taken: the next call returns only newer ones
    assert [r["ckpt/save/step"] for r in records] == [10, 20, 30]
    for r, h in zip(records, handles):
        tiers = {f"ckpt/save/{t}_{u}" for t in ("local", "remote") for u in ("s", "gbps")}
        assert set(r) == SAVE_KEYS | tiers and _numbers(r)
        stats = h.stats
        assert r["ckpt/save/bytes"] == stats.nbytes >= 256 * 1024 * 4 + 100 * 8
        assert r["ckpt/save/stall_ms"] == pytest.approx(stats.stall_s * 1e3) and r["ckpt/save/stall_ms"] > 0
        assert 0 <= r["ckpt/save/wait_ms"] <= r["ckpt/save/stall_ms"]
        for tier in ("local", "remote"):
            assert r[f"ckpt/save/{tier}_s"] == stats.persist_s[tier] > 0
            assert r[f"ckpt/save/{tier}_gbps"] == pytest.approx(stats.nbytes / stats.persist_s[tier] / 1e9)
        assert r["ckpt/save/stage_gbps"] == pytest.approx(
            stats.nbytes / (r["ckpt/save/stage_ms"] / 1e3) / 1e9
        )
        assert (r["ckpt/save/skipped"], r["ckpt/save/failed"]) == (0, 0)


def test_a_record_appears_only_once_its_save_finished_on_every_tier(local_dir):
    go = threading.Event()

    class Gated(LocalTier):
        def write(self, step, manifest, data):
            assert go.wait(60)
            return super().write(step, manifest, data)

    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=Gated(local_dir)), policy=ckpt.Policy(every_steps=1000)
    ) as ck:
        h = ck.save(1, _state())
        h.wait("memory")
        assert ck.metrics() == [] and ck.maybe_save(2, _state()) is None  # not due
        go.set()
        h.wait()
        records = ck.metrics()
    assert [r["ckpt/save/step"] for r in records] == [1]


def test_restore_records_name_the_tier_and_the_size(tmp_path):
    state = _state(3.0)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "local")) as ck:
        ck.save(5, state).wait()
        ck.metrics()
        assert ck.restore(state) == 5  # from host memory, in this process
        (memory,) = ck.metrics()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tmp_path / "local")
    ) as ck:  # a new process would see the disk
        assert ck.restore(_state()) == 5
        (local,) = ck.metrics()
        info = ck.last_restore
    assert memory["ckpt/restore/from_memory"] == 1 and "ckpt/restore/from_local" not in memory
    assert set(local) == {
        "ckpt/restore/step",
        "ckpt/restore/bytes",
        "ckpt/restore/seconds",
        "ckpt/restore/gbps",
        "ckpt/restore/skipped",
        "ckpt/restore/from_local",
    } and _numbers(local)
    assert local["ckpt/restore/step"] == 5 and local["ckpt/restore/bytes"] == info.nbytes > 0
    assert local["ckpt/restore/seconds"] == info.seconds > 0 and local["ckpt/restore/skipped"] == 0
    assert local["ckpt/restore/gbps"] == pytest.approx(info.nbytes / info.seconds / 1e9)


def test_a_restore_that_passes_over_a_corrupt_checkpoint_counts_it(tmp_path):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path)) as ck:
        ck.save(1, _state(1.0)).wait()  # each lands (a save superseded on a busy tier would not)
        ck.save(2, _state(2.0)).wait()
    (data,) = (tmp_path / "step-000000002").glob("*.bin")
    with open(data, "r+b") as f:  # flip a byte in the data file
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with (
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path)) as ck,
        pytest.warns(RuntimeWarning, match="step-000000002"),
    ):
        assert ck.restore(_state()) == 1
        (r,) = ck.metrics()
    assert r["ckpt/restore/step"] == 1 and r["ckpt/restore/skipped"] == 1


def test_one_info_line_per_save_once_it_finished_and_nothing_at_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ckpt.metrics"):
        with ckpt.Checkpointer(
            storage=ckpt.Storage(url=f"file://{tmp_path}/remote", local_dir=tmp_path / "local"),
            policy=ckpt.Policy(every_steps=2, if_busy="wait"),
        ) as ck:  # every due save is taken, however slow the tiers
            for step in range(1, 8):
                ck.maybe_save(step, _state(step))
    lines = [r for r in caplog.records if r.name == "ckpt.metrics"]
    assert [r.levelno for r in lines] == [logging.INFO] * 3
    for rec, step in zip(lines, (2, 4, 6)):
        msg = rec.getMessage()
        assert msg.startswith(f"saved step {step}: ") and "stall " in msg and " ms" in msg
        assert "local " in msg and "remote " in msg and "GB/s" in msg


class _Full(LocalTier):
    def write(self, step, manifest, data):
        raise OSError(28, "No space left on device (injected)", str(self.root))


def test_a_failed_save_is_recorded_as_failed_and_its_line_names_the_tier(local_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ckpt.metrics"):
        ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=_Full(local_dir)))
        ck.save(4, _state())
        with pytest.raises(OSError):
            ck.wait()
        (r,) = ck.metrics()
        ck.close(raise_errors=False)
    assert r["ckpt/save/failed"] == 1 and "ckpt/save/local_s" not in r
    (line,) = [x.getMessage() for x in caplog.records if x.name == "ckpt.metrics"]
    assert "step 4" in line and "local FAILED" in line


def test_a_skipped_save_is_recorded_as_skipped_without_an_info_line(local_dir, caplog):
    go, started = threading.Event(), threading.Event()

    class Gated(LocalTier):
        def write(self, step, manifest, data):
            started.set()
            assert go.wait(60)
            return super().write(step, manifest, data)

    with caplog.at_level(logging.INFO, logger="ckpt.metrics"):
        with ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=Gated(local_dir), max_in_flight=1),
            policy=ckpt.Policy(if_busy="skip"),
        ) as ck:
            ck.save(1, _state())
            # the one buffer is being read by the write (before it starts, step 2 would supersede step 1)
            assert started.wait(60)
            assert ck.save(2, _state()).status == "skipped"
            go.set()
            ck.wait()
            records = {r["ckpt/save/step"]: r for r in ck.metrics()}
    assert records[2]["ckpt/save/skipped"] == 1 and "ckpt/save/local_s" not in records[2]
    assert records[1]["ckpt/save/skipped"] == 0
    assert [x.getMessage().split(":")[0] for x in caplog.records if x.name == "ckpt.metrics"] == [
        "saved step 1"
    ]


def test_on_metrics_gets_every_record_on_the_calling_thread(local_dir):
    got = []
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir),
        policy=ckpt.Policy(every_steps=1, if_busy="wait"),
        on_metrics=lambda r: got.append((threading.current_thread(), r)),
    ) as ck:
        ck.restore(_state())  # nothing to restore: no record
        for step in (1, 2, 3):
            ck.maybe_save(step, _state())
    assert [r["ckpt/save/step"] for _, r in got] == [1, 2, 3]
    assert all(t is threading.main_thread() for t, _ in got)


def test_an_on_metrics_that_raises_is_logged_and_checkpointing_goes_on(local_dir, caplog):
    def broken(record):
        raise RuntimeError("logger is down")

    with caplog.at_level(logging.ERROR, logger="ckpt.metrics"):
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), on_metrics=broken) as ck:
            ck.save(1, _state()).wait()
            ck.save(2, _state()).wait()
            records = ck.metrics()
    assert [r["ckpt/save/step"] for r in records] == [1, 2]
    assert [i.step for i in ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)).list()] == [2, 1]
    errors = [r for r in caplog.records if r.name == "ckpt.metrics" and r.levelno == logging.ERROR]
    assert len(errors) == 2 and errors[0].exc_info is not None


def test_on_metrics_must_be_callable(local_dir):
    with pytest.raises(TypeError, match="on_metrics"):
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir), on_metrics="wandb")

"""TieredCheckpointIO under Lightning's own checkpoint machinery: ModelCheckpoint's version counter and
save_last="link", loads of a path whose save is still being written (this instance, another one, another
process), and Lightning's AsyncCheckpointIO wrapper. Slow, stuck and full disks are LocalTier subclasses."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning", minversion="2.5")

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import ckpt  # noqa: E402
from ckpt.integrations.lightning import TieredCheckpointIO  # noqa: E402
from ckpt.tiers import LocalTier  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "lightning_io_worker.py"


class SlowLocal(LocalTier):
    """A disk that takes ``delay`` seconds before each checkpoint is written."""

    delay = 0.3

    def write(self, step, manifest, data):
        time.sleep(self.delay)
        return super().write(step, manifest, data)


class GatedLocal(LocalTier):
    """A disk that writes only once ``gate`` is set (see the ``gate`` fixture)."""

    gate: threading.Event

    def write(self, step, manifest, data):
        assert self.gate.wait(60), "hang detector: the test never opened the gate"
        return super().write(step, manifest, data)


class FullDisk(LocalTier):
    """A disk that is full: the data file's preallocation fails with ENOSPC."""

    def _write_data(self, path, size, chunk, get):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def io_with(tier: type[LocalTier], **kwargs) -> TieredCheckpointIO:
    return type(f"{tier.__name__}IO", (TieredCheckpointIO,), {"_local_tier": tier})(**kwargs)


@pytest.fixture
def gate():
    ev = threading.Event()
    yield ev, type("Gated", (GatedLocal,), {"gate": ev})
    ev.set()  # never leave a writer blocked


@pytest.fixture
def worker_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def _state(step: int, w: torch.Tensor) -> dict:
    return {"global_step": step, "state_dict": {"w": w}}


def _open_after(gate: threading.Event, seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, gate.set)
    t.start()
    return t


def _leftover_reservations(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("SAVING")]


# ---------------------------------------------------------------------------------------------
# Real Trainers


class EpochWeights(Callback):
    """Records the weights at each epoch's end (ModelCheckpoint saves then too, after the other callbacks)."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer, pl_module):
        self.weights[trainer.current_epoch] = {
            k: v.detach().clone() for k, v in pl_module.state_dict().items()
        }


def _fit(plugin, mc, epochs: int = 4):
    """``epochs`` epochs of 2 steps of lightning_worker's Tiny, no validation (ModelCheckpoint saves at each
    epoch's end); returns the weights at each epoch's end."""
    import lightning as L
    from lightning_worker import Tiny

    L.seed_everything(0, verbose=False)
    rec = EpochWeights()
    trainer = L.Trainer(
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec, mc],
        plugins=[plugin],
    )
    trainer.fit(Tiny(0.0))
    return rec.weights, trainer


def _versioned_checkpoint(root: Path):
    # One file name for every epoch: ModelCheckpoint's version counter must make it model-vN.ckpt.
    return ModelCheckpoint(
        dirpath=root, filename="model", save_top_k=-1, monitor="step", mode="max", every_n_epochs=1
    )


def _assert_each_holds_its_epoch(
    root: Path, names: list[str], weights: dict[int, dict[str, torch.Tensor]]
) -> None:
    epochs = []
    for name in names:
        sd = TieredCheckpointIO().load_checkpoint(root / name)
        epochs.append(sd["epoch"])
        want = weights[sd["epoch"]]
        assert sd["state_dict"].keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(sd["state_dict"][k], v), (name, k)
    assert sorted(epochs) == sorted(weights), (names, epochs)


def test_version_counter_keeps_every_epoch_when_the_disk_is_slow(tmp_path, worker_on_path):
    """ModelCheckpoint picks model-vN.ckpt by checking whether model.ckpt exists: a save still being written
    must already hold its path, or the next epoch overwrites it."""
    root = tmp_path / "ckpts"
    weights, _ = _fit(io_with(SlowLocal), _versioned_checkpoint(root))
    names = sorted(os.listdir(root))
    assert names == ["model-v1.ckpt", "model-v2.ckpt", "model-v3.ckpt", "model.ckpt"]
    _assert_each_holds_its_epoch(root, names, weights)
    assert _leftover_reservations(root) == []


def test_save_last_link_with_a_name_per_epoch_removes_links_not_their_targets(tmp_path, worker_on_path):
    """save_last="link" makes each last checkpoint a symbolic link; with a last name per epoch ModelCheckpoint
    removes the previous one through remove_checkpoint, which must remove the link only."""
    root = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=root, save_top_k=2, monitor="step", mode="max", save_last="link")
    mc.CHECKPOINT_NAME_LAST = "{epoch}-last"
    weights, _ = _fit(io_with(SlowLocal), mc)
    assert sorted(os.listdir(root)) == ["epoch=2-step=6.ckpt", "epoch=3-last.ckpt", "epoch=3-step=8.ckpt"]
    assert os.readlink(root / "epoch=3-last.ckpt") == "epoch=3-step=8.ckpt"
    _assert_each_holds_its_epoch(
        root, ["epoch=2-step=6.ckpt", "epoch=3-last.ckpt"], {e: weights[e] for e in (2, 3)}
    )


def test_load_through_another_instance_right_after_trainer_save_checkpoint(tmp_path, worker_on_path):
    """trainer.save_checkpoint(p) returns while p is written; loading p through a new TieredCheckpointIO
    waits for that write instead of failing with "no COMMIT"."""
    weights, trainer = _fit(io_with(SlowLocal), ModelCheckpoint(dirpath=tmp_path / "mc"), epochs=1)
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    sd = TieredCheckpointIO().load_checkpoint(tmp_path / "manual.ckpt")
    assert sd["global_step"] == 2
    for k, v in weights[0].items():
        assert torch.equal(sd["state_dict"][k], v)
    trainer.strategy.checkpoint_io.teardown()


def test_async_checkpoint_io_wrapper_end_to_end(tmp_path, worker_on_path):
    """Wrapped in Lightning's AsyncCheckpointIO, the plugin still holds each path when the save returns and
    its teardown (the end of fit) makes every checkpoint durable."""
    root = tmp_path / "ckpts"
    io = io_with(SlowLocal)
    weights, _ = _fit(AsyncCheckpointIO(io), _versioned_checkpoint(root))
    assert io.checkpointer is None  # teardown reached the plugin through the wrapper
    names = sorted(os.listdir(root))
    assert names == ["model-v1.ckpt", "model-v2.ckpt", "model-v3.ckpt", "model.ckpt"]
    assert _leftover_reservations(root) == []
    _assert_each_holds_its_epoch(root, names, weights)


def test_async_checkpoint_io_wrapper_raises_a_failed_write_at_the_end_of_fit(tmp_path, worker_on_path):
    root = tmp_path / "ckpts"
    with pytest.raises(OSError) as e:
        _fit(AsyncCheckpointIO(io_with(FullDisk)), _versioned_checkpoint(root), epochs=2)
    assert e.value.errno == errno.ENOSPC
    assert not root.exists() or os.listdir(root) == []  # no reservation outlives its failed save


def test_async_checkpoint_io_keeps_its_own_thread_for_other_plugins(tmp_path):
    from lightning.fabric.plugins import TorchCheckpointIO

    class Recording(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.thread = threading.current_thread()
            super().save_checkpoint(checkpoint, path, storage_options)

    inner = Recording()
    wrapper = AsyncCheckpointIO(inner)
    wrapper.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.pt")
    wrapper.teardown()
    assert inner.thread is not threading.current_thread()
    assert torch.equal(torch.load(tmp_path / "a.pt")["w"], torch.ones(2))


# ---------------------------------------------------------------------------------------------
# The reservation


def test_a_pending_save_holds_its_path_and_is_not_a_checkpoint_until_committed(tmp_path, gate):
    ev, gated = gate
    io = io_with(gated)
    p = tmp_path / "x.ckpt"
    io.save_checkpoint(_state(5, torch.ones(3)), p)
    assert p.is_dir()  # what ModelCheckpoint's exists() sees
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=p), collective=False) as reader:
        assert reader.list() == [] and reader.restore({"w": torch.zeros(3)}) is None
    with pytest.raises(TimeoutError) as e:  # another reader would wait for it
        TieredCheckpointIO(pending_save_timeout=0.2).load_checkpoint(p)
    assert (
        e.value.errno == errno.ETIMEDOUT and str(p) in str(e.value) and "pending_save_timeout" in str(e.value)
    )
    ev.set()
    io.teardown()
    assert sorted(os.listdir(p)) == ["latest", "step-000000005"]
    assert torch.equal(TieredCheckpointIO().load_checkpoint(p)["state_dict"]["w"], torch.ones(3))


def test_a_failed_save_removes_its_reservation_and_keeps_the_older_checkpoint(tmp_path):
    old, new = tmp_path / "old.ckpt", tmp_path / "new.ckpt"
    good = TieredCheckpointIO()
    good.save_checkpoint(_state(1, torch.ones(4)), old)
    good.teardown()
    io = io_with(FullDisk)
    io.save_checkpoint(_state(2, torch.zeros(4)), new)
    io.save_checkpoint(_state(2, torch.zeros(4)), old)
    with pytest.raises(OSError) as e:
        io.teardown()
    assert e.value.errno == errno.ENOSPC
    assert str(new) in str(e.value) and "/proc/" not in str(e.value)  # names the checkpoint's path
    assert not new.exists()
    assert sorted(os.listdir(old)) == ["latest", "step-000000001"]
    assert torch.equal(TieredCheckpointIO().load_checkpoint(old)["state_dict"]["w"], torch.ones(4))


def test_a_save_refused_at_once_leaves_no_reservation(tmp_path):
    io = TieredCheckpointIO(host_memory_limit=16)
    with pytest.raises(ckpt.HostMemoryError):
        io.save_checkpoint(_state(1, torch.ones(1024)), tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    io.teardown()


def test_a_snapshot_torn_before_the_write_removes_its_reservation(tmp_path):
    """A save the engine drops before it reaches the disk (a tensor written in place during the copy) ends its
    reservation too. Whether a copy is torn is a race: tries until one is (64 MB copies: the first, in practice)."""
    for attempt in range(5):
        w = torch.zeros(16 << 20)
        io = TieredCheckpointIO()
        p = tmp_path / f"x{attempt}.ckpt"
        io.save_checkpoint(_state(1, w), p)
        w.add_(1)
        try:
            TieredCheckpointIO().load_checkpoint(p)  # waits for the save to end
        except FileNotFoundError as e:
            assert isinstance(e.__cause__, ckpt.TornSnapshotError) and str(p) in str(e)
            assert not p.exists()
            with pytest.raises(ckpt.TornSnapshotError):
                io.teardown()
            return
        io.teardown()  # the copy won the race: a complete checkpoint, loaded above
    pytest.fail("no copy was torn in 5 attempts")


def test_saving_onto_a_symlink_replaces_the_link_not_its_target(tmp_path):
    target, link = tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    io = TieredCheckpointIO()
    io.save_checkpoint(_state(1, torch.ones(2)), target)
    link.symlink_to(target.name)
    io.save_checkpoint(_state(2, torch.full((2,), 2.0)), link)
    io.teardown()
    assert not link.is_symlink()
    assert torch.equal(TieredCheckpointIO().load_checkpoint(target)["state_dict"]["w"], torch.ones(2))
    assert torch.equal(TieredCheckpointIO().load_checkpoint(link)["state_dict"]["w"], torch.full((2,), 2.0))
    # A failed save onto a link puts the link back.
    shutil.rmtree(link)
    link.symlink_to(target.name)
    full = io_with(FullDisk)
    full.save_checkpoint(_state(3, torch.zeros(2)), link)
    with pytest.raises(OSError):
        full.teardown()
    assert link.is_symlink() and os.readlink(link) == target.name
    assert torch.equal(TieredCheckpointIO().load_checkpoint(link)["state_dict"]["w"], torch.ones(2))


def test_a_regular_file_at_the_path_is_refused_at_once(tmp_path):
    p = tmp_path / "pickled.ckpt"
    p.write_bytes(b"\x80\x04an old torch.save checkpoint")
    io = TieredCheckpointIO()
    with pytest.raises(FileExistsError) as e:
        io.save_checkpoint(_state(1, torch.ones(2)), p)
    assert e.value.errno == errno.EEXIST and str(p) in str(e.value)
    assert p.read_bytes().startswith(b"\x80\x04")
    io.teardown()


# ---------------------------------------------------------------------------------------------
# Symbolic links


def test_remove_checkpoint_of_a_link_removes_the_link_only(tmp_path, gate):
    ev, gated = gate
    io = io_with(gated)
    target = tmp_path / "epoch=0.ckpt"
    io.save_checkpoint(_state(1, torch.ones(2)), target)
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    io.remove_checkpoint(link)  # the target's save is still pending: not waited for, not touched
    assert not os.path.lexists(link)
    dangling = tmp_path / "dangling.ckpt"
    dangling.symlink_to("never-written.ckpt")
    io.remove_checkpoint(dangling)
    assert not os.path.lexists(dangling)
    ev.set()
    io.teardown()
    assert torch.equal(TieredCheckpointIO().load_checkpoint(target)["state_dict"]["w"], torch.ones(2))


def test_a_pending_save_is_never_written_through_a_link_made_at_its_path(tmp_path, gate, caplog):
    """ModelCheckpoint(save_last="link") replaces a last.ckpt directory by a link itself (rmtree, symlink),
    not through remove_checkpoint: a save of last.ckpt still pending must not land in the link's target. That
    save is superseded (Lightning wants the link there): a warning, not a failure of fit."""
    ev, gated = gate
    target, last = tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt"
    good = TieredCheckpointIO()
    good.save_checkpoint(_state(2, torch.ones(2)), target)
    good.teardown()
    io = io_with(gated)
    io.save_checkpoint(_state(1, torch.zeros(2)), last)
    shutil.rmtree(last)
    last.symlink_to(target.name)
    ev.set()
    with caplog.at_level(logging.WARNING, logger="ckpt.integrations.lightning"):
        io.teardown()
    assert any(str(last) in r.getMessage() for r in caplog.records), caplog.text
    assert os.readlink(last) == target.name
    assert sorted(os.listdir(target)) == ["latest", "step-000000002"]
    assert torch.equal(TieredCheckpointIO().load_checkpoint(last)["state_dict"]["w"], torch.ones(2))


def test_load_through_a_link_waits_for_the_pending_save_of_its_target(tmp_path, gate):
    ev, gated = gate
    io = io_with(gated)
    target, link = tmp_path / "epoch=0.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint(_state(1, torch.ones(2)), target)
    link.symlink_to(target.name)
    t = _open_after(ev, 0.2)
    assert torch.equal(io.load_checkpoint(link)["state_dict"]["w"], torch.ones(2))
    t.join()
    io.teardown()


# ---------------------------------------------------------------------------------------------
# Loads of a path whose save is pending elsewhere


def test_another_instance_waits_for_a_pending_save_in_this_process(tmp_path, gate):
    ev, gated = gate
    io = io_with(gated)
    p = tmp_path / "x.ckpt"
    io.save_checkpoint(_state(4, torch.full((3,), 4.0)), p)
    t = _open_after(ev, 0.2)
    assert torch.equal(TieredCheckpointIO().load_checkpoint(p)["state_dict"]["w"], torch.full((3,), 4.0))
    t.join()
    io.teardown()


def test_another_instance_sees_a_pending_save_fail(tmp_path):
    io = io_with(FullDisk)
    p = tmp_path / "x.ckpt"
    io.save_checkpoint(_state(4, torch.ones(3)), p)
    with pytest.raises(FileNotFoundError) as e:
        TieredCheckpointIO().load_checkpoint(p)
    assert str(p) in str(e.value)
    with pytest.raises(OSError):
        io.teardown()


@pytest.fixture(scope="module")
def savers(tmp_path_factory):
    """Two processes (started together: importing Lightning is most of their cost), each with a save pending
    in its own directory until the test writes a line to its stdin."""
    d = tmp_path_factory.mktemp("savers")
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(WORKER), str(d / name / "x.ckpt")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("released", "killed")
    }
    yield d, procs
    for p in procs.values():
        p.kill()
        p.wait(timeout=60)


def _reserved(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    if line != "reserved\n":
        proc.kill()
        raise AssertionError(line + proc.stdout.read())


def _release_after(proc: subprocess.Popen, seconds: float) -> threading.Timer:
    def go() -> None:
        proc.stdin.write("go\n")
        proc.stdin.flush()

    t = threading.Timer(seconds, go)
    t.start()
    return t


def test_a_load_waits_for_a_save_pending_in_another_process(savers):
    d, procs = savers
    saver, p = procs["released"], d / "released" / "x.ckpt"
    _reserved(saver)
    t = _release_after(saver, 0.3)  # its disk writes nothing before: a load that did not wait would fail
    sd = TieredCheckpointIO().load_checkpoint(p)
    t.join()
    assert saver.stdout.readline() == "committed\n"
    assert sd["global_step"] == 3 and torch.equal(
        sd["state_dict"]["w"], torch.arange(64, dtype=torch.float32)
    )


def test_a_load_of_a_save_stuck_in_another_process_times_out_and_one_of_a_killed_process_does_not_wait(
    savers,
):
    d, procs = savers
    saver, p = procs["killed"], d / "killed" / "x.ckpt"
    _reserved(saver)
    with pytest.raises(TimeoutError) as e:
        TieredCheckpointIO(pending_save_timeout=0.3).load_checkpoint(p)
    assert e.value.errno == errno.ETIMEDOUT and str(p) in str(e.value)
    assert f"pid {saver.pid}" in str(e.value) and "pending_save_timeout" in str(e.value)
    saver.kill()
    saver.wait(timeout=60)
    # Its owner is gone: nothing will commit, so the load says so at once instead of waiting its timeout.
    with pytest.raises(FileNotFoundError) as e:
        TieredCheckpointIO(pending_save_timeout=600).load_checkpoint(p)
    assert str(p) in str(e.value)
    # A new save of the path takes over the stale reservation.
    io = TieredCheckpointIO()
    io.save_checkpoint(_state(9, torch.ones(2)), p)
    io.teardown()
    assert _leftover_reservations(p) == []
    assert TieredCheckpointIO().load_checkpoint(p)["global_step"] == 9


def test_a_pending_save_whose_pid_a_later_process_got_does_not_hold_a_load(tmp_path):
    """A SAVING record left by a killed process whose pid now belongs to another live process (containers
    restart their processes under the same small pids) is a dead writer's: the load says so at once."""
    import json
    import socket

    p = tmp_path / "x.ckpt"
    p.mkdir()
    later = subprocess.Popen(["sleep", "120"])  # started after the record below was written
    try:
        (p / "SAVING").write_text(
            json.dumps(
                {
                    "pid": later.pid,
                    "host": socket.gethostname(),
                    "step": 3,
                    "since_unix": time.time() - 3600,
                    "token": "0" * 32,
                }
            )
        )
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError):
            TieredCheckpointIO(pending_save_timeout=60).load_checkpoint(p)
        assert time.monotonic() - t0 < 30
    finally:
        later.kill()
        later.wait(60)


def test_load_from_checkpoint_reads_a_tiered_checkpoint_directory(tmp_path):
    """``LightningModule.load_from_checkpoint`` reads ``torch.save`` files; on a TieredCheckpointIO directory it
    loads through the plugin (no pickle), hyperparameters included."""
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 2)

    net = Net(width=5)
    trainer = pl.Trainer(
        plugins=[TieredCheckpointIO()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=0,
    )
    trainer.strategy.connect(net)
    trainer.save_checkpoint(tmp_path / "net.ckpt")
    trainer.strategy.checkpoint_io.teardown()
    loaded = Net.load_from_checkpoint(tmp_path / "net.ckpt", map_location="cpu")
    assert loaded.hparams.width == 5
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), net.state_dict().values()))

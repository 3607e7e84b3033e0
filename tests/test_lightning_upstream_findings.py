"""TieredCheckpointIO under Lightning's own checkpointing tests: regressions for what they found.

Lightning's tests (Lightning-AI/pytorch-lightning, the versions of the 2.5/2.6 line) were run with every
``Trainer`` given ``plugins=[TieredCheckpointIO()]`` (CPU, lightning 2.6.6), ``torch.load`` of a checkpoint
replaced by ``TieredCheckpointIO().load_checkpoint`` and ``torch.save`` mocks by counts of the plugin's saves:

* ``tests/tests_pytorch/checkpointing/test_model_checkpoint.py`` (the 55 tests that go through a CheckpointIO):
  first 44 passed, 7 failed, 4 skipped (TensorBoardLogger: tensorboard not installed). 4 failures checked
  ``os.path.isfile`` of a checkpoint, a directory here (documented; they pass with ``os.path.exists``); 1 was
  finding 1. Now 48 passed, 3 failed, 4 skipped; the 3: ``LightningModule.load_from_checkpoint`` calls
  ``torch.load`` on the path (documented: load through the plugin), and
  ``test_save_last_every_n_epochs_interaction`` (2 cases), which fails on lightning 2.6.6 without the plugin
  too (a test newer than the release).
* ``tests/tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py``: 17 passed.
* ``tests/tests_pytorch/checkpointing/test_trainer_checkpoint.py``: 2 passed (``storage_options`` is refused
  with ``TypeError``, as Lightning's own ``TorchCheckpointIO`` refuses it).
* ``tests/tests_pytorch/checkpointing/test_training_metadata.py`` (its flows, on the keys 2.6.6 writes): 6 passed.
* ``tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py`` (the custom plugin being TieredCheckpointIO,
  plus a fit with a doubly wrapped ``AsyncCheckpointIO``): 4 passed; the doubly wrapped case run again with a
  slow disk and one checkpoint name (the version counter) found finding 2.
* ``tests/tests_pytorch/trainer/connectors/test_checkpoint_connector.py``: 11 passed after the fixes;
  ``test_hpc_restore_attempt`` failed before them, now and then (finding 4).
* ``tests/tests_pytorch/models/test_restore.py`` (its resume tests, BoringModel for the sklearn models):
  6 passed after the fixes; ``test_callbacks_state_fit_ckpt_path`` failed before them (finding 3).

Findings, each a test below:

1. ``ModelCheckpoint(save_last="link")`` on a file system that refuses symbolic links: Lightning falls back to
   ``shutil.copy``, which cannot copy a checkpoint directory, so ``fit`` died with ``IsADirectoryError`` (and
   would have copied a checkpoint whose save was still pending). Now the plugin links or copies.
2. ``AsyncCheckpointIO(AsyncCheckpointIO(TieredCheckpointIO()))`` (nesting Lightning supports): only a wrapper
   directly around the plugin handed it the saves, so the outer one saved on its thread, ``ModelCheckpoint``'s
   version counter reused a name still being saved (an epoch lost), and the end of ``fit`` did not wait for the
   saves (a ``SAVING`` record left, failures unraised). Now the whole chain is seen through.
3. The plugin could not be copied: ``copy.deepcopy`` of anything reaching the Trainer (upstream's test deep-copies
   ``trainer.callbacks``; the progress bar holds the Trainer) and ``strategy="ddp_spawn"`` (which sends the
   Trainer to its workers) failed on the plugin's lock. Now a copy takes the settings and no engine.
4. A save through ``Trainer.save_checkpoint`` returned while its tensors were still being copied, safe only if
   the next in-place write to them came through ``optimizer.step()``. Lightning's ``WeightAveraging`` (EMA) and
   ``StochasticWeightAveraging`` copy the averaged weights into the model at ``on_train_end``, right after the
   last ``ModelCheckpoint`` save, and upstream's ``test_hpc_restore_attempt`` zeroes the weights right after
   ``trainer.save_checkpoint``: the snapshot tore, the checkpoint was dropped and ``fit`` raised
   ``TornSnapshotError``. Now ``Trainer.save_checkpoint`` returns once the copy has landed (the write stays in
   the background), a point-in-time copy as with Lightning's own plugins.
"""

from __future__ import annotations

import copy
import errno
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning", minversion="2.5")

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from ckpt.integrations.lightning import TieredCheckpointIO  # noqa: E402
from ckpt.tiers import LocalTier  # noqa: E402

HERE = Path(__file__).parent


class SlowLocal(LocalTier):
    """A disk that takes a while before each checkpoint is written: every save is still pending when
    ModelCheckpoint goes on (links ``last.ckpt``, picks the next name)."""

    def write(self, step, manifest, data):
        time.sleep(0.2)
        return super().write(step, manifest, data)


def _slow_io() -> TieredCheckpointIO:
    return type("SlowIO", (TieredCheckpointIO,), {"_local_tier": SlowLocal})()


class EpochWeights(Callback):
    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer, pl_module):
        self.weights[trainer.current_epoch] = {
            k: v.detach().clone() for k, v in pl_module.state_dict().items()
        }


@pytest.fixture
def fit(monkeypatch, tmp_path):
    """``fit(plugin, *callbacks, epochs=3)``: lightning_worker's Tiny, 2 steps an epoch, no validation (the default
    ModelCheckpoint, when no other is given, in ``tmp_path/checkpoints``)."""
    monkeypatch.syspath_prepend(str(HERE))

    def run(plugin, *callbacks, epochs: int = 3):
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
            callbacks=[rec, *callbacks],
            plugins=[plugin],
            default_root_dir=tmp_path,
        )
        trainer.fit(Tiny(0.0))
        return rec.weights, trainer

    return run


def _weights_equal(sd: dict, want: dict[str, torch.Tensor]) -> bool:
    return sd.keys() == want.keys() and all(torch.equal(sd[k], v) for k, v in want.items())


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if p.name == "SAVING" or ".copy-" in p.name]


def test_save_last_link_copies_the_checkpoint_where_links_are_refused(tmp_path, fit, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "symlink", no_links)  # a file system without symbolic links
    root = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=root, save_top_k=2, monitor="step", mode="max", save_last="link")
    weights, _ = fit(_slow_io(), mc)
    assert sorted(os.listdir(root)) == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    last = root / "last.ckpt"
    assert last.is_dir() and not last.is_symlink()
    sd = TieredCheckpointIO().load_checkpoint(last)
    assert sd["global_step"] == 6 and _weights_equal(sd["state_dict"], weights[2])
    assert _leftovers(root) == []


class FullDisk(LocalTier):
    def _write_data(self, path, size, chunk, get):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_save_last_link_copy_of_a_failed_save_raises_and_leaves_no_last(tmp_path, fit, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "symlink", no_links)
    root = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=root, save_top_k=2, monitor="step", mode="max", save_last="link")
    with pytest.raises(OSError) as e:
        # slow and full: the save is still pending when ModelCheckpoint links last.ckpt to it, then fails
        fit(
            type(
                "FullIO", (TieredCheckpointIO,), {"_local_tier": type("SlowFull", (SlowLocal, FullDisk), {})}
            )(),
            mc,
        )
    assert e.value.errno == errno.ENOSPC
    # the save's failure itself, not one raised while handling another error (the copy's, say)
    seen, todo = [], [e.value]
    while todo:
        err = todo.pop()
        if err is not None and all(err is not x for x in seen):
            seen.append(err)
            todo += [err.__cause__, err.__context__]
    assert all(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in seen), seen
    assert not os.path.lexists(root / "last.ckpt")
    assert _leftovers(root) == []


def test_save_last_link_still_links_where_the_file_system_can(tmp_path, fit):
    root = tmp_path / "ckpts"
    mc = ModelCheckpoint(dirpath=root, save_top_k=2, monitor="step", mode="max", save_last="link")
    weights, _ = fit(_slow_io(), mc)
    assert os.readlink(root / "last.ckpt") == "epoch=2-step=6.ckpt"
    assert _weights_equal(TieredCheckpointIO().load_checkpoint(root / "last.ckpt")["state_dict"], weights[2])


def test_nested_async_wrappers_hand_the_plugin_its_saves_and_teardown(tmp_path, fit):
    root = tmp_path / "ckpts"
    io = _slow_io()
    # one name for every epoch: the version counter must see each save's path taken when the save returns
    mc = ModelCheckpoint(dirpath=root, filename="model", save_top_k=-1, monitor="step", mode="max")
    weights, _ = fit(AsyncCheckpointIO(AsyncCheckpointIO(io)), mc, epochs=4)
    assert io.checkpointer is None  # the end of fit reached the plugin's teardown
    names = sorted(os.listdir(root))
    assert names == ["model-v1.ckpt", "model-v2.ckpt", "model-v3.ckpt", "model.ckpt"]
    assert _leftovers(root) == []
    epochs = []
    for name in names:
        sd = TieredCheckpointIO().load_checkpoint(root / name)
        epochs.append(sd["epoch"])
        assert _weights_equal(sd["state_dict"], weights[sd["epoch"]]), name
    assert sorted(epochs) == [0, 1, 2, 3]


def test_the_plugin_can_be_deep_copied_with_the_trainer(tmp_path, fit):
    class CopyCallbacks(Callback):  # what Lightning's test_restore does at fit start
        def on_fit_start(self, trainer, pl_module):
            self._trainer = trainer  # as Lightning's progress bars hold it
            self.copies = copy.deepcopy(trainer.callbacks)
            self._trainer = None

    grab = CopyCallbacks()
    io = TieredCheckpointIO(max_in_flight=2, pending_save_timeout=7)
    fit(io, grab, ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True), epochs=1)
    assert len(grab.copies) >= 3

    # A copy made while a save is in flight takes the settings, not the engine or its saves.
    io = _slow_io()
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, tmp_path / "x.ckpt")
    dup = copy.deepcopy(io)
    assert type(dup) is type(io) and dup.checkpointer is None and io.checkpointer is not None
    assert (dup.max_in_flight, dup.on_unsupported, dup.pending_save_timeout) == (1, "error", 600.0)
    # the copy waits for the original's pending save like any other instance of this process
    assert torch.equal(dup.load_checkpoint(tmp_path / "x.ckpt")["state_dict"]["w"], torch.ones(3))
    dup.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(3)}}, tmp_path / "y.ckpt")
    dup.teardown()
    io.teardown()
    assert torch.equal(
        TieredCheckpointIO().load_checkpoint(tmp_path / "y.ckpt")["state_dict"]["w"], torch.zeros(3)
    )


def _wide_tiny():
    """lightning_worker's Tiny plus a 64 MB parameter: the snapshot copy takes long enough for an in-place write
    made right after the save to land during it."""
    from lightning_worker import Tiny

    model = Tiny(0.0)
    model.wide = torch.nn.Parameter(torch.zeros(4096, 4096), requires_grad=False)
    return model


@pytest.mark.parametrize("averaging", ["ema", "swa"])
def test_averaging_callbacks_writing_the_model_after_the_last_save(tmp_path, monkeypatch, averaging):
    """WeightAveraging / StochasticWeightAveraging copy the averaged weights into the model at on_train_end,
    right after ModelCheckpoint's last save: that save must hold the weights it was given."""
    import lightning as L

    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # lightning < 2.6
        WeightAveraging = None
    if averaging == "ema" and WeightAveraging is None:
        pytest.skip("lightning.pytorch.callbacks.WeightAveraging needs lightning 2.6")
    monkeypatch.syspath_prepend(str(HERE))
    L.seed_everything(0, verbose=False)
    rec = EpochWeights()
    avg = (
        WeightAveraging()
        if averaging == "ema"
        else StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    )
    root = tmp_path / "ckpts"
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[TieredCheckpointIO()],
        default_root_dir=tmp_path,
        callbacks=[rec, avg, ModelCheckpoint(dirpath=root, save_last=True)],
    )
    model = _wide_tiny()
    trainer.fit(model)
    assert sorted(os.listdir(root)) == ["epoch=1-step=4.ckpt", "last.ckpt"] and _leftovers(root) == []
    sd = TieredCheckpointIO().load_checkpoint(root / "last.ckpt")
    # the model's weights at the save (EMA moves them to "current_model_state", the average to "state_dict")
    saved = sd["current_model_state"] if averaging == "ema" else sd["state_dict"]
    assert _weights_equal(saved, rec.weights[1])
    # ... which the callback has changed since, in place
    assert not torch.equal(model.net[0].weight, rec.weights[1]["net.0.weight"])


def test_trainer_save_checkpoint_is_a_point_in_time_copy(tmp_path, fit):
    """Upstream's test_hpc_restore_attempt: the weights are zeroed right after trainer.save_checkpoint."""
    _, trainer = fit(TieredCheckpointIO(), epochs=1)
    model = trainer.lightning_module
    model.wide = torch.nn.Parameter(torch.ones(4096, 4096), requires_grad=False)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")
    for p in model.parameters():
        torch.nn.init.constant_(p, 0)
    sd = trainer.strategy.checkpoint_io.load_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")
    assert _weights_equal(sd["state_dict"], want)
    trainer.strategy.checkpoint_io.teardown()

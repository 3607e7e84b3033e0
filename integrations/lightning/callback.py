"""``CheckpointCallback``: a Lightning ``Callback`` that saves everything ``trainer.fit`` needs to resume exactly,
through a :class:`ckpt.Checkpointer`, and restores the newest checkpoint when ``fit`` starts."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from ...api import Checkpointer
from ...ranks import distributed_world
from ...rng import RNGState
from ._trainer_state import (
    _averaged_models,
    _callback_schedulers,
    _datamodule_state,
    _epoch_or_run_ends,
    _load_datamodule_state,
    _Part,
)

__all__ = ["CheckpointCallback"]

log = logging.getLogger(__name__)


class CheckpointCallback(Callback):
    """Save and resume ``trainer.fit`` exactly, through a :class:`ckpt.Checkpointer`.

    Pass a Checkpointer, or the arguments to build one
    (``CheckpointCallback(local_dir="/nvme/run1", every_steps=100)``).

    Saving: after every training batch that ended with an optimizer step, the
    state is handed to ``checkpointer.maybe_save(trainer.global_step, ...)``
    (so ``every_steps`` / ``every_seconds`` decide), which returns at once.
    The next ``optimizer.step()`` waits for the copy; under automatic
    optimization Lightning runs forward and backward inside that call (the
    closure), so they start after the copy, while manual optimization
    overlaps them with it. When
    ``trainer.received_sigterm`` is set, the callback saves that step
    whatever the policy (at the batch end, or in ``on_exception`` when the
    signal came after this callback's batch end) and blocks until the
    checkpoint is durable, before Lightning stops the run (Lightning handles
    SIGTERM itself: the Checkpointer's preemption signals are not installed).
    Save requests (``signals=ckpt.Signals(save=(signal.SIGUSR2,))``) are: from
    the start of training to its end, such a signal makes the next batch end
    save durably and training goes on. With
    ``save_on_train_end`` the final state is saved too (at the last batch end
    when ``max_steps`` stops the run, so a longer run continues that epoch
    exactly). ``teardown`` waits for every save and raises the first failure.

    What is saved: the LightningModule's ``state_dict`` (restored in place),
    every optimizer and LR scheduler, ``trainer.fit_loop`` (epoch/batch/step
    progress and the positions of resumable dataloaders, i.e. those with
    ``state_dict()``/``load_state_dict()``), the ``state_dict`` of every other
    callback (by ``state_key``), of the precision plugin and of the
    datamodule, and Python/numpy/torch random number generators. Lightning's
    ``on_save_checkpoint``/``on_load_checkpoint`` hooks work on Lightning's
    checkpoint dict and are not called: keep extra state in a callback's or
    datamodule's ``state_dict``.

    Resuming: at ``on_fit_start`` the newest verified checkpoint is loaded
    (unless ``restore=False`` or ``trainer.fit(ckpt_path=...)`` was given).
    Creating a dataloader iterator draws from the global generator, so the
    generators are set on the side of the resumed run's iterator creation
    that matches the uninterrupted run: after it (``on_train_start``) for a
    checkpoint taken mid-epoch, before it (``on_fit_start``) for one taken at
    an epoch's last batch. For bit-identical resumption mid-epoch the
    training dataloader must be resumable (see ``docs/lightning.md``) and the
    run deterministic.

    Not saved: gradients accumulated over ``accumulate_grad_batches`` that
    have not reached an optimizer step yet; so saves happen only after
    optimizer steps, and a SIGTERM in the middle of an accumulation keeps the
    last checkpoint (waiting for it to be durable).

    In-place writers outside ``optimizer.step()``: the batch-end save runs
    after every batch-end hook (the callbacks' in any order, then the
    LightningModule's, whose ``on_train_batch_end`` is wrapped for the fit),
    so it holds their writes (``WeightAveraging``'s EMA update, a weight
    constraint) and none of them lands during its copy. The copy is waited
    for where Lightning and its callbacks write at the rare points that
    follow a batch end: after a save at an epoch's last batch, when the run
    stops (epoch-end and epoch-start hooks: ``StochasticWeightAveraging``
    averaging, ``WeightAveraging``/SWA copying the average into the model at
    ``on_train_end``) and at ``on_validation_start`` (``WeightAveraging``
    swaps the weights). Module buffers (BatchNorm statistics) are copied
    before the save returns. ``WeightAveraging``'s averaged model is saved
    (``averaged_models``, by ``state_key``), and SWA's own LR scheduler is
    left to SWA's ``state_dict``. Other code that writes saved tensors in
    place at other points calls ``callback.checkpointer.wait_staged()``
    first.

    Multi-process strategies (DDP on several devices or nodes): the process
    group starts after the callback was built, so at ``setup`` the callback
    makes its engine again, one per rank, collectively: ``local_dir`` gets a
    ``rank-<r>`` subdirectory, ``url`` is shared by all ranks (the job tier:
    one step directory, committed by rank 0, that restores on another number
    of ranks too), and the ranks resume the newest step that all of them hold. A ``checkpointer=`` passed in is refused there
    (it was made before the process group); pass its arguments instead.

    Args:
        checkpointer: the engine to use; the caller keeps ownership (it is
            waited for, not closed, at teardown).
        restore: load the newest checkpoint when fit starts.
        save_on_train_end: save the final state when training ends (if that
            step was not saved already) and wait for it.
        **checkpointer_args: arguments of :class:`ckpt.Checkpointer` when
            ``checkpointer`` is not given; the callback then owns it and
            closes it at teardown (a later fit builds a new one).
    """

    def __init__(
        self,
        checkpointer: Checkpointer | None = None,
        *,
        restore: bool = True,
        save_on_train_end: bool = True,
        **checkpointer_args: Any,
    ) -> None:
        super().__init__()
        if checkpointer is not None and checkpointer_args:
            raise TypeError(
                "pass either checkpointer=... or Checkpointer arguments, not both (got checkpointer "
                f"and {sorted(checkpointer_args)})"
            )
        if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
            raise TypeError(f"checkpointer must be a ckpt.Checkpointer, got {type(checkpointer).__name__}")
        self._args = checkpointer_args
        self._owned = checkpointer is None
        # Built now so that bad arguments fail at construction, not in the middle of fit.
        self._ck: Checkpointer | None = (
            checkpointer if checkpointer is not None else Checkpointer(**checkpointer_args)
        )
        self.restore = restore
        self.save_on_train_end = save_on_train_end
        self.restored_step: int | None = None
        self._rng_to_load: dict | None = None
        self._last_seen_step = -1
        self._last_saved_step = -1
        self._last_batch_stepped = False
        self._listening = False  # this callback installed the Checkpointer's save-request handlers
        self._hooked: tuple[LightningModule, bool, Any] | None = (
            None  # the module whose batch-end hook is wrapped
        )
        self._batch_ended = False
        self._restored_lrs: list[list[Any]] | None = None  # the optimizers' learning rates as restored
        self._epoch_start_owed = False  # restored at an epoch's end: the next epoch's start hooks are owed

    @property
    def checkpointer(self) -> Checkpointer:
        """The engine (built again after a teardown closed the one the callback owned)."""
        if self._ck is None:
            self._ck = self._build()
        return self._ck

    def _build(self) -> Checkpointer:
        """A Checkpointer from the callback's arguments; on a multi-process strategy one per rank:
        ``local_dir`` gets a ``rank-<r>`` subdirectory, ``url`` is shared (the job tier), and the ranks
        agree (collective)."""
        if distributed_world() <= 1:
            return Checkpointer(**self._args)
        args = dict(self._args)
        sub = f"rank-{torch.distributed.get_rank():05d}"
        local = args.get("local_dir", os.environ.get("CKPT_LOCAL_DIR"))
        if not isinstance(local, (str, os.PathLike)):
            raise ValueError(
                "CheckpointCallback on a multi-process strategy gives every rank its own "
                f"subdirectory of local_dir, which must then be a path (got {type(local).__name__})"
            )
        args["local_dir"] = os.path.join(local, sub)
        return Checkpointer(**args)  # the url stays one for all ranks: the job tier, which can reshard

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Multi-process strategies start the process group after this callback was built: make the
        # engine again now, one per rank (every rank runs this hook, as the collective needs).
        if distributed_world() <= 1 or (self._ck is not None and self._ck.ranks is not None):
            return
        if not self._owned:
            raise ValueError(
                "CheckpointCallback(checkpointer=...) on a multi-process strategy: that Checkpointer was made "
                "before the process group, so its ranks would write alone (or over each other). Pass the "
                "Checkpointer's arguments instead (CheckpointCallback(local_dir=..., ...)): the callback then "
                "makes one per rank, in <local_dir>/rank-<r>, when the processes have started"
            )
        if self._ck is not None:
            self._ck.close()
        self._ck = self._build()

    # -- the state -----------------------------------------------------------------------------------
    def _state(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        mode = self.checkpointer.on_unsupported

        def part(name: str, obj: Any) -> _Part:
            return _Part(name, obj.state_dict, obj.load_state_dict, mode)

        # Objects go in dicts keyed by position: the engine restores objects inside dicts in place.
        return {
            "module": pl_module,
            "optimizers": {str(i): o for i, o in enumerate(trainer.optimizers)},
            "schedulers": {
                str(i): part(f"schedulers/{i}", c.scheduler)
                for i, c in enumerate(trainer.lr_scheduler_configs)
                if id(c.scheduler) not in _callback_schedulers(trainer)
            },
            "fit_loop": part("fit_loop", trainer.fit_loop),
            "callbacks": _Part(
                "callbacks",
                lambda: self._callback_states(trainer),
                lambda sd: self._load_callback_states(trainer, sd),
                mode,
            ),
            "precision": part("precision", trainer.precision_plugin),
            "datamodule": _Part(
                "datamodule",
                lambda: _datamodule_state(trainer),
                lambda sd: _load_datamodule_state(trainer, sd),
                mode,
            ),
            "rng": _Part("rng", lambda: self._rng_state(trainer), self._defer_rng, mode),
            **_averaged_models(trainer),
        }

    def _callback_states(self, trainer: Trainer) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb is not self}

    def _load_callback_states(self, trainer: Trainer, states: dict[str, Any]) -> None:
        live = {cb.state_key: cb for cb in trainer.callbacks if cb is not self}
        for key, sd in states.items():
            if key in live:
                live[key].load_state_dict(sd)
            else:
                log.warning(
                    "the checkpoint holds the state of callback %s, which this Trainer does not have; "
                    "it is ignored",
                    key,
                )

    @staticmethod
    def _rng_state(trainer: Trainer) -> dict[str, Any]:
        # Creating a DataLoader iterator draws from the global torch generator (worker seeds). A resumed fit
        # creates its iterator between on_fit_start and on_train_start. The uninterrupted run created the
        # iterator of the epoch it goes on with before this save, unless this is the epoch's last batch:
        # then the next epoch's iterator comes after it. Recorded here to load the generators on the
        # matching side of the resumed run's iterator.
        last = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        return {"generators": RNGState().state_dict(), "before_iterator": last}

    def _defer_rng(self, sd: dict) -> None:
        self._rng_to_load = sd

    # -- hooks ---------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._hook_batch_end(trainer, pl_module)
        self._restored_lrs = None
        self._epoch_start_owed = False
        self._last_seen_step = self._last_saved_step = -1
        self._last_batch_stepped = False
        self.restored_step = None
        if not self.restore:
            return
        if trainer.ckpt_path is not None:
            log.info(
                "CheckpointCallback: not restoring, since fit(ckpt_path=%s) restores the run",
                trainer.ckpt_path,
            )
            return
        self._rng_to_load = None
        step = self.checkpointer.restore(self._state(trainer, pl_module))
        if step is not None:
            self.restored_step = self._last_seen_step = self._last_saved_step = step
            log.info("CheckpointCallback: resumed from step %d", step)
            self._epoch_start_owed = self._rng_to_load is not None and self._rng_to_load["before_iterator"]
            self._restored_lrs = [[g["lr"] for g in o.param_groups] for o in trainer.optimizers]
        if self._rng_to_load is not None and self._rng_to_load["before_iterator"]:
            self._load_rng()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A batch "stepped" when global_step moved since the previous batch end (not on the first
        # accumulation batches, whose global_step is still the starting one).
        self._last_seen_step = trainer.global_step
        if self._rng_to_load is not None:
            self._load_rng()
        owed, self._epoch_start_owed = self._epoch_start_owed, False
        loop = trainer.fit_loop
        more = (
            loop.max_epochs is None or loop.max_epochs < 0 or trainer.current_epoch < loop.max_epochs
        ) and (trainer.max_steps < 0 or trainer.global_step < trainer.max_steps)
        if owed and more and (loop.restarted_mid_epoch or loop.restarted_on_epoch_end):
            # Restored from a checkpoint taken at an epoch's last batch: the uninterrupted run went on with the
            # next epoch's on_train_epoch_start, which Lightning (2.6) skips when it resumes from a batch-end
            # checkpoint. Callbacks keep work there (StochasticWeightAveraging averages the weights and makes
            # its LR scheduler): run the hooks once, as the uninterrupted run did.
            from lightning.pytorch.trainer import call

            call._call_callback_hooks(trainer, "on_train_epoch_start")
            call._call_lightning_module_hook(trainer, "on_train_epoch_start")
        ck = self.checkpointer
        # after Lightning's own handlers; SIGTERM stays Lightning's
        if ck.signals.save and ck._listening.guard is None:
            ck._listening.listen(preempt=False)
            self._listening = True

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._restored_lrs is None:
            return
        lrs, self._restored_lrs = self._restored_lrs, None
        # StochasticWeightAveraging makes its SWALR again in a resumed fit (at the first epoch start), whose
        # first step sets the learning rates anew from the restored ones, then loads the scheduler's saved
        # state, which leaves them: the checkpoint's learning rates are the ones the uninterrupted run had.
        if _callback_schedulers(trainer):
            for opt, group_lrs in zip(trainer.optimizers, lrs):
                for g, lr in zip(opt.param_groups, group_lrs):
                    g["lr"] = lr

    def _unlisten(self) -> None:
        if self._listening and self._ck is not None:
            self._ck._listening.unlisten()  # before Lightning reinstalls the handlers it found
        self._listening = False

    def _load_rng(self) -> None:
        assert self._rng_to_load is not None
        RNGState().load_state_dict(self._rng_to_load["generators"])
        self._rng_to_load = None

    def _hook_batch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Make the batch-end save run after every batch-end hook: Lightning calls the callbacks' hooks in
        their list's order, then the LightningModule's; that hook is wrapped, for this fit, so that the save
        follows it (and so every callback's, whatever their order)."""
        self._unhook_batch_end()
        had = "on_train_batch_end" in vars(pl_module)
        inner = pl_module.on_train_batch_end

        @functools.wraps(inner)
        def on_train_batch_end(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if self._batch_ended:
                self._batch_ended = False
                self._after_batch(trainer, pl_module)
            return out

        on_train_batch_end._tierckpt_callback = self  # type: ignore[attr-defined]
        pl_module.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]
        self._hooked = (pl_module, had, inner)

    def _unhook_batch_end(self) -> None:
        if self._hooked is None:
            return
        module, had, inner = self._hooked
        self._hooked = None
        if getattr(vars(module).get("on_train_batch_end"), "_tierckpt_callback", None) is self:
            if had:
                module.on_train_batch_end = inner  # type: ignore[method-assign]
            else:
                del module.on_train_batch_end

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The save itself runs once every batch-end hook has run (see _hook_batch_end).
        if self._hooked is not None and self._hooked[0] is pl_module:
            self._batch_ended = True
        else:
            self._after_batch(trainer, pl_module)

    def _after_batch(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        stepped = step != self._last_seen_step
        self._last_seen_step = step
        self._last_batch_stepped = stepped
        ck = self.checkpointer
        if trainer.received_sigterm:
            if stepped and step != self._last_saved_step:
                ck.save(step, self._state(trainer, pl_module))
                self._last_saved_step = step
            elif not stepped:
                log.warning(
                    "SIGTERM in the middle of a gradient accumulation: the accumulated gradients are not "
                    "saved; the newest checkpoint is step %d",
                    self._last_saved_step,
                )
            ck.wait()  # durable before Lightning stops the run
            log.info("CheckpointCallback: SIGTERM received; step %d is durable", self._last_saved_step)
            return
        if not stepped or step == self._last_saved_step:
            return
        ending = _epoch_or_run_ends(trainer)
        if self.save_on_train_end and (0 < trainer.max_steps <= step or ending == "run"):
            # The run stops here (max_steps, possibly mid-epoch, or the last epoch's last batch). Saved here,
            # a later fit with a larger max_steps / max_epochs continues exactly; at on_train_end Lightning
            # has already marked the epoch completed, and callbacks (WeightAveraging,
            # StochasticWeightAveraging) may have copied their averaged weights into the model.
            ck.save(step, self._state(trainer, pl_module))
            self._last_saved_step = step
        elif ck.maybe_save(step, self._state(trainer, pl_module)) is not None:
            self._last_saved_step = step
        else:
            return
        if ending is not None or 0 < trainer.max_steps <= step or trainer.should_stop:
            # Epoch-end, epoch-start and train-end hooks write the state in place outside optimizer.step():
            # WeightAveraging's epoch updates and final copy, StochasticWeightAveraging's averaging at an
            # epoch's start and its final copy. Rare: the copy is waited for here, once an epoch.
            ck.wait_staged()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation during fit comes after a batch end whose save may still be copying, and writes in
        # place: WeightAveraging swaps the averaged and current weights at on_validation_epoch_start (which
        # runs after every callback's on_validation_start), BatchNorm in train mode updates its statistics.
        if trainer.state.fn == "fit" and self._ck is not None:
            self._ck.wait_staged()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unlisten()
        if (
            self.save_on_train_end
            and trainer.global_step != self._last_saved_step
            and trainer.global_step > 0
        ):
            self.checkpointer.save(trainer.global_step, self._state(trainer, pl_module))
            self._last_saved_step = trainer.global_step
        self.checkpointer.wait()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unlisten()
        self._unhook_batch_end()
        if self._ck is None:
            return
        # Lightning checks received_sigterm right after the batch-end hooks and stops the run by raising
        # SIGTERMException; a signal that arrived after this callback's on_train_batch_end is seen here.
        # The loop state is then that of a completed batch, which Lightning resumes from as well.
        step = trainer.global_step
        if (
            trainer.received_sigterm
            and self._last_batch_stepped
            and step == self._last_seen_step
            and step != self._last_saved_step
        ):
            try:
                self._ck.save(step, self._state(trainer, pl_module))
                self._last_saved_step = step
            except Exception as e:
                log.error("CheckpointCallback: the save on SIGTERM (step %d) failed: %s", step, e)
        # Whatever stopped the run, the saves already made should become durable.
        try:
            self._ck.wait()
            if trainer.received_sigterm:
                log.info("CheckpointCallback: SIGTERM received; step %d is durable", self._last_saved_step)
        except Exception as e:
            log.error("CheckpointCallback: a save failed while the run was stopping: %s", e)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unlisten()
        self._unhook_batch_end()
        if self._ck is None:
            return
        if self._owned:
            ck, self._ck = self._ck, None
            ck.close()
        else:
            self._ck.wait()

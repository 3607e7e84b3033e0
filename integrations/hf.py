"""Hugging Face ``transformers.Trainer`` integration: ``trainer.train()`` checkpointed through the tiers.

:class:`CheckpointCallback` is a ``TrainerCallback`` that owns (or is given) a
:class:`ckpt.Checkpointer`. Attached to a Trainer (``callback.attach(trainer)``)
it

* snapshots everything ``Trainer.train(resume_from_checkpoint=...)`` needs to
  resume exactly: the model, the optimizer, the LR scheduler, the gradient
  scaler, the ``TrainerState`` (as the JSON the Trainer writes itself, so the
  step, the epoch, the log history and the states of ``ExportableState``
  callbacks) and the random number generators, at the Trainer's save steps
  (``save_strategy``/``save_steps``) or by the Checkpointer's own policy
  (``every_steps``, ``every_seconds``, ``interval="auto"``);
* restores the newest verified checkpoint when ``trainer.train()`` starts, by
  setting the Trainer up as if it resumed from one of its own checkpoint
  directories: the Trainer itself then skips the batches already consumed in
  the current epoch and loads the generators where its own resume does;
* on SIGTERM saves the last completed step, waits until it is durable and
  exits with status 143 (the Checkpointer's preemption handling).

Pickle is never used: tensors are raw bytes, the rest JSON. See ``docs/hf.md``.

This module imports ``transformers``; ``import ckpt`` does not import it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable

import transformers
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..api import Checkpointer
from ..errors import CheckpointError, IncompatibleCheckpointError
from ..rng import RNGState

__all__ = ["CheckpointCallback"]

log = logging.getLogger(__name__)

# Tested with 4.57.1 and 5.24.0. The resume protocol used here (below) is the same in both.
_MIN_TRANSFORMERS = (4, 57)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in p if c.isdigit()) or "0") for p in v.split(".")[:2])


if _version_tuple(transformers.__version__) < _MIN_TRANSFORMERS:
    raise ImportError(
        f"ckpt.integrations.hf needs transformers>=4.57, found {transformers.__version__}: "
        "upgrade with pip install -U 'transformers>=4.57'"
    )

# ``Trainer.train(resume_from_checkpoint=DIR)`` reads DIR/trainer_state.json itself and loads the rest through
# these methods, at the points of the loop where an exact resume needs them (the random generators, say, after
# the skipped batches of the resumed epoch were drawn). The callback points the Trainer at a directory of its
# own holding only trainer_state.json and answers these calls for that directory from its checkpoint.
_TRAINER_STATE_NAME = "trainer_state.json"
_HOOKS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
# Two more points of the loop the callback must see, where no callback event runs: the end of a step's (or an
# epoch's) logging, evaluation and save, and the loading of the best model once the loop is over.
_LOOP_HOOKS = ("_maybe_log_save_evaluate", "_load_best_model")


class _View:
    """A Stateful over two callables: ``state_dict()`` is computed only when a save happens."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self._get, self._put = get, put

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, sd: Any) -> None:
        self._put(sd)


class _Held:
    """Receives a state dict at restore and keeps it until the Trainer asks for it.

    The optimizer and scheduler do not exist yet when the checkpoint is read
    (``train()`` makes them later), so their state dicts wait here.
    """

    def __init__(self) -> None:
        self.value: Any = None

    def state_dict(self) -> dict:
        return {}  # no live tensors to load into: the restore makes new ones

    def load_state_dict(self, sd: Any) -> None:
        self.value = sd


_HELD = ("optimizer", "scheduler", "scaler", "trainer_state", "rng")
#: where a checkpoint keeps the model's config: the key ``ckpt.export(format="hf")`` reads it from
_CONFIG_KEY = "hf_config"


def _config_json(model: Any) -> dict[str, Any]:
    """``model.config`` as its ``config.json`` (plain JSON values); ``{}`` for a model without a config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return {}
    return json.loads(config.to_json_string(use_diff=False))


class CheckpointCallback(TrainerCallback):
    """Save and resume ``Trainer.train()`` exactly, through a :class:`ckpt.Checkpointer`.

    ::

        cb = CheckpointCallback(local_dir="/nvme/run1", every_steps=100)
        trainer = Trainer(model, args, train_dataset=ds)
        cb.attach(trainer)
        trainer.train()          # resumes from the newest checkpoint by itself

    Pass a Checkpointer, or the arguments to build one. A Checkpointer the
    callback builds gets ``signals=(signal.SIGTERM,)`` unless ``signals`` is
    given; it is entered when ``train()`` starts and closed when it returns
    (waiting until every save is durable and raising the first failure).

    When to save: the Checkpointer's policy (``every_steps``,
    ``every_seconds``, ``interval="auto"``) and the Trainer's own save
    schedule (``save_strategy``/``save_steps``, which include the last step).
    At the Trainer's save steps the snapshot replaces the Trainer's
    ``checkpoint-N`` directory (the Trainer's save is cancelled) unless
    ``keep_trainer_checkpoints=True``. ``save_strategy="best"`` decides after
    an evaluation, where no callback runs: the Trainer then writes its own
    checkpoint, and the callback snapshots that step too.

    A step chosen at its ``on_step_end`` is snapshotted at the next boundary
    of the loop: the next step's start (after its batches were fetched), the
    next epoch's start, or the end of training. There, every generator is where
    the Trainer's own resume loads them (so logging, evaluation and the
    Trainer's saves of that step are behind it), and the weights are those
    after the step. The snapshot is copied while the next forward and backward
    run; the next ``optimizer.step()`` waits for the copy.

    Resuming: when ``train()`` is called without ``resume_from_checkpoint``
    and a checkpoint exists, the newest one that verifies is loaded (the model
    in place, where the Trainer loads weights of a checkpoint; the optimizer,
    scheduler and scaler once the Trainer made them; the generators where its
    resume loads them) and the Trainer resumes with its own logic: its
    ``TrainerState`` (step, epoch, log history, best metric), the epochs and
    the batches of the current epoch it skips (``ignore_data_skip`` as
    usual), the states of ``ExportableState`` callbacks
    (``restore_callback_states_from_checkpoint``). ``callback.restored_step``
    says which step was loaded. ``train(resume_from_checkpoint=PATH)`` resumes
    from the Trainer's own checkpoint instead; ``resume_from_checkpoint=True``
    (the run's newest checkpoint) restores the newest snapshot, unless the
    Trainer's own newest ``checkpoint-N`` is of a later step; ``False`` is the
    same as leaving it out. ``restore=False`` turns restoring by itself off.

    The ``TrainerState`` in a snapshot is the one the Trainer's own save of
    that step writes (``total_flos`` included; the end-of-training summary in
    the log history left out). With ``load_best_model_at_end``, the last
    step's snapshot and the final one are taken before the best model is
    loaded: they hold the last step's weights.

    SIGTERM (with the Checkpointer's ``signals``): the next boundary saves the
    last completed step whatever the policy, waits until it is durable on
    ``drain_tier`` and exits with status ``128 + signal`` (or raises
    :class:`ckpt.Preempted` with ``on_preempt="raise"``). A save request
    (``signals=ckpt.Signals(save=(signal.SIGUSR1,))``, which keeps SIGTERM as
    the preemption signal) makes the next boundary save the last completed step
    and wait until it is durable on ``save_tier``; training goes on.

    Not supported: DeepSpeed and FSDP (their weights and optimizer are loaded
    by their own engines), and several processes (``torchrun``): ``attach``
    refuses them.

    Args:
        checkpointer: the engine to use; the caller keeps ownership (it is
            waited for at the end of ``train()``, not closed; its signal
            handling is the caller's ``with`` block).
        restore: load the newest checkpoint when ``train()`` starts.
        save_on_train_end: save the final state when training ends, if that
            step was not saved already.
        keep_trainer_checkpoints: let the Trainer write its own
            ``checkpoint-N`` directories at its save steps as well (needed by
            ``load_best_model_at_end``).
        **checkpointer_args: arguments of :class:`ckpt.Checkpointer` when
            ``checkpointer`` is not given.
    """

    def __init__(
        self,
        checkpointer: Checkpointer | None = None,
        *,
        restore: bool = True,
        save_on_train_end: bool = True,
        keep_trainer_checkpoints: bool = False,
        **checkpointer_args: Any,
    ) -> None:
        if checkpointer is not None and checkpointer_args:
            raise TypeError(
                "pass either checkpointer=... or Checkpointer arguments, not both (got checkpointer "
                f"and {sorted(checkpointer_args)})"
            )
        if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
            raise TypeError(f"checkpointer must be a ckpt.Checkpointer, got {type(checkpointer).__name__}")
        if checkpointer is None:
            checkpointer_args.setdefault("signals", (signal.SIGTERM,))
        self._args = checkpointer_args
        self._owned = checkpointer is None
        # Built now so that bad arguments fail at construction, not when train() starts.
        self._ck: Checkpointer | None = (
            checkpointer if checkpointer is not None else Checkpointer(**checkpointer_args)
        )
        self.restore = restore
        self.save_on_train_end = save_on_train_end
        self.keep_trainer_checkpoints = keep_trainer_checkpoints
        self.restored_step: int | None = None
        self._trainer: Trainer | None = None
        self._resume_dir: str | None = None
        self._held: dict[str, _Held] | None = None
        self._handled = -1  # the step whose boundary was handled
        self._pending = -1  # a step the Trainer's schedule asked to save
        self._last_saved = -1
        # (step, len(log_history)) when the step's logging, evaluation and save were over: the log entries
        # appended later at that step are the Trainer's end-of-training summary, not part of the step's state
        self._logged: tuple[int, int] = (-1, 0)

    @property
    def checkpointer(self) -> Checkpointer:
        """The engine (built again after the end of a ``train()`` closed the one the callback owned)."""
        if self._ck is None:
            self._ck = Checkpointer(**self._args)
        return self._ck

    # -- attaching -----------------------------------------------------------------------------------
    def attach(self, trainer: Trainer) -> "CheckpointCallback":
        """Add the callback to ``trainer`` (if it is not among its callbacks yet) and hook its resume.

        ``trainer.train`` is wrapped (on this instance only) to restore the
        newest checkpoint, and the methods through which ``train()`` loads a
        checkpoint directory answer for the callback's. Returns the callback.
        """
        if not isinstance(trainer, Trainer):
            raise TypeError(f"attach needs a transformers.Trainer, got {type(trainer).__name__}")
        if self._trainer is trainer:
            return self
        if self._trainer is not None:
            raise ValueError(
                "this CheckpointCallback is attached to another Trainer already; make one per Trainer"
            )
        if getattr(trainer, "_ckpt_callback", None) is not None:
            raise ValueError(
                "this Trainer has a CheckpointCallback attached already; one Trainer takes one (two "
                "would both restore and save the run)"
            )
        self._check_supported(trainer)
        missing = [n for n in (*_HOOKS, *_LOOP_HOOKS) if not callable(getattr(trainer, n, None))]
        if missing:
            raise RuntimeError(
                f"this transformers {transformers.__version__} Trainer has no {missing}: "
                "ckpt.integrations.hf was tested with transformers 4.57 and 5.x"
            )
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        originals = {n: getattr(trainer, n) for n in ("train", *_HOOKS)}
        mine = {
            "_load_from_checkpoint": self._load_model,
            "_load_optimizer_and_scheduler": self._load_optimizer,
            "_load_scaler": self._load_scaler,
            "_load_rng_state": self._load_rng,
        }

        def hook(name: str) -> Callable[..., Any]:
            def call(path: Any, *args: Any, **kwargs: Any) -> Any:
                if path is not None and path == self._resume_dir:
                    return mine[name](trainer, *args, **kwargs)
                return originals[name](path, *args, **kwargs)

            return call

        for name in _HOOKS:
            setattr(trainer, name, hook(name))

        log_save_evaluate, load_best_model = (getattr(trainer, n) for n in _LOOP_HOOKS)

        def maybe_log_save_evaluate(*args: Any, **kwargs: Any) -> Any:
            out = log_save_evaluate(*args, **kwargs)
            self._logged = (trainer.state.global_step, len(trainer.state.log_history))
            return out

        def load_best() -> Any:
            # the last step's snapshot (and the final one) hold that step's weights, not the best model's
            self._finish(trainer.state)
            self.checkpointer.wait_staged()  # the load writes the weights in place: the copy must be done
            return load_best_model()

        trainer._maybe_log_save_evaluate = maybe_log_save_evaluate
        trainer._load_best_model = load_best

        def train(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
            return self._train(trainer, originals["train"], resume_from_checkpoint, args, kwargs)

        trainer.train = train
        trainer._ckpt_callback = self
        self._trainer = trainer
        return self

    def _check_supported(self, trainer: Trainer) -> None:
        args = trainer.args
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
            raise ValueError(
                "CheckpointCallback does not support DeepSpeed or FSDP Trainers (their engines load the "
                "weights and optimizer): drop the deepspeed / fsdp TrainingArguments, or use the "
                "Trainer's own checkpoints"
            )
        if args.world_size > 1:
            raise ValueError(
                f"CheckpointCallback runs in one process; this Trainer has world_size={args.world_size}. "
                "Use the Trainer's own checkpoints for multi-process runs"
            )
        if args.load_best_model_at_end and not self.keep_trainer_checkpoints:
            raise ValueError(
                "load_best_model_at_end=True loads the Trainer's own checkpoint-N directories: pass "
                "CheckpointCallback(keep_trainer_checkpoints=True), or drop load_best_model_at_end"
            )

    # -- train() -------------------------------------------------------------------------------------
    def _train(
        self, trainer: Trainer, train: Callable[..., Any], resume: Any, args: tuple, kwargs: dict
    ) -> Any:
        ck = self.checkpointer
        self.restored_step, self._held, self._resume_dir = None, None, None
        self._logged = (-1, 0)
        if resume is True and _newest_is_ours(ck, trainer):
            # True: "the run's newest checkpoint"; the run's checkpoints are the tiers' (the Trainer's own
            # checkpoint-N directories are replaced by them, or, kept, hold the same steps)
            self._resume_dir = resume = tempfile.mkdtemp(prefix="ckpt-hf-resume-")
        elif resume is not None and resume is not False:
            log.info(
                "CheckpointCallback: not restoring, since train(resume_from_checkpoint=%r) resumes the run",
                resume,
            )
        elif self.restore and ck.list():
            # The Trainer resumes from this directory; trainer_state.json is written into it from the checkpoint
            # when the Trainer asks for the model (_load_model), before it reads the file.
            self._resume_dir = resume = tempfile.mkdtemp(prefix="ckpt-hf-resume-")
        if self._owned:
            ck.__enter__()  # installs the signal handlers (main thread)
        try:
            out = train(resume, *args, **kwargs)
        except BaseException:
            self._end(ck, sys.exc_info())
            raise
        self._end(ck, (None, None, None))
        return out

    def _end(self, ck: Checkpointer, exc: tuple) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
        self._resume_dir, self._held = None, None
        if self._owned:
            self._ck = None
            ck.__exit__(*exc)  # waits until every save is durable; raises the first failure when no exception
        elif exc[0] is not None:
            try:
                ck.wait()
            except Exception as e:
                log.error("CheckpointCallback: a save failed while the run was stopping: %s", e)

    # -- restoring (called by the Trainer through the hooks) --------------------------------------------
    def _load_model(self, trainer: Trainer, model: Any = None) -> None:
        """Read the newest checkpoint: the model in place, the rest held until the Trainer asks."""
        held = {k: _Held() for k in _HELD}
        state = {"model": model if model is not None else trainer.model, **held, _CONFIG_KEY: _Held()}
        try:
            step = self.checkpointer.restore(state)
        except IncompatibleCheckpointError as first:  # a checkpoint from before the config was kept with it?
            del state[_CONFIG_KEY]
            try:
                step = self.checkpointer.restore(state)
            except IncompatibleCheckpointError:
                raise first from None  # no: the first error says what does not fit
        if step is None:
            raise CheckpointError(
                f"the checkpoint listed in {self.checkpointer.local.root} when train() started is "
                "gone: was it deleted meanwhile?"
            )
        with open(os.path.join(self._resume_dir, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(held["trainer_state"].value["json"])
        self._held = held
        self.restored_step = step
        log.info(
            "CheckpointCallback: resuming from step %d (%s tier)", step, self.checkpointer.last_restore.tier
        )

    def _load_optimizer(self, trainer: Trainer) -> None:
        assert self._held is not None
        trainer.optimizer.load_state_dict(self._held["optimizer"].value)
        trainer.lr_scheduler.load_state_dict(self._held["scheduler"].value)

    def _load_scaler(self, trainer: Trainer) -> None:
        assert self._held is not None
        sd = self._held["scaler"].value["sd"]
        scaler = getattr(trainer.accelerator, "scaler", None)
        if sd is not None and scaler is None:
            log.warning(
                "CheckpointCallback: the checkpoint holds a gradient scaler's state, but this Trainer has no "
                "scaler (fp16 off?); it is ignored"
            )
        elif sd is not None:
            scaler.load_state_dict(sd)

    def _load_rng(self, trainer: Trainer) -> None:
        assert self._held is not None
        RNGState().load_state_dict(self._held["rng"].value)

    # -- the state -----------------------------------------------------------------------------------
    def _state(self, trainer: Trainer) -> dict[str, Any]:
        def scaler() -> dict:
            s = getattr(trainer.accelerator, "scaler", None)
            return {"sd": s.state_dict() if s is not None else None}

        return {
            "model": trainer.model,
            "optimizer": trainer.optimizer,
            "scheduler": trainer.lr_scheduler,
            "scaler": _View(scaler, _refuse),
            "trainer_state": _View(lambda: {"json": _trainer_state_json(trainer, self._logged)}, _refuse),
            "rng": RNGState(),
            # the model's config as config.json holds it: `ckpt export --format hf` makes a model directory from
            # the checkpoint alone (computed at each save, never restored into: the model has its own)
            _CONFIG_KEY: _View(lambda: _config_json(trainer.model), _refuse),
        }

    # -- hooks ---------------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._trainer is None:
            raise RuntimeError(
                "CheckpointCallback is among the Trainer's callbacks but was not attached: call "
                "callback.attach(trainer) before trainer.train(), so that it can resume the run"
            )
        # Nothing to save before the next optimizer step: the restored step is saved, step 0 is the initial state.
        self._handled = state.global_step
        self._last_saved = state.global_step if self.restored_step is not None else -1
        self._pending = -1

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._take_trainer_save(state, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._take_trainer_save(state, control)  # save_strategy="epoch"

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._pending = state.global_step  # the Trainer wrote a checkpoint of its own: snapshot it too

    def _take_trainer_save(self, state: TrainerState, control: TrainerControl) -> None:
        if control.should_save:
            self._pending = state.global_step
            if not self.keep_trainer_checkpoints:
                control.should_save = False

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._boundary(state)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._boundary(state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._finish(state)
        self.checkpointer.wait()

    def _finish(self, state: TrainerState) -> None:
        """The loop is over: save the last step if asked, and the final state (``save_on_train_end``).

        Runs before the Trainer loads its best model (``load_best_model_at_end``), or at ``on_train_end``."""
        self._boundary(state)
        step = state.global_step
        if self.save_on_train_end and step != self._last_saved and step > 0:
            self.checkpointer.save(step, self._state(self._trainer))
            self._last_saved = step

    def _boundary(self, state: TrainerState) -> None:
        """Save the last completed step if the policy, the Trainer's schedule or a signal asks (once per step)."""
        step = state.global_step
        if step == self._handled:
            return
        self._handled = step
        ck = self.checkpointer
        payload = self._state(self._trainer)
        # on a preemption signal: saves, makes it durable, exits. Without a policy of its own the Checkpointer
        # saves at the Trainer's schedule alone (below): not the error of a plain loop's maybe_save
        handle = ck._maybe_save(step, payload)
        if handle is None and self._pending == step:
            handle = ck.save(step, payload)
        if handle is not None:
            self._last_saved = step


def _refuse(sd: Any) -> None:
    raise AssertionError("restores go through _Held")  # the save-side views are never restored into


def _newest_is_ours(ck: Checkpointer, trainer: Trainer) -> bool:
    """Whether the tiers hold a checkpoint at least as new as the Trainer's newest ``checkpoint-N`` directory."""
    listed = ck.list()
    if not listed:
        return False
    theirs = get_last_checkpoint(trainer.args.output_dir) if os.path.isdir(trainer.args.output_dir) else None
    if theirs is None:
        return True
    step = os.path.basename(theirs)[len(PREFIX_CHECKPOINT_DIR) + 1 :]
    return not step.isdigit() or max(c.step for c in listed) >= int(step)


def _trainer_state_json(trainer: Trainer, logged: tuple[int, int]) -> str:
    """``trainer.state`` as the Trainer's own save at this step would write trainer_state.json.

    As that save does, the floating-point operations counted since the Trainer last stored them are added to
    ``total_flos``, and the states of the ``ExportableState`` callbacks (and of the ``TrainerControl``) are those
    of now. ``logged`` is (step, length of the log history) when that step's logging, evaluation and save were
    over: at the same step, the entries logged later (the end-of-training summary) are left out."""
    d = dataclasses.asdict(trainer.state)
    d["total_flos"] = trainer.state.total_flos + trainer.current_flos
    step, length = logged
    if step == trainer.state.global_step:
        d["log_history"] = d["log_history"][:length]
    stateful = [
        cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)
    ]
    d["stateful_callbacks"] = TrainerState(stateful_callbacks=stateful).stateful_callbacks
    return json.dumps(d, sort_keys=True)

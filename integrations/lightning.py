"""PyTorch Lightning integration: a resumption callback and a tiered ``CheckpointIO`` plugin.

Two independent pieces (use either, or both):

* :class:`CheckpointCallback` saves everything ``trainer.fit`` needs to resume
  exactly (the LightningModule, optimizers, LR schedulers, the fit loop's
  progress and its resumable dataloaders' positions, other callbacks' states,
  the precision plugin, the datamodule and the random number generators) from
  ``on_train_batch_end``, through a :class:`ckpt.Checkpointer`, and restores
  the newest checkpoint when ``fit`` starts. On SIGTERM it saves at the next
  batch end and waits until that checkpoint is durable.
* :class:`TieredCheckpointIO` is a Lightning ``CheckpointIO`` plugin
  (``Trainer(plugins=[TieredCheckpointIO()])``): every ``trainer.save_checkpoint``
  (so every ``ModelCheckpoint`` save) is snapshotted into host memory and
  written in the background; each checkpoint "file" is a directory in the
  ``ckpt`` format (``ckpt verify PATH`` checks it).

``CheckpointCallback`` also runs on multi-process strategies (DDP; FSDP2 models
save their DTensor shards): it makes one engine per rank in
``<local_dir>/rank-<r>`` once the processes exist, and the ranks agree on the
step they resume. ``TieredCheckpointIO`` saves where Lightning tells it (rank 0
under DDP). Pickle is never used: values of a
checkpoint that are neither tensors nor JSON-safe are refused (default) or,
with ``on_unsupported="skip"``, left out. See ``docs/lightning.md``.

This module imports ``lightning``; ``import ckpt`` does not import it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import lightning
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from ..api import Checkpointer
from ..errors import RefusedStateError
from ..format import COMMIT_NAME, Manifest
from ..pipeline import SaveHandle
from ..policy import Retention
from ..ranks import distributed_world
from ..rng import RNGState
from ..tiers import LocalTier

__all__ = ["CheckpointCallback", "TieredCheckpointIO"]

log = logging.getLogger(__name__)

# Tested with 2.5.0 and 2.6.6. With 2.4 a run resumed from a checkpoint of an epoch's last batch was not
# bit-identical to the uninterrupted one (2.5 reworked how loops restart from a batch-end checkpoint).
_MIN_LIGHTNING = (2, 5)


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


if _version_tuple(lightning.__version__) < _MIN_LIGHTNING:
    raise ImportError(f"ckpt.integrations.lightning needs lightning>=2.5, found {lightning.__version__}: "
                      "upgrade with pip install -U 'tierckpt[lightning]' (or 'lightning>=2.5')")

# Top-level key under which TieredCheckpointIO records the keys it left out (on_unsupported="skip").
_DROPPED_KEY = "tierckpt_dropped"


# ---------------------------------------------------------------------------------------------
# Making Lightning's values storable without pickle


def _storable(value: Any, path: str, on_unsupported: str, dropped: list[str]) -> Any:
    """Return ``value`` in a form the engine stores without pickle.

    Tensors, numpy values, ``None``/bool/int/float/str, ``torch.dtype`` and
    ``torch.Size`` pass through. Mappings (``AttributeDict``, ``OrderedDict``)
    become dicts, ``argparse.Namespace`` becomes a dict of its attributes,
    ``os.PathLike`` becomes its string; lists and tuples are converted element
    by element. Anything else raises :class:`RefusedStateError` naming
    ``path``, or with ``on_unsupported="skip"`` is recorded in ``dropped`` and
    replaced by :data:`_SKIP` (the caller leaves it out).
    """
    if isinstance(value, (torch.Tensor, str, int, float, bool, type(None), torch.dtype, torch.Size)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                if on_unsupported == "error":
                    raise RefusedStateError(
                        f"checkpoint dict at {path!r} has a key of type {type(k).__name__} ({k!r}); keys must be "
                        "str, int, float, bool or None. Pass on_unsupported='skip' to leave such entries out.")
                dropped.append(f"{path}/{k!r}")
                continue
            sub = _storable(v, f"{path}/{k}", on_unsupported, dropped)
            if sub is not _SKIP:
                out[k] = sub
        return out
    if isinstance(value, argparse.Namespace):
        return _storable(vars(value), path, on_unsupported, dropped)
    if isinstance(value, (list, tuple)):
        items = [_storable(v, f"{path}/{i}", on_unsupported, dropped) for i, v in enumerate(value)]
        # A left-out element becomes None, so the positions of the others do not shift.
        items = [None if v is _SKIP else v for v in items]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "numpy":     # arrays and numpy scalars: the engine stores them natively
        return value
    if on_unsupported == "error":
        raise RefusedStateError(
            f"checkpoint value at {path!r} is a {type(value).__module__}.{type(value).__qualname__}, which cannot "
            "be stored without pickle. Store tensors or JSON-safe values there, or pass on_unsupported='skip' "
            "to leave such values out of the checkpoint (they are then missing when it is loaded).")
    dropped.append(path)
    return _SKIP


class _Skip:
    def __repr__(self) -> str:
        return "<left out>"


_SKIP: Any = _Skip()


def _map_location(value: Any, map_location: Any) -> Any:
    """Move every tensor in ``value`` as ``torch.load(map_location=...)`` would."""
    if map_location is None:
        return value
    if isinstance(value, torch.Tensor):
        if isinstance(map_location, (str, torch.device)):
            return value.to(map_location)
        if isinstance(map_location, Mapping):
            target = map_location.get(str(value.device)) or map_location.get(value.device.type)
            return value if target is None else value.to(target)
        if callable(map_location):
            moved = map_location(value, str(value.device))
            return value if moved is None else moved
        raise TypeError(f"map_location must be None, a str, a torch.device, a dict or a callable, "
                        f"got {type(map_location).__name__}")
    if isinstance(value, dict):
        return {k: _map_location(v, map_location) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_location(v, map_location) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_location(v, map_location) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# TieredCheckpointIO


class _PathTier(LocalTier):
    """The local tier of :class:`TieredCheckpointIO`: each save goes to the directory Lightning named.

    Lightning decides where every checkpoint goes (``ModelCheckpoint`` picks
    ``epoch=0-step=100.ckpt``, ``last.ckpt``, ...), while one Checkpointer (one
    host buffer, one background writer) serves them all. So the target
    directory of each engine step is registered before the save and the write
    is delegated to a plain :class:`LocalTier` rooted there. Listing returns
    nothing, so the Checkpointer's retention never deletes anything: Lightning
    removes checkpoints itself through ``remove_checkpoint``.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._targets: dict[int, Path] = {}
        self._lock = threading.Lock()

    def target(self, step: int, path: Path) -> None:
        with self._lock:
            self._targets[step] = path

    def forget(self, step: int) -> None:
        with self._lock:
            self._targets.pop(step, None)

    def write(self, step: int, manifest: Manifest, data: memoryview) -> float:
        with self._lock:
            path = self._targets.pop(step)
        tier = LocalTier(path)
        seconds = tier.write(step, manifest, data)
        # The new checkpoint is committed: older ones saved to the same path (say last.ckpt) are now stale.
        for old in tier.all_step_dirs():
            if old != step:
                tier.delete(old)
        return seconds

    def committed_steps(self) -> list[int]:
        return []

    def all_step_dirs(self) -> dict[int, Path]:
        return {}


class TieredCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ``ckpt``: snapshot now, persist in the background.

    ``Trainer(plugins=[TieredCheckpointIO()])`` routes ``trainer.save_checkpoint``
    and ``ModelCheckpoint`` through it. Contract:

    * ``save_checkpoint(checkpoint, path)`` returns once the checkpoint's
      tensors are being copied into a host buffer; the training loop goes on
      (the next ``optimizer.step()`` waits for the copy) and a background
      thread writes ``path``. ``path`` becomes a **directory** in the ``ckpt``
      format (one committed step inside; ``ckpt verify PATH`` checks it).
      Saving to an existing path replaces it once the new checkpoint is
      committed, so a crash leaves either the old or the new one.
    * ``load_checkpoint(path, map_location)`` waits for a pending save of
      ``path``, verifies every chunk's checksum and returns the checkpoint
      dict (tensors on the device they were saved from, or as
      ``map_location`` says). Mappings come back as plain dicts.
    * ``remove_checkpoint(path)`` waits for a pending save of ``path``, then
      deletes it.
    * ``teardown()`` (called by Lightning at the end of ``fit``) waits until
      every save is durable and raises the first failure; a later save starts
      a new writer.

    A save that fails in the background (disk full, say) is logged at once and
    raised by ``load_checkpoint`` / ``remove_checkpoint`` of that path and by
    ``teardown`` (so by the end of ``fit``).

    Args:
        max_in_flight: checkpoints held in host memory at once (one buffer
            each, the size of the checkpoint's tensors). A save finding them
            all still being written waits.
        host_memory_limit: bytes of host staging memory allowed (see
            :class:`ckpt.Checkpointer`).
        on_unsupported: ``"error"`` (default): a value that is neither a
            tensor nor JSON-safe (after turning mappings, ``Namespace`` and
            paths into dicts and strings) raises ``RefusedStateError`` naming
            its key, and nothing is written. ``"skip"``: such values are left
            out (a list element becomes ``None``) and listed in a warning; the
            checkpoint records their keys, logged again when it is loaded;
            the dict ``load_checkpoint`` returns lacks them.

    Paths are local (a remote URL raises ``ValueError``). Loading a file
    written by another ``CheckpointIO`` (a ``torch.save`` pickle) is refused.
    """

    def __init__(self, *, max_in_flight: int = 1, host_memory_limit: int | None = None,
                 on_unsupported: str = "error") -> None:
        if on_unsupported not in ("error", "skip"):
            raise ValueError(f"on_unsupported must be 'error' or 'skip', got {on_unsupported!r}")
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self.host_memory_limit = host_memory_limit
        self.on_unsupported = on_unsupported
        self._ck: Checkpointer | None = None
        self._tier: _PathTier | None = None
        self._in_flight: list[tuple[Path, SaveHandle]] = []   # saves not yet known to be finished
        self._seq = 0

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The engine behind the saves (``None`` before the first save and after ``teardown``)."""
        return self._ck

    # -- CheckpointIO ------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` and write it to the directory ``path`` in the background."""
        if storage_options is not None:
            raise TypeError("TieredCheckpointIO.save_checkpoint does not take storage_options; pass "
                            f"storage_options=None (got {storage_options!r})")
        target = self._local_path(path)
        dropped: list[str] = []
        state = _storable(dict(checkpoint), "checkpoint", self.on_unsupported, dropped)
        if dropped:
            state[_DROPPED_KEY] = dropped
            log.warning("TieredCheckpointIO left out of %s values that need pickle (on_unsupported='skip'): %s",
                        target, ", ".join(dropped))
        ck = self._checkpointer(target)
        step = self._engine_step(checkpoint)
        # The tier maps engine steps to paths, so a step is in flight once at a time: an earlier save with
        # this step (last.ckpt after epoch=...-step=N.ckpt, say) is written first. With one host buffer the
        # save would wait for it anyway. Its failure, if any, is raised by teardown.
        self._in_flight = [(p, h) for p, h in self._in_flight if not h.done()]
        for _, h in self._in_flight:
            if h.step == step:
                _wait_quietly(h)
        assert self._tier is not None
        self._tier.target(step, target)
        try:
            handle = ck.save(step, state)
        except BaseException:
            self._tier.forget(step)
            raise
        if handle.status == "skipped":     # not with if_busy="wait"; kept as a guard against silent loss
            self._tier.forget(step)
            raise RuntimeError(f"the save of {target} was skipped")
        self._in_flight.append((target, handle))

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint directory ``path`` (``weights_only`` is moot: nothing is unpickled)."""
        target = self._local_path(path)
        self._wait_for(target)
        if not target.exists():
            raise FileNotFoundError(f"checkpoint {str(path)!r} not found")
        if not target.is_dir():
            raise ValueError(f"{str(path)!r} is a file, not a checkpoint directory written by TieredCheckpointIO "
                             "(files written by torch.save need pickle, which this plugin never uses); pass the "
                             "path of a checkpoint saved through TieredCheckpointIO")
        state: dict[str, Any] = {}
        # Lightning decides which ranks save and load which paths: no agreement between ranks here
        with Checkpointer(local_dir=target, keep=_keep_all(), collective=False) as reader:
            step = reader.restore(state, strict=False)
        if step is None:
            raise FileNotFoundError(f"{str(path)!r} holds no committed checkpoint (no {COMMIT_NAME} file: the save "
                                    "did not finish)")
        dropped = state.pop(_DROPPED_KEY, None)
        if dropped:
            log.info("checkpoint %s was saved without these values (on_unsupported='skip'): %s",
                     target, ", ".join(map(str, dropped)))
        return _map_location(state, map_location)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path`` once any pending save of it is written; no-op if absent."""
        target = self._local_path(path)
        self._wait_for(target)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()

    def teardown(self) -> None:
        """Wait until every save is durable, stop the writer; raises the first failure."""
        ck, self._ck, self._tier, self._in_flight = self._ck, None, None, []
        if ck is not None:
            ck.close()

    # -- helpers -------------------------------------------------------------------------------------
    def _checkpointer(self, target: Path) -> Checkpointer:
        if self._ck is None:
            # The tier's own root is never written (each save goes to its path); the checkpoint's parent is a
            # directory Lightning creates anyway.
            self._tier = _PathTier(target.parent)
            self._ck = Checkpointer(local_dir=self._tier, keep=_keep_all(), max_in_flight=self.max_in_flight,
                                    if_busy="wait", host_memory_limit=self.host_memory_limit,
                                    on_unsupported=self.on_unsupported, collective=False)
        return self._ck

    def _engine_step(self, checkpoint: Mapping[str, Any]) -> int:
        # The step directory inside the checkpoint is named after the trainer's global step (what
        # `ckpt ls PATH` shows); a checkpoint dict without one gets a sequence number.
        step = checkpoint.get("global_step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
        self._seq += 1
        return self._seq

    def _wait_for(self, target: Path) -> None:
        """Wait for the saves of ``target``; raises the failure of one of them."""
        mine = [h for p, h in self._in_flight if p == target]
        self._in_flight = [(p, h) for p, h in self._in_flight if p != target]
        for h in mine:
            h.wait()

    @staticmethod
    def _local_path(path: str | os.PathLike) -> Path:
        s = os.fspath(path)
        if "://" in s and not s.startswith("file://"):
            raise ValueError(f"TieredCheckpointIO writes local paths only; got {s!r}: point ModelCheckpoint's "
                             "dirpath (or Trainer(default_root_dir=...)) at a local directory")
        return Path(s.removeprefix("file://")).expanduser().absolute()


def _wait_quietly(handle: SaveHandle) -> None:
    try:
        handle._wait_quietly()   # not counted as raised: the Checkpointer raises it at close (teardown)
    except Exception:
        pass    # logged when it happened


def _keep_all() -> Retention:
    # Lightning (ModelCheckpoint's save_top_k) decides what to delete, through remove_checkpoint.
    return Retention(local=None)


# ---------------------------------------------------------------------------------------------
# CheckpointCallback


class _Part:
    """A Stateful view of one part of the trainer, with values made storable without pickle."""

    def __init__(self, name: str, get: Callable[[], Any], put: Callable[[Any], None], on_unsupported: str) -> None:
        self.name, self._get, self._put, self._on_unsupported = name, get, put, on_unsupported

    def state_dict(self) -> Any:
        dropped: list[str] = []
        sd = _storable(self._get(), self.name, self._on_unsupported, dropped)
        if dropped:
            log.warning("CheckpointCallback left out values that need pickle (on_unsupported='skip'): %s",
                        ", ".join(dropped))
        return {"v": None if sd is _SKIP else sd}

    def load_state_dict(self, sd: Any) -> None:
        self._put(sd["v"])


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
    checkpoint is durable, before Lightning stops the run. With
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

    A tensor of the state written in place outside ``optimizer.step()`` while
    a save may be in flight (another callback's EMA, say) must be preceded by
    ``callback.checkpointer.wait_staged()``.

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

    def __init__(self, checkpointer: Checkpointer | None = None, *, restore: bool = True,
                 save_on_train_end: bool = True, **checkpointer_args: Any) -> None:
        super().__init__()
        if checkpointer is not None and checkpointer_args:
            raise TypeError("pass either checkpointer=... or Checkpointer arguments, not both (got checkpointer "
                            f"and {sorted(checkpointer_args)})")
        if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
            raise TypeError(f"checkpointer must be a ckpt.Checkpointer, got {type(checkpointer).__name__}")
        self._args = checkpointer_args
        self._owned = checkpointer is None
        # Built now so that bad arguments fail at construction, not in the middle of fit.
        self._ck: Checkpointer | None = checkpointer if checkpointer is not None else Checkpointer(**checkpointer_args)
        self.restore = restore
        self.save_on_train_end = save_on_train_end
        self.restored_step: int | None = None
        self._rng_to_load: dict | None = None
        self._last_seen_step = -1
        self._last_saved_step = -1
        self._last_batch_stepped = False

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
            raise ValueError("CheckpointCallback on a multi-process strategy gives every rank its own "
                             f"subdirectory of local_dir, which must then be a path (got {type(local).__name__})")
        args["local_dir"] = os.path.join(local, sub)
        return Checkpointer(**args)   # the url stays one for all ranks: the job tier, which can reshard

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
                "makes one per rank, in <local_dir>/rank-<r>, when the processes have started")
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
            "schedulers": {str(i): part(f"schedulers/{i}", c.scheduler)
                           for i, c in enumerate(trainer.lr_scheduler_configs)},
            "fit_loop": part("fit_loop", trainer.fit_loop),
            "callbacks": _Part("callbacks", lambda: self._callback_states(trainer),
                               lambda sd: self._load_callback_states(trainer, sd), mode),
            "precision": part("precision", trainer.precision_plugin),
            "datamodule": _Part("datamodule", lambda: _datamodule_state(trainer),
                                lambda sd: _load_datamodule_state(trainer, sd), mode),
            "rng": _Part("rng", lambda: self._rng_state(trainer), self._defer_rng, mode),
        }

    def _callback_states(self, trainer: Trainer) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb is not self}

    def _load_callback_states(self, trainer: Trainer, states: dict[str, Any]) -> None:
        live = {cb.state_key: cb for cb in trainer.callbacks if cb is not self}
        for key, sd in states.items():
            if key in live:
                live[key].load_state_dict(sd)
            else:
                log.warning("the checkpoint holds the state of callback %s, which this Trainer does not have; "
                            "it is ignored", key)

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
        self._last_seen_step = self._last_saved_step = -1
        self._last_batch_stepped = False
        self.restored_step = None
        if not self.restore:
            return
        if trainer.ckpt_path is not None:
            log.info("CheckpointCallback: not restoring, since fit(ckpt_path=%s) restores the run", trainer.ckpt_path)
            return
        self._rng_to_load = None
        step = self.checkpointer.restore(self._state(trainer, pl_module))
        if step is not None:
            self.restored_step = self._last_seen_step = self._last_saved_step = step
            log.info("CheckpointCallback: resumed from step %d", step)
        if self._rng_to_load is not None and self._rng_to_load["before_iterator"]:
            self._load_rng()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A batch "stepped" when global_step moved since the previous batch end (not on the first
        # accumulation batches, whose global_step is still the starting one).
        self._last_seen_step = trainer.global_step
        if self._rng_to_load is not None:
            self._load_rng()

    def _load_rng(self) -> None:
        assert self._rng_to_load is not None
        RNGState().load_state_dict(self._rng_to_load["generators"])
        self._rng_to_load = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
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
                log.warning("SIGTERM in the middle of a gradient accumulation: the accumulated gradients are not "
                            "saved; the newest checkpoint is step %d", self._last_saved_step)
            ck.wait()      # durable before Lightning stops the run
            log.info("CheckpointCallback: SIGTERM received; step %d is durable", self._last_saved_step)
            return
        if not stepped or step == self._last_saved_step:
            return
        if self.save_on_train_end and 0 < trainer.max_steps <= step:
            # The run stops at max_steps, possibly mid-epoch. Saved here, a later fit with a larger max_steps
            # continues this epoch exactly; at on_train_end Lightning has already marked the epoch completed.
            ck.save(step, self._state(trainer, pl_module))
            self._last_saved_step = step
        elif ck.maybe_save(step, self._state(trainer, pl_module)) is not None:
            self._last_saved_step = step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_on_train_end and trainer.global_step != self._last_saved_step and trainer.global_step > 0:
            self.checkpointer.save(trainer.global_step, self._state(trainer, pl_module))
            self._last_saved_step = trainer.global_step
        self.checkpointer.wait()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._ck is None:
            return
        # Lightning checks received_sigterm right after the batch-end hooks and stops the run by raising
        # SIGTERMException; a signal that arrived after this callback's on_train_batch_end is seen here.
        # The loop state is then that of a completed batch, which Lightning resumes from as well.
        step = trainer.global_step
        if (trainer.received_sigterm and self._last_batch_stepped and step == self._last_seen_step
                and step != self._last_saved_step):
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
        if self._ck is None:
            return
        if self._owned:
            ck, self._ck = self._ck, None
            ck.close()
        else:
            self._ck.wait()


def _datamodule_state(trainer: Trainer) -> Any:
    dm = trainer.datamodule
    return dm.state_dict() if dm is not None else None


def _load_datamodule_state(trainer: Trainer, sd: Any) -> None:
    dm = trainer.datamodule
    if dm is not None and sd is not None:
        dm.load_state_dict(sd)

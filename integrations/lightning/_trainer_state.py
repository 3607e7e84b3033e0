"""What :class:`~ckpt.integrations.lightning.CheckpointCallback` reads from the ``Trainer``: storable views of
its parts, the LR schedulers and averaged models that callbacks keep, the datamodule's state, and where
the fit loop stands at a batch end."""

from __future__ import annotations

import logging
from typing import Any, Callable

from lightning.pytorch import Trainer

from ._storable import _SKIP, _storable

log = logging.getLogger(__name__)


class _Part:
    """A Stateful view of one part of the trainer, with values made storable without pickle."""

    def __init__(
        self, name: str, get: Callable[[], Any], put: Callable[[Any], None], on_unsupported: str
    ) -> None:
        self.name, self._get, self._put, self._on_unsupported = name, get, put, on_unsupported

    def state_dict(self) -> Any:
        dropped: list[str] = []
        sd = _storable(self._get(), self.name, self._on_unsupported, dropped)
        if dropped:
            log.warning(
                "CheckpointCallback left out values that need pickle (on_unsupported='skip'): %s",
                ", ".join(dropped),
            )
        return {"v": None if sd is _SKIP else sd}

    def load_state_dict(self, sd: Any) -> None:
        self._put(sd["v"])


def _epoch_or_run_ends(trainer: Trainer) -> str | None:
    """At a batch end: ``"run"`` when it is the last batch of the last epoch, ``"epoch"`` when it is an
    epoch's last batch, else ``None``."""
    loop = trainer.fit_loop
    epoch_loop = loop.epoch_loop
    last = bool(epoch_loop.batch_progress.is_last_batch) or (
        epoch_loop.batch_progress.current.ready >= trainer.num_training_batches
    )
    if not last:
        return None
    max_epochs = loop.max_epochs
    if max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs:
        return "run"
    return "epoch"


def _callback_schedulers(trainer: Trainer) -> set[int]:
    """ids of the LR schedulers that callbacks put in ``trainer.lr_scheduler_configs`` and save and
    restore themselves: ``StochasticWeightAveraging``'s ``SWALR`` (in its ``state_dict``; a resumed fit
    has no such scheduler until SWA makes it again at an epoch's start, and loads it then)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return {
        id(cb._swa_scheduler)
        for cb in trainer.callbacks
        if isinstance(cb, StochasticWeightAveraging) and getattr(cb, "_swa_scheduler", None) is not None
    }


def _averaged_models(trainer: Trainer) -> dict[str, Any]:
    """``WeightAveraging`` callbacks' averaged models (Lightning 2.6), by ``state_key``: the callback keeps
    them out of its ``state_dict`` (it writes them through ``on_save_checkpoint``, which the callback does
    not call). Only present when there are some, so checkpoints without them restore as before."""
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # lightning < 2.6
        return {}
    models = {
        cb.state_key: cb._average_model
        for cb in trainer.callbacks
        if isinstance(cb, WeightAveraging) and getattr(cb, "_average_model", None) is not None
    }
    return {"averaged_models": models} if models else {}


def _datamodule_state(trainer: Trainer) -> Any:
    dm = trainer.datamodule
    return dm.state_dict() if dm is not None else None


def _load_datamodule_state(trainer: Trainer, sd: Any) -> None:
    dm = trainer.datamodule
    if dm is not None and sd is not None:
        dm.load_state_dict(sd)

"""What importing ``ckpt.integrations.lightning`` changes in Lightning, so that its own code paths hand
:class:`~ckpt.integrations.lightning.TieredCheckpointIO` its checkpoints: the ``AsyncCheckpointIO`` wrapper,
``ModelCheckpoint(save_last="link")``, ``Trainer.save_checkpoint`` and ``load_from_checkpoint``. With any
other ``CheckpointIO``, Lightning behaves as before. Each patch marks what it replaced, so applying them
again changes nothing.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from lightning.pytorch import Trainer

from ...format import parse_step_dir
from ._reservation import _SAVING_NAME
from .checkpoint_io import TieredCheckpointIO


def apply() -> None:
    """Apply every patch below (once: a patched entry point is left as it is)."""
    _route_async_checkpoint_io()
    _route_model_checkpoint_link()
    _route_trainer_save_checkpoint()
    _point_load_from_checkpoint()


def _tiered_base(io: Any, through: type | None = None) -> TieredCheckpointIO | None:
    """The :class:`TieredCheckpointIO` at the bottom of ``io``'s wrappers (Lightning's ``_WrappingCheckpointIO``,
    or only those of type ``through``), however deeply nested; ``None`` when another plugin is there."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    seen = 0
    while isinstance(io, through or _WrappingCheckpointIO) and seen < 64:
        io, seen = io.checkpoint_io, seen + 1
    return io if isinstance(io, TieredCheckpointIO) else None


def _route_async_checkpoint_io() -> None:
    """Make Lightning's ``AsyncCheckpointIO`` hand a wrapped :class:`TieredCheckpointIO` its saves at once and
    its ``teardown``, also through wrappers nested in each other (``AsyncCheckpointIO(AsyncCheckpointIO(...))``).

    The wrapper runs each save on a thread of its own after cloning every tensor on the caller's thread, and
    its ``teardown`` stops that thread without calling the wrapped plugin's. For this plugin, whose saves
    already return before the write, that would only add a full copy of the state, let ``ModelCheckpoint`` look
    for a path (``-vN`` names) or remove one before the save reached the plugin, and leave the plugin's saves
    unflushed and their failures unraised at the end of ``fit``. Other wrapped plugins keep the wrapper's
    behaviour.
    """
    try:
        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
    except ImportError:  # pragma: no cover - every supported Lightning has it
        return
    if getattr(AsyncCheckpointIO, "_tierckpt_routed", False):
        return
    wrapped_save, wrapped_teardown = AsyncCheckpointIO.save_checkpoint, AsyncCheckpointIO.teardown

    @functools.wraps(wrapped_save)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
        base = _tiered_base(self, AsyncCheckpointIO)  # another wrapper in between keeps its own save
        if base is not None:
            return base.save_checkpoint(*args, **kwargs)
        return wrapped_save(self, *args, **kwargs)

    @functools.wraps(wrapped_teardown)
    def teardown(self: Any) -> None:
        base = _tiered_base(self, AsyncCheckpointIO)
        try:
            wrapped_teardown(self)
        finally:
            if base is not None:
                base.teardown()

    AsyncCheckpointIO.save_checkpoint = save_checkpoint
    AsyncCheckpointIO.teardown = teardown
    AsyncCheckpointIO._tierckpt_routed = True


def _route_model_checkpoint_link() -> None:
    """Make ``ModelCheckpoint(save_last="link")`` link or copy a :class:`TieredCheckpointIO` checkpoint through it.

    Lightning links ``last.ckpt`` to the newest checkpoint and, where the file system refuses symbolic links,
    copies it with ``shutil.copy``, which cannot copy a checkpoint directory (and would copy one whose save is
    still pending). With this plugin under the trainer's strategy (wrapped or not), :meth:`TieredCheckpointIO._link`
    does it instead; any other plugin keeps Lightning's behaviour.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    wrapped = ModelCheckpoint.__dict__.get("_link_checkpoint")
    if not isinstance(wrapped, staticmethod) or getattr(wrapped.__func__, "_tierckpt_routed", False):
        return
    original = wrapped.__func__

    @functools.wraps(original)
    def _link_checkpoint(trainer: Trainer, filepath: str, linkpath: str) -> None:
        base = _tiered_base(trainer.strategy.checkpoint_io)
        if base is None:
            return original(trainer, filepath, linkpath)
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            base._link(filepath, linkpath)
        trainer.strategy.barrier()
        return None

    _link_checkpoint._tierckpt_routed = True  # type: ignore[attr-defined]
    ModelCheckpoint._link_checkpoint = staticmethod(_link_checkpoint)


def _route_trainer_save_checkpoint() -> None:
    """Make ``Trainer.save_checkpoint`` return once a :class:`TieredCheckpointIO` save's tensors are in host memory.

    The plugin's own ``save_checkpoint`` returns while the copy is still running, which is safe where the next
    in-place write to the state comes through ``optimizer.step()`` (it waits for the copy). Through the
    Trainer, other writes come first: a callback's hooks after the save (``WeightAveraging`` and
    ``StochasticWeightAveraging`` copy the averaged weights into the model at the end of training, or update
    them at an epoch's end), a BatchNorm forward under manual optimization, or the caller's own code after
    ``trainer.save_checkpoint``. Each would tear the snapshot and drop that checkpoint; so every save made
    through the Trainer (``ModelCheckpoint``'s, ``OnExceptionCheckpoint``'s, SLURM's, the user's) is a
    point-in-time copy when the call returns, as with Lightning's own plugins. Only the write is in the
    background.
    """
    wrapped = Trainer.save_checkpoint
    if getattr(wrapped, "_tierckpt_routed", False):
        return

    @functools.wraps(wrapped)
    def save_checkpoint(self: Trainer, *args: Any, **kwargs: Any) -> None:
        wrapped(self, *args, **kwargs)
        base = _tiered_base(self.strategy.checkpoint_io)
        if base is not None:
            base._wait_copied()

    save_checkpoint._tierckpt_routed = True  # type: ignore[attr-defined]
    Trainer.save_checkpoint = save_checkpoint


def _point_load_from_checkpoint() -> None:
    """Make ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read a
    :class:`TieredCheckpointIO` checkpoint directory: Lightning reads the path with ``torch.load``
    (``lightning.pytorch.core.saving.pl_load``), which fails with a bare ``IsADirectoryError`` on a
    directory; such a directory is loaded through :meth:`TieredCheckpointIO.load_checkpoint` instead (no
    pickle), and the rest of ``load_from_checkpoint`` (hyperparameters, ``strict``, ``map_location``) runs
    as for a file. Any other path is loaded as Lightning loads it."""
    from lightning.pytorch.core import saving

    wrapped = saving.pl_load
    if getattr(wrapped, "_tierckpt_routed", False):
        return

    @functools.wraps(wrapped)
    def pl_load(path_or_url: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and _is_tiered_checkpoint(path_or_url):
            return TieredCheckpointIO().load_checkpoint(path_or_url, map_location=map_location)
        return wrapped(path_or_url, map_location, *args, **kwargs)

    pl_load._tierckpt_routed = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load


def _is_tiered_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory a :class:`TieredCheckpointIO` save made (a step directory, or a save
    of it still pending, inside)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return _SAVING_NAME in names or any(parse_step_dir(n) is not None for n in names)

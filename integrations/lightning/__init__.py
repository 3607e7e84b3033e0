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
  ``ckpt`` format (``ckpt verify PATH`` checks it). The path exists from the
  moment the save returns (a ``SAVING`` record, no ``COMMIT``, until the write
  commits), and loads of it wait for the write, in this process or another.
  Importing this module makes Lightning's ``AsyncCheckpointIO`` hand a wrapped
  ``TieredCheckpointIO`` its saves directly and call its ``teardown``, makes
  ``Trainer.save_checkpoint`` return once such a save's tensors are in host
  memory, and makes ``ModelCheckpoint(save_last="link")`` link or copy its
  checkpoint directories; with any other plugin, Lightning behaves as before.

``CheckpointCallback`` also runs on multi-process strategies (DDP; FSDP2 models
save their DTensor shards): it makes one engine per rank in
``<local_dir>/rank-<r>`` once the processes exist, and the ranks agree on the
step they resume. ``TieredCheckpointIO`` saves where Lightning tells it (rank 0
under DDP). Pickle is never used: values of a
checkpoint that are neither tensors nor JSON-safe are refused (default) or,
with ``on_unsupported="skip"``, left out. See ``docs/lightning.md``.

The package, one module each:

* ``callback``: :class:`CheckpointCallback`.
* ``checkpoint_io``: :class:`TieredCheckpointIO`.
* ``_patches``: what importing the package changes in Lightning (``AsyncCheckpointIO``,
  ``ModelCheckpoint(save_last="link")``, ``Trainer.save_checkpoint``, ``load_from_checkpoint``).
* ``_reservation``: the ``SAVING`` record and the reservation a pending save holds on its path.
* ``_path_tier``: the local tier that writes each save to the directory Lightning named.
* ``_trainer_state``: the parts of the ``Trainer`` the callback saves, and where the fit loop stands.
* ``_storable``: values made storable without pickle (both pieces).

This package imports ``lightning``; ``import ckpt`` does not import it.
"""

from __future__ import annotations

import lightning

__all__ = ["CheckpointCallback", "TieredCheckpointIO"]

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
    raise ImportError(
        f"ckpt.integrations.lightning needs lightning>=2.5, found {lightning.__version__}: "
        "upgrade with pip install -U 'tierckpt[lightning]' (or 'lightning>=2.5')"
    )

# After the version check, so that an older Lightning fails with the message above, not in an import below.
from ._patches import apply as _apply_patches  # noqa: E402
from .callback import CheckpointCallback  # noqa: E402
from .checkpoint_io import TieredCheckpointIO  # noqa: E402

_apply_patches()

"""The local tier behind :class:`~ckpt.integrations.lightning.TieredCheckpointIO`: each save is written to the
directory Lightning named for it, and ends that directory's reservation."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ...format import Manifest
from ...tiers import LocalTier
from ._reservation import _renamed, _Reservation

log = logging.getLogger(__name__)


class _PathTier(LocalTier):
    """The local tier of :class:`TieredCheckpointIO`: each save goes to the directory Lightning named.

    Lightning decides where every checkpoint goes (``ModelCheckpoint`` picks
    ``epoch=0-step=100.ckpt``, ``last.ckpt``, ...), while one Checkpointer (one
    host buffer, one background writer) serves them all. So the target
    directory of each engine step is registered before the save and the write
    is delegated to a plain :class:`LocalTier` rooted there; the save's
    reservation of the directory ends as the write commits or fails. Listing
    returns nothing, so the Checkpointer's retention never deletes anything:
    Lightning removes checkpoints itself through ``remove_checkpoint``.
    """

    def __init__(self, root: Path, writer: type[LocalTier] = LocalTier) -> None:
        super().__init__(root)
        self._writer = writer
        self._targets: dict[int, _Reservation] = {}
        self._lock = threading.Lock()

    def target(self, step: int, reservation: _Reservation) -> None:
        with self._lock:
            self._targets[step] = reservation

    def forget(self, step: int) -> None:
        with self._lock:
            self._targets.pop(step, None)

    def write(self, step: int, manifest: Manifest, data: memoryview) -> float:
        with self._lock:
            res = self._targets.pop(step)
        if res.superseded():
            return self._superseded(res)
        root = res.root
        try:
            tier = self._writer(root)
            seconds = tier.write(step, manifest, data)
            # The new checkpoint is committed: older ones saved to the same path (say last.ckpt) are now stale.
            for old in tier.all_step_dirs():
                if old != step:
                    tier.delete(old)
        except OSError as e:
            if res.superseded():
                return self._superseded(res)
            named = _renamed(e, root, res.path)
            res.settle(named)
            raise named from e
        except BaseException as e:
            res.settle(e)
            raise
        res.settle(None)
        return seconds

    @staticmethod
    def _superseded(res: _Reservation) -> float:
        # Lightning removed the directory (or put a link there) itself while this save was pending:
        # ModelCheckpoint(save_last="link") replaces a last.ckpt directory by a link to a newer checkpoint.
        log.warning(
            "%s was removed or replaced while its save (step %d) was pending: that save is not written there",
            res.path,
            res.step,
        )
        res.settle(None)
        return 0.0

    def committed_steps(self) -> list[int]:
        return []

    def acquire_owner(self) -> None:
        return (
            None  # no steps of its own in this root to guard: each save goes to a directory Lightning names
        )

    def all_step_dirs(self) -> dict[int, Path]:
        return {}

"""``TieredCheckpointIO``: a Lightning ``CheckpointIO`` plugin that snapshots each checkpoint into host memory
and writes it in the background, as a ``ckpt`` checkpoint directory at the path Lightning names."""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ...api import Checkpointer
from ...format import COMMIT_NAME, fsync_dir, fsync_file
from ...pipeline import SaveHandle
from ...policy import Retention
from ...tiers import LocalTier
from ._path_tier import _PathTier
from ._reservation import (
    _SAVING_NAME,
    _committed_steps,
    _pending_here,
    _read_saving,
    _Reservation,
    _saver_alive,
    _Settler,
)
from ._storable import _map_location, _storable

__all__ = ["TieredCheckpointIO"]

log = logging.getLogger(__name__)


# Top-level key under which TieredCheckpointIO records the keys it left out (on_unsupported="skip").
_DROPPED_KEY = "tierckpt_dropped"


class TieredCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ``ckpt``: snapshot now, persist in the background.

    ``Trainer(plugins=[TieredCheckpointIO()])`` routes ``trainer.save_checkpoint``
    and ``ModelCheckpoint`` through it. Contract:

    * ``save_checkpoint(checkpoint, path)`` returns once the checkpoint's
      tensors are being copied into a host buffer; the training loop goes on
      (the next ``optimizer.step()`` waits for the copy) and a background
      thread writes ``path``. Through ``trainer.save_checkpoint`` (every
      ``ModelCheckpoint`` save) the call returns once the copy has landed, so
      in-place changes made next (a ``WeightAveraging`` callback's, the
      caller's) are not in the checkpoint; called directly, change none of its
      tensors in place before ``checkpointer.wait_staged()`` (or the save
      fails with ``TornSnapshotError``). ``path`` becomes a **directory** in
      the ``ckpt`` format (one committed step inside; ``ckpt verify PATH`` checks it).
      It exists from the moment ``save_checkpoint`` returns (so
      ``ModelCheckpoint``'s ``-vN`` names never collide), holding only a
      ``SAVING`` record until the write commits: no loader takes it for a
      checkpoint before. A failed save removes what it created there.
      Saving to an existing path replaces it once the new checkpoint is
      committed, so a crash leaves either the old or the new one; a symbolic
      link there is replaced by the checkpoint (its target is not written),
      and put back if the save fails; a regular file there is refused
      (``FileExistsError``).
    * ``load_checkpoint(path, map_location)`` first waits for the saves of
      ``path`` pending in this process (through any ``TieredCheckpointIO``;
      through a symbolic link, the saves of its target), then, while another
      process's save of it is pending (its ``SAVING`` record), for that save
      to commit, at most ``pending_save_timeout`` seconds (``TimeoutError``
      naming the path and the saving process) and not at all once that
      process is gone. It then verifies every chunk's checksum and returns
      the checkpoint dict (tensors on the device they were saved from, or as
      ``map_location`` says). Mappings come back as plain dicts.
    * ``remove_checkpoint(path)`` waits for a pending save of ``path``, then
      deletes it. A symbolic link is removed itself, at once; what it points
      to is never touched.
    * ``teardown()`` (called by Lightning at the end of ``fit``, also through
      Lightning's ``AsyncCheckpointIO`` wrapper) waits until every save is
      durable and raises the first failure; a later save starts a new writer.

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
        pending_save_timeout: seconds ``load_checkpoint`` waits for a save of
            the path pending in another process to commit (default 600).

    Paths are local (a remote URL raises ``ValueError``). Loading a file
    written by another ``CheckpointIO`` (a ``torch.save`` pickle) is refused.
    ``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` to the newest
    checkpoint directory, or copies it where the file system refuses links.
    A copy of the plugin (``copy.deepcopy``, or the Trainer that
    ``strategy="ddp_spawn"`` sends to its workers) has the same settings and
    none of the saves: those in flight stay with the original.
    """

    def __init__(
        self,
        *,
        max_in_flight: int = 1,
        host_memory_limit: int | None = None,
        on_unsupported: str = "error",
        pending_save_timeout: float = 600.0,
    ) -> None:
        if on_unsupported not in ("error", "skip"):
            raise ValueError(f"on_unsupported must be 'error' or 'skip', got {on_unsupported!r}")
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
        if (
            isinstance(pending_save_timeout, bool)
            or not isinstance(pending_save_timeout, (int, float))
            or not pending_save_timeout >= 0
        ):
            raise ValueError(
                f"pending_save_timeout must be a number of seconds >= 0, got {pending_save_timeout!r}"
            )
        self.max_in_flight = max_in_flight
        self.host_memory_limit = host_memory_limit
        self.on_unsupported = on_unsupported
        self.pending_save_timeout = float(pending_save_timeout)
        self._ck: Checkpointer | None = None
        self._tier: _PathTier | None = None
        self._settler: _Settler | None = None
        # saves not yet known to be finished: (real path, handle)
        self._in_flight: list[tuple[str, SaveHandle]] = []
        self._seq = 0
        self._lock = threading.Lock()  # the fields above
        self._save_lock = (
            threading.Lock()
        )  # one save_checkpoint at a time (AsyncCheckpointIO may call from a thread)

    # Copies (copy.deepcopy of a Trainer, a callback holding one) and the process a launcher starts
    # (strategy="ddp_spawn" sends the Trainer to each worker) get the settings, never the engine: its buffers,
    # threads and saves in flight stay with this instance; a copy starts its own writer on its first save.
    _SETTINGS = ("max_in_flight", "host_memory_limit", "on_unsupported", "pending_save_timeout")

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in self._SETTINGS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**{k: state[k] for k in self._SETTINGS})

    # The tier class that writes each checkpoint directory (tests put a slow or failing subclass here).
    _local_tier: type[LocalTier] = LocalTier

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The engine behind the saves (``None`` before the first save and after ``teardown``)."""
        return self._ck

    # -- CheckpointIO ------------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` and write it to the directory ``path`` in the background."""
        if storage_options is not None:
            raise TypeError(
                "TieredCheckpointIO.save_checkpoint does not take storage_options; pass "
                f"storage_options=None (got {storage_options!r})"
            )
        target = self._local_path(path)
        dropped: list[str] = []
        state = _storable(dict(checkpoint), "checkpoint", self.on_unsupported, dropped)
        if dropped:
            state[_DROPPED_KEY] = dropped
            log.warning(
                "TieredCheckpointIO left out of %s values that need pickle (on_unsupported='skip'): %s",
                target,
                ", ".join(dropped),
            )
        with self._save_lock:
            ck, tier, settler = self._checkpointer(target)
            step = self._engine_step(checkpoint)
            # The tier maps engine steps to paths, so a step is in flight once at a time: an earlier save with
            # this step (last.ckpt after epoch=...-step=N.ckpt, say) is written first. With one host buffer the
            # save would wait for it anyway. Its failure, if any, is raised by teardown.
            with self._lock:
                self._in_flight = [(k, h) for k, h in self._in_flight if not h.done()]
                same = [h for _, h in self._in_flight if h.step == step]
            for h in same:
                _wait_quietly(h)
            res = _Reservation(target, step)
            tier.target(step, res)
            try:
                handle = ck.save(step, state)
                if handle.status == "skipped":  # not with if_busy="wait"; kept as a guard against silent loss
                    raise RuntimeError(f"the save of {target} was skipped")
            except BaseException as e:
                tier.forget(step)
                res.settle(e)
                raise
            with self._lock:
                self._in_flight.append((res.key, handle))
            settler.watch(handle, res)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint directory ``path`` (``weights_only`` is moot: nothing is unpickled)."""
        target = self._local_path(path)
        deadline = time.monotonic() + self.pending_save_timeout
        waited = self._wait_for(target, str(path), deadline)
        self._wait_for_other_process(target, str(path), deadline)
        failed = next((r.error for r in waited if r.error is not None), None)
        if not target.exists():
            if failed is not None:
                raise FileNotFoundError(
                    f"checkpoint {str(path)!r} not found: its save failed ({failed})"
                ) from failed
            raise FileNotFoundError(f"checkpoint {str(path)!r} not found")
        if not target.is_dir():
            raise ValueError(
                f"{str(path)!r} is a file, not a checkpoint directory written by TieredCheckpointIO "
                "(files written by torch.save need pickle, which this plugin never uses); pass the "
                "path of a checkpoint saved through TieredCheckpointIO"
            )
        # the checkpoint's own keys: restore(strict=False) loads only keys the state already has
        state: dict[str, Any] = dict.fromkeys(_saved_keys(target))
        # Lightning decides which ranks save and load which paths: no agreement between ranks here
        with Checkpointer(local_dir=target, keep=_keep_all(), collective=False) as reader:
            step = reader.restore(state, strict=False)
        if step is None:
            why = f"its save failed ({failed})" if failed is not None else "the save did not finish"
            raise FileNotFoundError(
                f"{str(path)!r} holds no committed checkpoint (no {COMMIT_NAME} file: {why})"
            )
        dropped = state.pop(_DROPPED_KEY, None)
        if dropped:
            log.info(
                "checkpoint %s was saved without these values (on_unsupported='skip'): %s",
                target,
                ", ".join(map(str, dropped)),
            )
        return _map_location(state, map_location)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path`` once any pending save of it is written; no-op if absent.

        A symbolic link is removed at once, never what it points to.
        """
        target = self._local_path(path)
        if not target.is_symlink():
            self._wait_for(target, str(path), time.monotonic() + self.pending_save_timeout)
        if target.is_symlink():
            target.unlink(missing_ok=True)
        elif target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()

    def teardown(self) -> None:
        """Wait until every save is durable, stop the writer; raises the first failure."""
        with self._lock:
            ck, settler = self._ck, self._settler
            self._ck, self._tier, self._settler, self._in_flight = None, None, None, []
        if ck is None:
            return
        try:
            ck.close()
        finally:
            settler.stop()  # every save has ended: their reservations are settled once it returns

    def _wait_copied(self) -> None:
        """Block until the tensors of the saves made so far are copied into host memory (the writes go on):
        from then on the caller may change them in place."""
        ck = self._ck
        if ck is not None:
            ck.wait_staged()

    def _link(self, filepath: str | os.PathLike, linkpath: str | os.PathLike) -> None:
        """Make ``linkpath`` a relative symbolic link to the checkpoint ``filepath``, or a copy of it where the
        file system refuses links (``ModelCheckpoint(save_last="link")``; Lightning copies a file there).

        What is at ``linkpath`` is removed first, as Lightning does (a link or a file unlinked, a directory
        removed: a save of it still pending is superseded, see :class:`_Reservation`). The copy waits for
        ``filepath``'s pending save, takes its committed checkpoint, flushed to stable storage under a
        temporary name and renamed to ``linkpath``: a crash leaves no partial ``linkpath``.
        """
        target, link = self._local_path(filepath), self._local_path(linkpath)
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)
        try:
            os.symlink(os.path.relpath(target, link.parent), link)
            return
        except OSError as e:
            log.info("could not link %s to %s (%s): copying the checkpoint instead", link, target, e)
        deadline = time.monotonic() + self.pending_save_timeout
        waited = self._wait_for(target, str(filepath), deadline)
        self._wait_for_other_process(target, str(filepath), deadline)
        failed = next((r.error for r in waited if r.error is not None), None)
        if not _committed_steps(target):
            why = f": its save failed ({failed})" if failed is not None else ""
            raise FileNotFoundError(
                errno.ENOENT, f"no committed checkpoint to copy to {link}{why}", str(target)
            )
        _copy_checkpoint(target, link)

    # -- helpers -------------------------------------------------------------------------------------
    def _checkpointer(self, target: Path) -> tuple[Checkpointer, _PathTier, _Settler]:
        with self._lock:
            if self._ck is None:
                # The tier's own root is never written (each save goes to its path); the checkpoint's parent is
                # a directory Lightning creates anyway.
                self._tier = _PathTier(target.parent, self._local_tier)
                self._ck = Checkpointer(
                    local_dir=self._tier,
                    keep=_keep_all(),
                    max_in_flight=self.max_in_flight,
                    if_busy="wait",
                    host_memory_limit=self.host_memory_limit,
                    on_unsupported=self.on_unsupported,
                    collective=False,
                )
                self._settler = _Settler()
            assert self._tier is not None and self._settler is not None
            return self._ck, self._tier, self._settler

    def _engine_step(self, checkpoint: Mapping[str, Any]) -> int:
        # The step directory inside the checkpoint is named after the trainer's global step (what
        # `ckpt ls PATH` shows); a checkpoint dict without one gets a sequence number.
        step = checkpoint.get("global_step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
        with self._lock:
            self._seq += 1
            return self._seq

    def _wait_for(self, target: Path, shown: str, deadline: float) -> list[_Reservation]:
        """Wait until the saves of ``target`` (through a link: of its target) made in this process have ended.

        A save made through this instance is waited for however long it takes, and its failure raised; one
        made through another instance until ``deadline`` (then ``TimeoutError``). Returns the reservations
        of the other instances' saves, settled.
        """
        key = os.path.realpath(target)
        with self._lock:
            mine = [h for k, h in self._in_flight if k == key]
            self._in_flight = [(k, h) for k, h in self._in_flight if k != key]
        for h in mine:
            h.wait()
        pending = _pending_here(key)
        for r in pending:
            if not r.settled.wait(max(0.0, deadline - time.monotonic())):
                raise self._still_saving(
                    shown,
                    target,
                    f"another TieredCheckpointIO of this process (pid {os.getpid()}, step {r.step})",
                )
        return pending

    def _wait_for_other_process(self, target: Path, shown: str, deadline: float) -> None:
        """While ``target`` holds the ``SAVING`` record of a live process, wait for it to go (until ``deadline``)."""
        marker = target / _SAVING_NAME
        pause = 0.01
        while True:
            record = _read_saving(marker)
            if not record:
                return
            if not _saver_alive(record):
                log.warning(
                    "%s was left by a save that can no longer finish (pid %s on this host is gone); loading "
                    "what is committed there",
                    marker,
                    record.get("pid"),
                )
                return
            left = deadline - time.monotonic()
            if left <= 0:
                who = (
                    f"pid {record.get('pid')} on host {record.get('host')!r} (step {record.get('step')})"
                    if "unreadable" not in record
                    else "a process its unreadable record does not name"
                )
                raise self._still_saving(shown, target, who)
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.5)

    def _still_saving(self, shown: str, target: Path, who: str) -> TimeoutError:
        return TimeoutError(
            errno.ETIMEDOUT,
            f"checkpoint {shown!r} is still being saved by {who}: waited {self.pending_save_timeout:g} "
            "s for it to commit. Pass TieredCheckpointIO(pending_save_timeout=...) to wait longer, or "
            f"delete {target / _SAVING_NAME} if that save is known to be dead",
            str(target),
        )

    @staticmethod
    def _local_path(path: str | os.PathLike) -> Path:
        s = os.fspath(path)
        if "://" in s and not s.startswith("file://"):
            raise ValueError(
                f"TieredCheckpointIO writes local paths only; got {s!r}: point ModelCheckpoint's "
                "dirpath (or Trainer(default_root_dir=...)) at a local directory"
            )
        return Path(s.removeprefix("file://")).expanduser().absolute()


def _wait_quietly(handle: SaveHandle) -> None:
    try:
        handle._wait_quietly()  # not counted as raised: the Checkpointer raises it at close (teardown)
    except Exception:
        pass  # logged when it happened


def _keep_all() -> Retention:
    # Lightning (ModelCheckpoint's save_top_k) decides what to delete, through remove_checkpoint.
    return Retention(local=None)


def _copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy the checkpoint directory ``src`` (no ``SAVING`` record) to ``dst``, which must not exist: every file
    fsynced under a temporary name next to ``dst``, then renamed to it."""
    tmp = dst.with_name(f".{dst.name}.copy-{secrets.token_hex(6)}")

    def copy(a: str, b: str) -> None:
        shutil.copy2(a, b)
        fsync_file(b)

    try:
        shutil.copytree(
            src, tmp, copy_function=copy, ignore=shutil.ignore_patterns(_SAVING_NAME, f".{_SAVING_NAME}.*")
        )
        for d, _, _ in os.walk(tmp, topdown=False):
            fsync_dir(d)
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _saved_keys(target: Path) -> list[str]:
    """Top-level keys of the newest committed step under ``target`` whose records validate (objects
    saved through ``state_dict()`` excepted: there is no object to load them into)."""
    from ...errors import CheckpointError

    tier = LocalTier(target)
    for s in tier.committed_steps():
        try:
            tree = tier.open(s)[1].tree
        except (CheckpointError, OSError):
            continue
        return [k for k, v in tree.items() if not (isinstance(v, dict) and "$obj" in v)]
    return []

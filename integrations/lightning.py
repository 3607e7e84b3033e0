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

This module imports ``lightning``; ``import ckpt`` does not import it.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import os
import queue
import secrets
import shutil
import socket
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import lightning
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from .. import procs
from ..api import Checkpointer
from ..errors import RefusedStateError
from ..format import COMMIT_NAME, Manifest, fsync_dir, fsync_file, parse_step_dir, step_dir_name
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
                        "str, int, float, bool or None. Pass on_unsupported='skip' to leave such entries out.",
                        path=path)
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
            "to leave such values out of the checkpoint (they are then missing when it is loaded).", path=path)
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

# The file in a checkpoint directory while a save of it is being written: JSON naming the process, host and
# step saving it. Never a COMMIT, so no reader takes the directory for a checkpoint; removed when the save ends.
_SAVING_NAME = "SAVING"

# Reservations of this process not yet settled, by the real path of their directory; the lock also orders
# every reservation's file system changes against the others' (a save and the end of an earlier one there).
_reservations: dict[str, list["_Reservation"]] = {}
_reservations_lock = threading.Lock()
_PROC_FD = Path("/proc/self/fd")


class _Reservation:
    """A checkpoint path held by one save from the moment ``save_checkpoint`` returns until the save ends.

    Taking it makes ``path`` a directory (``ModelCheckpoint`` decides on ``-vN``
    names by whether a path exists) holding :data:`_SAVING_NAME`; a symbolic
    link there is replaced (its target, another checkpoint, is never written
    through). The directory is held open, and on Linux written through that
    descriptor (``/proc/self/fd/N``): a directory removed or replaced by a link
    while the save is pending (``ModelCheckpoint(save_last="link")`` does that
    to a ``last.ckpt`` directory itself) is never written through the new
    name. Settling it removes ``SAVING`` if it is still this save's. A save
    that failed also removes the directory when it created it and nothing was
    committed there since, and puts back the link it replaced; an older
    checkpoint in the directory is left as it was.
    """

    def __init__(self, path: Path, step: int) -> None:
        self.path = path
        self.step = step
        self.token = secrets.token_hex(8)
        self.error: BaseException | None = None
        self.settled = threading.Event()
        self._link: str | None = None
        self._created = False
        self._fd: int | None = None
        with _reservations_lock:
            self._take()
            self.key = os.path.realpath(path)
            _reservations.setdefault(self.key, []).append(self)

    def _take(self) -> None:
        path = self.path
        if path.is_symlink():
            self._link = os.readlink(path)
            path.unlink()
        elif path.exists() and not path.is_dir():
            raise FileExistsError(errno.EEXIST, "a file is in the way of a checkpoint: TieredCheckpointIO saves "
                                  "each checkpoint as a directory and does not replace a file (a torch.save "
                                  "checkpoint, say); move the file away or save to another path", str(path))
        self._created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
            record = {"pid": os.getpid(), "host": socket.gethostname(), "step": self.step,
                      "since_unix": time.time(), "token": self.token}
            tmp = path / f".{_SAVING_NAME}.{self.token}"
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path / _SAVING_NAME)   # readers see the whole record or none
        except BaseException:
            self._undo()
            self._close()
            raise

    @property
    def root(self) -> Path:
        """Where the save writes: the directory it took, whatever its name now points to (Linux)."""
        return _PROC_FD / str(self._fd) if _PROC_FD.is_dir() and self._fd is not None else self.path

    def superseded(self) -> bool:
        """Whether the directory was removed or replaced (by a link, say) since the save took it."""
        try:
            now = os.stat(self.path, follow_symlinks=False)
            held = os.fstat(self._fd) if self._fd is not None else now
        except FileNotFoundError:
            return True
        return not stat.S_ISDIR(now.st_mode) or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def settle(self, error: BaseException | None) -> None:
        """End the reservation: the save committed (``error`` None) or failed (idempotent)."""
        with _reservations_lock:
            if self.settled.is_set():
                return
            try:
                if not self.superseded():   # else the name is someone else's now: nothing of this save is there
                    marker = self.path / _SAVING_NAME
                    if _read_saving(marker).get("token") == self.token:
                        marker.unlink(missing_ok=True)
                    if error is not None:
                        self._undo()
            except OSError as e:
                log.warning("could not end the reservation of %s: %s", self.path, e)
            finally:
                self._close()
                self.error = error
                mine = _reservations.get(self.key, [])
                if self in mine:
                    mine.remove(self)
                if not mine:
                    _reservations.pop(self.key, None)
                self.settled.set()

    def _undo(self) -> None:
        """After a failure: the path as it was before this save (another save's reservation aside)."""
        path = self.path
        if self._created and path.is_dir() and not path.is_symlink() and not (path / _SAVING_NAME).exists() \
                and not _committed_steps(path):
            shutil.rmtree(path, ignore_errors=True)
        if self._link is not None and not os.path.lexists(path):
            os.symlink(self._link, path)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_saving(marker: Path) -> dict[str, Any]:
    """The record of ``SAVING`` (``{}`` when absent; ``{"unreadable": True}`` when it is not a record)."""
    try:
        record = json.loads(marker.read_bytes()[:4096])
    except (FileNotFoundError, NotADirectoryError):   # no record, or no directory to hold one
        return {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return record if isinstance(record, dict) else {"unreadable": True}


def _committed_steps(path: Path) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    steps = [s for s in map(parse_step_dir, names) if s is not None]
    return [s for s in steps if (path / step_dir_name(s) / COMMIT_NAME).is_file()]


def _saver_alive(record: dict[str, Any]) -> bool:
    """Whether the process that wrote a ``SAVING`` record may still commit (True when it cannot be told)."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool):
        return True
    if pid == os.getpid():   # this process: alive only if one of its reservations still holds the token
        with _reservations_lock:
            return any(r.token == record.get("token") for rs in _reservations.values() for r in rs)
    since = record.get("since_unix")   # a live process that started after the record is another with its pid
    return procs.alive(pid, since if isinstance(since, (int, float)) and not isinstance(since, bool) else None)


def _renamed(e: OSError, root: Path, path: Path) -> OSError:
    """``e`` with the paths under ``root`` (``/proc/self/fd/N``) named under ``path``, the checkpoint's path."""
    if root == path or e.errno is None:
        return e

    def name(x: Any) -> Any:
        return str(x).replace(str(root), str(path), 1) if isinstance(x, (str, os.PathLike)) else x

    return OSError(e.errno, name(e.strerror), name(e.filename), None, name(e.filename2))


def _pending_here(key: str) -> list[_Reservation]:
    with _reservations_lock:
        return list(_reservations.get(key, ()))


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
        log.warning("%s was removed or replaced while its save (step %d) was pending: that save is not written "
                    "there", res.path, res.step)
        res.settle(None)
        return 0.0

    def committed_steps(self) -> list[int]:
        return []

    def acquire_owner(self) -> None:
        return None   # no steps of its own in this root to guard: each save goes to a directory Lightning names

    def all_step_dirs(self) -> dict[int, Path]:
        return {}


class _Settler:
    """Ends the reservations of saves that failed before reaching the tier (a torn snapshot, say), in save
    order (the engine finishes saves in order)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ckpt-lightning-settle", daemon=True)
        self._thread.start()

    def watch(self, handle: SaveHandle, res: _Reservation) -> None:
        self._queue.put((handle, res))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            handle, res = job
            try:
                err = handle._wait_quietly()   # the plugin's own wait: the user still hears of the failure
            except BaseException as e:         # noqa: BLE001
                err = e
            res.settle(err)


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

    def __init__(self, *, max_in_flight: int = 1, host_memory_limit: int | None = None,
                 on_unsupported: str = "error", pending_save_timeout: float = 600.0) -> None:
        if on_unsupported not in ("error", "skip"):
            raise ValueError(f"on_unsupported must be 'error' or 'skip', got {on_unsupported!r}")
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
        if isinstance(pending_save_timeout, bool) or not isinstance(pending_save_timeout, (int, float)) \
                or not pending_save_timeout >= 0:
            raise ValueError(f"pending_save_timeout must be a number of seconds >= 0, got {pending_save_timeout!r}")
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
        self._lock = threading.Lock()        # the fields above
        self._save_lock = threading.Lock()   # one save_checkpoint at a time (AsyncCheckpointIO may call from a thread)

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
                if handle.status == "skipped":   # not with if_busy="wait"; kept as a guard against silent loss
                    raise RuntimeError(f"the save of {target} was skipped")
            except BaseException as e:
                tier.forget(step)
                res.settle(e)
                raise
            with self._lock:
                self._in_flight.append((res.key, handle))
            settler.watch(handle, res)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint directory ``path`` (``weights_only`` is moot: nothing is unpickled)."""
        target = self._local_path(path)
        deadline = time.monotonic() + self.pending_save_timeout
        waited = self._wait_for(target, str(path), deadline)
        self._wait_for_other_process(target, str(path), deadline)
        failed = next((r.error for r in waited if r.error is not None), None)
        if not target.exists():
            if failed is not None:
                raise FileNotFoundError(f"checkpoint {str(path)!r} not found: its save failed ({failed})") from failed
            raise FileNotFoundError(f"checkpoint {str(path)!r} not found")
        if not target.is_dir():
            raise ValueError(f"{str(path)!r} is a file, not a checkpoint directory written by TieredCheckpointIO "
                             "(files written by torch.save need pickle, which this plugin never uses); pass the "
                             "path of a checkpoint saved through TieredCheckpointIO")
        # the checkpoint's own keys: restore(strict=False) loads only keys the state already has
        state: dict[str, Any] = dict.fromkeys(_saved_keys(target))
        # Lightning decides which ranks save and load which paths: no agreement between ranks here
        with Checkpointer(local_dir=target, keep=_keep_all(), collective=False) as reader:
            step = reader.restore(state, strict=False)
        if step is None:
            why = f"its save failed ({failed})" if failed is not None else "the save did not finish"
            raise FileNotFoundError(f"{str(path)!r} holds no committed checkpoint (no {COMMIT_NAME} file: {why})")
        dropped = state.pop(_DROPPED_KEY, None)
        if dropped:
            log.info("checkpoint %s was saved without these values (on_unsupported='skip'): %s",
                     target, ", ".join(map(str, dropped)))
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
            settler.stop()   # every save has ended: their reservations are settled once it returns

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
            raise FileNotFoundError(errno.ENOENT, f"no committed checkpoint to copy to {link}{why}", str(target))
        _copy_checkpoint(target, link)

    # -- helpers -------------------------------------------------------------------------------------
    def _checkpointer(self, target: Path) -> tuple[Checkpointer, _PathTier, _Settler]:
        with self._lock:
            if self._ck is None:
                # The tier's own root is never written (each save goes to its path); the checkpoint's parent is
                # a directory Lightning creates anyway.
                self._tier = _PathTier(target.parent, self._local_tier)
                self._ck = Checkpointer(local_dir=self._tier, keep=_keep_all(), max_in_flight=self.max_in_flight,
                                        if_busy="wait", host_memory_limit=self.host_memory_limit,
                                        on_unsupported=self.on_unsupported, collective=False)
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
                raise self._still_saving(shown, target, f"another TieredCheckpointIO of this process (pid "
                                         f"{os.getpid()}, step {r.step})")
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
                log.warning("%s was left by a save that can no longer finish (pid %s on this host is gone); loading "
                            "what is committed there", marker, record.get("pid"))
                return
            left = deadline - time.monotonic()
            if left <= 0:
                who = (f"pid {record.get('pid')} on host {record.get('host')!r} (step {record.get('step')})"
                       if "unreadable" not in record else "a process its unreadable record does not name")
                raise self._still_saving(shown, target, who)
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.5)

    def _still_saving(self, shown: str, target: Path, who: str) -> TimeoutError:
        return TimeoutError(errno.ETIMEDOUT,
                            f"checkpoint {shown!r} is still being saved by {who}: waited {self.pending_save_timeout:g} "
                            "s for it to commit. Pass TieredCheckpointIO(pending_save_timeout=...) to wait longer, or "
                            f"delete {target / _SAVING_NAME} if that save is known to be dead", str(target))

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


def _copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy the checkpoint directory ``src`` (no ``SAVING`` record) to ``dst``, which must not exist: every file
    fsynced under a temporary name next to ``dst``, then renamed to it."""
    tmp = dst.with_name(f".{dst.name}.copy-{secrets.token_hex(6)}")

    def copy(a: str, b: str) -> None:
        shutil.copy2(a, b)
        fsync_file(b)

    try:
        shutil.copytree(src, tmp, copy_function=copy,
                        ignore=shutil.ignore_patterns(_SAVING_NAME, f".{_SAVING_NAME}.*"))
        for d, _, _ in os.walk(tmp, topdown=False):
            fsync_dir(d)
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    except ImportError:   # pragma: no cover - every supported Lightning has it
        return
    if getattr(AsyncCheckpointIO, "_tierckpt_routed", False):
        return
    wrapped_save, wrapped_teardown = AsyncCheckpointIO.save_checkpoint, AsyncCheckpointIO.teardown

    @functools.wraps(wrapped_save)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
        base = _tiered_base(self, AsyncCheckpointIO)   # another wrapper in between keeps its own save
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


_route_async_checkpoint_io()


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

    _link_checkpoint._tierckpt_routed = True   # type: ignore[attr-defined]
    ModelCheckpoint._link_checkpoint = staticmethod(_link_checkpoint)


_route_model_checkpoint_link()


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

    save_checkpoint._tierckpt_routed = True   # type: ignore[attr-defined]
    Trainer.save_checkpoint = save_checkpoint


_route_trainer_save_checkpoint()


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

    pl_load._tierckpt_routed = True   # type: ignore[attr-defined]
    saving.pl_load = pl_load


def _is_tiered_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory a :class:`TieredCheckpointIO` save made (a step directory, or a save
    of it still pending, inside)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return _SAVING_NAME in names or any(parse_step_dir(n) is not None for n in names)


_point_load_from_checkpoint()


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
        self._listening = False   # this callback installed the Checkpointer's save-request handlers
        self._hooked: tuple[LightningModule, bool, Any] | None = None   # the module whose batch-end hook is wrapped
        self._batch_ended = False
        self._restored_lrs: list[list[Any]] | None = None   # the optimizers' learning rates as restored
        self._epoch_start_owed = False   # restored at an epoch's end: the next epoch's start hooks are owed

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
                           for i, c in enumerate(trainer.lr_scheduler_configs)
                           if id(c.scheduler) not in _callback_schedulers(trainer)},
            "fit_loop": part("fit_loop", trainer.fit_loop),
            "callbacks": _Part("callbacks", lambda: self._callback_states(trainer),
                               lambda sd: self._load_callback_states(trainer, sd), mode),
            "precision": part("precision", trainer.precision_plugin),
            "datamodule": _Part("datamodule", lambda: _datamodule_state(trainer),
                                lambda sd: _load_datamodule_state(trainer, sd), mode),
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
        self._hook_batch_end(trainer, pl_module)
        self._restored_lrs = None
        self._epoch_start_owed = False
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
        more = ((loop.max_epochs is None or loop.max_epochs < 0 or trainer.current_epoch < loop.max_epochs)
                and (trainer.max_steps < 0 or trainer.global_step < trainer.max_steps))
        if owed and more and (loop.restarted_mid_epoch or loop.restarted_on_epoch_end):
            # Restored from a checkpoint taken at an epoch's last batch: the uninterrupted run went on with the
            # next epoch's on_train_epoch_start, which Lightning (2.6) skips when it resumes from a batch-end
            # checkpoint. Callbacks keep work there (StochasticWeightAveraging averages the weights and makes
            # its LR scheduler): run the hooks once, as the uninterrupted run did.
            from lightning.pytorch.trainer import call

            call._call_callback_hooks(trainer, "on_train_epoch_start")
            call._call_lightning_module_hook(trainer, "on_train_epoch_start")
        ck = self.checkpointer
        if ck.signals.save and ck._guard is None:   # after Lightning's own handlers; SIGTERM stays Lightning's
            ck._listen(preempt=False)
            self._listening = True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
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
            self._ck._unlisten()   # before Lightning reinstalls the handlers it found
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

        on_train_batch_end._tierckpt_callback = self   # type: ignore[attr-defined]
        pl_module.on_train_batch_end = on_train_batch_end   # type: ignore[method-assign]
        self._hooked = (pl_module, had, inner)

    def _unhook_batch_end(self) -> None:
        if self._hooked is None:
            return
        module, had, inner = self._hooked
        self._hooked = None
        if getattr(vars(module).get("on_train_batch_end"), "_tierckpt_callback", None) is self:
            if had:
                module.on_train_batch_end = inner   # type: ignore[method-assign]
            else:
                del module.on_train_batch_end

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
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
                log.warning("SIGTERM in the middle of a gradient accumulation: the accumulated gradients are not "
                            "saved; the newest checkpoint is step %d", self._last_saved_step)
            ck.wait()      # durable before Lightning stops the run
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
        if self.save_on_train_end and trainer.global_step != self._last_saved_step and trainer.global_step > 0:
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
        self._unlisten()
        self._unhook_batch_end()
        if self._ck is None:
            return
        if self._owned:
            ck, self._ck = self._ck, None
            ck.close()
        else:
            self._ck.wait()


def _epoch_or_run_ends(trainer: Trainer) -> str | None:
    """At a batch end: ``"run"`` when it is the last batch of the last epoch, ``"epoch"`` when it is an
    epoch's last batch, else ``None``."""
    loop = trainer.fit_loop
    epoch_loop = loop.epoch_loop
    last = bool(epoch_loop.batch_progress.is_last_batch) or (
        epoch_loop.batch_progress.current.ready >= trainer.num_training_batches)
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

    return {id(cb._swa_scheduler) for cb in trainer.callbacks
            if isinstance(cb, StochasticWeightAveraging) and getattr(cb, "_swa_scheduler", None) is not None}


def _averaged_models(trainer: Trainer) -> dict[str, Any]:
    """``WeightAveraging`` callbacks' averaged models (Lightning 2.6), by ``state_key``: the callback keeps
    them out of its ``state_dict`` (it writes them through ``on_save_checkpoint``, which the callback does
    not call). Only present when there are some, so checkpoints without them restore as before."""
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:   # lightning < 2.6
        return {}
    models = {cb.state_key: cb._average_model for cb in trainer.callbacks
              if isinstance(cb, WeightAveraging) and getattr(cb, "_average_model", None) is not None}
    return {"averaged_models": models} if models else {}


def _datamodule_state(trainer: Trainer) -> Any:
    dm = trainer.datamodule
    return dm.state_dict() if dm is not None else None


def _load_datamodule_state(trainer: Trainer, sd: Any) -> None:
    dm = trainer.datamodule
    if dm is not None and sd is not None:
        dm.load_state_dict(sd)


def _saved_keys(target: Path) -> list[str]:
    """Top-level keys of the newest committed step under ``target`` whose records validate (objects
    saved through ``state_dict()`` excepted: there is no object to load them into)."""
    from ..errors import CheckpointError

    tier = LocalTier(target)
    for s in tier.committed_steps():
        try:
            tree = tier.open(s)[1].tree
        except (CheckpointError, OSError):
            continue
        return [k for k, v in tree.items() if not (isinstance(v, dict) and "$obj" in v)]
    return []

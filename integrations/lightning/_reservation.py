"""A checkpoint path held by a pending :class:`~ckpt.integrations.lightning.TieredCheckpointIO` save.

The ``SAVING`` record a save leaves in its directory until it commits, the reservations of this process
(what loads and removals of a path wait for), whether the process behind another's record may still
commit, and the thread that ends the reservations of saves that failed before reaching the tier.
"""

from __future__ import annotations

import errno
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
from pathlib import Path
from typing import Any

from ... import procs
from ...format import COMMIT_NAME, parse_step_dir, step_dir_name
from ...pipeline import SaveHandle

log = logging.getLogger(__name__)


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
            raise FileExistsError(
                errno.EEXIST,
                "a file is in the way of a checkpoint: TieredCheckpointIO saves "
                "each checkpoint as a directory and does not replace a file (a torch.save "
                "checkpoint, say); move the file away or save to another path",
                str(path),
            )
        self._created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "step": self.step,
                "since_unix": time.time(),
                "token": self.token,
            }
            tmp = path / f".{_SAVING_NAME}.{self.token}"
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path / _SAVING_NAME)  # readers see the whole record or none
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
                if (
                    not self.superseded()
                ):  # else the name is someone else's now: nothing of this save is there
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
        if (
            self._created
            and path.is_dir()
            and not path.is_symlink()
            and not (path / _SAVING_NAME).exists()
            and not _committed_steps(path)
        ):
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
    except (FileNotFoundError, NotADirectoryError):  # no record, or no directory to hold one
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
    if pid == os.getpid():  # this process: alive only if one of its reservations still holds the token
        with _reservations_lock:
            return any(r.token == record.get("token") for rs in _reservations.values() for r in rs)
    since = record.get("since_unix")  # a live process that started after the record is another with its pid
    return procs.alive(
        pid, since if isinstance(since, (int, float)) and not isinstance(since, bool) else None
    )


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
                err = handle._wait_quietly()  # the plugin's own wait: the user still hears of the failure
            except BaseException as e:  # noqa: BLE001
                err = e
            res.settle(err)

"""The local tier: one directory on this node's NVMe.

Write path (phase 2): in a staging directory beside the step's (a hidden
name that listing and retention never see), preallocate the rank's data file
(a full disk fails here, before any byte is written), write it from the host
buffer in parallel chunks with ``os.pwrite`` while checksumming each chunk in
the same thread, ``fsync``, write the manifest atomically, then ``COMMIT``
(temporary name, fsync, rename, fsync of the directory); then rename the
staging directory into place (an atomic exchange with a committed copy it
replaces), fsync the root, and move ``latest``. A committed step is therefore
never taken apart for a write: it is there, old or new, at every instant.

Ownership: one live writer per directory (:class:`OwnerLock`, an ``flock``
on ``.ckpt-lock``). Readers need no lock.

Read path (restore): validate ``COMMIT`` and the manifest, check the data
file's size, then read it in parallel chunks into a small ring of (pinned)
host buffers, verify each chunk's checksum before any of its bytes is used,
and scatter the bytes into the destination tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import json
import mmap
import logging
import os
import queue
import re
import secrets
import shutil
import socket
import stat
import threading
import time
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

from .. import knobs, procs
from ..commit import DirSink, publish, rank_record
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, LockedError
from ..format import (
    COMMIT_NAME,
    LATEST_NAME,
    Commit,
    Manifest,
    data_name,
    fsync_dir,
    manifest_name,
    open_regular,
    parse_step_dir,
    read_record,
    read_records,
    step_dir_name,
    write_atomic,
)
from ..integrity import checksum
from ..policy import Committed, Retention, Timeline, TimelineCopies
from ..scatter import Scatter
from .base import PersistingTier, StepInfo, StoredTier, Tier, register

__all__ = ["LocalTier", "OwnerLock", "LOCK_NAME", "linked", "owned", "remove_step_dir"]

log = logging.getLogger(__name__)

#: the file in a local_dir whose flock marks its live owner (never deleted: see OwnerLock)
LOCK_NAME = ".ckpt-lock"


@register
class LocalTier(PersistingTier, StoredTier, TimelineCopies):
    """Committed checkpoints under ``root`` (``root/step-XXXXXXXXX/``): the tier on this node's disk."""

    name = "local"
    nearness = 10
    refills = True  # a checkpoint restored from a farther tier is written here on the way

    needs = None  # every Checkpointer has one (local_dir)

    @classmethod
    def for_storage(cls, storage: Any, built: dict[str, Any], pool: Any, rank: int) -> "LocalTier | None":
        """The local tier of ``storage.local_dir`` (a directory, or a :class:`LocalTier` to use as it is)."""
        if cls.name != LocalTier.name:  # a tier registered as a subclass: made from its own setting
            return super().for_storage(storage, built, pool, rank)
        local_dir = storage.local_dir
        return local_dir if isinstance(local_dir, LocalTier) else cls(local_dir)

    def __init__(self, root: str | os.PathLike, rank: int = 0, world_size: int = 1) -> None:
        self.root = Path(root).expanduser()
        self.rank = rank
        self.world_size = world_size
        # what this process knows of each step here: True when it committed the step itself (checksums
        # from its own bytes, or every chunk checked against them for a copy) or read it back in full,
        # False when a read failed verification; retention keeps the newest True one
        self.verified: dict[int, bool] = {}
        self.timeline = Timeline()  # what a fresh write's COMMIT records (the Checkpointer sets it)
        self._copying: dict[int, Timeline] = {}
        self.owner: OwnerLock | None = None  # this directory's lock, once acquire_owner took it
        self.root.mkdir(parents=True, exist_ok=True)

    # -- listing ----------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def step_location(self, step: int) -> str:
        """The directory of ``step`` (:meth:`step_dir`) as text."""
        return str(self.step_dir(step))

    def committed_steps(self) -> list[int]:
        """Steps with a ``COMMIT`` here, newest first (not yet verified)."""
        steps = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        for name in names:
            s = parse_step_dir(name)
            if s is not None and (self.root / name / COMMIT_NAME).is_file():
                steps.append(s)
        return sorted(steps, reverse=True)

    def committed(self) -> list[Committed]:
        """Every committed step here with its timeline (read from its ``COMMIT``) and whether it is linked
        in. A ``COMMIT`` gone since the listing leaves its step out; one that fails its checks lists
        timeline 0 (a restore then finds it broken); one the disk fails to give (an I/O or permission
        error) lists timeline 0 with ``known=False``, so that retention deletes nothing meanwhile."""
        out = []
        for s in self.committed_steps():
            name = step_dir_name(s)
            path = self.root / name / COMMIT_NAME
            try:
                out.append(
                    Committed(
                        s,
                        Timeline.of(Commit.from_bytes(read_record(path), str(path))),
                        linked(self.root, name),
                    )
                )
            except FileNotFoundError:
                continue
            except CorruptCheckpointError:
                out.append(Committed(s, Timeline(), linked(self.root, name)))
            except OSError as e:
                log.warning("%s could not be read (%s): its timeline is not known", path, e)
                out.append(Committed(s, Timeline(), linked(self.root, name), known=False))
        return out

    def owns(self, step: int) -> bool:
        """Whether this tier may delete ``step``: ``False`` for a linked step (see :func:`linked`)."""
        return not linked(self.root, step_dir_name(step))

    def describe(self, step: int, timeline: Timeline | None = None) -> StepInfo:
        """The step directory, the bytes of its files, its ``COMMIT``'s modification time."""
        d = self.step_dir(step)
        try:
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            return StepInfo(str(d), size, (d / COMMIT_NAME).stat().st_mtime, self.world_size)
        except OSError:
            return StepInfo(str(d))

    def location(self) -> str:
        return str(self.root)

    def where(self, step: int) -> str:
        return f"{self.step_dir(step)}/{manifest_name(self.rank)}"

    def bytes_held(self) -> int | None:
        return sum(self.describe(s).nbytes or 0 for s in self.committed_steps())

    def capacity_bytes(self) -> int | None:
        """Free space on the file system of ``root`` plus what the committed steps take."""
        try:
            return shutil.disk_usage(self.root).free + (self.bytes_held() or 0)
        except OSError:
            return None

    def keep_of(self, keep: Retention) -> int | None:
        return keep.local

    def all_step_dirs(self) -> dict[int, Path]:
        out = {}
        for name in os.listdir(self.root):
            s = parse_step_dir(name)
            if s is not None:
                out[s] = self.root / name
        return out

    # -- write ------------------------------------------------------------------------------------
    def write(self, step: int, manifest: Manifest, data: memoryview) -> float:
        """Persist ``data`` (the rank's data file image) and commit; returns seconds spent.

        Fills ``manifest.chunks`` with the checksums computed on the way.
        """
        c = manifest.chunk_bytes
        return self.write_chunks(step, manifest, lambda i: data[i * c : (i + 1) * c], compute_checksums=True)

    def write_chunks(
        self,
        step: int,
        manifest: Manifest,
        chunk: Callable[[int], bytes | memoryview],
        compute_checksums: bool,
    ) -> float:
        """Persist the data file from ``chunk(i)`` (its ``i``-th chunk) and commit; returns seconds spent.

        With ``compute_checksums=False`` the manifest's checksums are kept, and the
        checksums computed while writing must match them or nothing is committed
        (a copy from the remote tier or from a peer rank). The copy is written and
        committed in a staging directory, then switched into place: a committed copy
        of ``step`` already there stays whole until the new one replaces it in one
        rename, and stays as it was when this write fails or the process dies. An
        exception raised by ``chunk`` (a download, say) is raised as it is.
        """
        t0 = time.perf_counter()
        d = self.step_dir(step)
        if linked(self.root, step_dir_name(step)):
            raise OSError(
                errno.ELOOP,
                f"step {step} of the local tier is a symbolic link (a checkpoint kept "
                "elsewhere, read-only): a save never writes through it",
                str(d),
            )
        self._still_owner()  # a fenced owner writes nothing, not even a staging directory (nor sweeps)
        self._sweep()
        stage = self.root / _staging_name(step, "new")
        _writing(stage, True)  # this process's own sweep leaves it alone while it is being written
        try:
            stage.mkdir(parents=True)  # parents: a local_dir removed since is made again, as before
            sums = self._write_data(
                stage / data_name(self.rank), manifest.data_bytes, manifest.chunk_bytes, chunk
            )
            if compute_checksums:
                manifest.chunks = sums
            elif sums != manifest.chunks:  # the writer's own checksums: bytes that differ are never committed
                i = (
                    next(i for i, (a, b) in enumerate(zip(sums, manifest.chunks)) if a != b)
                    if len(sums) == len(manifest.chunks)
                    else 0
                )
                raise CorruptCheckpointError(
                    f"{d / data_name(self.rank)}: bytes [{i * manifest.chunk_bytes}, "
                    f"{min((i + 1) * manifest.chunk_bytes, manifest.data_bytes)}) fail their checksum; not committed"
                )
            local = dataclasses.replace(
                manifest,
                codecs=None,
                stored_sizes=None,
                generation=None,
                rank=self.rank,
                world_size=self.world_size,
            )
            raw = local.to_bytes()
            commit = rank_record(
                step,
                self.rank,
                self.world_size,
                raw,
                manifest.data_bytes,
                self._copying.get(step, self.timeline),
            )
            publish(DirSink(stage), [(manifest_name(self.rank), raw)], commit.to_bytes())
            self._still_owner()
            self._switch(step, stage, d)  # the checkpoint exists (or is replaced) from here on
            self.verified[step] = True
        except _SourceError as e:  # the bytes could not be had (a download failed): not the disk's fault
            self._discard(stage)
            raise e.error from None
        except _Unsynced as u:  # in place and committed; only its durability is in doubt
            self._discard(stage)  # nothing, or the copy it replaced
            e = u.error
            raise OSError(
                e.errno,
                f"{e.strerror} while making step {step} durable in the local tier: it is in "
                f"place and committed (listed, and restored like any other), but the fsync of {self.root} "
                "that makes its rename survive a power loss failed, so it may be gone (with the older "
                "copy of this step it replaced, if any) after one; check the disk",
                str(d),
            ) from e
        except OSError as e:
            self._discard(stage)
            hint = (
                "free space there or point local_dir elsewhere"
                if e.errno in (errno.ENOSPC, errno.EDQUOT)
                else "the file is larger than this process may write (ulimit -f / RLIMIT_FSIZE) or the file "
                "system allows: raise that limit or point local_dir elsewhere"
                if e.errno == errno.EFBIG
                else f"{d.name} in local_dir is not a directory but has a checkpoint directory's name; "
                "move it out of local_dir"
                if e.errno == errno.ENOTDIR and os.path.lexists(d) and not os.path.isdir(d)
                else "check the local_dir path and its permissions"
            )
            at = f" at {e.filename}" if e.filename and str(e.filename) != str(d) else ""
            raise OSError(
                e.errno,
                f"{e.strerror}{at} while writing step {step} to the local tier (staged beside "
                f"it, then renamed into place; {hint}); older checkpoints are untouched",
                str(d),
            ) from e
        except BaseException:
            self._discard(stage)
            raise
        finally:
            _writing(stage, False)
        self._write_latest(step)
        return time.perf_counter() - t0

    def _switch(self, step: int, stage: Path, d: Path) -> None:
        """Move the committed staging directory ``stage`` to ``d``; a copy already at ``d`` is exchanged
        with it in one step (``renameat2(RENAME_EXCHANGE)``) and removed afterwards."""
        try:
            os.rename(stage, d)  # nothing at d (an empty directory is replaced too)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        else:
            _synced(self.root)
            return
        try:
            _exchange(stage, d)
        except OSError as e:
            if e.errno not in _NO_EXCHANGE:
                raise
            # No atomic exchange on this file system (NFS, say): two renames. A kill between them leaves the
            # old copy under its aside name, and the next write here (_sweep) moves it back.
            aside = self.root / _staging_name(step, "old")
            _writing(aside, True)
            try:
                os.rename(d, aside)
                try:
                    os.rename(stage, d)
                except BaseException:
                    os.rename(aside, d)
                    raise
                try:
                    _synced(self.root)
                finally:
                    self._discard(aside)
            finally:
                _writing(aside, False)
            return
        _synced(self.root)
        self._discard(stage)  # now the replaced copy: uncommitted first, then removed

    def _write_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` unless a newer step is committed (a promote of an older one).
        Advisory: a failure is logged, never undoes the commit."""
        try:
            if any(s > step for s in self.committed_steps()):
                return
            write_atomic(
                self.root / LATEST_NAME, (step_dir_name(step) + "\n").encode()
            )  # threads may race here
        except OSError as e:
            log.warning(
                "step %d is committed in %s, but %s could not be updated: %s", step, self.root, LATEST_NAME, e
            )

    def _sweep(self) -> None:
        """Tidy up after writers that died mid-write (on this host): remove their staging directories,
        and move back an old copy that a kill left aside between the two renames of a file system without
        an atomic exchange. Live writers' directories are left alone, so this is safe beside any of them."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        host = _host_tag()
        for name in names:
            t = _LATEST_TMP_RE.match(name)
            if t is not None:  # `latest` being replaced: by a writer that died, unless in use
                pid, path = int(t.group(1)), self.root / name
                with contextlib.suppress(OSError):
                    # this process's own: another thread may be replacing `latest` now, unless it is old
                    if (
                        (time.time() - os.stat(path).st_mtime > 60)
                        if pid == os.getpid()
                        else not _in_use(path, pid)
                    ):
                        os.unlink(path)
                continue
            m = _STAGING_RE.match(name)
            if (
                m is None
                or m.group(4) != host
                or _in_use(self.root / name, int(m.group(3)), m.group(2) == "new")
            ):
                continue
            path, d = self.root / name, self.root / m.group(1)
            try:
                if m.group(2) == "old" and not (d / COMMIT_NAME).exists():
                    if d.exists():
                        shutil.rmtree(d)
                    os.rename(path, d)
                    fsync_dir(self.root)
                    log.warning("put back %s, which a writer killed while replacing it had moved aside", d)
                else:
                    self._clear(path)
            except OSError as e:
                log.warning("could not tidy up %s (left by a writer that died): %s", path, e)

    def acquire_owner(self) -> "OwnerLock | None":
        """Become the one live writer of this directory (see :class:`OwnerLock`); raises
        :class:`~ckpt.errors.LockedError` when another live Checkpointer, here or in another process,
        owns it. A subclass whose root holds no steps of its own may return ``None``."""
        lock = OwnerLock.acquire(self.root)
        self.owner = lock
        self._sweep()
        return lock

    def left_in_ram(self) -> Tier | None:
        """The memory tier of the snapshots that this directory's owners left in this node's RAM (their
        shared-memory segments are named from the directory's identity, :mod:`ckpt.identity`), or ``None``
        when the directory has no identity yet."""
        from ..pool import HostPool
        from .memory import MemoryTier, space_for

        space = space_for(str(self.root), 0)
        return None if space is None else MemoryTier(HostPool(1, None, pin=False), space)

    def _still_owner(self) -> None:
        """Before a write starts and before a change the directory's readers can see (a step switched into
        place, a step deleted): the owner lock, where this tier holds one, still keeps other writers out
        (:meth:`OwnerLock.reassert`). Once another process took the directory, every call raises
        :class:`~ckpt.errors.LockedError`: the saves, the retention, the promotes and the restores' refills
        of this tier (they all write through :meth:`write_chunks` or :meth:`delete`)."""
        if self.owner is not None:
            self.owner.reassert()

    def _write_data(
        self, path: Path, size: int, chunk: int, get: Callable[[int], bytes | memoryview]
    ) -> list[int]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now, not halfway through
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise OSError(e.errno, e.strerror, str(path)) from None

            def one(i: int) -> int:
                try:
                    view = memoryview(get(i))
                except BaseException as e:
                    raise _SourceError(e) from e
                off, done = i * chunk, 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], off + done)
                return checksum(view)

            with ThreadPoolExecutor(
                max(1, knobs.get("CKPT_PERSIST_THREADS")), thread_name_prefix="ckpt-write"
            ) as ex:
                futures = [ex.submit(one, i) for i in range(-(-size // chunk))]
                try:
                    sums = [f.result() for f in futures]
                except BaseException:
                    for f in futures:  # the write has failed: do not fetch and write the rest
                        f.cancel()
                    raise
            os.fsync(fd)
        except OSError as e:
            if e.filename is None:
                raise OSError(e.errno, e.strerror, str(path)) from None
            raise
        finally:
            os.close(fd)
        return sums

    def _clear(self, d: Path) -> None:
        """Make room for a fresh write of ``d``: a committed copy is uncommitted first. A linked step
        is never cleared (``OSError(ELOOP)``): the save fails rather than write into its target."""
        self.verified.pop(parse_step_dir(d.name), None)
        remove_step_dir(d.parent, d.name)

    def _discard(self, d: Path) -> None:
        try:
            self._clear(d)
        except OSError as e:
            log.warning("could not remove the partial checkpoint %s: %s", d, e)
            with _WRITING_GUARD:
                _ABANDONED.add(_key(d))  # the next write of this process removes it (_sweep)

    def delete(self, step: int) -> None:
        """Remove a checkpoint: ``COMMIT`` first, so a crash mid-delete never leaves a torn 'committed' step.

        Never through a symbolic link: a linked step raises ``OSError(ELOOP)`` (see :func:`remove_step_dir`).
        """
        self._still_owner()
        self.verified.pop(step, None)
        remove_step_dir(self.root, step_dir_name(step))

    # -- read -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def mapped(self, step: int) -> Iterator[memoryview]:
        """This rank's data file of ``step``, memory-mapped read-only (no copy into this process)."""
        path = self.step_dir(step) / data_name(self.rank)
        fd, _ = open_regular(path)
        with open(fd, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                yield memoryview(b"")
                return
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mm)
            try:
                yield view
            finally:
                try:
                    view.release()
                    mm.close()
                except BufferError:
                    pass  # a slice is still referenced somewhere: the mapping closes when it is collected

    def open(self, step: int) -> tuple[Commit, Manifest]:
        """Read and validate the commit record and this rank's manifest of ``step``."""
        d = self.step_dir(step)
        commit, manifest = read_records(
            lambda name: _read(d / name), step, self.rank, self.world_size, str(d)
        )
        dpath = d / data_name(self.rank)
        try:
            st = os.stat(dpath)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{dpath}: data file is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{dpath}: the data file is not a regular file; refused unread")
        size = st.st_size
        if size != manifest.data_bytes:
            raise IncompleteCheckpointError(f"{dpath}: {size} bytes on disk, {manifest.data_bytes} committed")
        if manifest.codecs is not None and any(c != "raw" for c in manifest.codecs):
            raise CorruptCheckpointError(f"{d}: the local tier stores raw chunks, the manifest lists codecs")
        return commit, manifest

    def records(self, step: int) -> tuple[Commit, list[Manifest]]:
        """The commit record of ``step`` and this rank's manifest, its one copy here (:meth:`open`)."""
        commit, manifest = self.open(step)
        return commit, [manifest]

    def check_stored(self, step: int, manifest: Manifest) -> None:
        """Rank ``manifest.rank``'s data file is a regular file of its committed size."""
        path = self.step_dir(step) / data_name(manifest.rank)
        try:
            fd, st = open_regular(path)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{path}: data file is missing") from None
        os.close(fd)
        if st.st_size != manifest.data_bytes:
            raise IncompleteCheckpointError(
                f"{path}: {st.st_size} bytes on disk, {manifest.data_bytes} committed"
            )

    def fetch(self, step: int, rank: int, manifest: Manifest, i: int) -> bytearray:
        """Chunk ``i`` of rank ``rank``'s data file, read and checked against its checksum."""
        path = self.step_dir(step) / data_name(rank)
        off = i * manifest.chunk_bytes
        length = min(manifest.chunk_bytes, manifest.data_bytes - off)
        buf = bytearray(max(0, length))
        fd = open_regular(path)[0]
        try:
            view, got = memoryview(buf), 0
            while got < length:
                n = os.preadv(fd, [view[got:]], off + got)
                if n == 0:
                    raise IncompleteCheckpointError(
                        f"{path}: ends at byte {off + got}, expected {off + length}"
                    )
                got += n
        finally:
            os.close(fd)
        if checksum(buf) != manifest.chunks[i]:
            raise CorruptCheckpointError(
                f"{path}: bytes [{off}, {off + length}) fail their {manifest.checksum_algorithm} checksum"
            )
        return buf

    def copy_id(self, step: int) -> tuple[int, ...] | None:
        """What tells this copy of ``step`` from another (its ``COMMIT``'s identity), or ``None`` when the
        step is not committed here now. A restore compares it before and after a failed read: a copy that
        a live writer removed or replaced meanwhile is listed again, not taken for a corrupt one."""
        try:
            st = os.stat(self.step_dir(step) / COMMIT_NAME)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size

    def manifest_of(self, step: int, timeline: Timeline | None = None) -> Manifest:
        """This rank's validated manifest of ``step`` (:meth:`open`; a step has one copy here)."""
        return self.open(step)[1]

    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None]) -> None:
        """Read, verify and scatter this rank's data of ``step`` into ``dest``."""
        self._read(step, manifest, Scatter(manifest.items, dest))

    def verify(self, step: int) -> list[Manifest]:
        """Read every byte of ``step`` and check it against its checksums; returns its manifest (this rank's
        one copy) in a list, as every tier does."""
        manifest = self.open(step)[1]
        self._read(step, manifest, None)
        return [manifest]

    def _read(self, step: int, manifest: Manifest, sc: Scatter | None) -> None:
        dpath = self.step_dir(step) / data_name(self.rank)
        chunk = manifest.chunk_bytes
        n = len(manifest.chunks)
        if n == 0:
            return
        pin = sc is not None and sc.to_device
        fd, direct = _open_for_read(dpath, chunk)
        # a chunk is never longer than the data file: buffers are sized by what the file holds, not by
        # the chunk size the manifest declares (one chunk of 2**45 bytes over a small file is valid)
        size = min(chunk, -(-manifest.data_bytes // _PAGE) * _PAGE)
        ring: queue.Queue = queue.Queue()
        for _ in range(min(n, knobs.get("CKPT_RESTORE_BUFFERS"))):
            # verifying scatters nothing: a numpy buffer (no torch needed by `ckpt verify`)
            ring.put((_aligned_empty(size, pin) if sc is not None else _aligned_bytes(size), None))
        streams = pin and sc.open_streams()
        try:

            def one(i: int) -> None:
                buf, ev = ring.get()
                try:
                    for e in ev or ():
                        e.synchronize()  # the previous H2D copies out of this buffer are done
                    off = i * chunk
                    length = min(chunk, manifest.data_bytes - off)
                    view = memoryview(buf.numpy() if sc is not None else buf)
                    _read_range(fd, direct, dpath, view, off, length)
                    if checksum(view[:length]) != manifest.chunks[i]:
                        raise CorruptCheckpointError(
                            f"{dpath}: bytes [{off}, {off + length}) fail their {manifest.checksum_algorithm} "
                            "checksum"
                        )
                    if sc is not None:
                        sc.copy(buf[:length], off)
                        ev = sc.record() if streams else None
                finally:
                    ring.put((buf, ev))

            with ThreadPoolExecutor(knobs.get("CKPT_IO_THREADS"), thread_name_prefix="ckpt-read") as ex:
                for f in [ex.submit(one, i) for i in range(n)]:
                    f.result()
        finally:
            os.close(fd)
            if streams:
                sc.synchronize()


def _is_link(path: str | os.PathLike, dir_fd: int | None = None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def linked(root: str | os.PathLike, name: str) -> bool:
    """Whether checkpoint directory ``name`` of ``root`` is linked in: the directory, or its ``COMMIT``,
    is a symbolic link (a checkpoint that lives elsewhere, a shared baseline say). A linked checkpoint
    is listed and restored from like any other, read-only: retention, ``ckpt gc`` and saves never
    delete it, nor anything inside it, nor write into it."""
    d = os.path.join(root, name)
    return _is_link(d) or _is_link(os.path.join(d, COMMIT_NAME))


def _linked_error(path: str, what: str = "") -> OSError:
    return OSError(
        errno.ELOOP,
        f"{what or 'the checkpoint directory'} is a symbolic link: a linked checkpoint is "
        "read-only here (retention, gc and saves never delete or write through a link; remove the link "
        "itself to drop it from this directory)",
        path,
    )


def remove_step_dir(root: str | os.PathLike, name: str) -> bool:
    """Delete checkpoint directory ``name`` of ``root`` (``/``-separated for nested names): its
    ``COMMIT`` first (then the directory is fsynced), so that a crash mid-delete never leaves a torn
    committed checkpoint, then everything else. Returns ``False`` when there is no such directory.

    Nothing is deleted through a symbolic link. Each component of ``name`` is opened with
    ``O_NOFOLLOW`` and every removal is relative to those descriptors (``shutil.rmtree`` with
    ``dir_fd`` checks each directory it enters the same way), so a link swapped in for the directory
    mid-delete cannot redirect it to the link's target. A directory, or ``COMMIT``, that is a link
    raises ``OSError(ELOOP)`` and nothing is deleted; other links inside are removed themselves, never
    their targets.
    """
    parts = [p for p in str(name).split("/") if p]
    where = os.path.join(os.fspath(root), *parts)
    try:
        fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY)]
    except FileNotFoundError:
        return False
    try:
        for part in parts:
            try:
                fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
            except FileNotFoundError:
                return False
            except OSError as e:
                if _is_link(part, fds[-1]):
                    raise _linked_error(where) from None
                raise OSError(e.errno, e.strerror, where) from None
        if len(fds) < 2:
            raise ValueError(f"remove_step_dir needs the name of a directory inside {root}, got {name!r}")
        fd = fds[-1]
        try:
            st = os.stat(COMMIT_NAME, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _linked_error(os.path.join(where, COMMIT_NAME), f"its {COMMIT_NAME}")
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(COMMIT_NAME, dir_fd=fd)  # uncommitted from here on, and durably so
            os.fsync(fd)
        os.close(fds.pop())
        try:
            shutil.rmtree(parts[-1], dir_fd=fds[-1])
        except OSError as e:
            if _is_link(parts[-1], fds[-1]):  # swapped in since it was opened: rmtree refused it
                raise _linked_error(where) from e
            raise OSError(e.errno, e.strerror or str(e), where) from e
        return True
    finally:
        for fd in fds:
            os.close(fd)


_PAGE = 4096


def _aligned_bytes(nbytes: int) -> Any:
    """A uint8 numpy array of ``nbytes`` whose address is page aligned (as O_DIRECT requires)."""
    import numpy as np

    raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
    shift = (-raw.ctypes.data) % _PAGE
    return raw[shift : shift + nbytes]


def _aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` whose address is page aligned (as O_DIRECT requires)."""
    import torch

    t = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=pin, device="cpu")
    shift = (-t.data_ptr()) % _PAGE
    return t[shift : shift + nbytes]


def _open_for_read(path: Path, chunk: int) -> tuple[int, bool]:
    """Open with O_DIRECT where the file system allows it and chunks are page multiples.

    Buffered reads of a cold file advance one readahead window at a time; O_DIRECT hands the device each
    whole chunk at once, which is what makes a cold restore run at the disk's bandwidth.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if flag and knobs.get("CKPT_DIRECT_IO") and chunk % _PAGE == 0:
        try:
            return open_regular(path, flag)[0], True
        except CorruptCheckpointError:
            raise
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{path}: data file is missing") from None
        except OSError:
            pass  # e.g. tmpfs: no O_DIRECT
    try:
        return open_regular(path)[0], False
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: data file is missing") from None


def _read_range(fd: int, direct: bool, path: Path, view: memoryview, off: int, length: int) -> None:
    """Fill ``view[:length]`` with the file's bytes ``[off, off + length)``."""
    want = -(-length // _PAGE) * _PAGE if direct else length  # O_DIRECT sizes are page multiples
    got = 0
    while got < length:
        try:
            r = os.preadv(fd, [view[got:want]], off + got)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise OSError(e.errno, e.strerror, str(path)) from None
            direct, want = False, length  # an unaligned tail: finish with a buffered read
            bfd = open_regular(path)[0]
            try:
                _read_range(bfd, False, path, view, off, length)
            finally:
                os.close(bfd)
            return
        if r == 0:
            raise IncompleteCheckpointError(f"{path}: ends at byte {off + got}, expected {off + length}")
        got += r


def _read(path: Path) -> bytes:
    """A record of a step directory (:func:`~ckpt.format.read_record`: regular files only, bounded)."""
    try:
        return read_record(path)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: missing") from None


# -- staging and exchange ---------------------------------------------------------------------------
class _Unsynced(Exception):
    """The fsync of the root after a step was renamed into place failed: the step is committed (visible),
    its durability is not known."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _synced(root: Path) -> None:
    try:
        fsync_dir(root)
    except OSError as e:
        raise _Unsynced(e) from e


#: staging directories being written by this process (absolute paths): its own sweep leaves them alone,
#: and removes the others it left (a discard that failed), which no later process would while it lives
_WRITING: set[str] = set()
_ABANDONED: set[str] = set()  # this process's staging directories that a write failed to remove
_WRITING_GUARD = threading.Lock()


def _writing(stage: Path, on: bool) -> None:
    with _WRITING_GUARD:
        (_WRITING.add if on else _WRITING.discard)(_key(stage))


def _key(path: Path) -> str:
    """One name for ``path`` however its directory was spelled (a link to it, a relative path)."""
    return os.path.join(os.path.realpath(path.parent), path.name)


def _in_use(path: Path, pid: int, made_by_pid: bool = True) -> bool:
    """Whether the staging directory (or temporary file) ``path`` of process ``pid`` of this host may
    still be written: this process's own only while one of its writes uses it (one of an earlier process
    that had the same pid is not), another's while that process lives and (``made_by_pid``: ``path`` was
    made by it, not moved aside by it) started before ``path`` was last modified."""
    since = None
    if made_by_pid:
        with contextlib.suppress(OSError):
            since = os.stat(path, follow_symlinks=False).st_mtime
    if pid != os.getpid():
        return procs.alive(pid, since)
    with _WRITING_GUARD:
        key = _key(path)
        if key in _WRITING:
            return True
        if key in _ABANDONED:  # a write of this process failed to remove it
            return False
    started = procs.started(pid)  # last written before this process started: an earlier one had its pid
    return not (since is not None and started is not None and since < started - 2.0)


class _SourceError(Exception):
    """What the chunk source of a write raised, carried past the write's own OSError handling."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


# .step-000000005.new-<pid>-<host>-<nonce>: a write in progress (or the copy it replaced, after the exchange);
# .step-000000005.old-...: a replaced copy moved aside on a file system without an atomic exchange
_STAGING_RE = re.compile(r"^\.(step-\d{9,})\.(new|old)-(\d+)-([0-9a-f]{8})-[0-9a-f]{8}$")
# .latest.tmp-<pid>-<12 hex>: format.write_atomic's temporary name for `latest`
_LATEST_TMP_RE = re.compile(r"^\." + re.escape(LATEST_NAME) + r"\.tmp-(\d+)-[0-9a-f]{12}$")
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _host_tag() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _staging_name(step: int, kind: str) -> str:
    return f".{step_dir_name(step)}.{kind}-{os.getpid()}-{_host_tag()}-{secrets.token_hex(4)}"


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # renameat2's flags
#: the errnos of a renameat2 the kernel, the C library or the file system does not have
NO_RENAMEAT2 = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})
_AT_FDCWD = -100
_renameat2: Any = None


def renameat2(a: Path, b: Path, flags: int) -> None:
    """Linux ``renameat2(a, b, flags)`` (``RENAME_NOREPLACE``: fail with EEXIST where ``b`` exists, even an
    empty directory; ``RENAME_EXCHANGE``: swap the two entries atomically). Raises an OSError with its
    errno, one of :data:`NO_RENAMEAT2` where the kernel, the C library or the file system cannot."""
    global _renameat2
    if _renameat2 is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _renameat2 = fn or False
    if not _renameat2:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def _exchange(a: Path, b: Path) -> None:
    """Swap the directory entries ``a`` and ``b`` atomically (:func:`renameat2` with ``RENAME_EXCHANGE``)."""
    renameat2(a, b, RENAME_EXCHANGE)


# -- ownership ----------------------------------------------------------------------------------------
_held: "weakref.WeakValueDictionary[tuple[int, int], OwnerLock]" = weakref.WeakValueDictionary()
_held_guard = threading.RLock()  # re-entrant: a collected OwnerLock's __del__ may run inside acquire()


class OwnerLock:
    """This process's ownership of a local tier directory: an exclusive ``flock`` on ``root/.ckpt-lock``.

    One live writer per directory: two Checkpointers writing one ``local_dir`` replace each other's
    committed steps and prune each other's saves in flight. :meth:`acquire` refuses a directory that
    another live owner holds, in another process or in this one, with
    :class:`~ckpt.errors.LockedError` naming the owner's pid and host (recorded in the lock file).
    The kernel drops the lock when the owner's process dies, however it dies, so a killed owner
    leaves nothing to clean up; the file stays (removing it would let two processes lock two
    different files of one name). A forked child does not inherit the ownership.

    ``flock`` works between the processes of one host; on NFS, Linux maps it onto the server's
    byte-range locks (NFSv4, or NFSv3 with lockd), which other clients see too, unless the share is
    mounted with ``local_lock=flock`` or ``local_lock=all``: then only this host's processes are refused.
    """

    def __init__(self, root: Path, fd: int, key: tuple[int, int]) -> None:
        self.root, self._fd, self._key = root, fd, key
        self._lost = False  # the lock file's name was taken from under it, and taking it again failed
        self._fenced: LockedError | None = None  # another live process took the directory: final

    @classmethod
    def acquire(cls, root: str | os.PathLike) -> "OwnerLock":
        root = Path(root).expanduser()
        path = root / LOCK_NAME
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        with _held_guard:
            # Asked before the file is opened: on NFS the lock is a POSIX lock, which closing any other
            # descriptor of the file in this process would drop.
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) in _held:
                    raise _locked(root, me, same_process=True)
            except FileNotFoundError:
                pass
            try:
                # never through a link (the lock's content is rewritten: a link would make it truncate its
                # target), and never blocking on a FIFO left at its name
                fd = os.open(
                    path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644
                )
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise OSError(
                        e.errno,
                        f"the owner lock {path} is a symbolic link: the lock file is rewritten "
                        "by each owner, so it is never opened through a link; remove the link (a plain "
                        "file is made in its place)",
                        str(path),
                    ) from None
                if e.errno in (errno.EISDIR, errno.ENXIO):
                    raise _not_a_lock_file(path, e.errno)
                raise OSError(
                    e.errno,
                    f"{e.strerror} while creating the owner lock {path}: a Checkpointer writes "
                    "local_dir, so it must be a writable directory",
                    str(path),
                ) from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise _not_a_lock_file(path, errno.EEXIST, st.st_mode)
                os.set_blocking(fd, True)
                key = (st.st_dev, st.st_ino)
                if key in _held:  # created and taken by another thread of this process meanwhile
                    raise _locked(root, me, same_process=True)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise _locked(root, _read_owner(fd)) from None
                    if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                        raise OSError(e.errno, f"{e.strerror} while locking {path}", str(path)) from None
                    # e.g. NFS without a lock manager: other processes cannot be refused; this one's
                    # Checkpointers still are (the registry), and the writes themselves stay safe
                    log.warning(
                        "%s cannot be locked (%s): a second process writing local_dir %s will not be "
                        "refused; make sure only one does",
                        path,
                        e.strerror,
                        root,
                    )
                info = json.dumps({**me, "since_unix": time.time()}).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, info, 0)
            except BaseException:
                os.close(fd)
                raise
            lock = cls(root, fd, key)
            _held[key] = lock
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def reassert(self) -> None:
        """Make sure the lock still keeps other writers out, before this owner changes the directory.

        The lock is on the file at ``root/.ckpt-lock``; a file removed or replaced by hand (a tidy-up
        script, ``rm -rf local_dir/.*``) leaves this owner holding a lock nobody else can see, and a second
        process would lock a new file of the same name and write beside it. Where the name no longer leads
        to the locked file, the owner takes the name again (logged as an error). Where another live process
        already holds the new file, this owner is *fenced*: this raises :class:`~ckpt.errors.LockedError`,
        and so does every later call, for good (``held`` is false, ``fenced`` true): the other process owns
        the directory now, and nothing this one would write, delete or promote there may land beside its
        steps. A retake that failed otherwise (the directory not writable, say) is tried again at the next
        call, which raises until it succeeds. After :meth:`release` this returns at once."""
        with _held_guard:
            if self._fenced is not None:
                raise self._refusal()
            fd = self._fd
            if fd is None and not self._lost:
                return  # released
            if fd is not None:
                path = self.root / LOCK_NAME
                mine = os.fstat(fd)
                try:
                    st = os.stat(path, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                        return
                    what = "replaced by another file"
                except FileNotFoundError:
                    what = "removed"
                log.error(
                    "the owner lock %s of this process (pid %d) was %s: taking it again, so that no other "
                    "process writes %s beside this one (never remove %s while a Checkpointer uses the "
                    "directory)",
                    path,
                    os.getpid(),
                    what,
                    self.root,
                    LOCK_NAME,
                )
                if _held.get(self._key) is self:
                    del _held[self._key]
                self._fd, self._lost = None, True
                os.close(fd)
            try:
                new = OwnerLock.acquire(self.root)
            except LockedError as e:  # another live process took the name meanwhile: it owns the directory
                self._fenced = e
                log.error("%s", self._refusal())
                raise self._refusal() from None
            del _held[new._key]
            self._fd, self._key, self._lost, new._fd = new._fd, new._key, False, None
            _held[self._key] = self

    @property
    def fenced(self) -> bool:
        """Whether another live process took the directory from this owner (see :meth:`reassert`)."""
        return self._fenced is not None

    def _refusal(self) -> LockedError:
        """The error every write of a fenced owner raises (a new one each time: never re-raised with the
        tracebacks of the earlier ones)."""
        e = self._fenced
        who = f"pid {e.pid} on host {e.host}" if e.pid is not None else "another live process"
        return LockedError(
            f"this Checkpointer (pid {os.getpid()}) no longer owns local_dir {str(self.root)!r}: its "
            f"owner lock {LOCK_NAME} was removed or replaced, and {who} took the directory and owns "
            "it now. Nothing of this Checkpointer is written, deleted or promoted there any more "
            "(its saves, retention and restores that would refill local_dir raise this): stop this "
            f"process, or give it another local_dir; never remove {LOCK_NAME} while a Checkpointer "
            "uses the directory",
            e.path,
            e.pid,
            e.host,
        )

    def release(self) -> None:
        """Give up ownership (idempotent)."""
        with _held_guard:
            fd, self._fd, self._lost = self._fd, None, False
            if fd is None:
                return
            if _held.get(self._key) is self:
                del _held[self._key]
            os.close(fd)  # drops the flock

    def __del__(self) -> None:  # a Checkpointer dropped without close()
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def owned(root: str | os.PathLike) -> bool:
    """Whether a live process (this one included) owns the local tier at ``root`` now (holds its lock).
    A missing directory or lock file has no owner."""
    path = Path(root).expanduser() / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never blocks
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        with _held_guard:
            if (st.st_dev, st.st_ino) in _held:
                return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        return False  # nobody held it (the shared lock goes with the descriptor)
    finally:
        os.close(fd)


def _forget_in_child() -> None:
    """After fork: the child holds copies of the owner's lock descriptors; closing them leaves the lock
    with the parent alone (the kernel drops it once every descriptor of it is closed)."""
    global _held_guard
    _held_guard = threading.RLock()  # another thread of the parent may have held it at the fork
    for lock in list(_held.values()):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _not_a_lock_file(path: Path, err: int, mode: int | None = None) -> OSError:
    """The owner lock's name is taken by something else (``err``: ``EISDIR`` for a directory, else the
    errno of what refused it); nothing is written to ``local_dir`` until it is moved away."""
    what = (
        "a directory"
        if err == errno.EISDIR
        else "a FIFO"
        if mode is not None and stat.S_ISFIFO(mode)
        else "not a regular file"
    )
    return OSError(
        err,
        f"the owner lock {path} is {what}, not the regular file this library keeps "
        "there: nothing is written to local_dir until it is removed (a plain file is made in its place)",
        str(path),
    )


def _read_owner(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _locked(root: Path, owner: dict, same_process: bool = False) -> LockedError:
    pid, host = owner.get("pid"), owner.get("host")
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
    host = host if isinstance(host, str) else None
    since = owner.get("since_unix")
    when = (
        f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
        if isinstance(since, (int, float)) and not isinstance(since, bool)
        else ""
    )
    if same_process:
        who = f"another Checkpointer in this process (pid {pid} on host {host})"
        fix = "close() that one first, or give this one another local_dir"
    else:
        who = (
            f"a live process (pid {pid} on host {host}{when})"
            if pid is not None
            else "a live process (it has not recorded its pid yet, or runs on another host)"
        )
        fix = (
            "give this process its own local_dir, or stop that one (a process that died holds no lock); "
            "reading (restore, ckpt ls / verify / inspect) needs no lock"
        )
    return LockedError(
        f"local_dir {str(root)!r} is owned by {who}, which writes checkpoints there: two writers "
        f"would replace each other's steps and prune each other's saves in flight; {fix}",
        str(root),
        pid,
        host,
    )

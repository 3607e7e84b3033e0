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
import mmap
import logging
import os
import queue
import re
import secrets
import shutil
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import knobs
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format import (COMMIT_NAME, LATEST_NAME, Commit, Manifest, data_name, fsync_dir, manifest_name,
                      parse_step_dir, read_records, step_dir_name, write_atomic)
from ..integrity import checksum
from ..scatter import Scatter

__all__ = ["LocalTier"]

log = logging.getLogger(__name__)


class LocalTier:
    """Committed checkpoints under ``root`` (``root/step-XXXXXXXXX/``)."""

    name = "local"

    def __init__(self, root: str | os.PathLike, rank: int = 0, world_size: int = 1) -> None:
        self.root = Path(root).expanduser()
        self.rank = rank
        self.world_size = world_size
        self.root.mkdir(parents=True, exist_ok=True)

    # -- listing ----------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

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
        return self.write_chunks(step, manifest, lambda i: data[i * c:(i + 1) * c], compute_checksums=True)

    def write_chunks(self, step: int, manifest: Manifest, chunk: Callable[[int], bytes | memoryview],
                     compute_checksums: bool) -> float:
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
        self._sweep()
        stage = self.root / _staging_name(step, "new")
        try:
            stage.mkdir()
            sums = self._write_data(stage / data_name(self.rank), manifest.data_bytes, manifest.chunk_bytes, chunk)
            if compute_checksums:
                manifest.chunks = sums
            elif sums != manifest.chunks:   # the writer's own checksums: bytes that differ are never committed
                i = next(i for i, (a, b) in enumerate(zip(sums, manifest.chunks)) if a != b) \
                    if len(sums) == len(manifest.chunks) else 0
                raise CorruptCheckpointError(
                    f"{d / data_name(self.rank)}: bytes [{i * manifest.chunk_bytes}, "
                    f"{min((i + 1) * manifest.chunk_bytes, manifest.data_bytes)}) fail their checksum; not committed")
            local = dataclasses.replace(manifest, codecs=None, stored_sizes=None, generation=None, rank=self.rank,
                                        world_size=self.world_size)
            raw = local.to_bytes()
            write_atomic(stage / manifest_name(self.rank), raw)
            commit = Commit(step=step, world_size=self.world_size,
                            manifests={manifest_name(self.rank): Commit.manifest_checksum(raw)},
                            data={data_name(self.rank): manifest.data_bytes})
            write_atomic(stage / COMMIT_NAME, commit.to_bytes())
            self._switch(step, stage, d)   # the checkpoint exists (or is replaced) from here on
        except _SourceError as e:   # the bytes could not be had (a download failed): not the disk's fault
            self._discard(stage)
            raise e.error from None
        except OSError as e:
            self._discard(stage)
            hint = ("free space there or point local_dir elsewhere" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                    else "check the local_dir path and its permissions")
            raise OSError(e.errno, f"{e.strerror} while writing step {step} to the local tier "
                          f"({hint}); older checkpoints are untouched", str(e.filename or d)) from e
        except BaseException:
            self._discard(stage)
            raise
        self._write_latest(step)
        return time.perf_counter() - t0

    def _switch(self, step: int, stage: Path, d: Path) -> None:
        """Move the committed staging directory ``stage`` to ``d``; a copy already at ``d`` is exchanged
        with it in one step (``renameat2(RENAME_EXCHANGE)``) and removed afterwards."""
        try:
            os.rename(stage, d)   # nothing at d (an empty directory is replaced too)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        else:
            fsync_dir(self.root)
            return
        try:
            _exchange(stage, d)
        except OSError as e:
            if e.errno not in _NO_EXCHANGE:
                raise
            # No atomic exchange on this file system (NFS, say): two renames. A kill between them leaves the
            # old copy under its aside name, and the next write here (_sweep) moves it back.
            aside = self.root / _staging_name(step, "old")
            os.rename(d, aside)
            try:
                os.rename(stage, d)
            except BaseException:
                os.rename(aside, d)
                raise
            fsync_dir(self.root)
            self._discard(aside)
            return
        fsync_dir(self.root)
        self._discard(stage)   # now the replaced copy: uncommitted first, then removed

    def _write_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` unless a newer step is committed (a promote of an older one).
        Advisory: a failure is logged, never undoes the commit."""
        try:
            if any(s > step for s in self.committed_steps()):
                return
            path = self.root / LATEST_NAME
            tmp = self.root / f".{LATEST_NAME}.tmp-{os.getpid()}-{threading.get_ident()}"   # threads may race here
            with open(tmp, "wb") as f:
                f.write((step_dir_name(step) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(self.root)
        except OSError as e:
            log.warning("step %d is committed in %s, but %s could not be updated: %s", step, self.root, LATEST_NAME, e)

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
            m = _STAGING_RE.match(name)
            if m is None or m.group(4) != host or _alive(int(m.group(3))):
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

    def _write_data(self, path: Path, size: int, chunk: int, get: Callable[[int], bytes | memoryview]) -> list[int]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)   # ENOSPC now, not halfway through
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

            with ThreadPoolExecutor(knobs.get("CKPT_IO_THREADS"), thread_name_prefix="ckpt-write") as ex:
                futures = [ex.submit(one, i) for i in range(-(-size // chunk))]
                try:
                    sums = [f.result() for f in futures]
                except BaseException:
                    for f in futures:   # the write has failed: do not fetch and write the rest
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
        """Make room for a fresh write of ``d``: a committed copy is uncommitted first."""
        if d.exists():
            commit = d / COMMIT_NAME
            if commit.exists():
                commit.unlink()
                fsync_dir(d)
            shutil.rmtree(d)

    def _discard(self, d: Path) -> None:
        try:
            self._clear(d)
        except OSError as e:
            log.warning("could not remove the partial checkpoint %s: %s", d, e)

    def delete(self, step: int) -> None:
        """Remove a checkpoint: ``COMMIT`` first, so a crash mid-delete never leaves a torn 'committed' step."""
        self._clear(self.step_dir(step))

    # -- read -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def mapped(self, step: int) -> Iterator[memoryview]:
        """This rank's data file of ``step``, memory-mapped read-only (no copy into this process)."""
        path = self.step_dir(step) / data_name(self.rank)
        with open(path, "rb") as f:
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
                    pass   # a slice is still referenced somewhere: the mapping closes when it is collected

    def open(self, step: int) -> tuple[Commit, Manifest]:
        """Read and validate the commit record and this rank's manifest of ``step``."""
        d = self.step_dir(step)
        commit, manifest = read_records(lambda name: _read(d / name), step, self.rank, self.world_size, str(d))
        dpath = d / data_name(self.rank)
        try:
            size = dpath.stat().st_size
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{dpath}: data file is missing") from None
        if size != manifest.data_bytes:
            raise IncompleteCheckpointError(f"{dpath}: {size} bytes on disk, {manifest.data_bytes} committed")
        if manifest.codecs is not None and any(c != "raw" for c in manifest.codecs):
            raise CorruptCheckpointError(f"{d}: the local tier stores raw chunks, the manifest lists codecs")
        return commit, manifest

    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None]) -> None:
        """Read, verify and scatter this rank's data of ``step`` into ``dest``."""
        self._read(step, manifest, Scatter(manifest.items, dest))

    def verify(self, step: int) -> Manifest:
        """Read every byte of ``step`` and check it against its checksums; returns the manifest."""
        manifest = self.open(step)[1]
        self._read(step, manifest, None)
        return manifest

    def _read(self, step: int, manifest: Manifest, sc: Scatter | None) -> None:
        dpath = self.step_dir(step) / data_name(self.rank)
        chunk = manifest.chunk_bytes
        n = len(manifest.chunks)
        if n == 0:
            return
        pin = sc is not None and sc.to_device
        fd, direct = _open_for_read(dpath, chunk)
        ring: queue.Queue = queue.Queue()
        for _ in range(min(n, knobs.get("CKPT_RESTORE_BUFFERS"))):
            ring.put((_aligned_empty(chunk, pin), None))
        stream = torch.cuda.Stream() if pin else None
        try:
            def one(i: int) -> None:
                buf, ev = ring.get()
                try:
                    if ev is not None:
                        ev.synchronize()   # the previous H2D copy out of this buffer is done
                    off = i * chunk
                    length = min(chunk, manifest.data_bytes - off)
                    view = memoryview(buf.numpy())
                    _read_range(fd, direct, dpath, view, off, length)
                    if checksum(view[:length]) != manifest.chunks[i]:
                        raise CorruptCheckpointError(
                            f"{dpath}: bytes [{off}, {off + length}) fail their {manifest.checksum_algorithm} "
                            "checksum")
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            sc.copy(buf[:length], off)
                            ev = torch.cuda.Event()
                            ev.record(stream)
                    elif sc is not None:
                        sc.copy(buf[:length], off)
                finally:
                    ring.put((buf, ev))

            with ThreadPoolExecutor(knobs.get("CKPT_IO_THREADS"), thread_name_prefix="ckpt-read") as ex:
                for f in [ex.submit(one, i) for i in range(n)]:
                    f.result()
        finally:
            os.close(fd)
            if stream is not None:
                stream.synchronize()


_PAGE = 4096


def _aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` whose address is page aligned (as O_DIRECT requires)."""
    t = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=pin)
    shift = (-t.data_ptr()) % _PAGE
    return t[shift:shift + nbytes]


def _open_for_read(path: Path, chunk: int) -> tuple[int, bool]:
    """Open with O_DIRECT where the file system allows it and chunks are page multiples.

    Buffered reads of a cold file advance one readahead window at a time; O_DIRECT hands the device each
    whole chunk at once, which is what makes a cold restore run at the disk's bandwidth.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if flag and knobs.get("CKPT_DIRECT_IO") and chunk % _PAGE == 0:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:
            pass   # e.g. tmpfs: no O_DIRECT
    return os.open(path, os.O_RDONLY), False


def _read_range(fd: int, direct: bool, path: Path, view: memoryview, off: int, length: int) -> None:
    """Fill ``view[:length]`` with the file's bytes ``[off, off + length)``."""
    want = -(-length // _PAGE) * _PAGE if direct else length   # O_DIRECT sizes are page multiples
    got = 0
    while got < length:
        try:
            r = os.preadv(fd, [view[got:want]], off + got)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise OSError(e.errno, e.strerror, str(path)) from None
            direct, want = False, length   # an unaligned tail: finish with a buffered read
            bfd = os.open(path, os.O_RDONLY)
            try:
                _read_range(bfd, False, path, view, off, length)
            finally:
                os.close(bfd)
            return
        if r == 0:
            raise IncompleteCheckpointError(f"{path}: ends at byte {off + got}, expected {off + length}")
        got += r


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: missing") from None


# -- staging and exchange ---------------------------------------------------------------------------
class _SourceError(Exception):
    """What the chunk source of a write raised, carried past the write's own OSError handling."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


# .step-000000005.new-<pid>-<host>-<nonce>: a write in progress (or the copy it replaced, after the exchange);
# .step-000000005.old-...: a replaced copy moved aside on a file system without an atomic exchange
_STAGING_RE = re.compile(r"^\.(step-\d{9,})\.(new|old)-(\d+)-([0-9a-f]{8})-[0-9a-f]{8}$")
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _host_tag() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _staging_name(step: int, kind: str) -> str:
    return f".{step_dir_name(step)}.{kind}-{os.getpid()}-{_host_tag()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # another user's process
    return True


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None


def _exchange(a: Path, b: Path) -> None:
    """Swap the directory entries ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``).
    Raises an OSError with errno EINVAL / ENOSYS / EOPNOTSUPP where the kernel or file system cannot."""
    global _renameat2
    if _renameat2 is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _renameat2 = fn or False
    if not _renameat2:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))

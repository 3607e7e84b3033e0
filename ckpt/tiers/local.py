"""The local tier: one directory on this node's NVMe.

Write path (phase 2): preallocate the rank's data file (a full disk fails
here, before any byte is written), write it from the host buffer in parallel
chunks with ``os.pwrite`` while checksumming each chunk in the same thread,
``fsync``, write the manifest atomically, then ``COMMIT`` (temporary name,
fsync, rename, fsync of the directory), then move ``latest``.

Read path (restore): validate ``COMMIT`` and the manifest, check the data
file's size, then read it in parallel chunks into a small ring of (pinned)
host buffers, verify each chunk's checksum before any of its bytes is used,
and scatter the bytes into the destination tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import logging
import os
import queue
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import torch

from .. import knobs
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format import (COMMIT_NAME, LATEST_NAME, Commit, Manifest, data_name, fsync_dir, manifest_name,
                      open_regular, parse_step_dir, read_record, read_records, step_dir_name, write_atomic)
from ..integrity import checksum
from ..policy import Committed, Timeline
from ..scatter import Scatter

__all__ = ["LocalTier", "linked", "remove_step_dir"]

log = logging.getLogger(__name__)


class LocalTier:
    """Committed checkpoints under ``root`` (``root/step-XXXXXXXXX/``)."""

    name = "local"

    def __init__(self, root: str | os.PathLike, rank: int = 0, world_size: int = 1) -> None:
        self.root = Path(root).expanduser()
        self.rank = rank
        self.world_size = world_size
        # what this process knows of each step here: True when it committed the step itself (checksums
        # from its own bytes, or every chunk checked against them for a copy) or read it back in full,
        # False when a read failed verification; retention keeps the newest True one
        self.verified: dict[int, bool] = {}
        self.timeline = Timeline()   # what a fresh write's COMMIT records (the Checkpointer sets it)
        self._copying: dict[int, Timeline] = {}
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

    def committed(self) -> list[Committed]:
        """Every committed step here with its timeline (read from its ``COMMIT``; timeline 0 when that
        cannot be read, which a restore then finds anyway) and whether it is linked in."""
        out = []
        for s in self.committed_steps():
            name = step_dir_name(s)
            out.append(Committed(s, _timeline(self.root / name / COMMIT_NAME), linked(self.root, name)))
        return out

    @contextlib.contextmanager
    def copying(self, step: int, timeline: Timeline) -> Iterator[None]:
        """Writes of ``step`` made inside record ``timeline`` (a copy of a checkpoint keeps its timeline)."""
        self._copying[step] = timeline
        try:
            yield
        finally:
            self._copying.pop(step, None)

    def owns(self, step: int) -> bool:
        """Whether this tier may delete ``step``: ``False`` for a linked step (see :func:`linked`)."""
        return not linked(self.root, step_dir_name(step))

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
        (a copy from the remote tier or from a peer rank).
        """
        t0 = time.perf_counter()
        d = self.step_dir(step)
        try:
            self._clear(d)
            d.mkdir(parents=True, exist_ok=True)
            sums = self._write_data(d / data_name(self.rank), manifest.data_bytes, manifest.chunk_bytes, chunk)
            if compute_checksums:
                manifest.chunks = sums
            elif sums != manifest.chunks:   # the writer's own checksums: bytes that differ are never committed
                i = next(i for i, (a, b) in enumerate(zip(sums, manifest.chunks)) if a != b) \
                    if len(sums) == len(manifest.chunks) else 0
                raise CorruptCheckpointError(
                    f"{d / data_name(self.rank)}: bytes [{i * manifest.chunk_bytes}, "
                    f"{min((i + 1) * manifest.chunk_bytes, manifest.data_bytes)}) fail their checksum; not committed")
            local = dataclasses.replace(manifest, codecs=None, stored_sizes=None, rank=self.rank,
                                        world_size=self.world_size)
            raw = local.to_bytes()
            write_atomic(d / manifest_name(self.rank), raw)
            commit = Commit(step=step, world_size=self.world_size,
                            manifests={manifest_name(self.rank): Commit.manifest_checksum(raw)},
                            data={data_name(self.rank): manifest.data_bytes},
                            **self._copying.get(step, self.timeline).record())
            write_atomic(d / COMMIT_NAME, commit.to_bytes())
            self.verified[step] = True
            write_atomic(self.root / LATEST_NAME, (step_dir_name(step) + "\n").encode())
        except OSError as e:
            self._discard(d)
            hint = ("free space there or point local_dir elsewhere" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                    else "check the local_dir path and its permissions")
            raise OSError(e.errno, f"{e.strerror} while writing step {step} to the local tier "
                          f"({hint}); older checkpoints are untouched", str(e.filename or d)) from e
        except BaseException:
            self._discard(d)
            raise
        return time.perf_counter() - t0

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
                view = memoryview(get(i))
                off, done = i * chunk, 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], off + done)
                return checksum(view)

            with ThreadPoolExecutor(knobs.get("CKPT_IO_THREADS"), thread_name_prefix="ckpt-write") as ex:
                sums = list(ex.map(one, range(-(-size // chunk))))
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

    def delete(self, step: int) -> None:
        """Remove a checkpoint: ``COMMIT`` first, so a crash mid-delete never leaves a torn 'committed' step.

        Never through a symbolic link: a linked step raises ``OSError(ELOOP)`` (see :func:`remove_step_dir`).
        """
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
                    pass   # a slice is still referenced somewhere: the mapping closes when it is collected

    def open(self, step: int) -> tuple[Commit, Manifest]:
        """Read and validate the commit record and this rank's manifest of ``step``."""
        d = self.step_dir(step)
        commit, manifest = read_records(lambda name: _read(d / name), step, self.rank, self.world_size, str(d))
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
        # a chunk is never longer than the data file: buffers are sized by what the file holds, not by
        # the chunk size the manifest declares (one chunk of 2**45 bytes over a small file is valid)
        size = min(chunk, -(-manifest.data_bytes // _PAGE) * _PAGE)
        ring: queue.Queue = queue.Queue()
        for _ in range(min(n, knobs.get("CKPT_RESTORE_BUFFERS"))):
            ring.put((_aligned_empty(size, pin), None))
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


def _is_link(path: str | os.PathLike, dir_fd: int | None = None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _timeline(path: Path) -> Timeline:
    try:
        return Timeline.of(Commit.from_bytes(read_record(path), str(path)))
    except (OSError, CorruptCheckpointError):
        return Timeline()


def linked(root: str | os.PathLike, name: str) -> bool:
    """Whether checkpoint directory ``name`` of ``root`` is linked in: the directory, or its ``COMMIT``,
    is a symbolic link (a checkpoint that lives elsewhere, a shared baseline say). A linked checkpoint
    is listed and restored from like any other, read-only: retention, ``ckpt gc`` and saves never
    delete it, nor anything inside it, nor write into it."""
    d = os.path.join(root, name)
    return _is_link(d) or _is_link(os.path.join(d, COMMIT_NAME))


def _linked_error(path: str, what: str = "") -> OSError:
    return OSError(errno.ELOOP, f"{what or 'the checkpoint directory'} is a symbolic link: a linked checkpoint is "
                   "read-only here (retention, gc and saves never delete or write through a link; remove the link "
                   "itself to drop it from this directory)", path)


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
            os.unlink(COMMIT_NAME, dir_fd=fd)   # uncommitted from here on, and durably so
            os.fsync(fd)
        os.close(fds.pop())
        try:
            shutil.rmtree(parts[-1], dir_fd=fds[-1])
        except OSError as e:
            if _is_link(parts[-1], fds[-1]):   # swapped in since it was opened: rmtree refused it
                raise _linked_error(where) from e
            raise OSError(e.errno, e.strerror or str(e), where) from e
        return True
    finally:
        for fd in fds:
            os.close(fd)


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
            return open_regular(path, flag)[0], True
        except CorruptCheckpointError:
            raise
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{path}: data file is missing") from None
        except OSError:
            pass   # e.g. tmpfs: no O_DIRECT
    try:
        return open_regular(path)[0], False
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: data file is missing") from None


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

"""Shared-memory segments: snapshot buffers that outlive the process that wrote them.

The memory tier keeps its host buffers in files of a RAM file system (``/dev/shm`` on Linux,
``$CKPT_SHM_DIR`` to choose another), mapped into the training process and registered with the
CUDA driver, so device-to-host copies run at pinned bandwidth. A process that dies (SIGKILL, an
OOM kill, a NCCL timeout) leaves them in RAM; a new process on the same node finds them by name
and restores from them after checking every chunk against its checksum.

Names, per ``local_dir`` and rank (``<key>``: :func:`ckpt.identity.directory_key`, 16 hex digits of a
hash of the directory's resolved path and the random id it keeps, so a directory deleted and made again,
or one at another path, never finds another's segments, and no other user can predict the names)::

    ckpt-<key>-r<rank>-s<slot>.buf    a buffer: one snapshot's data file image
    ckpt-<key>-r<rank>-s<slot>.rec    its commit record (JSON), present only while the buffer holds a
                                      whole snapshot
    ckpt-<key>-p<src>-s<slot>.buf/.rec  a replica of rank <src>'s snapshot that the owner of local_dir
                                      holds (peer tier)

A record exists only while its buffer holds exactly the snapshot it describes: it is removed before
the buffer is written again and put back (a temporary name, then ``rename``) only once the copy has
landed, passed the torn-write check, and its chunk checksums are computed. A process killed while a
buffer is being written leaves that buffer without a record, so it is never served; the previous
snapshot, in another buffer, keeps its record. Segments are created ``0600`` under a fresh name and
renamed into place, never truncated in place (a reader's mapping of the old file stays valid), and
only regular files owned by this user are ever mapped.

Only the owner of ``local_dir`` (:class:`ckpt.tiers.local.OwnerLock`) writes a segment; anyone may
read one. The RAM is freed when the segment files are removed (``Checkpointer.close()`` after a
clean finish, :func:`free` / ``ckpt gc --memory`` for what a crashed job left) and no process maps
them any more. Their size counts against the container's memory limit (tmpfs pages are charged to
the cgroup that touched them) and against the size of ``/dev/shm`` (Docker gives 64 MB by default:
``--shm-size``; Kubernetes: an ``emptyDir`` with ``medium: Memory``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch

from . import identity, knobs, procs
from .errors import CorruptCheckpointError
from .format import FORMAT_VERSION, Manifest, parse_record, read_record
from .integrity import checksum
from .policy import Timeline

__all__ = [
    "Segment",
    "AllocationStopped",
    "SnapshotRecord",
    "host_register",
    "host_unregister",
    "populate",
    "open_for_read",
    "SegmentInfo",
    "shm_root",
    "prefix_for",
    "replica_prefix",
    "local_key",
    "available_bytes",
    "chunk_checksums",
    "first_bad_chunk",
    "write_record",
    "read_snapshot_record",
    "remove_record",
    "segments",
    "free",
    "remove_leftovers",
    "Orphan",
    "orphans",
    "sweep_orphans",
]

log = logging.getLogger(__name__)

_KIND = "ckpt-memory-snapshot"
_NAME_RE = re.compile(r"^(ckpt-[0-9a-f]{16}-[rp]\d{5})-s(\d{2})\.(buf|rec)$")
MAX_RECORD_BYTES = 256 << 20  # a record holds one manifest: far below this even for 100k tensors


def shm_root() -> Path | None:
    """The RAM file system the memory tier uses (``$CKPT_SHM_DIR``, default ``/dev/shm``), or ``None``
    when shared segments are off (``CKPT_SHM=0``) or the directory is missing or not writable. An empty
    ``CKPT_SHM_DIR`` (``export CKPT_SHM_DIR=$UNSET``) counts as not set, never as the working directory."""
    if not knobs.get("CKPT_SHM"):
        return None
    root = Path(os.path.abspath(os.environ.get("CKPT_SHM_DIR") or "/dev/shm"))
    try:
        st = os.stat(root)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or not os.access(root, os.W_OK | os.X_OK):
        return None
    return root


def prefix_for(local_dir: str | os.PathLike, rank: int, create: bool = False) -> str | None:
    """The segment names' prefix of ``local_dir``'s rank ``rank``: one name space per local tier and rank.
    ``None`` when the directory has no id (:func:`ckpt.identity.directory_id`; ``create``: give it one):
    no segment can be its then."""
    key = identity.directory_key(local_dir, create)
    return None if key is None else f"ckpt-{key}-r{rank:05d}"


def replica_prefix(local_dir: str | os.PathLike, src: int, create: bool = False) -> str | None:
    """The segment names' prefix of the replicas of rank ``src``'s snapshots that the owner of ``local_dir``
    holds (the peer tier): the local tier's name space, ``p`` for a replica instead of ``r``."""
    prefix = prefix_for(local_dir, src, create)
    return None if prefix is None else prefix.rsplit("-r", 1)[0] + f"-p{src:05d}"


def local_key(prefix: str) -> str:
    """The part of a segment prefix that names its ``local_dir`` (shared by its own and its replicas')."""
    return prefix[: len("ckpt-") + 16]


def available_bytes(root: Path) -> int:
    """Bytes a new segment may still take in ``root`` (what ``statvfs`` says is free to this user)."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def buffer_name(prefix: str, slot: int) -> str:
    return f"{prefix}-s{slot:02d}.buf"


def record_name(prefix: str, slot: int) -> str:
    return f"{prefix}-s{slot:02d}.rec"


class Segment:
    """One mapped segment file: ``tensor`` is a ``uint8`` view of all of it."""

    def __init__(self, path: Path, tensor: torch.Tensor, writable: bool) -> None:
        self.path = path
        self.tensor = tensor
        self.writable = writable
        self.registered = False
        self._pieces: list[int] = []  # the registered pieces' addresses

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @classmethod
    def create(
        cls, path: Path, nbytes: int, paced: bool = False, stop: threading.Event | None = None
    ) -> "Segment":
        """A new segment of ``nbytes`` at ``path``, every page reserved now (a full RAM file system fails
        here with ``ENOSPC``, never later inside a copy), replacing any segment of that name. ``paced``
        (beside a training loop): reserved :data:`REGISTER_PIECE` bytes at a time with a pause after each,
        like :meth:`register`; ``stop`` set meanwhile: :class:`AllocationStopped`, nothing left at
        ``path`` (and the segment it would have replaced kept)."""

        def fill(fd: int, tmp: Path) -> torch.Tensor:
            try:
                if paced:  # the pages only: nothing here waits on a snapshot copy (no CUDA call)
                    for a, b in pieces(0, nbytes):
                        _pause(stop, 0.0)
                        os.posix_fallocate(fd, a, b - a)
                        _pause(stop, REGISTER_GAP_S, quiet_first=False)
                else:
                    os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, nbytes)  # a file system without fallocate: pages come as they are written
            return torch.from_file(str(tmp), shared=True, size=nbytes, dtype=torch.uint8)

        return cls(path, _publish(path, fill), writable=True)

    @classmethod
    def open(cls, path: Path, nbytes: int, writable: bool) -> "Segment":
        """Map the existing segment at ``path`` (at least ``nbytes``): a regular file owned by this user,
        else ``OSError``. ``writable=False`` maps it copy-on-write: reading never changes it."""
        st = os.lstat(path)
        _check(st, path, nbytes)
        tensor = torch.from_file(str(path), shared=writable, size=st.st_size, dtype=torch.uint8)
        return cls(path, tensor, writable)

    def register(
        self, device: int | None = None, paced: bool = False, stop: threading.Event | None = None
    ) -> bool:
        """Page-lock the mapping with the CUDA driver (device-to-host copies at pinned bandwidth), as
        ``device``'s memory (default: this thread's current device), in pieces of :data:`REGISTER_PIECE`
        bytes: every CUDA copy into or out of a segment must stay inside one piece (:func:`pieces`).

        Every page is mapped first (:func:`populate`), so that the driver only pins pages already there
        (registering a 6.9 GiB segment whose pages were not mapped took 9 s on an H200 node). While the
        driver registers, the training thread's CUDA calls wait for it: registering 6.9 GiB at once
        stalled one step of a training loop 0.30-0.45 s, and back-to-back 64 MiB pieces 0.22 s; with
        ``paced`` (a background allocation beside a training loop) the pages are mapped 64 MiB at a time
        (~16 ms each) with a pause of :data:`REGISTER_GAP_S` after each, then each piece is registered (~3 ms)
        after such a pause, at a moment no snapshot copy is in flight (:data:`quiet`), and the loop ran at its
        own speed (same node, registration alone: 0.9 s in all, no step slower than without it). Mapping
        6.9 GiB in one call held the process's mmap lock 1.9 s and stalled the training thread (a pinned
        allocation of a save, a step) as long. Neither holds the GIL. ``False`` where there is no
        CUDA or the driver refuses (copies then go through pageable memory). ``stop`` set between two
        pieces: every piece registered so far is unregistered and :class:`AllocationStopped` raised."""
        if self.registered or not torch.cuda.is_available() or self.nbytes == 0:
            return self.registered
        if device is not None:
            torch.cuda.set_device(device)  # register in the context the copies run in, never device 0's
        ptr = self.tensor.data_ptr()
        if not paced:
            populate(ptr, self.nbytes, write=self.writable)
        else:  # mapping pages holds this process's mmap lock, which any allocation of the loop needs: in pieces
            for a, b in pieces(0, self.nbytes):
                _pause(stop, 0.0)
                populate(ptr + a, b - a, write=self.writable)
                _pause(stop, REGISTER_GAP_S, quiet_first=False)  # no CUDA call: copies in flight go on
        done: list[int] = []
        # paced: pieces registered back to back within one quiet moment, for at most this long (0: one a moment)
        burst = knobs.get("CKPT_REGISTER_BURST_MS") / 1e3 if paced else 0.0
        began: float | None = None  # when the burst under way began
        try:
            for a, b in pieces(0, self.nbytes):
                if began is not None and time.monotonic() - began < burst and not (copying and copying()):
                    _pause(stop, 0.0)  # the same quiet moment: the next piece at once
                else:
                    # the driver's registration, a few ms a piece, waits for a moment with no snapshot copy in
                    # flight
                    _pause(stop, REGISTER_GAP_S if paced else 0.0)
                    began = time.monotonic()
                rc = host_register(ptr + a, b - a)
                if rc != 0:
                    for p in done:
                        host_unregister(p)
                    log.warning(
                        "cudaHostRegister of the %.2f GiB memory-tier segment %s failed (CUDA error %d): "
                        "its copies go through pageable memory, slower",
                        self.nbytes / 2**30,
                        self.path,
                        rc,
                    )
                    return False
                done.append(ptr + a)
        except BaseException:  # stopped (or failed) between pieces: none of it stays registered
            for p in done:
                host_unregister(p)
            raise
        self._pieces = done
        self.registered = True
        return True

    def release(self) -> None:
        """Unregister and drop this process's mapping (the file stays; :func:`free` removes it)."""
        if self.registered:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                for p in self._pieces:
                    host_unregister(p)
            self.registered = False
            self._pieces = []
        self.tensor = torch.empty(0, dtype=torch.uint8, device="cpu")


class AllocationStopped(Exception):
    """A paced allocation (:meth:`Segment.create`, :meth:`Segment.register`) was told to stop: its owner
    is closing. Nothing it had done is left behind."""


def _pause(stop: threading.Event | None, seconds: float, quiet_first: bool = True) -> None:
    """Between two pieces of a paced allocation: wait ``seconds`` (then, where :data:`quiet` is set and
    ``quiet_first``, until it returns: before a registration), and raise :class:`AllocationStopped` as soon
    as ``stop`` is set."""
    if stop is None:
        if seconds > 0:
            time.sleep(seconds)
    elif stop.wait(seconds) if seconds > 0 else stop.is_set():
        raise AllocationStopped("the memory tier is closing")
    if seconds > 0 and quiet_first and quiet is not None:
        quiet()
        if stop is not None and stop.is_set():
            raise AllocationStopped("the memory tier is closing")


#: called between two pieces of a paced (background) allocation: returns once no snapshot is being copied to
#: the host (bounded), so that a snapshot's copy never runs beside a registration (:mod:`ckpt.pool` sets it)
quiet: Callable[[], None] | None = None
#: whether a snapshot is being copied to the host now (:mod:`ckpt.pool` sets it): a burst of registrations
#: (``CKPT_REGISTER_BURST_MS``) ends when one begins
copying: Callable[[], bool] | None = None


#: bytes per registration of a segment with the CUDA driver (a multiple of every chunk and alignment size)
REGISTER_PIECE = 64 << 20
#: pause after each piece of a paced registration (seconds): the training thread's CUDA calls get through
REGISTER_GAP_S = 0.005


def pieces(offset: int, nbytes: int) -> Iterator[tuple[int, int]]:
    """``[offset, offset + nbytes)`` of a segment cut at the boundaries of its registration pieces, as
    ``(start, end)`` ranges: a CUDA copy may not span two registrations (the driver refuses it with
    ``cudaErrorInvalidValue``), so every copy into or out of a segment goes range by range."""
    end = offset + nbytes
    while offset < end:
        cut = min(end, (offset // REGISTER_PIECE + 1) * REGISTER_PIECE)
        yield offset, cut
        offset = cut


_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context of the process
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+


def populate(ptr: int, nbytes: int, write: bool = True, threads: int = 1) -> bool:
    """Map every page of the range ``[ptr, ptr + nbytes)`` of a mapping into this process now
    (``madvise(MADV_POPULATE_WRITE)``, or ``_READ``), on ``threads`` threads (they inherit the caller's
    priority), without holding the GIL. ``False`` where the kernel or platform has no such advice (the
    pages are then mapped by whoever touches them first). One thread by default: on an H200 node, 8
    threads mapped 6.9 GiB in 1.7 s instead of 2.4 s but stalled the training thread three times,
    0.74 s in all (one thread: not once; the registration after it, 0.3 s)."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = ptr - ptr % page
    end = ptr + nbytes
    n = max(1, threads)
    step = -(-(end - start) // n // page) * page
    ranges = [(a, min(step, end - a)) for a in range(start, end, step)]
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ

    def one(r: tuple[int, int]) -> int:
        return 0 if libc.madvise(r[0], r[1], advice) == 0 else ctypes.get_errno() or -1

    if len(ranges) == 1:
        errs = [one(ranges[0])]
    else:
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="ckpt-populate") as ex:
            errs = list(ex.map(one, ranges))
    bad = next((e for e in errs if e), 0)
    if bad:
        log.debug(
            "madvise(MADV_POPULATE) of %d bytes failed (errno %d): pages are mapped on first touch",
            nbytes,
            bad,
        )
        return False
    return True


def _libc() -> Any:
    """This process's C library through ``ctypes`` (its calls release the GIL), or ``None``."""
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(None, use_errno=True)
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.madvise.restype = ctypes.c_int
            _LIBC = lib
    return _LIBC or None


_LIBC: Any = None


def _loaded_cudart() -> Any:
    """The CUDA runtime library this process's torch loaded, through ``ctypes`` (its calls release the
    GIL, torch's ``cudart()`` bindings do not), or ``None`` (torch linked it statically: use those)."""
    global _CUDART
    if _CUDART is None:
        _CUDART = False
        with contextlib.suppress(OSError):
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart.so" in line}
            for path in sorted(paths):  # the same file dlopen'ed again: the same handle, the same state
                with contextlib.suppress(OSError, AttributeError):
                    lib = ctypes.CDLL(path)
                    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
                    lib.cudaHostRegister.restype = ctypes.c_int
                    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
                    lib.cudaHostUnregister.restype = ctypes.c_int
                    lib.cudaGetLastError.argtypes = []
                    lib.cudaGetLastError.restype = ctypes.c_int
                    _CUDART = lib
                    break
    return _CUDART or None


_CUDART: Any = None


def host_register(ptr: int, nbytes: int) -> int:
    """``cudaHostRegister(ptr, nbytes, portable)``; the CUDA error code (0: registered). A failure is
    cleared from this thread's CUDA error state (see :func:`_forget_error`)."""
    torch.cuda.init()
    lib = _loaded_cudart()
    if lib is not None:
        rc = int(lib.cudaHostRegister(ptr, nbytes, _PORTABLE))
    else:
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    if rc:
        _forget_error(lib)
    return rc


def host_unregister(ptr: int) -> int:
    """``cudaHostUnregister(ptr)``; the CUDA error code (a failure cleared, as in :func:`host_register`)."""
    lib = _loaded_cudart()
    if lib is not None:
        rc = int(lib.cudaHostUnregister(ptr))
    else:
        rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if rc:
        _forget_error(lib)
    return rc


def _forget_error(lib: Any) -> None:
    """Clear the error a failed runtime call left in this thread's CUDA state. The runtime keeps the last
    error of each thread until ``cudaGetLastError`` reads it, and torch checks it after its own kernel
    launches: a registration we handled (its copies fall back to pageable memory) would otherwise fail the
    next tensor operation of this thread with the registration's error."""
    if lib is not None:
        lib.cudaGetLastError()
        return
    # torch's own bindings have no cudaGetLastError: a kernel launch reads (and clears) the error
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device="cuda").zero_()


def open_for_read(path: Path, nbytes: int) -> int:
    """A read-only descriptor of the segment at ``path`` (at least ``nbytes``): a regular file owned by
    this user, never followed through a link, else ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        _check(os.fstat(fd), path, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check(st: os.stat_result, path: Path, nbytes: int) -> None:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(
            errno.EPERM,
            "not a regular file owned by this user: a memory-tier segment is never mapped from such a file",
            str(path),
        )
    if st.st_size < nbytes:
        raise OSError(errno.EINVAL, f"segment holds {st.st_size} bytes, its record needs {nbytes}", str(path))


@dataclass
class SnapshotRecord:
    """A committed snapshot in a segment: its step, timeline and manifest (with chunk checksums)."""

    step: int
    timeline: Timeline
    manifest: Manifest
    slot: int
    buffer: str  # the segment's file name
    local_dir: str
    pid: int
    host: str
    created_unix: float
    path: Path | None = None  # the record file it was read from
    stamp: tuple[int, int] | None = None  # (inode, mtime_ns) of that file: it changes when rewritten

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "kind": _KIND,
                "format_version": FORMAT_VERSION,
                "step": self.step,
                **self.timeline.record(),
                "slot": self.slot,
                "buffer": self.buffer,
                "local_dir": self.local_dir,
                "pid": self.pid,
                "host": self.host,
                "created_unix": self.created_unix,
                "manifest": self.manifest.to_bytes().decode(),
            },
            separators=(",", ":"),
            allow_nan=False,
        ).encode()


def write_record(
    root: Path,
    prefix: str,
    slot: int,
    step: int,
    timeline: Timeline,
    manifest: Manifest,
    local_dir: str,
    guard: Callable[[SnapshotRecord], ContextManager[bool]] | None = None,
) -> SnapshotRecord | None:
    """Commit the snapshot in segment ``slot``: its record, put in place in one rename. ``guard(record)``:
    a context manager entered around that rename, whose value says whether to make it (``False``: nothing
    is published, ``None`` is returned); the caller's lock, held across its check and the rename."""
    rec = SnapshotRecord(
        step,
        timeline,
        manifest,
        slot,
        buffer_name(prefix, slot),
        os.path.realpath(local_dir),
        os.getpid(),
        socket.gethostname(),
        time.time(),
    )
    path = root / record_name(prefix, slot)
    rec.path = path

    def fill(fd: int, tmp: Path) -> None:
        with open(fd, "wb", closefd=False) as f:  # writes the whole record, however the OS splits it
            f.write(rec.to_bytes())

    if guard is None:
        _publish(path, fill)
        return rec
    return rec if _publish(path, fill, lambda: guard(rec)) else None


def _publish(
    path: Path, fill: Callable[[int, Path], Any], guard: Callable[[], ContextManager[bool]] | None = None
) -> Any:
    """Create ``path`` under a fresh temporary name (``0600``, never through a link), ``fill(fd, tmp)``
    it, then rename it into place: a reader sees the old file or the whole new one. On any failure
    the temporary is removed and ``path`` is left as it was. Returns what ``fill`` returned; with
    ``guard`` (a context manager entered around the rename, whose value says whether to make it), whether
    the file was put in place."""
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        out = fill(fd, tmp)
        if guard is None:
            os.rename(tmp, path)
            return out
        with guard() as go:
            if go:
                os.rename(tmp, path)
        if not go:
            os.unlink(tmp)
        return go
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


def remove_record(root: Path, prefix: str, slot: int) -> None:
    """Withdraw segment ``slot``'s snapshot (before its buffer is written again). An entry at the record's
    name that is not a regular file of this user is no record (it is never read as one) and is left alone;
    ``OSError`` when a record of this user's cannot be removed."""
    path = root / record_name(prefix, slot)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            raise


def read_snapshot_record(path: Path) -> SnapshotRecord:
    """Read and validate a record (bounded, regular files only, no pickle); ``CorruptCheckpointError``
    naming the file when it does not validate, ``OSError`` when it cannot be read."""
    where = str(path)
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise CorruptCheckpointError(f"{where}: not a regular file of this user, so no memory-tier record")
    raw = read_record(path, where, limit=MAX_RECORD_BYTES)
    d = parse_record(raw, where)
    try:
        ok = (
            d.get("kind") == _KIND
            and d.get("format_version") == FORMAT_VERSION
            and all(
                isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] >= 0
                for k in ("step", "slot", "pid", "timeline")
            )
            and isinstance(d.get("forks", []), list)
            and all(
                isinstance(f, list) and len(f) == 2 and all(isinstance(v, int) and v >= 0 for v in f)
                for f in d.get("forks", [])
            )
            and all(isinstance(d.get(k), str) for k in ("buffer", "local_dir", "host", "manifest"))
            and isinstance(d.get("created_unix"), (int, float))
        )
    except TypeError:
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"{where}: memory-tier record fails validation")
    manifest = Manifest.from_bytes(d["manifest"].encode(), where)
    m = _NAME_RE.match(d["buffer"])
    if (
        m is None
        or m.group(3) != "buf"
        or int(m.group(2)) != d["slot"]
        or manifest.step != d["step"]
        or not path.name.startswith(m.group(1))
    ):
        raise CorruptCheckpointError(f"{where}: names another segment or step than its own")
    timeline = Timeline(d["timeline"], tuple((int(n), int(s)) for n, s in d.get("forks", [])))
    return SnapshotRecord(
        d["step"],
        timeline,
        manifest,
        d["slot"],
        d["buffer"],
        d["local_dir"],
        d["pid"],
        d["host"],
        float(d["created_unix"]),
        path,
        (st.st_ino, st.st_mtime_ns),
    )


def still_current(rec: SnapshotRecord) -> bool:
    """Whether ``rec``'s file is still the one read (its buffer was not withdrawn or rewritten since)."""
    try:
        st = os.lstat(rec.path)
    except OSError:
        return False
    return (st.st_ino, st.st_mtime_ns) == rec.stamp


def _views(tensor: torch.Tensor, data_bytes: int, chunk: int) -> list[memoryview]:
    mv = memoryview(tensor.numpy())
    return [mv[i : min(i + chunk, data_bytes)] for i in range(0, data_bytes, chunk)]


def chunk_checksums(
    tensor: torch.Tensor,
    data_bytes: int,
    chunk: int,
    background: bool = False,
    stop: Callable[[], bool] | None = None,
) -> list[int] | None:
    """CRC-32C of each ``chunk`` bytes of ``tensor[:data_bytes]`` (a host tensor), on
    ``CKPT_IO_THREADS`` threads (the checksum releases the GIL); ``background`` (a commit while
    training runs): on ``CKPT_PERSIST_THREADS``. ``stop()``, asked before each chunk: ``True`` gives the
    pass up (``None`` is returned; the bytes are no longer wanted)."""
    views = _views(tensor, data_bytes, chunk)

    def one(v: memoryview) -> int | None:
        return None if stop is not None and stop() else checksum(v)

    if len(views) <= 1:
        sums = [one(v) for v in views]
    else:
        threads = knobs.get("CKPT_PERSIST_THREADS" if background else "CKPT_IO_THREADS")
        with ThreadPoolExecutor(max(1, min(len(views), threads))) as ex:
            sums = list(ex.map(one, views))
    return None if None in sums else sums  # type: ignore[return-value]


def first_bad_chunk(tensor: torch.Tensor, manifest: Manifest) -> int | None:
    """The index of the first chunk of ``tensor`` whose checksum differs from ``manifest``'s (``None``: all match)."""
    sums = chunk_checksums(tensor, manifest.data_bytes, manifest.chunk_bytes)
    return next((i for i, (a, b) in enumerate(zip(sums, manifest.chunks)) if a != b), None)


@dataclass
class SegmentInfo:
    """Segments of one local tier and rank found in the RAM file system (for ``ckpt ls`` / ``ckpt gc``)."""

    prefix: str
    nbytes: int  # RAM the files take
    files: list[Path]
    records: list[SnapshotRecord]  # the committed snapshots among them
    local_dir: str | None  # from a record, when one could be read


def segments(root: Path | None = None, prefix: str | None = None) -> list[SegmentInfo]:
    """Every memory-tier segment in ``root`` (default :func:`shm_root`), grouped by local tier and rank;
    only those of ``prefix`` when given. Unreadable records are left out of ``records``."""
    root = root if root is not None else shm_root()
    if root is None:
        return []
    groups: dict[str, SegmentInfo] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in sorted(names):
        m = (
            _NAME_RE.match(name.split(".new-")[0].lstrip("."))
            if name.startswith(".ckpt-")
            else _NAME_RE.match(name)
        )
        if m is None or (prefix is not None and m.group(1) != prefix):
            continue
        path = root / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            continue
        g = groups.setdefault(m.group(1), SegmentInfo(m.group(1), 0, [], [], None))
        g.files.append(path)
        g.nbytes += st.st_blocks * 512
        if name.endswith(".rec") and not name.startswith("."):
            try:
                rec = read_snapshot_record(path)
            except (OSError, CorruptCheckpointError):
                continue
            g.records.append(rec)
            g.local_dir = g.local_dir or rec.local_dir
    return list(groups.values())


def free(root: Path | None = None, prefix: str | None = None) -> int:
    """Remove the segments of ``prefix`` (every memory-tier segment when ``None``) from ``root``; returns
    the bytes of RAM given back once no process maps them. Records go first, so no reader is ever
    served a buffer whose record outlived it."""
    freed = 0
    for g in segments(root, prefix):
        for path in sorted(g.files, key=lambda p: not p.name.endswith(".rec")):
            try:
                n = os.lstat(path).st_blocks * 512
                os.unlink(path)
                freed += n
            except FileNotFoundError:
                pass
    return freed


@dataclass
class Orphan:
    """A group of segments no running job uses (:func:`orphans`): ``why`` is ``"directory gone"`` (its
    local_dir was deleted or made anew: no job can ever use them) or ``"owner gone"`` (the next job on that
    directory restores from them); ``age_s``, seconds since they were last written."""

    group: SegmentInfo
    why: str
    age_s: float


def orphans(root: Path | None = None, skip: str | None = None) -> list[Orphan]:
    """The groups of memory-tier segments in ``root`` (default :func:`shm_root`) that no running job uses:
    no process that committed one of their snapshots lives on this host, and no live process owns their
    local_dir. Groups with no readable record count only once they are a day old (a live job's segments
    have no record between their allocation and its first snapshot). ``skip``: a local_dir key
    (:func:`local_key`) to pass over (the caller's own)."""
    from .tiers.local import owned

    host = socket.gethostname()
    now = time.time()
    out = []
    for g in segments(root):
        key = local_key(g.prefix)
        if key == skip:
            continue
        try:
            age = now - max(os.lstat(f).st_mtime for f in g.files)
        except OSError:
            continue  # being removed
        if not g.records:
            if age > 86400:
                out.append(Orphan(g, "owner gone", age))
            continue
        if any(r.host == host and procs.alive(r.pid, since=r.created_unix) for r in g.records):
            continue
        local_dir = g.local_dir
        current = identity.directory_key(local_dir) if local_dir is not None else None
        if current is None or f"ckpt-{current}" != key:
            out.append(Orphan(g, "directory gone", age))
        elif not owned(local_dir):
            out.append(Orphan(g, "owner gone", age))
    return out


def sweep_orphans(root: Path | None = None, skip: str | None = None) -> int:
    """Free the segments of :func:`orphans` that no job can use (their directory is gone) or that are older
    than ``CKPT_SHM_ORPHAN_S``, and name the others in the log, in one warning (each group once per process;
    the first :data:`NAMED_AT_MOST` by directory, the rest counted: a node that many dead jobs left RAM on
    gets one line, not one per job); returns the bytes of RAM given back. The policy of a job's first save
    (``Checkpointer``, once it owns its local_dir), documented in docs/guides/memory.md."""
    limit = knobs.get("CKPT_SHM_ORPHAN_S")
    freed = 0
    named: list[SegmentInfo] = []
    for o in orphans(root, skip):
        g = o.group
        if o.why == "directory gone" or (limit > 0 and o.age_s > limit):
            n = free(root, g.prefix)
            freed += n
            log.info(
                "freed %.2f GB of RAM held by memory-tier segments no job can use (%s, %s; %.1f h old): %s",
                n / 1e9,
                o.why,
                g.local_dir or "no readable record",
                o.age_s / 3600,
                g.prefix,
            )
        elif g.prefix not in _NAMED:
            _NAMED.add(g.prefix)
            named.append(g)
    if named:
        shown = "; ".join(
            f"{g.local_dir} (steps {sorted(r.step for r in g.records)}, {g.nbytes / 1e9:.2f} GB)"
            for g in named[:NAMED_AT_MOST]
        )
        more = (
            f"; and {len(named) - NAMED_AT_MOST} more (`ckpt ls --memory` lists them)"
            if len(named) > NAMED_AT_MOST
            else ""
        )
        log.warning(
            "%.2f GB of RAM in %s hold snapshots of %d job(s) that are not running: %s%s. The next job on "
            "each directory restores from them; `ckpt gc --memory DIR` frees them now, and they are freed "
            "by themselves %.0f h after their last write (CKPT_SHM_ORPHAN_S)",
            sum(g.nbytes for g in named) / 1e9,
            root or shm_root(),
            len(named),
            shown,
            more,
            limit / 3600,
        )
    return freed


#: groups of segments :func:`sweep_orphans` names by directory in its one warning
NAMED_AT_MOST = 5

_NAMED: set[str] = set()  # groups sweep_orphans named already in this process

_TEMP_RE = re.compile(r"^\.(ckpt-[0-9a-f]{16}-[rp]\d{5}-s\d{2}\.(?:buf|rec))\.new-(\d+)-[0-9a-f]+$")


def remove_leftovers(root: Path, prefix: str) -> int:
    """Remove the half-made segments and records of ``prefix`` that another process left in ``root``: the
    temporaries :func:`_publish` writes before renaming them into place, when their writer was killed
    first (an OOM kill while a 7 GB segment was being reserved leaves 7 GB of RAM taken, and a job that
    keeps being killed there would fill the RAM file system). Called by the owner of ``prefix`` (one
    process at a time owns a local tier, so a temporary of another process's is no longer being
    written); regular files of this user only. Returns the bytes of RAM given back."""
    freed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        m = _TEMP_RE.match(name)
        if m is None or not m.group(1).startswith(prefix + "-s"):
            continue
        path = root / name
        try:
            st = os.lstat(path)
            # this process's own temporary is being written, unless it is older than this process: an earlier
            # process with the same pid left it (a container restarted after an OOM kill gets the same pid)
            if int(m.group(2)) == os.getpid() and procs.alive(os.getpid(), st.st_mtime):
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)
                freed += st.st_blocks * 512
                log.info(
                    "removed %s, a memory-tier segment its writer (pid %s) did not finish", path, m.group(2)
                )
        except FileNotFoundError:
            pass
    return freed


def record_of(root: Path, prefix: str, slot: int) -> SnapshotRecord | None:
    """Segment ``slot``'s record, or ``None`` when it has none or it does not validate (logged)."""
    path = root / record_name(prefix, slot)
    try:
        return read_snapshot_record(path)
    except FileNotFoundError:
        return None
    except (OSError, CorruptCheckpointError) as e:
        log.warning("memory-tier record %s is unusable, its snapshot is not served: %s", path, e)
        return None

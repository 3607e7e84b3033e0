"""One file of a layout of the caller's own on a store, written part by part and read back by range, through
the remote tier's store client (:class:`~ckpt.tiers.remote_store.StoreClient`: every request under the
watchdog of ``CKPT_REMOTE_STALL_S``, its puts, its reads of a range). The DCP adapter
(:mod:`ckpt.integrations.dcp`) keeps a rank's data file so; the remote tier's own data is one object per
chunk, each described by its manifest (:mod:`ckpt.tiers.remote_parts`), which is the form ``"parts"`` here
without a manifest.

The file takes the form its store takes best (:func:`form_of`):

``"file"``
    a mounted file system (``file://``): one file, written by positioned writes into a temporary file of
    this host (:class:`~ckpt.tiers.remote_store.OnHost`), flushed and renamed into place when it is closed.
``"multipart"``
    S3 through s3fs: one object, by a multipart upload whose every request is watched (parts of at least
    5 MiB, S3's least but for the last, and at most s3fs's ``default_block_size``); the object appears when
    the upload completes. A file smaller than a part is one put.
``"parts"``
    any other object store: one object per part, ``<path>.parts/000000``, ``000001`` ...; a reader maps a
    range onto them (:func:`read_file`), knowing the part size the writer recorded.

A failed upload publishes nothing (no object or file at its path): :meth:`FileUpload.abort` removes what it
uploaded (a pending multipart upload is aborted, since completing it would publish it), unless the store
stalled (removing would stall the same way), and says what it left where.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .. import stall
from ..stall import StallError
from .remote_parts import map_all, stall_names
from .remote_store import OnHost, StoreClient

__all__ = ["PARTS", "MIN_PART_BYTES", "FileUpload", "form_of", "part_path", "read_file"]

#: the suffix of the folder of a file's parts on a store of parts: ``<path>.parts/000000`` ...
PARTS = ".parts"
#: the least part size a caller may ask for
MIN_PART_BYTES = 4096
#: S3 takes no part of a multipart upload smaller than this, but the last
S3_MIN_PART_BYTES = 5 << 20


def form_of(client: StoreClient) -> str:
    """The form a file takes on ``client``'s store: ``"file"``, ``"multipart"`` or ``"parts"`` (the module
    docstring)."""
    if client._local_fs:
        return "file"
    return "multipart" if hasattr(client.fs.inner, "call_s3") else "parts"


def part_path(path: str, i: int) -> str:
    """The object holding part ``i`` of the file at ``path`` on a store of parts."""
    return f"{path}{PARTS}/{i:06d}"


def read_file(
    client: StoreClient, path: str, start: int, end: int, part_bytes: int | None = None
) -> bytes | bytearray:
    """Bytes ``[start, end)`` of a file :class:`FileUpload` wrote at ``path`` (fewer when it is short), each
    request one range read of the store client (:meth:`~ckpt.tiers.remote_store.StoreClient.read_range`).
    ``part_bytes``: the size of the parts it was written in on a store of parts (what its writer recorded);
    the range is then read from the parts it spans, else from the one object (or, on a mounted file system,
    where a file is always one file, the file). Failures are the store client's own, raised as they are."""
    if part_bytes is None or form_of(client) == "file":
        return client.read_range(path, start, end)
    out = bytearray()
    for i in range(start // part_bytes, -(-end // part_bytes) if end > start else 0):
        base = i * part_bytes
        a, b = max(start, base) - base, min(end, base + part_bytes) - base
        got = client.read_range(part_path(path, i), a, b)
        out += got
        if len(got) < b - a:
            break  # a short part: the file ends here
    return out


class FileUpload:
    """One file going to ``path`` on ``client``'s store in parts of ``part_bytes`` (in the form of
    :func:`form_of`), each part one request under the watchdog; ``who`` names the file in a stall's message
    (``"rank 0's rank-00000.dcp.bin of 'step-1'"``, as :func:`~ckpt.tiers.remote_parts.stall_names` names
    the remote tier's parts). Fed as it is produced (:meth:`write`: one part in flight while the next fills,
    so host memory holds about two parts, never the file) or from a finished file of this host
    (:meth:`send_file`: parts in parallel on the remote tier's pool); :meth:`close` publishes it,
    :meth:`abort` gives it up without publishing anything.

    Making one prepares the store: on a store of parts, the parts (and the single object) an earlier upload
    to ``path`` left are removed, so none outlives this one; on a mounted file system, the temporary file is
    created. A failed request raises the store client's own failure (a stall: :class:`~ckpt.stall.StallError`
    naming the URL, the file and the part)."""

    def __init__(self, client: StoreClient, path: str, who: str, part_bytes: int) -> None:
        self.client, self.path, self.who = client, path, who
        self.form = form_of(client)
        if self.form == "multipart":  # no larger than s3fs's own block (storage_options default_block_size)
            block = getattr(client.fs.inner, "default_block_size", None) or part_bytes
            part_bytes = max(min(part_bytes, block), S3_MIN_PART_BYTES)
        self.part_bytes = max(MIN_PART_BYTES, part_bytes)
        self.stalled = False
        self.tmp: str | None = None  # a mounted file system's temporary file
        self.upload_id: str | None = None  # s3fs's multipart upload, begun with the first part
        self.etags: list[dict[str, Any]] = []
        self._guard(-1, self._begin)
        self.buf = bytearray()
        self.sent = 0  # parts sent
        self.written = 0  # bytes written (a mounted file system's file)
        self.pending: Future | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-file-upload")

    # -- feeding it ---------------------------------------------------------------------------------------
    def write(self, data: Any) -> None:
        """Append ``data`` (any buffer). A mounted file system's file takes it by positioned writes straight
        from the caller's buffer (nothing copied or held); elsewhere full parts go up as they fill."""
        view = memoryview(data).cast("B")
        if self.form == "file":
            for a in range(0, len(view), self.part_bytes):
                piece = view[a : a + self.part_bytes]
                self._guard(self.sent, self._put_part, self.sent, piece, self.written)
                self.sent, self.written = self.sent + 1, self.written + len(piece)
            return
        while view:
            take = min(len(view), self.part_bytes - len(self.buf))
            self.buf += view[:take]
            view = view[take:]
            if len(self.buf) == self.part_bytes:
                self._send()

    def send_file(self, src: str) -> None:
        """Upload the finished file ``src`` of this host and :meth:`close`: its parts are read and sent in
        parallel on the remote tier's pool (:func:`~ckpt.tiers.remote_parts.map_all`,
        ``CKPT_REMOTE_THREADS``; the first failure cancels the parts not yet started), so host memory holds
        the parts in flight. A file that changes size meanwhile is an ``OSError(EIO)``."""
        fd = os.open(src, os.O_RDONLY)
        try:
            size, c = os.fstat(fd).st_size, self.part_bytes
            if self.form == "multipart" and size < c:  # smaller than a part: one plain put (close)
                self.buf += os.pread(fd, size, 0)
            elif size:
                if self.form == "multipart":
                    self._guard(-1, self._start_multipart)

                def put(i: int) -> None:
                    piece = os.pread(fd, min(c, size - i * c), i * c)
                    if len(piece) != min(c, size - i * c):
                        raise OSError(errno.EIO, f"{src}: shorter than it was ({size} bytes)", src)
                    self._guard(i, self._put_part, i, piece, i * c)

                self.sent = -(-size // c)
                map_all(put, self.sent, "ckpt-file-upload")
        finally:
            os.close(fd)
        self.close()

    def close(self) -> None:
        """Send what is left and publish the file: a mounted file system's file flushed and renamed into
        place, the multipart upload completed (the object appears only now)."""
        if self.form == "multipart" and self.sent == 0:  # smaller than a part: one plain put
            self._guard(-1, self.client._put, self.path, bytes(self.buf))
            self.pool.shutdown()
            return
        if self.buf:
            self._send()
        if self.pending is not None:
            self.pending.result()
        self.pool.shutdown()
        self._guard(-1, self._end)

    def abort(self) -> str | None:
        """Give the file up: remove what was uploaded. Returns ``None`` when nothing is left, else what stays
        where: after a stall nothing is removed (removing would stall the same way), and a removal that
        fails says its error. What stays is never published: no object or file is at ``path``."""
        self.pool.shutdown(
            wait=True, cancel_futures=True
        )  # a part in flight ends within the watchdog's bound
        p = self.pending
        if p is not None and p.done() and not p.cancelled() and isinstance(p.exception(), StallError):
            self.stalled = True
        where = self.client._url(
            self.tmp
            if self.form == "file" and self.tmp
            else self.path + PARTS
            if self.form == "parts"
            else self.path
        )
        if self.stalled:
            if self.form == "multipart":
                return (
                    f"the multipart upload of {where} stays pending (the store stalled; never completed, so no "
                    "object: abort it, or let a lifecycle rule of the bucket expire it)"
                )
            return f"its partial upload stays at {where} (the store stalled)"
        try:
            self._discard()
        except Exception as e:  # noqa: BLE001 - the upload's own error is the one to report
            return f"its partial upload at {where} could not be removed ({type(e).__name__}: {e})"
        return None

    # -- the requests, by form ------------------------------------------------------------------------------
    def _guard(self, i: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a request of part ``i`` (-1: of the file); a stall names the file and the part."""
        what = f"part {i} of {self.who}" if i >= 0 else self.who
        try:
            with stall_names(what):
                return fn(*args)
        except StallError:
            self.stalled = True
            raise

    def _send(self) -> None:
        data, self.buf = bytes(self.buf), bytearray()  # object-store clients want bytes
        if self.pending is not None:
            self.pending.result()  # the part before: at most one in flight
        i, self.sent = self.sent, self.sent + 1
        self.pending = self.pool.submit(self._guard, i, self._put_part, i, data, i * self.part_bytes)

    def _begin(self) -> None:
        if self.form == "file":
            self.client.fs.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.tmp = f"{self.path}.tmp-{os.getpid()}"
            stall.call(OnHost, "create", self.tmp)
        elif self.form == "parts":
            self._clear()

    def _put_part(self, i: int, data: Any, offset: int) -> None:
        """Part ``i``, the file's bytes from ``offset``: written at ``offset`` of the temporary file, one
        object, or part ``i + 1`` of the multipart upload (sent again after a stall, a part replaces itself)."""
        if self.form == "file":
            stall.call(OnHost, "write_at", self.tmp, data, offset)
        elif self.form == "parts":
            self.client._put(part_path(self.path, i), bytes(data))
        else:
            if self.upload_id is None:
                self._start_multipart()
            out = self._s3("upload_part", PartNumber=i + 1, UploadId=self.upload_id, Body=bytes(data))
            self.etags.append({"PartNumber": i + 1, "ETag": out["ETag"]})  # list.append: any thread

    def _start_multipart(self) -> None:
        """Begin the multipart upload, before its parts are sent (in any order)."""
        self.upload_id = self._s3("create_multipart_upload")["UploadId"]

    def _end(self) -> None:
        if self.form == "file":
            stall.call(OnHost, "publish", self.tmp, self.path)
        elif self.upload_id is not None:
            parts = sorted(self.etags, key=lambda p: p["PartNumber"])
            self._s3("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": parts})
            self.client.fs.invalidate_cache(self.path)

    def _discard(self) -> None:
        if self.form == "file":
            if self.tmp is not None:
                self.client.remove(self.tmp)
        elif self.form == "parts":
            self._clear()
        elif self.upload_id is not None:
            self._s3("abort_multipart_upload", UploadId=self.upload_id)

    def _s3(self, method: str, **kwargs: Any) -> Any:
        """One S3 request of s3fs for the object at ``path``, under the watchdog (cancelled on the file
        system's loop when it stalls); a stall names the object's URL."""
        inner = self.client.fs.inner
        bucket, key, _ = inner.split_path(self.path)
        try:
            return stall.call(inner, "call_s3", method, Bucket=bucket, Key=key, **kwargs)
        except StallError as e:
            raise StallError(e.errno, e.strerror, self.client._url(self.path)) from None

    def _clear(self) -> None:
        """Remove the parts and the single object an earlier upload to ``path`` left."""
        try:
            self.client.fs.rm(f"{self.path}{PARTS}", recursive=True)
        except FileNotFoundError:
            pass  # nothing there
        self.client.remove(self.path)

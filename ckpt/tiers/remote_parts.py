"""A rank's data on the remote tier as parts: one object per chunk (``rank-00000/part-000000`` ...), raw or
zstd-compressed, uploaded and downloaded as parallel independent requests. The upload of a data file's
chunks; the checks of what a manifest states about its parts against the parts themselves (codec, stored
size, decoded size, a listing); the bounded read of one part, decoded and checked against its checksum;
and the parallel download of a rank's data into tensors or the local tier."""

from __future__ import annotations

import bisect
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

    from .remote_store import StoreClient

from .. import knobs
from ..codec import RAW, check_codec, decode, encode, max_decoded
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format import ItemRecord, Manifest
from ..integrity import checksum
from ..scatter import Scatter
from ..stall import StallError
from .remote_errors import caused_by

__all__ = [
    "ABSENT",
    "Parts",
    "may_be_left_out",
    "map_all",
    "dominant_elem_size",
    "put_part",
    "stall_names",
]

#: the codec of a part a rank did not upload: its bytes are replicated tensors that rank 0 stores
ABSENT = "absent"


class Parts:
    """The parts of a rank's data, mixed into :class:`~ckpt.tiers.remote.RemoteTier` (its store through
    :class:`~ckpt.tiers.remote_store.StoreClient`; ``step_dir`` its layout)."""

    rank: int
    compression: str | None  # of the parts this rank uploads: None or "zstd"

    def _part(self, step: int, i: int, rank: int | None = None, generation: str | None = None) -> str:
        base = self.step_dir(step) if generation is None else f"{self.step_dir(step)}/{generation}"
        return f"{base}/rank-{self.rank if rank is None else rank:05d}/part-{i:06d}"

    def _put_parts(
        self,
        step: int,
        manifest: Manifest,
        data: memoryview,
        sizer: Callable[[int], int],
        source: str | None,
        gen: str | None,
        absent: set[int],
    ) -> list[tuple[int, str, int]]:
        """Encode and upload this rank's chunks of ``data`` as the parts of ``step`` (under ``gen``, a
        replacement's generation), in parallel; returns each chunk's checksum, codec and stored size.
        ``source``: the file ``data`` was read from, whose checksums ``manifest.chunks`` are: a chunk that
        fails them raises :class:`~ckpt.errors.CorruptCheckpointError` before it is uploaded. ``absent``: the
        chunks that rank 0 uploads (nothing is stored for them); ``sizer``: the element size that the byte
        shuffle of chunk ``i`` uses."""
        c, n = manifest.chunk_bytes, -(-manifest.data_bytes // manifest.chunk_bytes)

        def put(i: int) -> tuple[int, str, int]:
            view = data[i * c : (i + 1) * c]
            crc = checksum(view)
            if source is not None and crc != manifest.chunks[i]:
                raise CorruptCheckpointError(
                    f"{source}: bytes [{i * c}, {i * c + len(view)}) fail their {manifest.checksum_algorithm} "
                    f"checksum; nothing of step {step} at {self.url} was replaced"
                )
            if i in absent:  # only replicated bytes: rank 0 uploads them
                return crc, ABSENT, 0
            stored, codec = encode(view, self.compression, sizer(i))
            put_part(
                self,
                self._part(step, i, generation=gen),
                stored,
                f"rank {self.rank}'s part {i} of step {step}",
            )
            return crc, codec, len(stored)

        return map_all(put, n, "ckpt-upload")

    def _check_parts(self, step: int, m: Manifest) -> None:
        """Each part's codec must be one this library writes and its recorded stored size one that can
        hold its chunk (raw: the chunk itself; zstd: see :func:`~ckpt.codec.max_decoded`), so that no
        size the manifest states is used unless the stored bytes can back it. A part may be left out
        (``"absent"``, nothing stored) only where the writer leaves one out (:func:`may_be_left_out`):
        else a manifest could vouch for data that no object holds, and verify without reading a byte."""
        c = m.chunk_bytes
        left_out = may_be_left_out(m)
        for i, (codec, stored) in enumerate(zip(m.codecs, m.stored_sizes)):
            size = min(c, m.data_bytes - i * c)
            if codec == ABSENT:
                if stored == 0 and left_out(i):
                    continue
                if stored == 0:  # the manifest says that rank 0 holds bytes it does not
                    raise CorruptCheckpointError(
                        f"{self._url(self._part(step, i, m.rank, m.generation))}: not stored ({ABSENT!r}), but only a "
                        "job's rank above 0 leaves out a chunk, and only one holding nothing but replicated "
                        "tensors (which rank 0 stores)"
                    )
            else:
                check_codec(codec, self._url(self._part(step, i, m.rank, m.generation)))
                if (stored == size) if codec == RAW else (0 < stored <= size <= max_decoded(codec, stored)):
                    continue
            raise CorruptCheckpointError(
                f"{self._url(self._part(step, i, m.rank, m.generation))}: a {codec!r} part of {stored} "
                f"stored bytes cannot hold its {size}-byte chunk"
            )

    def check_stored(self, step: int, m: Manifest) -> None:
        """Every part of saved rank ``m.rank`` is there with the size its manifest records: one listing,
        before any part is downloaded or room for the data is allocated."""
        base = self.step_dir(step) if m.generation is None else f"{self.step_dir(step)}/{m.generation}"
        d = f"{base}/rank-{m.rank:05d}"
        entries = self.listing(f"listing {self._url(d)}", "ls", d, [], detail=True)
        # a key prefix that shares a part's name (``part-000001/x``: S3 lists both) is not the part
        held = {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size")
            for e in entries
            if e.get("type") != "directory"
        }
        for i, (codec, stored) in enumerate(zip(m.codecs, m.stored_sizes)):
            name = f"part-{i:06d}"
            if codec != ABSENT and held.get(name) != stored:
                where = self._url(self._part(step, i, m.rank, m.generation))
                raise IncompleteCheckpointError(
                    f"{where}: missing"
                    if name not in held
                    else f"{where}: {held[name]} bytes, {stored} committed"
                )

    def fetch(self, step: int, rank: int, manifest: Manifest, i: int) -> bytes | bytearray:
        """Part ``i`` of saved rank ``rank``'s data, decoded and checked against its checksum.

        A store failure is an ``OSError`` naming the part's URL; the read asks for no more than the
        stored size the manifest records (and one byte, to see a longer object)."""
        path = self._part(step, i, rank, manifest.generation)
        where = self._url(path)
        if manifest.codecs[i] == ABSENT:
            raise IncompleteCheckpointError(
                f"{where}: not stored (only replicated tensors, which rank 0 holds)"
            )
        expect = manifest.stored_sizes[i]
        status = self.status  # one record: another thread may replace it
        down = status.error if status.available is False else None
        if down is not None:  # another part of this load met the outage: the load fails anyway, fail fast
            raise ConnectionError(down.errno, f"reading {where}: not attempted, {down.strerror}")
        try:
            with self._store(f"reading rank {rank}'s part {i} of step {step} ({where})"):
                stored = self.read_range(path, 0, expect + 1)  # one byte more: to see a longer object
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{where}: missing") from None
        if len(stored) != expect:
            raise IncompleteCheckpointError(
                f"{where}: {len(stored)}{'+' if len(stored) > expect else ''} bytes, {expect} committed"
            )
        size = min(manifest.chunk_bytes, manifest.data_bytes - i * manifest.chunk_bytes)
        raw = decode(stored, manifest.codecs[i], size, where)
        if len(raw) != size or checksum(raw) != manifest.chunks[i]:
            raise CorruptCheckpointError(f"{where}: fails its {manifest.checksum_algorithm} checksum")
        return raw

    def load(
        self, step: int, manifest: Manifest, dest: list[torch.Tensor | None] | None, refill: Any = None
    ) -> None:
        """Download, decode and verify every part in parallel; scatter into ``dest`` (if given) and write
        the local tier ``refill`` (if given) on the way, so that the next restore is local."""
        import torch

        self.check_stored(step, manifest)  # before the refill allocates room for data_bytes
        sc = Scatter(manifest.items, dest) if dest is not None else None
        if sc is not None:
            sc.open_streams()  # here, on the caller's thread: after what it queued on the GPU
        c, n = manifest.chunk_bytes, len(manifest.chunks)

        def fetch(i: int) -> bytes:
            try:
                raw = self.fetch(step, manifest.rank, manifest, i)
            except OSError as e:  # the store, not the local disk the bytes were going to
                error = StallError if isinstance(e, StallError) else OSError
                path = self._part(step, i, manifest.rank, manifest.generation)
                raise error(
                    e.errno,
                    f"downloading {path} from {self.url} failed ({e.strerror or e}); check "
                    "storage_options and the store",
                    e.filename or self._url(path),
                ) from e
            size = len(raw)
            if sc is not None:
                chunk = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if size
                    else torch.empty(0, dtype=torch.uint8, device="cpu")
                )
                sc.copy(chunk, i * c)
                if sc.to_device:
                    sc.synchronize()  # the pageable source must outlive the copy
            return raw

        if refill is not None:
            # The local writer pulls each part through fetch(): downloads stream straight to disk,
            # with only the parts in flight held in memory. It reports any OSError as its own write
            # failure ("check the local_dir path"): a failed download is raised as what it is.
            fetch_errors: list[BaseException] = []

            def source(i: int) -> bytes:
                try:
                    return fetch(i)
                except BaseException as e:
                    fetch_errors.append(e)
                    raise

            try:
                refill.write_chunks(step, manifest, source, compute_checksums=False)
            except BaseException as e:
                origin = next((f for f in fetch_errors if caused_by(e, f)), None)
                if origin is None or origin is e:
                    raise
                raise origin from None
            return
        map_all(fetch, n, "ckpt-download")


def may_be_left_out(m: Manifest) -> Callable[[int], bool]:
    """Whether the writer of ``m`` may have left chunk ``i`` out
    (:meth:`~ckpt.tiers.remote_job.JobCommit._held_by_rank0`): only a job tier's rank above 0 does, and only
    a chunk that holds no byte of a tensor it stores alone (not in ``m.replicated``). Built from merged chunk
    spans, so a manifest claiming vast sizes costs no more than its items."""
    if m.rank == 0 or m.world_size < 2 or not m.replicated:
        return lambda i: False
    c, shared = m.chunk_bytes, set(m.replicated)
    spans: list[list[int]] = []
    for a, b in sorted(
        (it.offset // c, (it.offset + it.nbytes - 1) // c)
        for k, it in enumerate(m.items)
        if k not in shared and it.alias_of is None and it.nbytes
    ):
        if spans and a <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    starts = [a for a, _ in spans]

    def left_out(i: int) -> bool:
        j = bisect.bisect_right(starts, i) - 1
        return j < 0 or spans[j][1] < i

    return left_out


@contextlib.contextmanager
def stall_names(who: str, url: str | None = None) -> Iterator[None]:
    """A :class:`~ckpt.stall.StallError` raised inside is raised again naming ``who`` (``"rank 0's part 3
    of step 7"``) and ``url`` (``None``: the URL the stalled request was for): ``"<who> (<url>): <what
    stalled>"``, its ``errno`` and ``filename`` kept. The one wording of a stalled part, the remote tier's
    and the DCP adapter's (:mod:`ckpt.integrations.dcp`)."""
    try:
        yield
    except StallError as e:
        where = e.filename if url is None else url
        raise StallError(e.errno, f"{who} ({where}): {e.strerror}", e.filename) from None


def put_part(client: StoreClient, path: str, data: Any, who: str) -> None:
    """Put one part, ``data``, at ``path`` through ``client``
    (:meth:`~ckpt.tiers.remote_store.StoreClient._put`: one request under the watchdog, fsynced on a
    local or mounted file system); a stall names ``who`` (:func:`stall_names`). Object-store clients
    want bytes; local and mounted file systems take a view as it is."""
    with stall_names(who, client._url(path)):
        client._put(path, data if client._local_fs else bytes(data))


def map_all(fn: Callable[[int], Any], n: int, name: str) -> list[Any]:
    """``[fn(i) for i in range(n)]`` on the remote tier's thread pool; the first failure cancels the
    calls not yet started (an outage fails one request, not every remaining one after its retries)."""
    with ThreadPoolExecutor(knobs.get("CKPT_REMOTE_THREADS"), thread_name_prefix=name) as ex:
        futures = [ex.submit(fn, i) for i in range(n)]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def dominant_elem_size(items: list[ItemRecord], chunk: int) -> Callable[[int], int]:
    """Element size of the tensor covering most of chunk ``i`` (for the byte shuffle)."""
    import torch

    spans = sorted(
        (it.offset, it.offset + it.nbytes, getattr(torch, it.dtype).itemsize)
        for it in items
        if it.alias_of is None and it.nbytes
    )
    starts = [s[0] for s in spans]

    def size(i: int) -> int:
        lo, hi = i * chunk, (i + 1) * chunk
        best, best_len = 1, 0
        j = max(0, bisect.bisect_right(starts, lo) - 1)
        while j < len(spans) and spans[j][0] < hi:
            cover = min(hi, spans[j][1]) - max(lo, spans[j][0])
            if cover > best_len:
                best, best_len = spans[j][2], cover
            j += 1
        return best

    return size

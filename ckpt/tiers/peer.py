"""The peer tier: each rank's snapshots replicated into another rank's RAM, so that a replaced node
resumes without touching a disk or object storage.

Rank ``r`` sends every snapshot its peer lane takes to rank ``(r + jump) % world`` (its *holder*)
and holds the snapshots of rank ``(r - jump) % world`` (its *source*). With ``jump`` = ranks per node,
the replica lives on the next node: a node that is lost for good (its RAM and NVMe with it) gets
each of its ranks' newest snapshot back from the holders' RAM at restore.

The holder keeps the replicas in a snapshot pool of its own (:class:`ckpt.pool.HostPool`, two
buffers), as shared-memory segments named from its ``local_dir`` and the source rank
(``ckpt-<hash>-p<source>-s<slot>``, :func:`ckpt.shm.replica_prefix`), so a replica outlives the
holder's process too, and a :class:`~ckpt.tiers.memory.MemoryTier` over them lists, verifies and
serves them like any snapshot. A replica is committed (its record written) only after every chunk
landed and matched the sender's CRC-32C; the buffer it goes into has its record withdrawn first and
is never the one holding the newest committed replica, so a replica being overwritten when a node
dies is never served and the previous one stays valid. The holder's disk never sees a replica.

Transport (:class:`Exchange`): small control messages (sizes, the manifest, "ready", "kept") over a
gloo group of the tier's own; the data in pieces, either over the same gloo group straight from and
into host memory (the default), or, with ``CKPT_PEER_NCCL=1`` in a job with GPUs, over an NCCL group
of its own on a stream of its own, staged through a small ring of reused device buffers. Both move
from the sender's host buffer into the holder's segment with no other copy. The holder checks each piece
as it lands: over gloo on its host's threads, over NCCL on its GPU, in the staging buffer the piece passes
through (:func:`_checked_on_the_way`), so no host core reads the replica.

Collective contract: every rank exchanges the same steps in the same order. The pipeline gives the
peer lane a snapshot only when the lane is idle on every rank (the busy flags are agreed at ``save()``),
and a rank whose snapshot failed still takes its part (it sends "nothing").

Ideas from: Gemini (Wang et al., SOSP 2023, checkpoints in the CPU memory of peer machines),
ML Flashpoint's pairwise RAM replication and the NVIDIA resiliency extension's local checkpointing
with peer replication; the code is ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from .. import device_crc, knobs, shm
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import Manifest
from ..integrity import checksum
from ..policy import Committed, Timeline, TimelineCopies
from ..pool import HostPool, SharedSpace
from ..ranks import Ranks
from .base import PersistingTier, StepInfo, Tier, register
from .memory import MemoryTier, _scatter, _to_device

__all__ = ["PeerTier", "Exchange", "ReceivedCopy", "REPLICA_SLOTS", "over_nccl", "rank_gpu"]

log = logging.getLogger(__name__)

#: replica buffers a holder keeps per source rank: the newest committed one and the one being received
REPLICA_SLOTS = 2
_HDR = 7  # ok, manifest bytes, data bytes, step, timeline number, number of forks, piece bytes
_MAX_FORKS = 1 << 16


def replica_space(local_dir: str | os.PathLike, src: int) -> SharedSpace | None:
    """Where the holder of ``local_dir`` keeps rank ``src``'s replicas (``None``: no RAM file system,
    or ``CKPT_SHM=0``: the replicas then live in the holder's process memory)."""
    root = shm.shm_root()
    prefix = None if root is None else shm.replica_prefix(local_dir, src, create=True)
    if prefix is None:
        return None
    return SharedSpace(root, prefix, os.path.realpath(os.fspath(local_dir)))


class Exchange:
    """Moves one image each way between this rank and two others: its sends go to one rank, its receives
    come from another (the same rank in a job of two).

    Control messages go over ``group`` (gloo); the data over ``group`` too, or, with ``device`` (a CUDA
    device) and ``data_group`` (NCCL), staged through ``ring`` pairs of device buffers on a stream of its
    own. Each round posts its send and receive together (:func:`torch.distributed.batch_isend_irecv`),
    so no order of posting can deadlock; messages between two ranks are matched in the order posted.
    """

    def __init__(
        self,
        group: Any,
        piece: int,
        data_group: Any = None,
        device: torch.device | None = None,
        ring: int = 2,
    ) -> None:
        self.group = group
        self.piece = piece  # bytes per data message this rank sends (the receiver is told)
        self.data_group = data_group if data_group is not None else group
        self.device = device
        # two streams of its own on a GPU: host -> device copies (and the sends/receives queued behind them),
        # device -> host copies; pieces then move in a pipeline (see _staged)
        cuda = device is not None and device.type == "cuda"
        self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None
        self._ring = ring
        self._staging: list[tuple[torch.Tensor, torch.Tensor]] = []

    def warm(self, to: int, frm: int) -> None:
        """Set the data transport up with ``to`` and ``frm`` now, with one byte each way (collective with
        both): NCCL creates the communicator of a pair and connects it at their first message, which takes a
        second or more and would otherwise fall on the first exchange, or on a replaced rank's restore."""
        dev = self.device if self.device is not None and self.device.type == "cuda" else None
        with torch.cuda.device(dev) if dev is not None else contextlib.nullcontext():
            out = torch.zeros(1, dtype=torch.uint8, device=dev or "cpu")
            into = torch.empty(1, dtype=torch.uint8, device=dev or "cpu")
            for w in self._post(out, to, into, frm):
                w.wait()
            if dev is not None:
                torch.cuda.current_stream(dev).synchronize()

    def swap(
        self,
        out: torch.Tensor | None,
        to: int | None,
        into: torch.Tensor | None,
        frm: int | None,
        group: Any = None,
    ) -> None:
        """One round: send ``out`` to ``to`` and receive ``into`` from ``frm`` (either side ``None``: none)."""
        for w in _post(out, to, into, frm, group or self.group):
            w.wait()

    def data(
        self,
        out: torch.Tensor | None,
        to: int | None,
        into: torch.Tensor | None,
        frm: int | None,
        in_piece: int,
        landed: Callable[[int, int], None],
        out_ready: Callable[[int, int], None] | None = None,
        on_gpu: Callable[[torch.Tensor, int], None] | None = None,
    ) -> None:
        """Send ``out`` (host bytes) to ``to`` in pieces of :attr:`piece` bytes and receive ``into`` (host
        bytes) from ``frm`` in pieces of ``in_piece`` (the sender's); ``landed(offset, length)`` is called
        as each received piece is in ``into`` (the caller checks it while the next one arrives). On the
        device path ``out`` and ``into`` may be on the GPU; ``out_ready(offset, length)``, with ``out`` on
        the GPU, makes the current stream wait until those bytes of ``out`` are written (it is still being
        filled). ``on_gpu(piece, offset)``, on the device path with ``into`` on the host, is called with each
        received piece where it landed on the GPU (a staging buffer), on a stream of its own that the copy
        down waits for before the buffer is reused: work it queues there (checks) sees the piece's bytes;
        ``landed`` for that piece runs after that work is done."""
        n_out = out.numel() if out is not None and to is not None else 0
        n_in = into.numel() if into is not None and frm is not None else 0
        k_out = -(-n_out // self.piece)
        k_in = -(-n_in // in_piece) if n_in else 0
        if self.device is not None:
            sides = _Sides(out, to, into, frm, in_piece, n_out, n_in, max(k_out, k_in))
            self._staged(sides, landed, out_ready, on_gpu)
            return
        dist = torch.distributed
        posted = []  # every piece posted at once (a stream, matched in order), then taken as it lands
        for i in range(max(k_out, k_in)):
            ops = []
            if i < k_out:
                ops.append(
                    dist.P2POp(
                        dist.isend, out[i * self.piece : (i + 1) * self.piece], to, group=self.data_group
                    )
                )
            recv = into[i * in_piece : (i + 1) * in_piece] if i < k_in else None
            if recv is not None:
                ops.append(dist.P2POp(dist.irecv, recv, frm, group=self.data_group))
            posted.append((dist.batch_isend_irecv(ops), recv, i * in_piece))
        for works, recv, off in posted:
            for w in works:
                w.wait()
            if recv is not None:
                landed(off, recv.numel())

    def _staged(
        self,
        sides: _Sides,
        landed: Callable[[int, int], None],
        out_ready: Callable[[int, int], None] | None = None,
        on_gpu: Callable[[torch.Tensor, int], None] | None = None,
    ) -> None:
        """The device path: per piece, host -> device staging (sender), send/receive over ``data_group``,
        device staging -> host (receiver). On a GPU the three run as a pipeline over ``ring`` staging pairs:
        piece i + 1 is copied up on one stream while piece i is on the wire (NCCL's stream) and piece i - 1 is
        copied down on the other; a staging pair is reused only once the piece it held is on the host.
        ``landed`` runs on this thread for each piece once it is in ``into``, at most ``ring`` pieces behind.
        An ``into`` on the GPU (a restore) takes the pieces straight from the wire, an ``out`` on the GPU is sent
        from where it is."""
        out, to, into, frm, in_piece, n_out, n_in, pieces = sides
        size = max(self.piece, in_piece if n_in else 0)
        up, down = self._streams if self._streams is not None else (None, None)
        # a receive buffer on the GPU (a restore): the pieces land in it directly, no staging, no copy down;
        # data to send already on the GPU (a replica read there to be served) goes from where it is
        direct = into is not None and into.device.type == "cuda"
        direct_out = out is not None and out.device.type == "cuda"
        if up is not None and (direct or direct_out):
            # after what this thread queued on the device (an `into` just allocated there). Only then: the
            # current stream of the persist thread is the default one, where the training queues its steps,
            # and an exchange between host buffers must not wait for them
            up.wait_stream(torch.cuda.current_stream(self.device))
        # staging pairs only where a side goes through them (a restore's holder reading onto its GPU and an
        # owner receiving onto its GPU need none: 2 x ring x piece of GPU memory not taken)
        staged = (n_out and not direct_out) or (n_in and not direct)
        if staged and (not self._staging or self._staging[0][0].numel() < size):
            self._staging = []  # the old pair goes first: a larger one must not need both at once
            # allocated on the stream that first writes them: the caching allocator hands out memory that is
            # free in that stream's order (on the training's stream, a block the training just freed could
            # still be written by its queued kernels while ours lands in it)
            with torch.cuda.stream(up) if up is not None else contextlib.nullcontext():
                self._staging = [
                    (
                        torch.empty(size, dtype=torch.uint8, device=self.device),
                        torch.empty(size, dtype=torch.uint8, device=self.device),
                    )
                    for _ in range(self._ring)
                ]
        # a received piece's own work on the GPU (checks) runs on a third stream, beside its copy down
        check = (
            torch.cuda.Stream(self.device)
            if on_gpu is not None and up is not None and n_in and not direct
            else None
        )
        free: list[Any] = [None] * self._ring  # per pair: event after its last piece reached the host
        pending: list[tuple[Any, int, int]] = []  # (event, offset, length) of pieces on their way to the host
        with torch.cuda.device(self.device) if up is not None else contextlib.nullcontext():
            for i in range(pieces):
                j = i % self._ring
                s_buf, r_buf = self._staging[j] if staged else (None, None)
                a, b = i * self.piece, i * in_piece
                k = min(self.piece, n_out - a) if a < n_out else 0
                r = min(in_piece, n_in - b) if b < n_in else 0
                with torch.cuda.stream(up) if up is not None else contextlib.nullcontext():
                    if free[j] is not None:
                        up.wait_event(free[j])  # the pair's previous piece was sent and is on the host
                    if (
                        k and not direct_out
                    ):  # piece by registration piece of the snapshot buffer (shm.pieces)
                        for x, y in shm.pieces(a, k):
                            s_buf[x - a : y - a].copy_(out[x:y], non_blocking=True)
                    target = (into[b : b + r] if direct else r_buf[:r]) if r else None
                    if k and direct_out and out_ready is not None:
                        out_ready(a, k)  # the up stream waits for the piece to be on the GPU
                    source = (out[a : a + k] if direct_out else s_buf[:k]) if k else None
                    works = self._post(source, to, target, frm)
                with torch.cuda.stream(down) if down is not None else contextlib.nullcontext():
                    for w in works:
                        w.wait()  # on a GPU: the down stream waits for the wire, the host does not
                    if r and check is not None:  # the piece's checks, on the GPU while it is copied down
                        check.wait_stream(down)
                        with torch.cuda.stream(check):
                            on_gpu(r_buf[:r], b)
                    if r and not direct:
                        for x, y in shm.pieces(b, r):
                            into[x:y].copy_(r_buf[x - b : y - b], non_blocking=True)
                    if r and check is not None:
                        down.wait_stream(
                            check
                        )  # the pair is reused, and the piece landed, once both are done
                    ev = None
                    if down is not None:
                        ev = torch.cuda.Event()
                        ev.record(down)
                    free[j] = ev
                if r:
                    pending.append((ev, b, r))
                while pending and (len(pending) >= self._ring or i == pieces - 1):
                    ev, off, n = pending.pop(0)
                    if ev is not None:
                        ev.synchronize()
                    landed(off, n)
            if up is not None:
                up.synchronize()
                down.synchronize()

    def _post(
        self, out: torch.Tensor | None, to: int | None, into: torch.Tensor | None, frm: int | None
    ) -> list:
        """Post one send and/or receive over ``data_group`` together; returns their works (not waited)."""
        return _post(out, to, into, frm, self.data_group)


class _Sides(NamedTuple):
    """What one :meth:`Exchange.data` call moves over the device path: ``out`` to ``to`` (``n_out`` bytes) and
    ``into`` from ``frm`` (``n_in`` bytes, in the sender's pieces of ``in_piece``), in ``pieces`` rounds."""

    out: torch.Tensor | None
    to: int | None
    into: torch.Tensor | None
    frm: int | None
    in_piece: int
    n_out: int
    n_in: int
    pieces: int


def _post(
    out: torch.Tensor | None, to: int | None, into: torch.Tensor | None, frm: int | None, group: Any
) -> list:
    """Post a send of ``out`` to ``to`` and a receive into ``into`` from ``frm`` over ``group`` together (either
    side ``None``: none), so no order of posting between two ranks can deadlock; returns their works."""
    dist = torch.distributed
    ops = []
    if out is not None and to is not None:
        ops.append(dist.P2POp(dist.isend, out, to, group=group))
    if into is not None and frm is not None:
        ops.append(dist.P2POp(dist.irecv, into, frm, group=group))
    return dist.batch_isend_irecv(ops) if ops else []


def checked_receive(
    wire: Exchange,
    out: torch.Tensor | None,
    to: int | None,
    into: torch.Tensor | None,
    frm: int | None,
    in_piece: int,
    manifest: Manifest | None,
    threads: int | None = None,
    out_ready: Callable[[int, int], None] | None = None,
) -> list[int]:
    """:meth:`Exchange.data`, checking each received chunk against ``manifest`` on ``threads`` threads
    (default ``CKPT_PERSIST_THREADS``: beside a training) while later pieces arrive; returns the chunks that
    failed."""
    if into is None or manifest is None or not into.numel():  # nothing to check: the bytes still move
        wire.data(out, to, into, frm if into is not None else None, in_piece, lambda a, k: None, out_ready)
        return list(range(len(manifest.chunks))) if into is not None and manifest is not None else []
    c, n = manifest.chunk_bytes, manifest.data_bytes
    if _checked_where_it_lands(into) and into.numel() == n and device_crc.usable(into, c):
        return _checked_on_device(wire, out, to, into, frm, in_piece, manifest, threads, out_ready)
    if _checked_in_staging(wire, into, in_piece, c) and into.numel() == n:
        return _checked_on_the_way(wire, out, to, into, frm, in_piece, manifest, out_ready)
    threads = max(1, threads or knobs.get("CKPT_PERSIST_THREADS"))
    if into.device.type == "cuda":  # chunks the device checks cannot take: through the host
        crc_of = _DeviceChecks(into, threads)
    else:
        view = memoryview(into.numpy())

        def crc_of(a: int, b: int) -> int:
            return checksum(view[a:b])

    futures = {}
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-peer-crc") as ex:

            def landed(off: int, k: int) -> None:
                end = off + k
                for i in range(off // c, (end // c) if end < n else -(-n // c)):  # the chunks now complete
                    futures[i] = ex.submit(crc_of, i * c, min((i + 1) * c, n))

            wire.data(out, to, into, frm, in_piece, landed, out_ready)
            needed = -(-n // c)  # chunks the bytes make
            for i in range(needed):  # a chunk split across pieces: complete now
                if i not in futures:
                    futures[i] = ex.submit(crc_of, i * c, min((i + 1) * c, n))
            bad = [
                i
                for i, f in sorted(futures.items())
                if i >= len(manifest.chunks) or f.result() != manifest.chunks[i]
            ]
            bad += list(range(needed, len(manifest.chunks)))  # listed for bytes that do not exist
    finally:
        crc_of = view = None  # noqa: F841 - no export of the buffer outlives the call, nor a traceback of it
    return bad


def _checked_in_staging(wire: Exchange, into: torch.Tensor, in_piece: int, c: int) -> bool:
    """Whether a copy received into host memory through ``wire``'s GPU staging is checked there, on the GPU,
    as each piece passes (:func:`_checked_on_the_way`): the Triton checks are ready on that GPU and every
    chunk lies within one piece."""
    dev = wire.device
    return (
        dev is not None
        and dev.type == "cuda"
        and into.device.type == "cpu"
        and in_piece % c == 0
        and device_crc.startable(dev, c)
    )


def _checked_on_the_way(
    wire: Exchange,
    out: torch.Tensor | None,
    to: int | None,
    into: torch.Tensor,
    frm: int | None,
    in_piece: int,
    manifest: Manifest,
    out_ready: Callable[[int, int], None] | None,
) -> list[int]:
    """:func:`checked_receive` of a copy received into host memory (a replica) through the GPU's staging
    buffers: each piece's chunks are checked by the Triton kernel where the piece lands on the GPU, while it is
    copied down (:meth:`Exchange.data`'s ``on_gpu``), so no host core reads the copy; a piece whose checks
    could not be queued or read is checked on the host from its copy there. Returns the chunks that failed.

    What is checked is what came over the wire; the copy down to host memory is a DMA over the host link (its
    own link-level CRC), and a restore checks the replica again, end to end, as it lands on the rank that
    gets it back."""
    c, n = manifest.chunk_bytes, manifest.data_bytes
    view = memoryview(into.numpy())
    sums: list[int | None] = [None] * -(-n // c)
    pending: dict[int, device_crc.Pending | None] = {}

    def on_gpu(piece: torch.Tensor, off: int) -> None:  # on the wire's thread, the check stream current
        try:
            pending[off] = device_crc.start(piece, c)
        except Exception as e:  # noqa: BLE001 - never stops the wire: the piece is checked on the host
            log.info(
                "the GPU checks of bytes [%d, %d) of a received replica could not be queued (%s): checked on "
                "the host",
                off,
                off + piece.numel(),
                e,
            )
            pending[off] = None

    def landed(off: int, k: int) -> None:  # the piece is in `into`, its checks done
        got = None
        p = pending.pop(off, None)
        if p is not None:
            try:
                got = p.values(view[off : off + k])
            except Exception as e:  # noqa: BLE001 - checked on the host instead
                log.info(
                    "the GPU checks of bytes [%d, %d) of a received replica failed (%s): checked on the host",
                    off,
                    off + k,
                    e,
                )
        if got is None:
            got = [checksum(view[a : min(a + c, off + k)]) for a in range(off, off + k, c)]
        sums[off // c : off // c + len(got)] = got

    try:
        wire.data(out, to, into, frm, in_piece, landed, out_ready, on_gpu)
    finally:
        pending.clear()
        view = None  # noqa: F841 - no export of the buffer outlives the call, nor a traceback of it
    return _failed_chunks(sums, manifest)


def _failed_chunks(sums: list[int | None], manifest: Manifest) -> list[int]:
    """The chunks whose checksum in ``sums`` (``None``: never computed) is not ``manifest``'s, and those only one
    of the two lists has."""
    return [
        i
        for i in range(max(len(sums), len(manifest.chunks)))
        if i >= len(sums) or i >= len(manifest.chunks) or sums[i] is None or sums[i] != manifest.chunks[i]
    ]


def _warm_checks(device: torch.device) -> None:
    try:
        device_crc.warm(device, knobs.get("CKPT_CHUNK_BYTES"))
    except Exception as e:  # noqa: BLE001 - the restore builds them itself
        log.info("making the received copy's checks ready on %s failed (%s); a restore makes them", device, e)


def _checked_where_it_lands(into: torch.Tensor) -> bool:
    """Whether a received copy is checked on its own device (:mod:`ckpt.device_crc`): one on a GPU."""
    return into.device.type == "cuda"


#: bytes of whole chunks the GPU checks at a time while the rest of a copy arrives, by the tensor operations:
#: larger batches launch fewer of them (each batch launches ~600), smaller ones leave less to check after the
#: last piece and need less room for the check's temporaries (about 1.1x the batch)
GPU_CHECK_BYTES = 512 << 20
#: the same where the Triton kernel is ready (:func:`ckpt.device_crc.ready`: one launch a batch, no temporaries
#: but the batch's values): about one piece of the wire, so little is left to check after the last one lands
GPU_CHECK_BYTES_TRITON = 64 << 20


def _checked_on_device(
    wire: Exchange,
    out: torch.Tensor | None,
    to: int | None,
    into: torch.Tensor,
    frm: int | None,
    in_piece: int,
    manifest: Manifest,
    threads: int | None,
    out_ready: Callable[[int, int], None] | None,
) -> list[int]:
    """:func:`checked_receive` of a copy received onto a GPU (a restore): the GPU checks the chunks where they
    landed (:mod:`ckpt.device_crc`), :data:`GPU_CHECK_BYTES_TRITON` (:data:`GPU_CHECK_BYTES` by the tensor
    operations) of whole chunks at a time on a thread and stream
    of their own while later pieces arrive, instead of copying them back down through the host's link and
    cores; a batch the GPU has no room to check goes through the host. Returns the chunks that failed."""
    c, n = manifest.chunk_bytes, manifest.data_bytes
    sums: list[int | None] = [None] * -(-n // c)
    batch = max(c, (GPU_CHECK_BYTES_TRITON if device_crc.ready(into.device) else GPU_CHECK_BYTES) // c * c)
    cuda = into.device.type == "cuda"
    stream = torch.cuda.Stream(into.device) if cuda else None

    def check(a: int, b: int) -> None:
        try:
            with (
                torch.cuda.device(into.device) if cuda else contextlib.nullcontext(),
                torch.cuda.stream(stream) if cuda else contextlib.nullcontext(),
            ):
                got = device_crc.chunk_checksums(into[a:b], c)
        except torch.cuda.OutOfMemoryError:  # no room for the checks' temporaries: through the host
            log.info(
                "no room on %s to check bytes [%d, %d) of a received copy there: checked through the host",
                into.device,
                a,
                b,
            )
            got = _host_checks(into, a, b, c, threads)
        sums[a // c : a // c + len(got)] = got

    submitted = [0]  # bytes handed to the checking thread, whole chunks (all of it at the end)
    futures = []
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-peer-check") as ex:

        def landed(off: int, k: int) -> None:  # the wire's pieces land in order
            ready = n if off + k >= n else (off + k) // c * c
            while submitted[0] < ready and (ready - submitted[0] >= batch or ready == n):
                b = min(submitted[0] + batch, ready)
                futures.append(ex.submit(check, submitted[0], b))
                submitted[0] = b

        try:
            wire.data(out, to, into, frm, in_piece, landed, out_ready)
            landed(0, n)  # what is left once every piece is in
        finally:
            for f in futures:  # none outlives the call (nor reads `into` after it)
                f.exception()
        for f in futures:
            f.result()
    return _failed_chunks(sums, manifest)


def _host_checks(into: torch.Tensor, a: int, b: int, c: int, threads: int | None) -> list[int]:
    """CRC-32C of each chunk of ``c`` bytes of ``into[a:b]`` (a copy on a GPU), computed on the host through
    :class:`_DeviceChecks`."""
    threads = max(1, threads or knobs.get("CKPT_PERSIST_THREADS"))
    crc_of = _DeviceChecks(into, threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-peer-crc") as ex:
        return list(ex.map(lambda x: crc_of(x, min(x + c, b)), range(a, b, c)))


class _DeviceChecks:
    """CRC-32C of byte ranges of a buffer on the GPU: each range is copied down through one of a few small
    pinned buffers (on the calling thread's own stream) and checked there, in parts where it is longer than
    one, so no host copy of the whole buffer is ever made. Callable from several threads at once."""

    PART = 4 << 20

    def __init__(self, data: torch.Tensor, buffers: int) -> None:
        self.data = data
        self._free: queue.Queue = queue.Queue()
        size = min(self.PART, data.numel()) or 1
        for _ in range(buffers):
            self._free.put(torch.empty(size, dtype=torch.uint8, pin_memory=True, device="cpu"))
        self._local = threading.local()

    def __call__(self, a: int, b: int) -> int:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.data.device)
        buf = self._free.get()
        try:
            crc, view = 0, memoryview(buf.numpy())
            for x in range(a, b, buf.numel()):
                y = min(x + buf.numel(), b)
                with torch.cuda.stream(stream):
                    buf[: y - x].copy_(self.data[x:y], non_blocking=True)
                stream.synchronize()
                crc = checksum(view[: y - x], crc)
            return crc
        finally:
            self._free.put(buf)


@register
class PeerTier(PersistingTier, TimelineCopies):
    """The replicas of rank ``src``'s snapshots this rank holds (what it lists, reads, verifies) and the
    exchange that sends this rank's snapshots to its holder ``dst`` (:meth:`write`, collective).

    ``ranks``: a :class:`~ckpt.ranks.Ranks` over a gloo group used only by this tier; ``data_group`` and
    ``device``: an NCCL group and this rank's GPU, to move the data over NCCL (see :class:`Exchange`).
    """

    name = "peer"
    nearness = 20
    on_node = False  # for the rank it belongs to, a replica lives on another node
    durable = False  # in RAM
    needs = "peers="

    @classmethod
    def for_storage(cls, storage: Any, built: dict[str, Any], pool: Any, rank: int) -> None:
        """Never here: making the peer tier is collective, so the Checkpointer makes it once every rank owns its
        local_dir (:meth:`for_job`, through :meth:`ckpt.tiers.Tiers.add_peer`)."""
        return None

    @classmethod
    def for_job(cls, local_dir: str | os.PathLike, job: Any, peers: bool | int) -> "PeerTier":
        """The peer tier of this rank of ``job`` (its :class:`~ckpt.ranks.Ranks`, ``None`` in a single process:
        refused), as ``Checkpointer(peers=...)`` asks: ``True`` holds each rank's replicas on the same local
        rank of the next node (``LOCAL_WORLD_SIZE`` ranks on): a rank distance that is not a multiple of the
        world size. Collective (call on all ranks): it makes a gloo group of its own, and an NCCL one where the
        replicas move over NCCL (:func:`over_nccl`)."""
        if job is None:
            raise ValueError(
                "peers= keeps copies on other ranks of a multi-process job: it needs torch.distributed "
                "with more than one rank (and collective=None or True)"
            )
        world = job.world
        if peers is True:  # the same local rank on the next node (torchrun sets LOCAL_WORLD_SIZE)
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            jump = per_node if 0 < per_node < world else 1
        elif isinstance(peers, int) and not isinstance(peers, bool) and peers > 0 and peers % world:
            jump = peers
        else:
            raise ValueError(
                f"peers must be True (the next node's rank: LOCAL_WORLD_SIZE) or a rank distance "
                f"that is not a multiple of the world size {world}, got {peers!r}"
            )
        timeout = knobs.get("CKPT_PEER_TIMEOUT_S")
        if timeout <= 0:
            raise ValueError(f"CKPT_PEER_TIMEOUT_S must be a positive number of seconds, got {timeout}")
        ranks = Ranks(timeout_s=timeout, own_group=True)
        data_group, device = None, None
        if over_nccl(knobs.get("CKPT_PEER_NCCL")):
            device = rank_gpu()
            data_group = torch.distributed.new_group(backend="nccl", timeout=timedelta(seconds=timeout))
        return cls(local_dir, ranks, jump, data_group, device)

    def __init__(
        self,
        local_dir: str | os.PathLike,
        ranks: Any,
        jump: int,
        data_group: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.ranks = ranks
        self.rank, self.world = ranks.rank, ranks.world
        self.jump = jump
        self.dst = (self.rank + jump) % self.world  # holds this rank's replicas
        self.src = (self.rank - jump) % self.world  # whose replicas this rank holds
        self.space = replica_space(local_dir, self.src)
        # registered with the CUDA driver only where the replicas come through device staging (NCCL)
        self.pool = HostPool(REPLICA_SLOTS, None, pin=device is not None and device.type == "cuda")
        self.pool.holds_what = f"the peer tier keeps rank {self.src}'s replicas"
        if self.space is not None:
            self.pool.share(self.space)
            self.pool.adopt()  # replicas this rank's previous process held: still served, and reused
        self.store = MemoryTier(self.pool, self.space)
        self.store.rank = self.src
        self.timeline = Timeline()
        self._copying: dict[int, Timeline] = {}
        self.verified: dict[int, bool] = {}
        piece = max(knobs.get("CKPT_CHUNK_BYTES"), knobs.get("CKPT_PEER_PIECE_BYTES"))
        self.wire = Exchange(ranks.group, piece, data_group, device)
        #: why the exchanges stopped in this process (a transport failure), or ``None``
        self.broken: str | None = None
        try:
            self.wire.warm(self.dst, self.src)  # collective: the tier is made on every rank at once
        except RuntimeError as e:  # as a failed exchange: this process's peer tier stops, the rest goes on
            self.broken = f"{type(e).__name__}: {e}"
            log.error(
                "rank %d: the peer tier could not reach ranks %d (holder) and %d (source); it stops in this "
                "process (the other tiers go on): %s",
                self.rank,
                self.dst,
                self.src,
                self.broken,
            )
        self._stale_checked = False
        if device is not None and device.type == "cuda" and self.broken is None:
            # a restore receives onto the GPU and checks every chunk there: the check's kernel is compiled now
            # (construction is collective anyway), not beside a restore's or a save's transfers on the GPU
            t0 = time.perf_counter()
            _warm_checks(device)
            log.info(
                "rank %d: the GPU checks of received copies are ready on %s (%s) in %.3f s",
                self.rank,
                device,
                "Triton" if device_crc.ready(device) else "tensor operations",
                time.perf_counter() - t0,
            )

    def holder_of(self, rank: int) -> int:
        """The rank that holds ``rank``'s replicas."""
        return (rank + self.jump) % self.world

    # -- the Tier contract: the replicas held here ---------------------------------------------------
    def committed(self) -> list[Committed]:
        return self.store.committed()

    def location(self) -> str:
        return f"RAM of rank {self.rank} ({self.store.location()}): the replicas of rank {self.src}"

    def describe(self, step: int, timeline: Timeline | None = None) -> StepInfo:
        return self.store.describe(step, timeline)

    def manifest_of(self, step: int, timeline: Timeline | None = None) -> Manifest:
        return self.store.manifest_of(step, timeline)

    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None]) -> None:
        self.store.load(step, manifest, dest)

    def verify(self, step: int, timeline: Timeline | None = None) -> list[Manifest]:
        """The replica of ``step`` held here, checked: every chunk of one a previous process of this rank
        left is read and checked; one this process received was checked chunk by chunk as it arrived and
        has not left its RAM since (as the memory tier's own snapshots). Returns its manifest in a list (its
        source rank's)."""
        return self.store.verify(step, timeline)

    def delete(self, step: int) -> None:
        self.store.delete(step)

    def prunes_here(self) -> bool:
        return False  # what it keeps is its number of replica buffers

    def bytes_held(self) -> int | None:
        return self.store.bytes_held()

    def capacity_bytes(self) -> int | None:
        return self.store.capacity_bytes()

    def close(self, keep_shared: bool) -> None:
        """Let go of the replica buffers; their segments stay in RAM with ``keep_shared`` (the next
        process of this rank serves them)."""
        self.pool.close(keep_shared=keep_shared)

    # -- the exchange (collective) -----------------------------------------------------------------
    def write(self, step: int, manifest: Manifest, data: memoryview) -> float:
        """Send this rank's snapshot of ``step`` to its holder and hold its source's; returns (seconds) once
        the holder said it committed the replica. Raises :class:`~ckpt.errors.CheckpointError` when it did
        not (the holder's log says why) or the exchange failed. Collective."""
        return self._exchange(step, manifest, data)

    def abstain(self, step: int) -> None:
        """This rank has no snapshot of ``step``: it still takes its part (and holds its source's)."""
        self._exchange(step, None, None)

    def _exchange(self, step: int, manifest: Manifest | None, data: memoryview | None) -> float:
        """One exchange (collective): rounds of header, "header taken", manifest, forks, "buffer ready", data
        and "kept". Each side sends a message only where the other said it will receive it, so a side that
        refuses (a header out of bounds, a manifest that does not parse, no buffer, a record it cannot write)
        leaves neither waiting; a transport failure (a peer died, or stopped answering for
        ``CKPT_PEER_TIMEOUT_S``) stops the peer tier in this process (:attr:`broken`)."""
        if self.broken is not None:
            raise CheckpointError(
                f"step {step}: the peer tier stopped after a failed exchange ({self.broken}); "
                "snapshots are no longer replicated in this process"
            )
        t0 = time.perf_counter()
        sent = manifest is not None
        timeline = self._copying.get(step, self.timeline)  # the snapshot's own (see TimelineCopies)
        raw, forks, body = b"", torch.zeros(0, dtype=torch.int64, device="cpu"), None
        if sent:
            if len(manifest.chunks) != -(
                -manifest.data_bytes // manifest.chunk_bytes
            ):  # no record computed them
                manifest = dataclasses.replace(manifest, chunks=_sums(data, manifest))
            raw = manifest.to_bytes()
            forks = torch.tensor([v for f in timeline.forks for v in f], dtype=torch.int64, device="cpu")
            body = (
                torch.frombuffer(data, dtype=torch.uint8)[: manifest.data_bytes]
                if manifest.data_bytes
                else None
            )
        wire, dst, src = self.wire, self.dst, self.src
        hdr = torch.tensor(
            [
                int(sent),
                len(raw),
                manifest.data_bytes if sent else 0,
                step,
                timeline.number,
                forks.numel() // 2,
                wire.piece,
            ],
            dtype=torch.int64,
            device="cpu",
        )
        got = torch.zeros(_HDR, dtype=torch.int64, device="cpu")
        refused = None  # why the holder refused this rank's replica (its header or its buffer)
        try:
            wire.swap(hdr, dst, got, src)
            ok, mlen, dbytes, sstep, number, nforks, in_piece = got.tolist()
            if ok and not (
                0 < mlen <= shm.MAX_RECORD_BYTES
                and 0 <= dbytes < 1 << 50
                and 0 <= nforks <= _MAX_FORKS
                and in_piece > 0
                and sstep == step
            ):
                log.error(
                    "rank %d refuses rank %d's replica of step %d: its header is out of bounds (%s)",
                    self.rank,
                    src,
                    step,
                    got.tolist(),
                )
                ok = 0  # taken as "no replica": nothing more is received from the source
            taken = torch.zeros(1, dtype=torch.int64, device="cpu")
            wire.swap(
                torch.tensor([ok], device="cpu") if got[0].item() else None, src, taken if sent else None, dst
            )
            go = sent and bool(taken.item())
            if sent and not go:
                refused = "it refused the header"
            meta = torch.empty(mlen if ok else 0, dtype=torch.uint8, device="cpu")
            forks_in = torch.empty(2 * nforks if ok else 0, dtype=torch.int64, device="cpu")
            wire.swap(_bytes(raw) if go else None, dst, meta if ok else None, src)
            wire.swap(forks if go and forks.numel() else None, dst, forks_in if ok and nforks else None, src)
            held = None  # the holder takes a buffer for the replica, or says it cannot
            if ok:
                try:
                    timeline = Timeline(
                        number, tuple((int(a), int(b)) for a, b in forks_in.view(-1, 2).tolist())
                    )
                    held = self._take(step, sstep, bytes(meta.numpy()), dbytes, timeline), timeline
                except (CheckpointError, OSError, ValueError) as e:  # HostMemoryError, a full /dev/shm, a bad
                    log.error("rank %d cannot hold rank %d's replica of step %d: %s", self.rank, src, step, e)
            ready_in = torch.zeros(1, dtype=torch.int64, device="cpu")
            wire.swap(
                torch.tensor([int(held is not None)], device="cpu") if ok else None,
                src,
                ready_in if go else None,
                dst,
            )
            if go and not ready_in.item():
                refused = "it could not take a buffer for it"
            out = body if go and ready_in.item() else None
            kept = False
            if held is not None:
                (buf, m), timeline = held
                try:
                    bad = checked_receive(wire, out, dst, buf.tensor[: m.data_bytes], src, in_piece, m)
                    if bad:
                        log.error(
                            "rank %d's replica of step %d: bytes [%d, ...) failed their checksum on arrival; "
                            "not committed",
                            src,
                            step,
                            bad[0] * m.chunk_bytes,
                        )
                        buf.forget_image()
                    else:
                        try:
                            self.store.commit(
                                m.step, m, buf, checksums=m.chunks, timeline=timeline, record_required=True
                            )
                            self.verified[m.step] = kept = True
                        except OSError as e:  # the record could not be written (a full /dev/shm): not held,
                            buf.forget_image()  # and the source still hears so below
                            log.error(
                                "rank %d cannot commit rank %d's replica of step %d: %s",
                                self.rank,
                                src,
                                step,
                                e,
                            )
                finally:
                    self.pool.release(buf, staged=True)
                if kept:
                    self._free_stale()
            else:
                checked_receive(wire, out, dst, None, None, 1, None)
            ack = torch.zeros(2, dtype=torch.int64, device="cpu")
            wire.swap(
                torch.tensor([int(kept), step], device="cpu") if ok else None, src, ack if go else None, dst
            )
        except RuntimeError as e:  # gloo / NCCL: a peer died, or stopped answering for CKPT_PEER_TIMEOUT_S
            self.broken = f"{type(e).__name__}: {e}"
            log.error(
                "rank %d: the replica exchange of step %d with ranks %d (holder) and %d (source) failed; the "
                "peer tier stops in this process (the other tiers go on): %s",
                self.rank,
                step,
                dst,
                src,
                self.broken,
            )
            raise CheckpointError(
                f"step {step}: the replica exchange with ranks {dst} (holder) and {src} (source) "
                f"failed; one may have died or stopped answering ({self.broken})"
            ) from e
        if refused is not None:
            raise CheckpointError(
                f"step {step}: rank {dst} did not take this rank's replica: {refused} (its log says why)"
            )
        if sent and not (ack[0].item() == 1 and ack[1].item() == step):
            raise CheckpointError(
                f"step {step}: rank {dst} did not commit this rank's replica (its log says why)"
            )
        return time.perf_counter() - t0

    def _free_stale(self) -> None:
        """Once a replica of this configuration's source is committed, give back the RAM of replicas this
        ``local_dir`` holds for other source ranks (left by a job of another world size or peer distance:
        no rank of this job can ask for them)."""
        if self.space is None or self._stale_checked:
            return
        self._stale_checked = True
        mine = self.space.prefix
        key = shm.local_key(mine)
        for g in shm.segments(self.space.root):
            if g.prefix.startswith(key + "-p") and g.prefix != mine:
                freed = shm.free(self.space.root, g.prefix)
                log.info(
                    "rank %d freed %.2f GB of RAM held by replicas of another job layout (%s)",
                    self.rank,
                    freed / 1e9,
                    g.prefix,
                )

    def _take(
        self, step: int, sstep: int, raw: bytes, dbytes: int, timeline: Timeline
    ) -> tuple[Any, Manifest]:
        """Check an incoming manifest and take a replica buffer for it (its record withdrawn): never the one
        holding the newest replica on ``timeline``'s branch, while another can be taken."""
        where = f"rank {self.src}'s replica of step {sstep} (received)"
        m = Manifest.from_bytes(raw, where)
        if m.step != sstep or sstep != step or m.data_bytes != dbytes:
            raise CorruptCheckpointError(
                f"{where}: its step or size disagree with its header (step {step} expected)"
            )
        while self.pool.preparing is not None:  # the second buffer is still being allocated: waiting for it
            time.sleep(0.005)  # keeps the newest replica whole (acquire would take it now)
        with self.pool._cv:
            self.pool.live = timeline
        buf = self.pool.acquire(max(dbytes, 1), block=True, step=step)
        self.pool.prepare(dbytes)  # the other replica buffer, in the background, before the next exchange
        return buf, m

    # -- restore (collective) ----------------------------------------------------------------------
    def serve(
        self, step: int, timeline: Timeline, send_to: int | None, receive: bool
    ) -> "ReceivedCopy | None":
        """Send the replica of ``step`` this rank holds to ``send_to`` (its owner, whose own copies are gone)
        and/or, with ``receive``, take this rank's own snapshot of ``step`` back from its holder. Returns the
        copy received, every chunk checked against the holder's checksums (``None``: the holder had none).
        Raises :class:`~ckpt.errors.CorruptCheckpointError` for a copy that fails. Collective."""
        if self.broken is not None:
            raise CheckpointError(
                f"step {step}: the peer tier stopped after a failed exchange ({self.broken})"
            )
        manifest, body, buf, seg, reading = None, None, None, None, None
        source = ""  # where the served bytes came from, for the log
        t0 = time.perf_counter()
        if send_to is not None:
            try:
                manifest = self.store.manifest(step, timeline)
                if manifest is None:
                    raise LookupError(f"step {step} is no longer held")
                buf = self._hold(step, timeline)
                if buf is not None:
                    body = buf.tensor[: manifest.data_bytes]
                    source = (
                        f"from its {'pinned' if buf.pinned else 'pageable'} replica buffer (slot {buf.slot})"
                    )
                else:  # a replica a previous process left and this one did not take over
                    rec = self.store._record(step, timeline)
                    path = Path(rec.path).with_name(rec.buffer)
                    reading = _ReplicaRead.start(path, manifest, self.wire.device)
                    if reading is not None:
                        body = reading.data
                        source = f"read onto {self.wire.device} from {path}"
                    else:
                        seg = shm.Segment.open(path, manifest.data_bytes, writable=False)
                        body = seg.tensor[: manifest.data_bytes]
                        source = f"from a pageable mapping of {path}"
            except Exception as e:  # noqa: BLE001 - the owner hears "none" and falls back to another tier
                log.warning(
                    "rank %d cannot serve its replica of rank %d's step %d: %s", self.rank, send_to, step, e
                )
                manifest, body = None, None
        raw = manifest.to_bytes() if manifest is not None else b""
        holder = self.holder_of(self.rank) if receive else None
        wire = self.wire
        hdr = torch.tensor(
            [int(manifest is not None), len(raw), manifest.data_bytes if manifest else 0, wire.piece],
            dtype=torch.int64,
            device="cpu",
        )
        got = torch.zeros(4, dtype=torch.int64, device="cpu")
        problem = None  # why this rank's own copy, received, is not used
        try:
            # rounds: header, "ready" (the owner checked the header and has a buffer), manifest, data; the holder
            # sends the manifest and the data only to an owner that is ready, so a refusal leaves no one waiting
            wire.swap(hdr, send_to, got if receive else None, holder)
            ok, mlen, dbytes, in_piece = got.tolist()
            into = None
            if ok:
                if not (0 < mlen <= shm.MAX_RECORD_BYTES and 0 <= dbytes < 1 << 50 and in_piece > 0):
                    problem = CheckpointError(
                        f"rank {holder} sent a replica header out of bounds ({got.tolist()})"
                    )
                else:
                    try:
                        into = _receive_buffer(dbytes, wire.device)
                    except (RuntimeError, MemoryError, OSError) as e:  # no host memory for it: say so, go on
                        problem = CheckpointError(
                            f"no host memory to receive {dbytes} bytes ({type(e).__name__}: {e})"
                        )
            ready = into is not None
            ready_in = torch.zeros(1, dtype=torch.int64, device="cpu")
            wire.swap(
                torch.tensor([int(ready)], device="cpu") if ok else None,
                holder,
                ready_in if manifest is not None else None,
                send_to,
            )
            if manifest is not None and not ready_in.item():
                log.warning(
                    "rank %d did not take its replica of step %d back (its log says why)", send_to, step
                )
            go = manifest is not None and bool(ready_in.item())
            meta = torch.empty(mlen if ready else 0, dtype=torch.uint8, device="cpu")
            wire.swap(_bytes(raw) if go else None, send_to, meta if ready else None, holder)
            m = None
            if ready:
                try:
                    m = Manifest.from_bytes(
                        bytes(meta.numpy()), f"rank {self.rank}'s step {step} from rank {holder}"
                    )
                    if m.step != step or m.data_bytes != dbytes:
                        problem = CorruptCheckpointError(
                            "its manifest's step or size disagree with its header"
                        )
                except CorruptCheckpointError as e:
                    problem = e
            t1 = time.perf_counter()
            # a restore: nothing else runs, the checks take every I/O thread
            bad = checked_receive(
                wire,
                body if go else None,
                send_to if go else None,
                into,
                holder if ready else None,
                in_piece if ready else 1,
                m if problem is None else None,
                knobs.get("CKPT_IO_THREADS"),
                reading.ready if reading is not None else None,
            )
        except RuntimeError as e:
            raise CheckpointError(
                f"step {step}: moving replicas between the peers for a restore failed "
                f"({type(e).__name__}: {e})"
            ) from e
        finally:
            if reading is not None:  # its copies are over before its buffer goes
                try:
                    reading.finish()
                except Exception as e:  # noqa: BLE001 - the owner's checks refused what was sent
                    log.warning(
                        "rank %d served its replica of rank %d's step %d as read, and the read failed: %s",
                        self.rank,
                        send_to,
                        step,
                        e,
                    )
            del body
            if buf is not None:
                self.pool.release(buf)
            if seg is not None:
                seg.release()
        t2 = time.perf_counter()
        log.info(
            "rank %d, peer tier restore of step %d: %s%s; %.3f s to open and agree, %.3f s moving the data",
            self.rank,
            step,
            f"served {manifest.data_bytes} bytes to rank {send_to} {source}" if go else "served none",
            f", received {dbytes} bytes from rank {holder}" if ready else "",
            t1 - t0,
            t2 - t1,
        )
        if not ok:
            return None
        where = f"this rank's replica of step {step}, received from rank {holder}"
        if problem is not None:
            raise type(problem)(f"{where}: {problem}; not used") from problem
        if bad:
            raise CorruptCheckpointError(
                f"{where}: bytes [{bad[0] * m.chunk_bytes}, ...) fail their checksum; not used"
            )
        return ReceivedCopy(step, timeline, m, into, holder)

    def _hold(self, step: int, timeline: Timeline) -> Any:
        """The replica buffer holding ``step`` on ``timeline``, held once (``None``: none)."""
        with self.pool._cv:
            for b in self.pool.buffers:
                if b.image_step == step and (b.image_timeline or Timeline()) == timeline:
                    b.holds += 1
                    return b
        return None


class _ReplicaRead:
    """A replica segment that a previous process left, read onto ``device`` (the NCCL path's GPU) in the
    background to be sent from there as it lands: ``pread`` into small pinned buffers on ``CKPT_IO_THREADS``
    threads and copied up, every chunk checked against ``manifest`` on the way, as the memory tier reads
    its own (:func:`~ckpt.tiers.memory._to_device`). A mapping of the segment would be pageable memory to
    the GPU (copied a page fault and a bounce buffer at a time).

    :meth:`ready` orders a stream after the copies of a byte range; :meth:`finish` waits for the read and
    raises :class:`~ckpt.errors.CorruptCheckpointError` naming the first chunk that failed (the owner's own
    checks refuse such a copy: it was sent as read)."""

    def __init__(self, path: Path, manifest: Manifest, device: torch.device) -> None:
        self.path, self.manifest = path, manifest
        # opened here: a segment that is gone or not one of ours is refused before anything is sent
        self._fd = shm.open_for_read(path, manifest.data_bytes)
        try:
            with torch.cuda.device(device):
                self.data = torch.empty(manifest.data_bytes, dtype=torch.uint8, device=device)
        except BaseException:
            os.close(self._fd)
            raise
        self._landed: dict[int, torch.cuda.Event] = {}  # chunk -> event after its copy
        self._cv = threading.Condition()
        self._over = False
        self._dest = _WholeBuffer(self.data, self._copied)
        self._job = Background(self._read, device)

    @classmethod
    def start(cls, path: Path, manifest: Manifest, device: torch.device | None) -> "_ReplicaRead | None":
        """The read started, or ``None`` (nothing started) without a GPU or where it has no room for the
        replica: the caller sends from a mapping of the segment."""
        if device is None or device.type != "cuda":
            return None
        try:
            return cls(path, manifest, device)
        except torch.cuda.OutOfMemoryError:
            log.info(
                "no room for %d bytes on %s to serve a replica from: it is sent from host memory",
                manifest.data_bytes,
                device,
            )
            return None

    def _read(self) -> int | None:
        try:
            return _to_device(self.manifest, self._fd, self._dest)
        finally:  # whatever happened, a sender waiting in ready() goes on
            os.close(self._fd)
            with self._cv:
                self._over = True
                self._cv.notify_all()

    def _copied(self, offset: int, event: torch.cuda.Event) -> None:
        with self._cv:
            self._landed[offset // self.manifest.chunk_bytes] = event
            self._cv.notify_all()

    def ready(self, offset: int, length: int) -> None:
        """Make the current stream wait for the copies of bytes ``[offset, offset + length)`` (blocks this
        thread until they are queued or the read is over; a chunk that failed its check or was never read,
        the read having stopped, is sent as it is: the owner's checks refuse it)."""
        c = self.manifest.chunk_bytes
        for i in range(offset // c, -(-(offset + length) // c)):
            with self._cv:
                while i not in self._landed and not self._over:
                    self._cv.wait()
                ev = self._landed.get(i)
            if ev is not None:
                torch.cuda.current_stream(self.data.device).wait_event(ev)

    def finish(self) -> None:
        """Wait for the read; raises what it raised, or ``CorruptCheckpointError`` for a chunk that failed."""
        bad = self._job.result()
        if bad is not None:
            raise CorruptCheckpointError(
                f"{self.path}: bytes [{bad * self.manifest.chunk_bytes}, ...) of the "
                "replica fail their checksum"
            )


class _WholeBuffer:
    """The destination of :func:`~ckpt.tiers.memory._to_device` for one flat GPU buffer: a snapshot's bytes at
    their own offsets (the interface of :class:`~ckpt.scatter.Scatter`), copied on a stream of its own;
    ``copied(offset, event)`` is told of each chunk once its copy is queued."""

    def __init__(self, data: torch.Tensor, copied: Callable[[int, torch.cuda.Event], None]) -> None:
        self.data = data
        self._copied = copied
        self._stream: torch.cuda.Stream | None = None

    def open_streams(self) -> bool:
        self._stream = torch.cuda.Stream(self.data.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.data.device))  # after the buffer's allocation
        return True

    def copy(self, chunk: torch.Tensor, offset: int) -> None:
        with torch.cuda.stream(self._stream):
            self.data[offset : offset + chunk.numel()].copy_(chunk, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._copied(offset, ev)

    def record(self) -> list[torch.cuda.Event]:
        ev = torch.cuda.Event()
        ev.record(self._stream)
        return [ev]

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class Background:
    """``fn()`` on a thread of its own working on ``device`` (a GPU: its current device), started now;
    :meth:`result` joins it and returns its value or raises what it raised."""

    def __init__(self, fn: Callable[[], Any], device: torch.device | None) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                    self._value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to result()
                self._error = e

        self._thread = threading.Thread(target=run, name="ckpt-peer", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _receive_buffer(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """Memory to receive a restore into. On ``device`` (the NCCL path's GPU) where it has room: the pieces
    land there from the wire and go to the state's tensors without a host round trip (pinning gigabytes of
    host memory would take seconds; the caching allocator reuses the block for training afterwards). Else
    host memory: pinned where there is CUDA (it goes to the GPU next), or with every page mapped now on
    ``CKPT_IO_THREADS`` threads (faulting them in one by one while receiving would halve the rate: a
    restore waits for this, nothing else runs)."""
    if device is not None and device.type == "cuda":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            log.info(
                "no room for %d bytes on %s to receive a restore: it goes through host memory", nbytes, device
            )
    if torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True, device="cpu")
    t = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    shm.populate(t.data_ptr(), nbytes, write=True, threads=knobs.get("CKPT_IO_THREADS"))
    return t


def _bytes(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _sums(data: memoryview, manifest: Manifest) -> list[int]:
    c = manifest.chunk_bytes
    views = [data[i : min(i + c, manifest.data_bytes)] for i in range(0, manifest.data_bytes, c)]
    with ThreadPoolExecutor(max(1, min(len(views), knobs.get("CKPT_PERSIST_THREADS")))) as ex:
        return list(ex.map(checksum, views))


class ReceivedCopy(Tier):
    """This rank's snapshot of one step, received at restore from the RAM of the rank holding it, every
    chunk checked. Restore reads it as the peer tier (``last_restore.tier == "peer"``)."""

    name = "peer"
    nearness = PeerTier.nearness
    on_node = False
    durable = False

    def __init__(
        self, step: int, timeline: Timeline, manifest: Manifest, data: torch.Tensor, holder: int
    ) -> None:
        self.step, self.manifest, self.data, self.holder = step, manifest, data, holder
        self.timeline = timeline
        self.rank = manifest.rank
        self.verified = {step: True}

    def committed(self) -> list[Committed]:
        return [Committed(self.step, self.timeline)] if self.data is not None else []

    def location(self) -> str:
        return f"RAM of rank {self.holder}"

    def describe(self, step: int, timeline: Timeline | None = None) -> StepInfo:
        if step != self.step:
            return StepInfo()
        return StepInfo(self.location(), self.manifest.data_bytes, self.manifest.created_unix, 1)

    def manifest_of(self, step: int, timeline: Timeline | None = None) -> Manifest:
        if step != self.step or self.data is None:
            raise LookupError(f"step {step} was not received from a peer")
        return self.manifest

    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None]) -> None:
        self.manifest_of(step)
        _scatter(manifest, dest, self.data[: manifest.data_bytes])

    def verify(self, step: int, timeline: Timeline | None = None) -> list[Manifest]:
        return [self.manifest_of(step)]  # every chunk was checked on arrival

    def delete(self, step: int) -> None:
        if step == self.step:
            self.data = None


def over_nccl(knob: int) -> bool:
    """Whether the peer tier moves its replicas over NCCL: ``CKPT_PEER_NCCL`` 1 (where there is CUDA and NCCL),
    0 (never: gloo from host memory), or -1, the default: where the job's own process group runs NCCL (then
    each rank has a GPU of its own; a gloo-only job on a GPU machine may have put every rank on one GPU).
    The same on every rank: the knob comes from the job's environment, the backend from the job's group."""
    dist = torch.distributed
    if knob == 0 or not torch.cuda.is_available() or not dist.is_nccl_available():
        return False
    if knob > 0:
        return True
    try:
        return "nccl" in str(dist.get_backend()).lower()
    except (RuntimeError, ValueError):  # no default group
        return False


def rank_gpu() -> torch.device:
    """This rank's GPU: the one its default process group was bound to (``init_process_group(device_id=...)``),
    else the current device (``torch.cuda.set_device``)."""
    with contextlib.suppress(AttributeError, RuntimeError, ValueError):  # no default group, an older torch
        bound = torch.distributed.distributed_c10d._get_default_group().bound_device_id
        if bound is not None and bound.type == "cuda":
            return torch.device(
                "cuda", bound.index if bound.index is not None else torch.cuda.current_device()
            )
    return torch.device("cuda", torch.cuda.current_device())

"""Phase 1: snapshot the state into a reusable host buffer, overlapped with training.

CUDA tensors are copied device-to-host on a side stream into a pinned buffer
that is allocated on the first save and reused. ``save()`` only enqueues the
copies; it never waits for them. Two fences keep the snapshot consistent:

* module buffers (BatchNorm running statistics, which the forward pass itself
  updates in place) are copied first, and the compute stream waits on that
  small copy's event, so the next forward cannot overwrite them mid-copy;
* every optimizer's ``step()`` waits for the whole copy, on the GPU
  (``Stream.wait_event`` from a global step pre-hook), since the step is what
  mutates parameters and optimizer state.

Anything else that mutates state in place between ``save()`` and the next
optimizer step (an EMA update, say) must call ``Checkpointer.wait_staged()``
first. Such a mutation fails the save with :class:`~ckpt.errors.TornSnapshotError`
naming the tensor, instead of persisting a torn snapshot, through two checks:

* the tensor version counter: when a snapshot is fenced, a tensor whose
  ``_version`` moved since ``save()`` is reported (conservative: on the GPU, a
  write that the host cannot prove came after the copy is reported too);
* a value fingerprint (:func:`_fingerprint`), for writes the counter misses
  (through ``.data``, which has a counter of its own, or a numpy view): taken at
  ``save()`` ordered before anything the caller does next (synchronously for CPU
  tensors, on the caller's stream for CUDA tensors) and compared with the
  fingerprint of the host copy once it has landed, before the snapshot is
  published or persisted. Exact for the snapshot itself: a write that lands
  after the copy is never reported; one that leaves the fingerprint unchanged
  (an exact permutation of words) is not seen.

The copy is enqueued in chunks (:class:`_PacedCopy`): a first burst by ``save()``, then one chunk at a
time, each once the previous one has landed, by a thread of its own. While a stream has device-to-host
copies queued, another stream's device-to-host copy waits for them: a small copy of the training loop
(``loss.item()``) would otherwise wait behind the whole snapshot, the GPU idle. The optimizer step's
pre-hook enqueues whatever is left at once before it waits.

CPU tensors take the same path: a staging thread copies them into the pool
(the buffers-first copy is done before ``save()`` returns), so CPU-only tests
exercise the asynchronous logic.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from . import knobs, priority, shm as _shm
from .errors import RefusedStateError, TornSnapshotError
from .format import Manifest, ItemRecord
from .plan import Entry
from .pool import HostBuffer, _copy_began, _copy_ended

__all__ = ["Snapshot", "SnapshotStats", "stage", "wait_all_staged"]

log = logging.getLogger(__name__)


@dataclass
class SnapshotStats:
    """Timings of one save (seconds) and its size."""

    step: int
    nbytes: int = 0
    stall_s: float = 0.0  # time save() blocked the caller
    wait_s: float = 0.0  # part of the stall spent waiting for a free buffer
    stage_s: float | None = None  # device-to-host copy time
    persist_s: dict[str, float] = field(default_factory=dict)
    skipped_tiers: dict[str, str] = field(default_factory=dict)  # tiers that did not write it, and why

    @property
    def stage_gbps(self) -> float | None:
        """The device-to-host copy's rate, GB/s (10^9 bytes), or ``None`` before it was timed."""
        return self.nbytes / self.stage_s / 1e9 if self.stage_s else None

    def persist_gbps(self, tier: str) -> float | None:
        """State bytes per second persisted to ``tier``, GB/s, or ``None`` when it did not write this save."""
        s = self.persist_s.get(tier)
        return self.nbytes / s / 1e9 if s else None


class Snapshot:
    """One state captured into a host buffer; fenced once the copy is known to be ordered."""

    def __init__(
        self,
        step: int,
        entries: list[Entry],
        records: list[ItemRecord],
        data_bytes: int,
        manifest: Manifest,
        buffer: HostBuffer,
        stats: SnapshotStats,
        timeline: Any = None,
    ) -> None:
        self.step = step
        #: the :class:`~ckpt.policy.Timeline` it was taken on: every tier commits it with this one, whatever
        #: the Checkpointer's timeline is by the time the tier gets to it (a rollback may come in between)
        self.timeline = timeline
        self.seq: int | None = (
            None  # its place in the order snapshots are handed to the tiers (the pipeline's)
        )
        self.entries = entries
        self.records = records
        self.data_bytes = data_bytes
        self.manifest = manifest
        self.buffer = buffer
        self.stats = stats
        self.error: BaseException | None = None
        self._cuda_done: torch.cuda.Event | None = None
        self._cuda_start: torch.cuda.Event | None = None
        self._cuda_device: torch.device | None = None  # the GPU whose side stream copies the state
        self._cpu_done = threading.Event()
        self._cpu_thread: threading.Thread | None = None  # the CPU tensors' copy, once started
        self._dma = (
            False  # counted among the copies in flight (_copy_began) until the landing check saw it land
        )
        self._lock = threading.Lock()
        self._fenced = False
        self._t0 = time.perf_counter()
        # Value checks of the CUDA tensors' copies: (key, record, dtype, shape, words) per tensor, their
        # fingerprints at save() (copied to the host on the side stream), and the paced copy itself,
        # which hands over its chunks, each with the event that says it has landed (verified as they land).
        self._checks: list[tuple[str, ItemRecord, torch.dtype, torch.Size, bool]] = []
        self._fp_host: torch.Tensor | None = None
        self._fp_after: torch.Tensor | None = None  # the same fingerprints once the copy was taken (host)
        self._copy: _PacedCopy | None = None
        self._verified = False
        self._verify_lock = threading.Lock()

    @classmethod
    def of_image(cls, step: int, buffer: HostBuffer, manifest: Manifest | None, timeline: Any) -> "Snapshot":
        """The snapshot of ``step`` that ``buffer`` holds already (``manifest`` describes it; ``None``: none could
        be had, for a snapshot that fails): nothing to copy, fenced, for the tiers to write as they write a new
        one (a snapshot a previous process took and did not persist)."""
        nbytes = manifest.data_bytes if manifest is not None else 0
        stats = SnapshotStats(step, nbytes=nbytes, stage_s=0.0)
        snap = cls(
            step,
            [],
            manifest.items if manifest is not None else [],
            nbytes,
            manifest,
            buffer,
            stats,
            timeline,
        )
        snap._cpu_done.set()
        snap._fenced = True
        return snap

    def _dma_landed(self) -> None:
        """Its copy to the host is no longer in flight (counted once)."""
        if self._dma:
            self._dma = False
            _copy_ended()

    # -- fences -------------------------------------------------------------------------------
    @property
    def fenced(self) -> bool:
        return self._fenced

    def fence_on_device(self) -> None:
        """Order the current stream after the copy (no host sync for CUDA), then check versions. The
        copies not yet enqueued are enqueued now, at once: the caller is about to change the state."""
        if self._fenced:
            return
        if self._copy is not None:
            self._copy.finish_now()
        if self._cuda_done is not None:  # the current stream of the state's GPU, not of the current GPU
            torch.cuda.current_stream(self._cuda_device).wait_event(self._cuda_done)
        self._cpu_done.wait()
        self._fence()

    def wait_copied(self) -> None:
        """Block the calling thread until every byte is in the host buffer and checked, then fence."""
        self._verify_cuda_copies()
        if self._copy is not None:
            self._copy.enqueued.wait()  # (returns at once after the verification: it waited for the end)
        if self._cuda_done is not None:
            self._cuda_done.synchronize()
        self._cpu_done.wait()
        thread = self._cpu_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # it has signalled; joined, no thread of the copy outlives the snapshot's watcher
        self._fence()
        if self.stats.stage_s is None:
            if self._cuda_start is not None:
                self.stats.stage_s = self._cuda_start.elapsed_time(self._cuda_done) / 1e3
            else:
                self.stats.stage_s = time.perf_counter() - self._t0

    def _verify_cuda_copies(self) -> None:
        """Compare each CUDA tensor's fingerprint at save() with its fingerprint once its copy was taken (both
        computed on the GPU, the second on the side stream after the last copy and before the optimizer step
        may run: equal, the copy read the values of save()). The host reads none of the snapshot's bytes for
        it: the memory tier's commit checksums the buffer once, after the copy (checksumming it while the copy
        landed slowed the copy by a third and a snapshot every 10 steps cost the loop +3.2% instead of +0.4%
        on an H200 node). Done once, by the first caller."""
        with self._verify_lock:
            if self._verified or self._copy is None:
                return
            torn: list[str] = []
            try:
                for (
                    _
                ) in self._copy.landed():  # until every chunk is enqueued and ``done`` recorded after them
                    pass
                self._cuda_done.synchronize()  # the copy has landed and the second fingerprints are on the host
                if self.error is None and self._fp_host is not None and self._fp_after is not None:
                    before, after = self._fp_host.tolist(), self._fp_after.tolist()
                    torn = [self._checks[i][0] for i, (a, b) in enumerate(zip(before, after)) if a != b]
            finally:
                self._dma_landed()
                self._verified = True
                self._checks, self._fp_host, self._fp_after = [], None, None
        if torn:
            self._torn(torn)

    def _torn(self, keys: list[str]) -> None:
        """Fail the save: the host copy of ``keys`` differs from their values at save()."""
        more = (
            f" (and {len(keys) - 1} more: {', '.join(repr(k) for k in keys[1:4])}{', ...' if len(keys) > 4 else ''})"
            if len(keys) > 1
            else ""
        )
        with self._lock:
            if self.error is None:
                self.error = TornSnapshotError(
                    f"tensor {keys[0]!r}{more} was written in place after save() and before its snapshot copy "
                    f"was complete: the copy differs from its value at save(), so step {self.step}'s save is "
                    "dropped rather than persisted torn. Writes through .data, a numpy view or torch.no_grad() "
                    "are not seen by version counters; call Checkpointer.wait_staged() before in-place updates "
                    "outside optimizer.step() (an EMA update, say)",
                    keys=keys,
                )

    def _fence(self) -> None:
        with self._lock:
            if self._fenced:
                return
            self._fenced = True
            if self.error is None:
                for e in self.entries:
                    if not e.is_buffer and e.tensor._version != e.version:
                        self.error = TornSnapshotError(
                            f"tensor {e.key!r} was modified in place while step {self.step}'s snapshot copy "
                            "could still be in flight, so this save is dropped rather than persisted torn. "
                            "Call Checkpointer.wait_staged() before in-place updates outside optimizer.step() "
                            "(an EMA update, say)",
                            keys=[e.key],
                        )
                        break
            self.entries = []  # drop tensor references: the copy no longer needs them
        _forget(self)


# Snapshots whose copies the next optimizer step must wait for.
_pending: list[Snapshot] = []
_pending_lock = threading.Lock()
_hook_handle: Any = None


def _forget(s: Snapshot) -> None:
    with _pending_lock:
        if s in _pending:
            _pending.remove(s)


def _fence_pending() -> None:
    with _pending_lock:
        snaps = list(_pending)
    for s in snaps:
        s.fence_on_device()


def _optimizer_pre_hook(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Make the optimizer's update wait for pending snapshot copies.

    ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS)
    runs forward and backward inside the closure: the wait then goes into the
    closure, after backward and right before the update, so the copy still
    overlaps forward and backward. ``args[0]`` is the optimizer itself.
    """
    if not _pending:
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        _fence_pending()
        return None

    def fenced_closure() -> Any:
        loss = closure()
        _fence_pending()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": fenced_closure}
    return (args[0], fenced_closure, *args[2:]), kwargs


def _ensure_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook_handle = register_optimizer_step_pre_hook(_optimizer_pre_hook)


def wait_all_staged() -> None:
    """Host-wait for every pending snapshot copy in this process and fence it."""
    with _pending_lock:
        snaps = list(_pending)
    for s in snaps:
        s.wait_copied()


def _dst(buf: HostBuffer, rec: ItemRecord, t: torch.Tensor) -> torch.Tensor:
    return _view(buf, rec, t.dtype, t.shape)


def _copies(buf: HostBuffer, rec: ItemRecord, t: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (destination, source) pairs that copy ``t`` into its place in ``buf``: one, or, in a shared
    segment where the item spans registration pieces, one per part inside a piece (a CUDA copy may not
    span two registrations: :func:`ckpt.shm.pieces`)."""
    dst = _dst(buf, rec, t)
    if buf.segment is None:
        return [(dst, t)]
    return list(_within_pieces(dst, t, rec.offset))


def _within_pieces(
    dst: torch.Tensor, src: torch.Tensor, offset: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``dst := src`` (``dst`` a contiguous view at byte ``offset`` of a segment) as copies that each stay
    inside one registration piece: as bytes where ``src`` is plain and contiguous, else by halving the
    leading dimension (a row that still spans a boundary: its own elements) down to parts that fit."""
    n = dst.numel() * dst.element_size()
    piece = _shm.REGISTER_PIECE
    if n == 0 or dst.dim() == 0 or offset // piece == (offset + n - 1) // piece:
        yield dst, src
        return
    if src.is_contiguous() and not (src.is_complex() or src.is_conj() or src.is_neg()):
        d, s_ = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for a, b in _shm.pieces(offset, n):
            yield d[a - offset : b - offset], s_[a - offset : b - offset]
        return
    if dst.shape[0] == 1:
        yield from _within_pieces(dst[0], src[0], offset)
        return
    half = dst.shape[0] // 2
    yield from _within_pieces(dst[:half], src[:half], offset)
    yield from _within_pieces(dst[half:], src[half:], offset + half * (n // dst.shape[0]))


def _view(buf: HostBuffer, rec: ItemRecord, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    key = (rec.offset, dtype, shape)
    view = buf.views.get(key)
    if view is None:  # the same state saves into the same views every time: build them once
        view = buf.views[key] = buf.tensor[rec.offset : rec.offset + rec.nbytes].view(dtype).view(shape)
    return view


# -- value fingerprints ---------------------------------------------------------------------------------
# Version counters miss writes through .data (a counter of its own), numpy views and numpy arrays.
# So each saved tensor's fingerprint is taken at save(), ordered before anything the caller does
# next (on the CPU: before save() returns; on CUDA: on the caller's stream), and compared with the
# same fingerprint of its host copy once that has landed. A mismatch fails the save.

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fits_words(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be read in place as whole 64-bit words (the fast form)."""
    return t.is_contiguous() and (t.numel() * t.element_size()) % 8 == 0 and t.data_ptr() % 8 == 0


def _as_ints(t: torch.Tensor, words: bool) -> torch.Tensor:
    """``t``'s bytes as integers, in place: 64-bit words (``words``), or integers of its item size
    (a complex tensor as its real and imaginary parts)."""
    if words:
        return t.reshape(-1).view(torch.int64)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def _fingerprint(t: torch.Tensor, words: bool) -> int:
    """The sum, wrapping modulo 2**64, of ``t``'s bytes read as integers: as 64-bit words when
    ``words`` (contiguous, whole aligned words: the fast form), otherwise as integers of its item
    size (any layout). Read in place, without a temporary copy of ``t``. Integer addition modulo
    2**64 gives the same result in any order, so it is exact and equal on every device for equal
    bytes, and any change confined to one word (or element) changes it; a permutation does not.
    On the CPU numpy sums (one thread, GIL released, and several times faster than torch's widening
    integer sums); on CUDA :func:`_fingerprint_on_device` gives the same number."""
    if t.device.type != "cpu":
        return int(_fingerprint_on_device(t, words))
    return int(_as_ints(t, words).numpy().sum(dtype=np.int64))


def _fingerprint_on_device(t: torch.Tensor, words: bool) -> torch.Tensor:
    """:func:`_fingerprint` as a 0-dim int64 tensor, computed on ``t``'s device and current stream."""
    return _as_ints(t, words).sum(dtype=torch.int64)


def _fingerprints(
    pairs: list[tuple[Entry, ItemRecord]],
) -> tuple[list[bool], torch.Tensor | list[int] | None]:
    """Each tensor's form (words or items: the copy lands at ``rec.offset`` and must allow the same
    form) and fingerprint at this point of the caller's thread (CPU tensors: a list of ints) or stream
    (CUDA tensors: stacked in one int64 tensor on the device)."""
    # A lazily conjugated or negated view's bytes are not its values (the copy holds the values):
    # such rare tensors are resolved into a temporary first.
    srcs = [
        e.tensor.resolve_conj().resolve_neg() if e.tensor.is_conj() or e.tensor.is_neg() else e.tensor
        for e, _ in pairs
    ]
    words = [_fits_words(t) and r.offset % 8 == 0 for t, (_, r) in zip(srcs, pairs)]
    if not pairs:
        return words, None
    if srcs[0].device.type == "cpu":
        return words, [_fingerprint(t, w) for t, w in zip(srcs, words)]
    return words, _GRAPHS.fingerprints(srcs, words)


class _FingerprintGraphs:
    """The CUDA tensors' fingerprints of one save, as one CUDA graph launch instead of one reduction
    launch per tensor (584 for a 1.24 B model with AdamW: ~12 ms of the host's time in ``save()``, while
    the GPU waits for the loop's next launches).

    A graph reads fixed addresses, so it serves only the same tensors at the same addresses, shapes,
    strides and forms as when it was captured (the key); a model and optimizer keep their tensors in
    place across steps, so the key repeats. It is captured the second time in a row a key is seen (a
    state made of new tensors each time never pays for a capture) and replayed on the caller's stream,
    ordered like the launches it replaces; the result is cloned out of the graph's memory, so a later
    replay never overwrites a save's fingerprints still being read. One graph per device; a capture that
    fails (e.g. inside the caller's own capture) falls back to the launches for good."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple] = {}  # device -> the key of the last save
        self._graph: dict[int, tuple[tuple, Any, torch.Tensor]] = {}  # device -> (key, graph, output)
        self._off = False  # a capture failed
        self._lock = threading.Lock()

    @staticmethod
    def _launch(srcs: list[torch.Tensor], words: list[bool]) -> torch.Tensor:
        return torch.stack([_fingerprint_on_device(t, w) for t, w in zip(srcs, words)])

    def fingerprints(self, srcs: list[torch.Tensor], words: list[bool]) -> torch.Tensor:
        dev = srcs[0].device.index if srcs[0].device.index is not None else torch.cuda.current_device()
        if (
            self._off
            or not knobs.get("CKPT_FINGERPRINT_GRAPH")
            or torch.cuda.is_current_stream_capturing()
            or any(t.device != srcs[0].device for t in srcs)
        ):
            return self._launch(srcs, words)
        key = tuple(
            (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, w) for t, w in zip(srcs, words)
        )
        with self._lock:
            held = self._graph.get(dev)
            if held is not None and held[0] == key:
                held[1].replay()  # on the current stream: ordered like the launches it stands for
                return held[2].clone()
            again = self._seen.get(dev) == key
            self._seen[dev] = key
            if not again:
                return self._launch(srcs, words)
            try:
                graph = self._capture(srcs, words)
            except Exception as e:  # noqa: BLE001 - the launches give the same numbers
                log.info(
                    "fingerprints stay one launch per tensor: capturing them as a CUDA graph failed (%s: %s)",
                    type(e).__name__,
                    e,
                )
                self._off = True
                return self._launch(srcs, words)
            self._graph[dev] = (key, *graph)
            graph[0].replay()
            return graph[1].clone()

    def _capture(self, srcs: list[torch.Tensor], words: list[bool]) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            out = self._launch(srcs, words)
        torch.cuda.current_stream().wait_stream(side)
        return graph, out


_GRAPHS = _FingerprintGraphs()
_GRAPHS_AFTER = _FingerprintGraphs()  # the second fingerprints, on the side stream (a graph of their own)


# -- the paced device-to-host copy -------------------------------------------------------------------
# While one stream has device-to-host copies queued, a device-to-host copy of another stream waits for
# them (one H200, 2026-11-24: a 4-byte .item() on the compute stream waited 67 ms behind 4 GiB queued on
# the side stream, in one copy, in 64 MiB chunks, or on a high-priority stream alike); it gets the copy
# engine as soon as the side stream has none queued, even for microseconds. Enqueued all at once, a
# 7.4 GB snapshot held the first sync of the next step (the HF forward's .all().item(), loss.item()) for
# the rest of its 135 ms copy, the GPU idle meanwhile: ~120 ms per snapshot. So the copy is enqueued in
# chunks: a first burst by save() (it starts at once, whatever the threads do next), then one chunk at a
# time, each after the previous one has landed, by a thread of its own: a sync of the loop waits for at
# most the burst once, then for at most one chunk (~1 ms). The pacing costs ~10% of the copy's speed
# (135 -> ~148 ms), still overlapped with forward and backward; the optimizer step's pre-hook enqueues
# whatever is left at once.

_COPY_CHUNK = 64 << 20  # bytes per chunk: one event each; a tensor larger than this is copied in pieces
_COPY_BURST = 4  # chunks save() enqueues itself (~5 ms of copy at 55 GB/s)


def _chunks(
    buf: HostBuffer, items: list[tuple[torch.Tensor, ItemRecord]], chunk: int
) -> Iterator[tuple[list, list[int]]]:
    """The copies of ``items`` into ``buf`` in chunks of about ``chunk`` bytes: per chunk, the (destination,
    source) pairs and the items whose last byte it copies. A contiguous tensor larger than a chunk is
    split (as bytes) across chunks; any other tensor is copied whole."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    done: list[int] = []
    size = 0
    for i, (t, rec) in enumerate(items):
        n = rec.nbytes
        if n > chunk and t.is_contiguous() and not (t.is_complex() or t.is_conj() or t.is_neg()):
            src = t.reshape(-1).view(torch.uint8)
            dst = buf.tensor[rec.offset : rec.offset + n]
            off = 0
            while off < n:
                k = min(chunk - size, n - off)
                if buf.segment is not None:  # a CUDA copy may not span two registration pieces
                    at = rec.offset + off
                    k = min(k, (at // _shm.REGISTER_PIECE + 1) * _shm.REGISTER_PIECE - at)
                pairs.append((dst[off : off + k], src[off : off + k]))
                size += k
                off += k
                if size >= chunk and off < n:
                    yield pairs, done
                    pairs, done, size = [], [], 0
        else:
            if size and size + n > chunk:
                yield pairs, done
                pairs, done, size = [], [], 0
            pairs.extend(_copies(buf, rec, t))
            size += n
        done.append(i)
        if size >= chunk:
            yield pairs, done
            pairs, done, size = [], [], 0
    if pairs or done:
        yield pairs, done


class _PacedCopy:
    """The copy of a snapshot's CUDA tensors (after its module buffers) on the side stream, enqueued a
    chunk at a time: a first burst by ``save()``, the rest by a thread of its own as earlier chunks land,
    or all at once by :meth:`finish_now` (the optimizer step's pre-hook, which must order itself after
    the whole copy). ``done`` is recorded after the last chunk; :meth:`landed` yields each chunk's event
    with the items it completes, in order, until the end."""

    def __init__(
        self,
        snap: Snapshot,
        items: list[tuple[torch.Tensor, ItemRecord]],
        stream: torch.cuda.Stream,
        done: torch.cuda.Event,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.snap = snap
        self.stream = stream
        self.done = done
        self.after = after  # enqueued after the last copy and before ``done`` (on the stream)
        self.enqueued = threading.Event()  # every copy is enqueued and ``done`` recorded
        self._chunks: Iterator[tuple[list, list[int]]] | None = _chunks(snap.buffer, items, _COPY_CHUNK)
        self._lock = threading.Lock()  # one thread enqueues at a time
        self._landed: queue.SimpleQueue = queue.SimpleQueue()

    def start(self) -> None:
        """Enqueue the first burst of chunks now (the caller's thread), and start the thread that enqueues
        the rest."""
        ahead = [self._next() for _ in range(max(_COPY_BURST, knobs.get("CKPT_COPY_AHEAD")))]
        if self.enqueued.is_set():
            return
        # Not a daemon, like the CPU staging thread: it holds tensor references until it has enqueued
        # the last copy (milliseconds to a fraction of a second), and shutdown waits for that.
        try:
            threading.Thread(
                target=self._run,
                args=([e for e in ahead if e is not None],),
                name=f"ckpt-copy-{self.snap.step}",
                daemon=False,
            ).start()
        except RuntimeError:  # no thread to be had: enqueue the rest now, unpaced
            self.finish_now()

    def _next(self) -> torch.cuda.Event | None:
        """Enqueue the next chunk (``None``: there is none left); after the last, record ``done``."""
        with self._lock:
            if self._chunks is None:
                return None
            try:
                with torch.cuda.stream(self.stream):
                    pairs, idxs = next(self._chunks, (None, None))
                    if pairs is None:
                        self._end()
                        return None
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                self._landed.put((ev, idxs))
                return ev
            except BaseException as e:
                self._fail(e)
                return None

    def _run(self, ahead: list[torch.cuda.Event]) -> None:
        try:
            torch.cuda.set_device(self.stream.device)
            inflight = collections.deque(ahead)
            limit = max(1, knobs.get("CKPT_COPY_AHEAD"))
            while True:
                while len(inflight) >= limit:
                    inflight.popleft().synchronize()  # releases the GIL
                ev = self._next()
                if ev is None:
                    return
                inflight.append(ev)
        except BaseException as e:  # reported on the save handle by the pipeline
            with self._lock:
                self._fail(e)

    def finish_now(self) -> None:
        """Enqueue every copy left, at once (the caller's thread), and ``done`` after them."""
        while self._next() is not None:
            pass

    def landed(self) -> Iterator[tuple[torch.cuda.Event, list[int]]]:
        """Each enqueued chunk's event and the items it completes, in order, until the copy is enqueued
        to its end (blocks while the next chunk is not enqueued yet)."""
        while True:
            item = self._landed.get()
            if item is None:
                return
            yield item

    def _end(self) -> None:
        """(under the lock, on the stream) No copy is left to enqueue: enqueue ``after``, record ``done``, let go
        of the tensors, tell the waiters."""
        try:
            after, self.after = self.after, None
            if after is not None:
                after()
            self.done.record(self.stream)
        finally:
            self._chunks = None
            self._landed.put(None)
            self.enqueued.set()

    def _fail(self, e: BaseException) -> None:
        """(under the lock) Enqueuing failed: the save fails; the copies already enqueued land first."""
        if self.snap.error is None:
            self.snap.error = e
        if self.enqueued.is_set():
            return
        self._chunks = None
        self.after = None
        try:
            self.stream.synchronize()  # no copy may still be writing into a buffer handed back
            self.done.record(self.stream)
        except BaseException:  # noqa: BLE001 - the error above is the one reported
            pass
        finally:
            self._landed.put(None)
            self.enqueued.set()


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream_for(
    cuda: list[tuple[Entry, ItemRecord]], side_stream: torch.cuda.Stream
) -> torch.cuda.Stream:
    """The side stream of the GPU that holds the state's CUDA tensors: ``side_stream`` where it is that GPU's,
    else one made for it once. torch runs a copy on the current stream of the copied tensor's GPU, so copies
    of a state on another GPU than the current one (``model.to("cuda:1")`` without ``set_device``) would
    escape a side stream of the current GPU, and the snapshot would count as copied before it was.
    Raises :class:`~ckpt.errors.RefusedStateError` for a state spread over several GPUs of one process."""
    devices = sorted({e.tensor.device for e, _ in cuda}, key=str)
    if len(devices) > 1:
        keys = {str(d): next(e.key for e, _ in cuda if e.tensor.device == d) for d in devices}
        raise RefusedStateError(
            f"the state's CUDA tensors are on {len(devices)} GPUs of this process ({keys}): a snapshot is "
            "copied on one GPU's side stream; run one process per GPU (torchrun), or save each GPU's part "
            "with a Checkpointer of its own"
        )
    device = devices[0]
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if side_stream.device == device:
        return side_stream
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _stage_cuda(snap: Snapshot, cuda: list[tuple[Entry, ItemRecord]], side_stream: torch.cuda.Stream) -> None:
    compute = torch.cuda.current_stream()
    checked = [(e, r) for e, r in cuda if not e.is_buffer]
    # on the caller's stream: ordered before anything the caller enqueues after save()
    words, fp_dev = _fingerprints(checked)
    side_stream.wait_stream(compute)  # the copy must see the step that was just computed
    start = torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side_stream):
        start.record(side_stream)
        if fp_dev is not None:
            snap._fp_host = torch.empty(len(checked), dtype=torch.int64, pin_memory=True, device="cpu")
            snap._fp_host.copy_(fp_dev, non_blocking=True)
            fp_dev.record_stream(side_stream)  # not reused by the caller's stream before this copy read it
        bufs = [(e, r) for e, r in cuda if e.is_buffer]
        if bufs:
            for e, r in bufs:
                for dst, src in _copies(snap.buffer, r, e.tensor):
                    dst.copy_(src, non_blocking=True)
            buf_ev = torch.cuda.Event()
            buf_ev.record(side_stream)
            compute.wait_event(buf_ev)  # next forward waits for this small copy, on the GPU
    snap._checks = [(e.key, r, e.tensor.dtype, e.tensor.shape, w) for (e, r), w in zip(checked, words)]
    snap._cuda_start, snap._cuda_done, snap._cuda_device = start, done, side_stream.device
    srcs = [
        e.tensor.resolve_conj().resolve_neg() if e.tensor.is_conj() or e.tensor.is_neg() else e.tensor
        for e, _ in checked
    ]

    def after() -> None:  # on the side stream, after the last copy: the values the copy read
        if srcs:
            fp = _GRAPHS_AFTER.fingerprints(srcs, words)
            snap._fp_after = torch.empty(len(srcs), dtype=torch.int64, pin_memory=True, device="cpu")
            snap._fp_after.copy_(fp, non_blocking=True)
        srcs.clear()

    snap._copy = _PacedCopy(snap, [(e.tensor, r) for e, r in checked], side_stream, done, after)
    snap._copy.start()


@torch.no_grad()
def stage(snap: Snapshot, side_stream: torch.cuda.Stream | None) -> None:
    """Enqueue the copies of ``snap``'s tensors into its buffer; returns before they finish."""
    _ensure_hook()
    with _pending_lock:
        _pending.append(snap)
    work = [(e, r) for e, r in zip(snap.entries, snap.records) if r.alias_of is None and r.nbytes > 0]
    cuda = [(e, r) for e, r in work if e.tensor.device.type == "cuda"]
    cpu = [(e, r) for e, r in work if e.tensor.device.type == "cpu"]
    other = [e.key for e, r in work if e.tensor.device.type not in ("cuda", "cpu")]
    if other:
        raise TypeError(f"tensors on devices other than cpu and cuda cannot be staged yet: {other[:3]}")
    # Module buffers on the CPU: copied now, before the caller's next forward can touch them.
    for e, r in cpu:
        if e.is_buffer:
            _dst(snap.buffer, r, e.tensor).copy_(e.tensor)
    rest = [(e, r) for e, r in cpu if not e.is_buffer]
    rest_words, rest_fp = _fingerprints(rest)  # the values at save(): before save() returns
    if cuda:
        if side_stream is None:
            raise RuntimeError("CUDA tensors in the state but no side stream")
        side_stream = _side_stream_for(cuda, side_stream)
        _copy_began()
        snap._dma = True
        try:
            with torch.cuda.device(side_stream.device):  # the state's GPU: its streams, not the current GPU's
                _stage_cuda(snap, cuda, side_stream)
        except BaseException:
            side_stream.synchronize()  # no copy may still be writing into a buffer handed back
            snap._dma_landed()
            raise
    if rest:
        expected = rest_fp

        @torch.no_grad()
        def copy_cpu() -> None:
            priority.lower_this_thread()
            try:
                torn = []
                for (e, r), words, fp in zip(rest, rest_words, expected):
                    dst = _dst(snap.buffer, r, e.tensor)
                    dst.copy_(e.tensor)
                    if _fingerprint(dst, words) != fp:  # the copy is not the value at save()
                        torn.append(e.key)
                if torn:
                    snap._torn(torn)
                if not cuda:
                    # The copy is complete and this thread knows it exactly: fence here, so that
                    # later in-place writes are ordered after the copy and never reported.
                    snap.stats.stage_s = time.perf_counter() - snap._t0
                    snap._fence()
            except BaseException as exc:  # reported on the save handle by the pipeline
                snap.error = exc
            finally:
                snap._cpu_done.set()

        # Not a daemon, for the reason given where the pipeline starts its watcher thread: it
        # drops tensor references after signalling, so shutdown must wait for it (milliseconds).
        snap._cpu_thread = threading.Thread(target=copy_cpu, name=f"ckpt-stage-{snap.step}", daemon=False)
        snap._cpu_thread.start()
    else:
        snap._cpu_done.set()

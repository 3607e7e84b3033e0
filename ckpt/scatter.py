"""Copy byte ranges of a host buffer into the destination tensors they belong to.

Restore reads a data file (or the memory tier's buffer) in chunks; each chunk
covers parts of one or more tensors. :class:`Scatter` maps a chunk onto the
items it overlaps and copies exactly those bytes, host-to-device with
``non_blocking=True`` on a dedicated stream when the destination is on the GPU
(full pinned bandwidth, no temporary on the device).
"""

from __future__ import annotations

import bisect
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from .format import ItemRecord

__all__ = ["Scatter", "writing_state"]


def writing_state() -> contextlib.AbstractContextManager:
    """The mode every write of restored bytes into the state's tensors runs in, on whatever thread:
    inference mode. The state may hold inference tensors (made under ``torch.inference_mode()``), which
    only inference mode may update in place, and a restore called inside inference mode makes its views of
    the state's normal tensors there, which then only inference mode may update; inference mode updates
    normal tensors too (their version counters move on), and records nothing for autograd."""
    import torch

    return torch.inference_mode()


class Scatter:
    """``records``/``dest`` are parallel lists; aliases, empty items and items with no destination
    (``None``: not bound to the state, e.g. keys left out with ``strict=False``) are skipped."""

    def __init__(self, records: list[ItemRecord], dest: list[torch.Tensor | None]) -> None:
        pairs = sorted(
            (
                (r.offset, r.nbytes, d)
                for r, d in zip(records, dest)
                if r.alias_of is None and r.nbytes > 0 and d is not None
            ),
            key=lambda p: p[0],
        )
        self._starts = [p[0] for p in pairs]
        self._pairs = [(off, n, _flat_bytes(d)) for off, n, d in pairs]
        self.to_device = any(d.device.type == "cuda" for _, _, d in self._pairs)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def open_streams(self) -> bool:
        """Give the copies into GPU destinations streams of their own, one per GPU that holds a destination,
        each ordered after everything the calling thread has queued on that GPU's current stream; ``False``
        (and nothing done) when no destination is on a GPU. Call it on the thread that runs the training
        (restore's caller): a write the caller queued into a destination (an initialisation, a ``zero_()``)
        then lands before the restored bytes instead of over them, and memory the caching allocator just
        handed to a stand-in is no longer used by earlier work. A copy runs on the stream of its
        destination's GPU (torch puts a copy on its device's current stream, so one stream of one GPU
        would not hold the copies to another). :meth:`record` marks what is queued so far,
        :meth:`synchronize` waits for all of it; destinations are used again only after that."""
        import torch

        if not self.to_device:
            return False
        for d in sorted({flat.device for _, _, flat in self._pairs if flat.device.type == "cuda"}, key=str):
            stream = torch.cuda.Stream(d)
            stream.wait_stream(torch.cuda.current_stream(d))
            self._streams[d] = stream
        return True

    def record(self) -> list[torch.cuda.Event]:
        """Events after the copies queued so far on every stream of :meth:`open_streams` (none opened: [])."""
        import torch

        events = []
        for stream in self._streams.values():
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        return events

    def synchronize(self) -> None:
        """Wait (on the host) for every copy queued on the streams of :meth:`open_streams`."""
        for stream in self._streams.values():
            stream.synchronize()

    def copy(self, chunk: torch.Tensor, chunk_offset: int) -> None:
        """Copy ``chunk`` (uint8, host, or on a GPU) holding file bytes ``[chunk_offset, +len)`` into place."""
        import torch

        end = chunk_offset + chunk.numel()
        i = max(0, bisect.bisect_right(self._starts, chunk_offset) - 1)
        with writing_state():
            while i < len(self._pairs):
                off, n, flat = self._pairs[i]
                if off >= end:
                    break
                lo, hi = max(off, chunk_offset), min(off + n, end)
                if lo < hi:
                    stream = self._streams.get(flat.device)
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        flat[lo - off : hi - off].copy_(
                            chunk[lo - chunk_offset : hi - chunk_offset], non_blocking=True
                        )
                i += 1


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    if not t.is_contiguous():  # plan.bind gives a non-contiguous live tensor a contiguous stand-in
        raise ValueError("restore destinations must be contiguous tensors")
    return t.view(-1).view(torch.uint8) if t.dim() else t.view(1).view(torch.uint8)

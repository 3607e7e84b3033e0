"""The memory tier: the newest snapshot, still in this process's host buffer.

It needs no I/O and no checksum pass (the bytes never left this process), so
when it is at least as new as anything on disk, restore uses it first: after a
recoverable error inside a long job, the state comes back at host-to-device
bandwidth.
"""

from __future__ import annotations

import torch

from ..format import Manifest
from ..policy import Committed, Timeline
from ..scatter import Scatter
from ..stage import HostPool

__all__ = ["MemoryTier"]


class MemoryTier:
    name = "memory"

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.timeline = Timeline()   # the timeline of the snapshots committed from now on (the Checkpointer sets it)

    def commit(self, step: int, manifest: Manifest, buffer) -> None:
        """Mark ``buffer`` as holding the complete, fenced snapshot of ``step``."""
        buffer.manifest = manifest
        buffer.image_timeline = self.timeline
        buffer.image_step = step

    def committed(self) -> list[Committed]:
        """The snapshots held, with the timeline each was saved on."""
        out = []
        for b in list(self.pool.buffers):
            step, manifest = b.image_step, b.manifest
            if step is not None and manifest is not None:
                out.append(Committed(step, getattr(b, "image_timeline", Timeline())))
        return out

    def manifest(self, step: int, timeline: Timeline) -> Manifest | None:
        """The manifest of the snapshot of ``step`` on ``timeline`` still held, if any."""
        return next((b.manifest for b in list(self.pool.buffers) if b.image_step == step and b.manifest is not None
                     and getattr(b, "image_timeline", Timeline()) == timeline), None)

    def newest(self) -> tuple[int, Manifest] | None:
        buf = self.pool.newest_image()
        if buf is None or buf.manifest is None:
            return None
        return buf.image_step, buf.manifest

    def load(self, step: int, manifest: Manifest, dest: list[torch.Tensor | None]) -> None:
        buf = next((b for b in self.pool.buffers if b.image_step == step and b.manifest is manifest), None) or \
            next((b for b in self.pool.buffers if b.image_step == step), None)
        if buf is None:
            raise LookupError(f"step {step} is no longer in host memory")
        sc = Scatter(manifest.items, dest)
        data = buf.tensor[:manifest.data_bytes]
        if sc.to_device:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                sc.copy(data, 0)
            stream.synchronize()
        else:
            sc.copy(data, 0)

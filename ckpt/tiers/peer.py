"""The peer tier: each rank keeps a copy of another rank's checkpoints on its own local disk.

Rank ``r`` sends every checkpoint it commits locally to rank ``(r + jump) % world`` and keeps
the ones of rank ``(r - jump) % world``, under ``<local_dir>/peers/rank-<src>/`` in the local
tier's format. With ``jump`` = ranks per node, the copy lives on the next node, so a node that is
lost for good (its NVMe with it) does not force a restore from remote storage: the node that
replaces it gets each of its ranks' files back from the peers at restore, over
``torch.distributed``, at network speed.

Transport: point-to-point ``isend``/``irecv`` over a gloo group of the tier's own, on the
persist thread, right after the local write. Every rank sends a small header first (ok, manifest
size, data size, step), then, if it has a committed image, the manifest and the data straight from
the host buffer (no copy); a rank whose save failed sends ``ok = 0`` so that its peer does not
wait. The receiver's local writer checks every chunk's CRC-32C against the sender's manifest as
it writes, before it commits the copy, so a torn transfer is never committed. Collective contract: every rank
exchanges the same steps in the same order, which holds because all ranks save the same steps
(the checkpointer's agreements) and persist them in order.

Ideas from: Gemini (Wang et al., SOSP 2023, checkpoints in the CPU memory of peer machines) and
the NVIDIA resiliency extension's local checkpointing with peer replication; the code is ours.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..format import Manifest, data_name, open_regular
from .local import LocalTier

__all__ = ["PeerTier"]

log = logging.getLogger(__name__)


class PeerTier:
    """Copies of rank ``src``'s checkpoints kept by this rank, and the exchange that makes them.

    ``ranks``: a :class:`~ckpt.ranks.Ranks` over a gloo group used only by this tier.
    """

    name = "peer"

    def __init__(self, local_root: Path, ranks: Any, jump: int) -> None:
        self.ranks = ranks
        self.rank, self.world = ranks.rank, ranks.world
        self.jump = jump
        self.dst = (self.rank + jump) % self.world   # receives this rank's copies
        self.src = (self.rank - jump) % self.world   # whose copies this rank keeps
        self.store = LocalTier(Path(local_root) / "peers" / f"rank-{self.src:05d}")

    def holder_of(self, rank: int) -> int:
        """The rank that keeps ``rank``'s copies."""
        return (rank + self.jump) % self.world

    def exchange(self, step: int, manifest: Manifest | None,
                 data: memoryview | None) -> Callable[[], None] | None:
        """Send this rank's committed image of ``step`` (``None``: it has none) to its peer and receive the
        one its source sends. Collective over the job. Returns what keeps the received copy (verify every
        chunk, write, commit; raises when it is unusable, and nothing is committed then), to be called once
        ``data`` is no longer needed, or ``None`` when the source sent nothing."""
        try:
            received = self._swap(self.dst, self.src, step, manifest, data)
        except RuntimeError as e:   # gloo: the peer or the source died, or the group timed out
            raise CheckpointError(f"step {step}: the exchange with peer ranks {self.dst} (to) and {self.src} (from) "
                                  f"failed; one may have died (gloo says: {e})") from e
        if received is None:
            return None
        return lambda: self._keep(step, *received)

    def confirm(self, step: int, kept: bool) -> bool:
        """Tell the source whether its copy of ``step`` is committed here, and hear the same from the
        destination about this rank's copy. Collective, after every :meth:`exchange` (and the keep)."""
        dist = torch.distributed
        out = torch.tensor([int(kept), step], dtype=torch.int64)
        got = torch.zeros(2, dtype=torch.int64)
        for r in (dist.isend(out, self.src, group=self.ranks.group), dist.irecv(got, self.dst, group=self.ranks.group)):
            r.wait()
        return bool(got[0]) and int(got[1]) == step

    def _swap(self, to: int | None, frm: int | None, step: int, manifest: Manifest | None,
              data: memoryview | torch.Tensor | None) -> tuple[Manifest, torch.Tensor] | None:
        """Send (``to``) and receive (``frm``) one image each, either side optional; returns what came in."""
        dist = torch.distributed
        group = self.ranks.group
        raw = manifest.to_bytes() if manifest is not None else b""
        reqs = []
        if to is not None:
            hdr = torch.tensor([int(manifest is not None), len(raw), manifest.data_bytes if manifest else 0, step],
                               dtype=torch.int64)
            reqs.append(dist.isend(hdr, to, group=group))
        got = torch.zeros(4, dtype=torch.int64)
        if frm is not None:
            reqs.append(dist.irecv(got, frm, group=group))
        for r in reqs:
            r.wait()
        reqs = []
        if to is not None and manifest is not None:
            reqs.append(dist.isend(torch.frombuffer(bytearray(raw), dtype=torch.uint8), to, group=group))
            if manifest.data_bytes:
                body = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
                reqs.append(dist.isend(body[:manifest.data_bytes], to, group=group))
        ok, mlen, dbytes, sstep = got.tolist()
        mbuf = dbuf = None
        if frm is not None and ok:
            mbuf = torch.empty(mlen, dtype=torch.uint8)
            dbuf = torch.empty(dbytes, dtype=torch.uint8)
            reqs.append(dist.irecv(mbuf, frm, group=group))
            if dbytes:
                reqs.append(dist.irecv(dbuf, frm, group=group))
        for r in reqs:
            r.wait()
        if mbuf is None:
            return None
        where = f"the copy of rank {frm}'s step {sstep} received from it"
        m = Manifest.from_bytes(bytes(mbuf.numpy()), where)
        if m.step != sstep or sstep != step or m.data_bytes != dbytes:
            raise CorruptCheckpointError(f"{where}: step or size disagree with its header (step {step} expected)")
        return m, dbuf

    def _keep(self, step: int, m: Manifest, data: torch.Tensor, into: LocalTier | None = None) -> None:
        """Write and commit a received image; the local writer checks every chunk against the sender's
        checksums on the way and commits nothing that differs."""
        view, c = memoryview(data.numpy()), m.chunk_bytes
        (into or self.store).write_chunks(step, m, lambda i: view[i * c:(i + 1) * c], compute_checksums=False)

    def serve(self, step: int, send_to: int | None, receive: bool, local: LocalTier) -> bool:
        """Restore side, collective: send this rank's kept copy of ``step`` to ``send_to`` (its owner,
        whose own copies are gone) and/or, with ``receive``, take this rank's own copy back from its
        holder into ``local``. Returns whether a copy was received and committed locally."""
        manifest, data = None, None
        if send_to is not None:
            try:
                manifest = self.store.open(step)[1]
                data = torch.empty(manifest.data_bytes, dtype=torch.uint8)
                path = self.store.step_dir(step) / data_name(0)
                fd, _ = open_regular(path)   # never blocks on a FIFO put in its place
                with open(fd, "rb") as f:
                    if f.readinto(memoryview(data.numpy())) != manifest.data_bytes:
                        raise CorruptCheckpointError(f"{path}: shorter than its manifest says")
            except Exception as e:   # noqa: BLE001 - the owner hears "none" and falls back to another tier
                log.warning("rank %d cannot serve its copy of rank %d's step %d: %s", self.rank, send_to, step, e)
                manifest, data = None, None
        got = self._swap(send_to, self.holder_of(self.rank) if receive else None, step, manifest, data)
        if got is None:
            return False
        self._keep(step, *got, into=local)
        return True

"""Tunables in one place.

Resolution order: an explicit argument wins over an environment variable, which
wins over the default here. Tests override them with :func:`override`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["get", "override"]

_DEFAULTS: dict[str, int] = {
    # Bytes covered by one checksum; also the unit of parallel I/O.
    "CKPT_CHUNK_BYTES": 16 << 20,
    # Every tensor starts at a multiple of this in the data file (and the host buffer).
    "CKPT_ALIGN_BYTES": 4096,
    # Threads that write, read and checksum one rank's data file.
    "CKPT_IO_THREADS": max(2, min(16, os.cpu_count() or 2)),
    # Threads that write and checksum a snapshot in the background while training runs (the local tier's
    # writes, the memory tier's commit checksums). More only adds contention with the training thread:
    # on an H200 node, 16 of them cost +2.5% step time at a snapshot every 10 steps, 4 cost nothing
    # measurable over the snapshot itself, and 4 keep up with a 1.5 GB/s disk.
    "CKPT_PERSIST_THREADS": 4,
    # Pinned chunks in flight while restoring from disk to a GPU.
    "CKPT_RESTORE_BUFFERS": 16,
    # Parallel requests (parts in flight) to the remote tier.
    "CKPT_REMOTE_THREADS": 8,
    # Read checkpoints with O_DIRECT where the file system supports it (1) or through the page cache (0).
    "CKPT_DIRECT_IO": 1,
    # Seconds the remote tier's reachability probe may take (at construction, and before an upload or a
    # listing while the store is down) before the store counts as unreachable.
    "CKPT_REMOTE_PROBE_S": 20,
    # Seconds a request of the remote tier (one part, record, listing or removal) may go without finishing
    # before it is aborted and sent again; after 3 such attempts the save's (or the restore's) remote copy
    # fails with a TimeoutError naming the URL (ckpt.stall). 0: no deadline but the client's own timeouts.
    "CKPT_REMOTE_STALL_S": 120,
    # Seconds a rank's upload waits for the other ranks' reports before a job tier's commit gives up.
    "CKPT_COMMIT_TIMEOUT_S": 3600,
    # Keep the memory tier's snapshot buffers in shared memory ($CKPT_SHM_DIR, default /dev/shm), so that
    # they outlive the process (1), or in this process's own pinned memory (0).
    "CKPT_SHM": 1,
    # Nice value added to the persist threads and the background allocation (ckpt.priority): the
    # training thread keeps the CPU on a node whose cores are busy (0: same priority as the process).
    "CKPT_PERSIST_NICE": 10,
    # A collective restore copies this rank's newest snapshot in host memory onto its GPU while the ranks
    # agree on a step (1), so a rank that waits for the others (a replaced node still starting) has its
    # own state ready on the GPU; 0: each rank reads its tier only once the step is agreed.
    "CKPT_READ_AHEAD": 1,
    # Bytes per data message of the peer tier's replica exchange: the holder checks one piece's chunks
    # while the next arrives (and, over NCCL, the size of each device staging buffer; two per direction).
    "CKPT_PEER_PIECE_BYTES": 64 << 20,
    # Move the peer tier's replicas over an NCCL group of its own, staged through device buffers (1, where
    # there is CUDA), or over gloo from host memory (0); -1: NCCL where the job's own process group runs
    # NCCL (each rank then has its GPU), else gloo.
    "CKPT_PEER_NCCL": -1,
    # Seconds one message of the peer tier's exchange may wait for the other side (its groups' timeout):
    # a holder or source that stopped answering (died unnoticed, hung) fails the exchange after this, and
    # the peer tier stops replicating in this process (training and the other tiers go on). A message waits
    # at most for one piece or for the holder to get a replica buffer (seconds), never for a whole replica.
    "CKPT_PEER_TIMEOUT_S": 300,
    # Milliseconds a save of maybe_save() under if_busy="skip" waits for a host buffer before it skips the
    # snapshot (0: it skips at once, and the loop never waits): while the background allocation of the
    # buffers is still running (a fresh process; it starts at the first maybe_save() and takes seconds per
    # GB-sized buffer), or while every buffer is held by a tier still persisting an earlier snapshot or holds
    # the newest committed one (no wait when no buffer exists yet and the one being allocated cannot be there
    # in time). Explicit save() calls, preemption drains and if_busy="wait" wait as long as it takes.
    "CKPT_BUSY_WAIT_MS": 0,
    # Take the fingerprints of a save's CUDA tensors as one CUDA graph launch once the same tensors are
    # saved twice in a row (1), or one reduction launch per tensor every time (0).
    "CKPT_FINGERPRINT_GRAPH": 1,
    # Seconds after their last write that memory-tier segments whose job is gone (its local_dir kept, no live
    # owner) are freed by the next Checkpointer started on the node (0: never; segments whose local_dir was
    # deleted or made anew are freed at once: no job can use them).
    "CKPT_SHM_ORPHAN_S": 86400,
    # Chunks (64 MiB each) of a snapshot's device-to-host copy queued on the side stream at a time, after
    # the first burst: a host sync of the training loop (loss.item()) waits behind at most these, and the
    # thread that queues the next chunk needs the GIL, which the training thread holds for up to the
    # interpreter's switch interval (5 ms): with one queued, the copy engine idles while that thread waits.
    "CKPT_COPY_AHEAD": 1,
    # Milliseconds of one burst of the background allocation's pinned registrations: once no snapshot copy
    # is in flight, its 64 MiB pieces are registered back to back (a few ms each) until this much time has
    # passed or a copy begins, then it waits for the next quiet moment (0: one piece per quiet moment, with
    # 5 ms between pieces). With snapshots every step a quiet moment comes about once a step, so one piece a
    # moment registers a 7.4 GB buffer's 110 pieces in about as many steps.
    "CKPT_REGISTER_BURST_MS": 0,
    # Seconds the interpreter-exit hook waits for queued saves to persist (0: as long as they take).
    "CKPT_EXIT_WAIT_S": 0,
}

_overrides: dict[str, int] = {}


def get(name: str) -> int:
    """Current value of knob ``name`` (override, then environment, then default)."""
    if name in _overrides:
        return _overrides[name]
    env = os.environ.get(name)
    if env is not None:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"environment variable {name}={env!r} must be an integer") from None
    return _DEFAULTS[name]


@contextlib.contextmanager
def override(**values: int) -> Iterator[None]:
    """Temporarily set knobs, e.g. ``with override(CKPT_CHUNK_BYTES=4096): ...``."""
    unknown = set(values) - set(_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown knobs {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)

"""A rank's claim on its node-local directory (``local_dir``).

``local_dir`` is the node-local identity of four things: the local tier's files, the owner lock that makes one
live process its only writer (:class:`~ckpt.tiers.local.OwnerLock`), the names of the memory tier's
shared-memory segments (derived from the directory's identity, :mod:`ckpt.identity`, which its first owner
makes) and the RAM that dead jobs left on the node (named or freed when a job first owns its directory,
:func:`ckpt.shm.sweep_orphans`). :class:`Ownership` holds that claim for one ``Checkpointer``: taking it (at
the first save, or at construction in a collective job, where every rank also checks that no other rank
shares its directory), re-asserting it before each write (a writer fenced out of its directory stays out),
and giving it back at close.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import zlib
from typing import Any

from . import knobs, shm
from .errors import LockedError
from .pool import HostPool
from .ranks import Ranks
from .tiers import LocalTier, MemoryTier, RemoteTier
from .tiers.local import OwnerLock, owned
from .tiers.memory import space_for

__all__ = ["Ownership"]

log = logging.getLogger(__name__)


class Ownership:
    """This process's ownership of ``local.root``, and what comes with it (the memory tier's segment space,
    the sweep of dead jobs' RAM, the adoption of the previous owner's segments).

    ``ranks``: the job's ranks in a collective job (``None``: a single process). Thread-safe: the persisting
    tiers ask :meth:`still_owner` from their threads."""

    def __init__(self, local: LocalTier, memory: MemoryTier, pool: HostPool, ranks: Ranks | None) -> None:
        self.local, self.memory, self.pool, self.ranks = local, memory, pool, ranks
        self.owner: OwnerLock | None = None
        self.owned = False
        self.by_restore = False  # taken only to persist a restored snapshot (ckpt.restore's hand-over)
        self._lock = threading.Lock()

    def own(self, sweep: bool = True) -> None:
        """Become the owner of ``local_dir`` (once): raises :class:`~ckpt.errors.LockedError` while another live
        writer owns it, and at every call once another process took the directory from this one (before a save's
        snapshot: no tier, the memory tier included, gets a step of a writer fenced out of its directory).
        ``sweep=False``: the caller looks for what dead jobs left in RAM itself (:meth:`sweep_orphans`), later."""
        with self._lock:
            if self.owned and self.owner is not None:
                self.owner.reassert()
            if not self.owned:
                self.owner = self.local.acquire_owner()
                self.owned = True
                # the owner of local_dir is the one writer of its memory tier's shared-memory segments, named
                # from the directory's id, which the first owner makes (ckpt.identity); a local tier that guards
                # no directory of its own (acquire_owner() gave no lock) keeps its snapshots in the process
                if self.memory.space is None and self.owner is not None:
                    self.memory.space = space_for(
                        self.local.root, self.ranks.rank if self.ranks else 0, create=True
                    )
                if sweep:
                    self.sweep_orphans()
                self.pool.share(self.memory.space)
                # and takes over the segments its previous process left, in the background from now on: a
                # restore then copies them from pinned memory, and the first save finds them ready
                self.pool.adopt_ahead()

    def own_for_job(self, remote_url: str | None) -> bool:
        """In a collective job (call on all ranks): refuse, on every rank, a ``local_dir`` or ``remote_url`` that
        another rank of the job writes too (each rank's files and ``COMMIT`` would overwrite the others'), and a
        ``local_dir`` that a live process outside the job owns; otherwise every rank now owns its ``local_dir``.
        Sharing is found by marker files, so a directory shared across hosts (a network file system) is found
        too. Returns whether every rank was given the same ``remote_url`` (one job tier for the whole job)."""
        ranks = self.ranks
        assert ranks is not None, "own_for_job() is for a collective job"
        try:
            # the sweep waits for the other ranks' locks (below): a job restarted by its launcher would otherwise
            # find a rank that has not taken its directory yet, and name that rank's RAM as a dead job's
            self.own(sweep=False)
            lock_error: BaseException | None = None
        except Exception as e:  # noqa: BLE001 - reported below on every rank, after the agreement
            lock_error = e
        try:
            nonce = ranks.gather([secrets.randbits(62)])[0][0]  # rank 0's: one name space for this job
            prefix = f".ckpt-job-{nonce:x}-rank-"
            marker = self.local.root / f"{prefix}{ranks.rank}"
            marker.touch()
            try:
                ranks.gather([])  # every marker exists before any rank looks
                mates = sorted(int(p.name[len(prefix) :]) for p in self.local.root.glob(f"{prefix}*"))
                url = zlib.crc32(remote_url.encode()) if remote_url is not None else -1
                # also: every rank has looked before markers go
                seen = ranks.gather([len(mates), url, int(lock_error is not None)])
            finally:
                marker.unlink(missing_ok=True)
            urls = [u for _, u, _ in seen]
            job_url = urls[0] != -1 and urls.count(urls[0]) == len(urls)  # one url for the whole job
            same_url = [] if job_url else [r for r, u in enumerate(urls) if u != -1 and urls.count(u) > 1]
            problems = (
                [f"local_dir {str(self.local.root)!r} is shared by ranks {mates}"]
                if len(mates) > 1
                else ["another rank's local_dir is shared"]
                if any(n > 1 for n, _, _ in seen)
                else []
            )
            if same_url:
                problems.append(f"ranks {same_url} were given the same url, other ranks another")
            if problems:
                raise ValueError(
                    f"{'; '.join(problems)}: in a multi-process job give every rank its own local_dir "
                    "(e.g. f'{root}/rank-{rank}') and every rank the same url (a job tier) or each its "
                    "own, or pass collective=False if only one rank checkpoints"
                )
            if lock_error is not None:
                raise lock_error
            locked = [r for r, (_, _, bad) in enumerate(seen) if bad]
            if locked:
                raise LockedError(
                    f"rank(s) {locked} could not take ownership of their local_dir (their errors say "
                    "why: another live process owns it, say): every rank stops",
                    str(self.local.root),
                )
        except BaseException:
            self.disown()
            raise
        self.sweep_orphans()  # every rank of the job owns its local_dir now
        return job_url

    def join_job(self, remote: RemoteTier | None) -> None:
        """In a collective job (call on all ranks; nothing otherwise): :meth:`own_for_job`, and where every rank
        was given the same url, make ``remote`` the job tier. Decided from gathered facts, so every rank joins
        (a collective) or none does."""
        if self.ranks is not None and self.own_for_job(remote.url if remote is not None else None):
            remote.join_job(Ranks(timeout_s=knobs.get("CKPT_COMMIT_TIMEOUT_S"), own_group=True))

    def still_owner(self) -> None:
        """Raise :class:`~ckpt.errors.LockedError` when this process owned ``local_dir`` and another process
        took it (the persisting tiers ask before each write, from their threads: a fenced writer's snapshots
        queued before it lost the directory reach no tier, the remote one included)."""
        owner = self.owner
        if self.owned and owner is not None:
            owner.reassert()

    def sweep_orphans(self) -> None:
        """One rank per node, before its first buffer: what dead jobs left in the RAM file system is named, or
        freed by the policy (``CKPT_SHM_ORPHAN_S``)."""
        if self.memory.space is not None and os.environ.get("LOCAL_RANK", "0") == "0":
            try:
                shm.sweep_orphans(skip=shm.local_key(self.memory.space.prefix))
            except OSError as e:
                log.debug("looking for the RAM that dead jobs left failed: %s", e)

    def may_refill(self) -> bool:
        """Whether a restore may write what it reads from a farther tier into ``local_dir`` (a refill): where this
        process owns it, or no live process does (asked just before the restore: taking the lock for the
        restore instead would make a trainer that starts meanwhile fail). Beside another live owner it writes
        nothing there: that process is the one writer of its directory."""
        if self.owned or not owned(self.local.root):
            return True
        log.info("restoring without writing into %s: another live process owns it", self.local.root)
        return False

    def other_owner(self) -> bool:
        """Whether another live process owns ``local_dir`` now (this one does not)."""
        return not self.owned and owned(self.local.root)

    def close(self, pipeline: Any, peer: Any, keep_memory: bool, took_snapshots: bool, loud: bool) -> None:
        """A Checkpointer's end on this node: finish every write (``pipeline``, and the replicas ``peer`` holds,
        or ``None``), keep the memory tier's segments in RAM for the next process or free them, then give the
        directory back. Kept: with ``keep_memory``, and where this process owns ``local_dir`` only because a
        restore persisted a previous process's snapshot and it took no snapshot itself (``took_snapshots``);
        never beside another owner. ``loud``: the kept memory tier is announced at WARNING."""
        try:
            keep_memory = keep_memory or (self.by_restore and not took_snapshots)
            pipeline.close(keep_shared=keep_memory or not self.owned)
            if keep_memory and self.owned:
                self.memory.say_kept(loud=loud)
            if peer is not None:  # the replicas this rank holds: freed with its own snapshots, or kept
                peer.close(keep_shared=keep_memory or not self.owned)
        finally:
            self.disown()  # every write is over: another process may own local_dir now

    def disown(self) -> None:
        """Give the directory back (idempotent): every write of this process is over."""
        with self._lock:
            owner, self.owner, self.owned = self.owner, None, False
        if owner is not None:
            owner.release()

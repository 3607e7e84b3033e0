"""Child side of the peer tier's part of the tier contract (tests/test_tier_contract.py): one gloo rank of a
two-rank job that runs every contract check on the peer tier, as the other tiers are checked in that module,
and prints the outcome of each as one JSON line (``results {"check": "ok" or what failed}``).

``python peer_contract_worker.py ROOT RANK WORLD``, MASTER_ADDR / MASTER_PORT from the environment. Each check
gets a peer tier of its own (its ``local_dir`` is ``ROOT/rank-<RANK>/<check>``, its RAM ``ROOT/shm-<RANK>``)
and commits through the contract: both ranks call :meth:`~ckpt.tiers.peer.PeerTier.write` with their own
snapshot images (a collective exchange), so each rank's tier then holds its *source*'s replicas. The checks
run in the same order on every rank; a check's assertions come after its exchanges, so one that fails on a
rank leaves the other no exchange to wait for.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from test_tier_contract import _flip, _image

SEEDS = (1, 2, 3)  # the snapshot images a check commits: its rank's state at one of these seeds


def state_of(rank: int, seed: int) -> dict:
    """Rank ``rank``'s training state at ``seed``: the same in every process that makes it."""
    from helpers import make_state, train

    state = make_state(100 * rank + seed)
    train(state, seed)
    return state


def raises(expected: type[BaseException] | tuple, call: Callable[[], object], what: str) -> None:
    """``call()`` raises ``expected`` (by type), or the check fails saying ``what`` happened instead."""
    try:
        call()
    except expected:
        return
    raise AssertionError(what)


class Ctx:
    """What every check gets: this rank's place, its images to commit, its source's expected values."""

    def __init__(self, root: Path, rank: int, world: int) -> None:
        from helpers import snapshot_values

        self.root, self.rank, self.world = root, rank, world
        self.src = (rank - 1) % world  # peers=1: rank r holds rank r - 1's replicas
        self.images = {}
        for seed in SEEDS:  # made before the process group exists: a scratch Checkpointer of one process
            self.images[seed] = _image(root / f"scratch-{rank}", 0, state_of(rank, seed))
        self.want = {seed: snapshot_values(state_of(self.src, seed)) for seed in SEEDS}
        self.tier = None

    def fresh(self, name: str, again: bool = False):
        """A peer tier of its own for check ``name`` (collective: every rank makes it at once); ``again``:
        over the same ``local_dir`` as the last one, as this rank's next process makes it."""
        from ckpt.ranks import Ranks
        from ckpt.tiers.peer import PeerTier

        d = self.root / f"rank-{self.rank}" / name
        d.mkdir(parents=True, exist_ok=again)
        self.tier = PeerTier.for_job(d, Ranks(), 1)
        return self.tier

    def commit(self, step: int, seed: int, data: bytes | None = None) -> None:
        """This rank's image of ``seed`` as ``step`` through the contract (collective): its holder commits
        it."""
        m, raw = self.images[seed]
        m = dataclasses.replace(
            copy.deepcopy(m), step=step, rank=self.rank, world_size=self.world, job=[self.rank, self.world]
        )
        self.tier.write(step, m, memoryview(data if data is not None else raw))

    def same_as_source(self, state: dict, seed: int) -> None:
        from helpers import snapshot_values

        want, got = self.want[seed], snapshot_values(state)
        for k in want["model"]:
            assert torch.equal(want["model"][k], got["model"][k]), k
        assert want["meta"] == got["meta"] and want["lr"] == got["lr"]


def listed_described_loaded_and_verified(c: Ctx) -> None:
    from ckpt.tiers.base import StepInfo, TierFigures
    from helpers import make_state

    tier = c.fresh("listed")
    c.commit(7, 1)
    listed = {e.step: e for e in tier.committed()}
    assert 7 in listed and listed[7].timeline == tier.timeline, listed
    assert 7 in tier.committed_steps()
    info = tier.describe(7)
    assert isinstance(info, StepInfo) and info.path and info.nbytes and info.nbytes > 0, info
    assert info.created_unix is not None and abs(info.created_unix - time.time()) < 600, info
    assert isinstance(tier.location(), str) and tier.location()
    assert isinstance(tier.where(7), str) and tier.where(7)
    m = tier.manifest_of(7, listed[7].timeline)
    assert m.step == 7 and m.data_bytes > 0 and m.rank == c.src, m.rank  # the replica held: its source's
    tier.check(7, listed[7].timeline)
    fig = tier.figures()
    assert isinstance(fig, TierFigures) and fig.name == tier.name == "peer" and fig.committed >= 1, fig
    tier.verify(7)
    into = make_state(50)
    assert tier.restore_into(into, 7, listed[7].timeline, True, None) > 0
    c.same_as_source(into, 1)
    assert tier.describe(99) == StepInfo() and isinstance(tier.where(99), str)  # a step not held
    raises(LookupError, lambda: tier.manifest_of(99), "a manifest of a step not held")


def flipped_byte_fails_verification_and_the_load(c: Ctx) -> None:
    """On the replicas a previous process of this rank left in RAM (a replica received in this process was
    checked as it arrived and never left it, as the memory tier's own snapshots): the next one's peer tier
    serves them, and checks every byte it reads."""
    from ckpt import shm
    from ckpt.errors import CorruptCheckpointError
    from helpers import make_state

    tier = c.fresh("flipped")
    c.commit(3, 3)
    space = tier.space
    assert space is not None, "no RAM file system for the replicas"
    tier.close(keep_shared=True)  # its replicas stay in RAM, as a crash leaves them
    ((rec,),) = [g.records for g in shm.segments(space.root, space.prefix)]
    _flip(Path(rec.path).with_name(rec.buffer))
    tier = c.fresh("flipped", again=True)  # the rank's next process
    assert tier.committed_steps() == [3], tier.committed_steps()
    raises(CorruptCheckpointError, lambda: tier.verify(3), "verify passed a replica with a flipped byte")
    raises(
        CorruptCheckpointError,
        lambda: tier.restore_into(make_state(4), 3, None, True, None),
        "a replica with a flipped byte was loaded",
    )


def restore_search_goes_by_tiers_alone(c: Ctx) -> None:
    from ckpt.errors import NoCheckpointError
    from ckpt.restore import restore
    from helpers import make_state, snapshot_values

    tier = c.fresh("search")
    c.commit(1, 1)
    c.commit(2, 2)
    into = make_state(9)
    info = restore(into, [tier])
    assert info is not None and info.step == 2 and info.tier == "peer" and info.nbytes > 0, info
    c.same_as_source(into, 2)
    assert tier.figures().reads >= 1
    # in a job, the replicas held are another rank's copies: passed over, never loaded into this rank's state
    before = snapshot_values(into)
    raises(
        NoCheckpointError,
        lambda: restore(into, [tier], job=[c.rank, c.world]),
        "the source's replica was restored into this rank's state",
    )
    assert all(torch.equal(before["model"][k], v) for k, v in snapshot_values(into)["model"].items())


def delete_removes_the_commit_and_the_step(c: Ctx) -> None:
    from ckpt.errors import CheckpointError
    from helpers import make_state

    tier = c.fresh("delete")
    c.commit(1, 1)
    c.commit(2, 2)
    tier.delete(1)
    assert 1 not in tier.committed_steps() and 2 in tier.committed_steps(), tier.committed_steps()
    raises(
        (CheckpointError, LookupError, OSError),
        lambda: tier.restore_into(make_state(1), 1, None, True, None),
        "a deleted step was loaded",
    )


def a_failed_write_leaves_the_committed_copy(c: Ctx) -> None:
    """The peer tier's write fails when its holder refuses the replica (here: bytes that fail their checksum
    on arrival): a CheckpointError, and the replica of the step committed before is as it was."""
    from ckpt.errors import CheckpointError
    from helpers import make_state

    tier = c.fresh("failed-write")
    c.commit(4, 1)
    bad = bytearray(c.images[2][1])
    bad[10] ^= 0xFF  # the manifest's checksums are the good bytes'
    raises(
        CheckpointError,
        lambda: c.commit(4, 2, data=bytes(bad)),
        "a replica that failed its checksum on arrival was reported committed",
    )
    assert tier.committed_steps() == [4], tier.committed_steps()
    tier.verify(4)
    into = make_state(7)
    tier.restore_into(into, 4, None, True, None)
    c.same_as_source(into, 1)


def retention_is_declared_by_its_buffers(c: Ctx) -> None:
    from ckpt.policy import Retention

    tier = c.fresh("retention")
    assert (
        tier.keep_of(Retention(local=1, remote=1)) is None
    )  # what it keeps is its number of replica buffers
    assert tier.prunes_here() is False


def a_commit_records_the_tiers_timeline(c: Ctx) -> None:
    from ckpt.policy import Timeline

    tier = c.fresh("timeline")
    tier.timeline = Timeline(2, ((0, 5),))
    c.commit(9, 3)
    entries = [e for e in tier.committed() if e.step == 9]
    assert [e.timeline for e in entries] == [Timeline(2, ((0, 5),))], entries


def status_and_copy_identity(c: Ctx) -> None:
    from ckpt.tiers.base import COPY_UNKNOWN, TierStatus

    tier = c.fresh("status")
    c.commit(4, 1)
    assert isinstance(tier.status, TierStatus) and tier.status.available is not False, tier.status
    stamp = tier.copy_id(4)
    assert stamp is not None
    if stamp is not COPY_UNKNOWN:
        assert tier.copy_id(4) == stamp and tier.copy_id(99) is None


def verify_returns_the_manifests_of_the_copies_it_read(c: Ctx) -> None:
    tier = c.fresh("verify")
    c.commit(5, 2)
    manifests = tier.verify(5)
    assert isinstance(manifests, list) and [m.rank for m in manifests] == [c.src], manifests
    assert manifests[0].step == 5 and manifests[0].data_bytes == tier.manifest_of(5).data_bytes


def no_stored_records_declared(c: Ctx) -> None:
    """Not a StoredTier (records, check_stored, fetch, stored_bytes, step_location): callers ask
    ``isinstance(tier, StoredTier)``."""
    from ckpt.tiers.base import StoredTier

    tier = c.fresh("stored")
    assert not isinstance(tier, StoredTier) and not tier.durable


def the_copy_a_restore_receives_meets_it_too(c: Ctx) -> None:
    """What a restore reads as the peer tier (:class:`~ckpt.tiers.peer.ReceivedCopy`): rank 1 gets its own
    snapshot back from the RAM of rank 0, its holder (collective), and the copy it received meets the contract
    (its own: loaded in the job; deleted, gone)."""
    from ckpt.errors import CheckpointError
    from ckpt.tiers.base import COPY_UNKNOWN, StepInfo, StoredTier, TierFigures, TierStatus
    from helpers import make_state, snapshot_values

    tier = c.fresh("received")
    c.commit(6, 2)
    timeline = tier.timeline
    got = tier.serve(6, timeline, send_to=1 if c.rank == 0 else None, receive=c.rank == 1)
    if c.rank == 0:
        assert got is None, got
        return
    assert got is not None and got.name == "peer" and not isinstance(got, StoredTier) and not got.durable
    assert [(e.step, e.timeline) for e in got.committed()] == [(6, timeline)] and got.committed_steps() == [6]
    info = got.describe(6)
    assert isinstance(info, StepInfo) and info.path and info.nbytes and info.created_unix, info
    assert (
        got.describe(99) == StepInfo() and isinstance(got.location(), str) and isinstance(got.where(6), str)
    )
    assert got.manifest_of(6, timeline).rank == c.rank  # this rank's own copy
    got.check(6, timeline)
    fig = got.figures()
    assert isinstance(fig, TierFigures) and fig.name == "peer" and fig.committed == 1, fig
    manifests = got.verify(6)
    assert isinstance(manifests, list) and [m.rank for m in manifests] == [c.rank], manifests
    assert isinstance(got.status, TierStatus) and got.status.available is not False
    stamp = got.copy_id(6)
    assert stamp is not None and (stamp is COPY_UNKNOWN or got.copy_id(6) == stamp)
    into = make_state(8)
    assert got.restore_into(into, 6, timeline, True, [c.rank, c.world]) > 0
    want, have = snapshot_values(state_of(c.rank, 2)), snapshot_values(into)
    assert all(torch.equal(want["model"][k], have["model"][k]) for k in want["model"])
    got.delete(6)
    assert got.committed_steps() == [], got.committed_steps()
    raises(
        (CheckpointError, LookupError, OSError),
        lambda: got.restore_into(make_state(1), 6, None, True, None),
        "a deleted copy was loaded",
    )


CHECKS: list[Callable[[Ctx], None]] = [
    listed_described_loaded_and_verified,
    flipped_byte_fails_verification_and_the_load,
    restore_search_goes_by_tiers_alone,
    delete_removes_the_commit_and_the_step,
    a_failed_write_leaves_the_committed_copy,
    retention_is_declared_by_its_buffers,
    a_commit_records_the_tiers_timeline,
    status_and_copy_identity,
    verify_returns_the_manifests_of_the_copies_it_read,
    no_stored_records_declared,
    the_copy_a_restore_receives_meets_it_too,
]


def main() -> None:
    root, rank, world = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.makedirs(root / f"shm-{rank}", exist_ok=True)
    os.environ["CKPT_SHM_DIR"] = str(root / f"shm-{rank}")
    c = Ctx(root, rank, world)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for check in CHECKS:
            try:
                check(c)
                results[check.__name__] = "ok"
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
                results[check.__name__] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            finally:
                if c.tier is not None:
                    c.tier.close(keep_shared=False)
                    c.tier = None
            torch.distributed.barrier()
    finally:
        print("results", json.dumps(results), flush=True)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""The tier contract (:mod:`ckpt.tiers.base`), one test run over every tier.

Each case builds a tier, commits steps to it through the contract (``write`` for the tiers the
pipeline persists to; a real snapshot for the memory tier), and checks what restore, retention, the
CLI and ``Checkpointer.list`` rely on: listing with timelines, describe/figures, validated manifests,
bit-exact loads, verification that fails on one flipped byte, deletion commit record first, a failed
write that leaves the committed copy as it was, and retention that keeps the newest.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import ckpt
from ckpt import shm
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.policy import Retention, Timeline, prune
from ckpt.pool import HostPool
from ckpt.tiers import LocalTier, MemoryTier, RemoteTier
from ckpt.tiers.base import PersistingTier, StepInfo, StoredTier, Tier, TierFigures, registered
from ckpt.tiers.memory import space_for

from helpers import make_state, snapshot_values, train

needs_shm = pytest.mark.skipif(shm.shm_root() is None, reason="no RAM file system (/dev/shm) here")


@dataclasses.dataclass
class Case:
    tier: Tier
    commit: Callable[[int, dict], None]  # commit ``state`` as step ``n`` through the contract
    corrupt: Callable[[int], None] | None  # flip one stored byte of step ``n`` (None: nothing stored)
    close: Callable[[], None] = lambda: None


def _image(tmp: Path, step: int, state: dict) -> tuple[ckpt.format.Manifest, bytes]:
    """The manifest and data file image a snapshot of ``state`` makes (through a scratch local tier)."""
    d = tmp / f"image-{step}-{time.monotonic_ns()}"
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=d)) as ck:
        ck.save(step, state).wait()
    side = LocalTier(d)
    manifest = side.open(step)[1]
    with side.mapped(step) as view:
        data = bytes(view)
    return manifest, data


def _writer(tier: PersistingTier, tmp: Path) -> Callable[[int, dict], None]:
    def commit(step: int, state: dict) -> None:
        manifest, data = _image(tmp, step, state)
        tier.write(step, copy.deepcopy(manifest), memoryview(data))

    return commit


def _flip(path: Path, at: int = 10) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _local(tmp: Path, request: Any) -> Case:
    tier = LocalTier(tmp / "local")
    return Case(tier, _writer(tier, tmp), lambda n: _flip(next((tier.step_dir(n)).glob("*.bin"))))


def _remote_file(tmp: Path, request: Any) -> Case:
    tier = RemoteTier(f"file://{tmp}/remote")
    return Case(tier, _writer(tier, tmp), lambda n: _flip(sorted(Path(tier.step_dir(n)).rglob("part-*"))[0]))


def _remote_s3(tmp: Path, request: Any) -> Case:
    bucket, port = request.getfixturevalue("s3_bucket")
    from s3server import storage_options

    tier = RemoteTier(f"s3://{bucket}/run", storage_options(port))

    def corrupt(n: int) -> None:
        part = sorted(tier.fs.find(tier.step_dir(n)))
        part = next(p for p in part if "/part-" in p)
        raw = bytearray(tier.fs.cat_file(part))
        raw[10] ^= 0xFF
        tier.fs.pipe_file(part, bytes(raw))

    return Case(tier, _writer(tier, tmp), corrupt)


def _memory_here(tmp: Path, request: Any) -> Case:
    """The memory tier of a live Checkpointer: its own host buffers (bytes that never left the process)."""
    with ckpt.knobs.override(CKPT_SHM=0):
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=tmp / "owner", max_in_flight=3), policy=ckpt.Policy(if_busy="wait")
        )

    def commit(step: int, state: dict) -> None:
        ck._use_timeline(ck.memory.timeline)  # the saves record the timeline the test gave the tier
        ck.save(step, state).wait()

    return Case(ck.memory, commit, None, close=lambda: ck.close())


def _memory_left(tmp: Path, request: Any) -> Case:
    """The memory tier a new process finds: the shared-memory segments a previous one left."""
    owner = tmp / "owner"
    owner.mkdir()
    space = space_for(owner, 0, create=True)  # the directory's id, as its first Checkpointer makes it
    tier = MemoryTier(HostPool(1, None, pin=False), space)
    made: list[ckpt.Checkpointer] = []

    def commit(step: int, state: dict) -> None:
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=owner, max_in_flight=3), policy=ckpt.Policy(if_busy="wait")
        )
        ck._use_timeline(tier.timeline)  # the saves record the timeline the test gave the tier
        ck.save(step, state).wait()
        ck.close(keep_memory=True)
        made.append(ck)

    def corrupt(n: int) -> None:
        rec = next(r for r in tier._left() if r.step == n)
        _flip(Path(rec.path).with_name(rec.buffer))

    def close() -> None:
        shm.free(space.root, space.prefix)

    return Case(tier, commit, corrupt, close)


CASES = {
    "memory (this process)": _memory_here,
    "memory (left in shared memory)": pytest.param(_memory_left, marks=needs_shm),
    "local": _local,
    "remote (file://)": _remote_file,
    "remote (s3, moto)": _remote_s3,
}


@pytest.fixture(params=list(CASES.values()), ids=list(CASES))
def case(request, tmp_path):
    c = request.param(tmp_path, request)
    yield c
    c.close()


def _fresh_values(state: dict) -> dict:
    return snapshot_values(state)


def test_the_tier_classes_are_registered_nearest_first():
    names = [c.name for c in registered()]
    assert names[:2] == ["memory", "local"] and "remote" in names
    assert len(names) == len(set(names))
    nearness = [c.nearness for c in registered()]
    assert nearness == sorted(nearness)


def test_a_committed_step_is_listed_described_loaded_and_verified(case, tmp_path):
    tier = case.tier
    state = make_state(1)
    train(state, 2)
    case.commit(7, state)
    want = snapshot_values(state)
    listed = {e.step: e for e in tier.committed()}
    assert 7 in listed and listed[7].timeline == tier.timeline
    assert 7 in tier.committed_steps()
    info = tier.describe(7)
    assert isinstance(info, StepInfo) and info.path and info.nbytes and info.nbytes > 0
    assert info.created_unix is not None and abs(info.created_unix - time.time()) < 600
    assert isinstance(tier.location(), str) and tier.location()
    m = tier.manifest_of(7, listed[7].timeline)
    assert m.step == 7 and m.data_bytes > 0
    tier.check(7, listed[7].timeline)
    fig = tier.figures()
    assert isinstance(fig, TierFigures) and fig.name == tier.name and fig.committed >= 1
    tier.verify(7)
    other = make_state(2)
    train(other, 5)
    n = tier.restore_into(other, 7, listed[7].timeline, True, None)
    assert n > 0
    got = snapshot_values(other)
    for k in want["model"]:
        assert torch.equal(want["model"][k], got["model"][k]), k
    assert want["meta"] == got["meta"] and want["lr"] == got["lr"]


def test_one_flipped_byte_fails_verification_and_the_load(case):
    if case.corrupt is None:
        pytest.skip("this tier's bytes never leave the process: nothing stored to flip")
    tier = case.tier
    case.commit(3, make_state(3))
    case.corrupt(3)
    with pytest.raises(CorruptCheckpointError):
        tier.verify(3)
    with pytest.raises(CorruptCheckpointError):
        tier.restore_into(make_state(4), 3, None, True, None)


def test_the_restore_search_goes_by_tiers_alone(case):
    """``ckpt.restore.restore`` over a list holding only this tier: newest step, bit-exact, its name reported."""
    from ckpt.restore import restore

    a, b = make_state(5), make_state(6)
    train(b, 3)
    case.commit(1, a)
    case.commit(2, b)
    want = snapshot_values(b)
    into = make_state(9)
    info = restore(into, [case.tier])
    assert info.step == 2 and info.tier == case.tier.name and info.nbytes > 0
    got = snapshot_values(into)
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"])
    assert case.tier.figures().reads >= 1


def test_delete_removes_the_commit_and_the_step(case):
    tier = case.tier
    case.commit(1, make_state(1))
    case.commit(2, make_state(2))
    tier.delete(1)
    assert 1 not in tier.committed_steps() and 2 in tier.committed_steps()
    with pytest.raises((CheckpointError, LookupError, OSError)):
        tier.restore_into(make_state(1), 1, None, True, None)


def test_a_write_that_fails_midway_leaves_the_committed_copy(case, tmp_path):
    tier = case.tier
    if not isinstance(tier, PersistingTier):
        pytest.skip("the memory tier commits host buffers: a failed copy is covered by test_memory_tier")
    first = make_state(1)
    case.commit(4, first)
    want = snapshot_values(first)
    manifest, data = _image(tmp_path, 4, make_state(2))

    class Failing:
        """A data image whose second chunk cannot be read (a source that fails mid-write)."""

        def __init__(self, raw: bytes, chunk: int) -> None:
            self.raw, self.chunk = memoryview(raw), chunk

        def __len__(self) -> int:
            return len(self.raw)

        def __getitem__(self, s: slice):
            if s.start is not None and s.start >= self.chunk:
                raise OSError(5, "the source failed mid-write")
            return self.raw[s]

    manifest.chunk_bytes = max(4096, manifest.data_bytes // 3 // 4096 * 4096)
    assert manifest.data_bytes > manifest.chunk_bytes
    with pytest.raises(OSError):
        tier.write(4, copy.deepcopy(manifest), Failing(data, manifest.chunk_bytes))
    assert tier.committed_steps() == [4]
    tier.verify(4)
    into = make_state(7)
    tier.restore_into(into, 4, None, True, None)
    got = snapshot_values(into)
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"])


def test_retention_keeps_the_newest_and_the_newest_verified(case):
    tier = case.tier
    if tier.keep_of(Retention(local=1, remote=1)) is None:
        pytest.skip("retention of this tier is its number of buffers")
    for s in (1, 2, 3):
        case.commit(s, make_state(s))
    tier.verified.clear()
    tier.verified[2] = True
    prune(tier, tier.keep_of(Retention(local=1, remote=1)), verified=lambda s: tier.verified.get(s) is True)
    assert tier.committed_steps() == [3, 2]


def test_a_commit_records_the_tiers_timeline(case):
    tier = case.tier
    tier.timeline = Timeline(2, ((0, 5),))
    case.commit(9, make_state(3))
    (e,) = [e for e in tier.committed() if e.step == 9]
    assert e.timeline == Timeline(2, ((0, 5),))


def test_status_and_copy_identity_are_declared_by_every_tier(case):
    """What restore and promote ask every tier, with one return type each: whether its storage answers
    (a TierStatus), and what identifies the copy of a step committed there now (None once it is gone)."""
    from ckpt.tiers.base import COPY_UNKNOWN, TierStatus

    tier = case.tier
    case.commit(4, make_state(4))
    assert isinstance(tier.status, TierStatus) and tier.status.available is not False
    stamp = tier.copy_id(4)
    assert stamp is not None
    if stamp is not COPY_UNKNOWN:  # a tier that can tell copies apart: stable while nothing changes
        assert tier.copy_id(4) == stamp and tier.copy_id(99) is None
        if isinstance(tier, PersistingTier):  # a re-save of the step is another copy
            case.commit(4, make_state(5))
            assert tier.copy_id(4) not in (None, stamp)


def test_verify_returns_the_manifests_of_the_copies_it_read(case):
    """One return type on every tier: a list of manifests, one per rank's copy of the step the tier holds, in
    rank order (here one rank: its own)."""
    tier = case.tier
    case.commit(5, make_state(5))
    manifests = tier.verify(5)
    assert isinstance(manifests, list) and [m.rank for m in manifests] == [tier.rank]
    assert manifests[0].step == 5 and manifests[0].data_bytes == tier.manifest_of(5).data_bytes


def test_every_ranks_records_stored_bytes_and_verified_chunks(case):
    """The tiers with commit records on storage give every rank's records of a step, say where its files are,
    check the stored bytes, and serve each chunk checked against its checksum: what `ckpt inspect` / `verify`
    and export read whatever the tier. A flipped byte fails the chunk that holds it, by type."""
    tier = case.tier
    if not isinstance(tier, StoredTier):
        assert not tier.durable  # a tier in RAM (memory, peer): no files for a reader outside the process
        pytest.skip("this tier keeps no commit records on storage")
    case.commit(6, make_state(6))
    commit, manifests = tier.records(6)
    assert commit.step == 6 and [m.rank for m in manifests] == [tier.rank]
    assert tier.step_location(6) == tier.describe(6).path  # where messages say the step's files are
    assert isinstance(tier.step_location(99), str)  # named without asking storage, committed or not
    m = manifests[0]
    assert tier.stored_bytes(6) == m.data_bytes
    tier.check_stored(6, m)
    image = b"".join(bytes(tier.fetch(6, m.rank, m, i)) for i in range(len(m.chunks)))
    assert len(image) == m.data_bytes
    if case.corrupt is not None:
        case.corrupt(6)
        with pytest.raises(CorruptCheckpointError):
            for i in range(len(m.chunks)):
                tier.fetch(6, m.rank, m, i)


# -- the peer tier ------------------------------------------------------------------------------------
# Its replicas live in another rank's RAM and its writes are collective, so it needs a real job: one
# two-rank gloo job per test run (tests/peer_contract_worker.py) runs every check above on the peer tier and
# reports each one's outcome; the tests below assert on those outcomes.

PEER_CHECKS = [
    "listed_described_loaded_and_verified",
    "flipped_byte_fails_verification_and_the_load",
    "restore_search_goes_by_tiers_alone",
    "delete_removes_the_commit_and_the_step",
    "a_failed_write_leaves_the_committed_copy",
    "retention_is_declared_by_its_buffers",
    "a_commit_records_the_tiers_timeline",
    "status_and_copy_identity",
    "verify_returns_the_manifests_of_the_copies_it_read",
    "no_stored_records_declared",
    "the_copy_a_restore_receives_meets_it_too",
]


@pytest.fixture(scope="module")
def peer_results(tmp_path_factory) -> list[dict[str, str]]:
    """Each rank's outcome of every peer check, from the one job this run makes: under pytest-xdist the first
    worker to get here runs it, under a file lock, and the others read what it wrote."""
    import fcntl
    import json
    import os
    import tempfile

    from helpers import run_ranks

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one per run, shared by its workers
    root = tmp_path_factory.getbasetemp()
    root = root.parent / f"peer-contract-{run}" if run else root / "peer-contract"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "results.json"
        if not done.exists():
            job = tempfile.mkdtemp(prefix="job-", dir=root)  # a worker after one whose job failed tries again
            out = run_ranks(
                Path(__file__).parent / "peer_contract_worker.py",
                job,
                world=2,
                timeout=120,
                env={"CKPT_PEER_TIMEOUT_S": "30"},
            )
            got = []
            for r in out:
                line = next((l for l in r.stdout.splitlines() if l.startswith("results ")), None)
                assert r.returncode == 0 and line is not None, r.stderr[-3000:]
                got.append(json.loads(line[len("results ") :]))
            assert all(sorted(g) == sorted(PEER_CHECKS) for g in got), got  # every check is asserted on below
            done.write_text(json.dumps(got))
        return json.loads(done.read_text())


def test_the_peer_tier_is_registered():
    from ckpt.tiers.peer import PeerTier

    assert PeerTier in registered() and PeerTier.name == "peer" and not PeerTier.durable


@pytest.mark.parametrize("check", PEER_CHECKS)
def test_the_peer_tier_meets_the_contract(peer_results, check):
    for rank, results in enumerate(peer_results):
        assert results.get(check) == "ok", f"rank {rank}: {results.get(check, 'not run')}"

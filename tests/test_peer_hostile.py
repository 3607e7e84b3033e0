"""The peer tier attacked through real gloo jobs (tests/peer_hostile_worker.py): ranks SIGKILLed at chosen points
of an exchange, replica segments flipped, truncated, replaced by links and FIFOs, records that lie, nodes wiped
in pairs. Whatever happens, a restart restores a step every rank agrees on, each rank's tensors bit-identical
to what it saved at that step (``restored S TIER True``), or every rank says there is no checkpoint: never torn
bytes, never a hang (every job runs under a time limit)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import run_ranks

HERE = Path(__file__).parent
WORKER = HERE / "peer_hostile_worker.py"
LIMIT = 60  # seconds a job may take before the test fails as hung


def _run(root: Path, mode: str, world: int, **env: str) -> list[subprocess.CompletedProcess]:
    return run_ranks(
        WORKER, str(root), mode, world=world, timeout=LIMIT, env={"CKPT_PEER_TIMEOUT_S": "15", **env}
    )


def _save(root: Path, world: int, **env: str) -> None:
    for r in _run(root, "save", world, **env):
        assert r.returncode == 0 and "saved [4, 2]" in r.stdout, r.stdout + r.stderr[-3000:]


def _killed(results: list[subprocess.CompletedProcess], victim: int) -> None:
    """Every rank was SIGKILLed; ``victim`` at the point it was armed for."""
    for r in results:
        assert r.returncode == -signal.SIGKILL and "dying" in r.stdout, r.stderr[-3000:]
    assert "dying armed" in results[victim].stdout, results[victim].stdout + results[victim].stderr[-3000:]


def _restored(results: list[subprocess.CompletedProcess]) -> list[tuple[int, str, bool]]:
    out = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(l for l in r.stdout.splitlines() if l.startswith("restored"))
        step, tier, exact = line.split()[1:]
        out.append((int(step), tier, exact == "True"))
    return out


def _no_checkpoint(results: list[subprocess.CompletedProcess]) -> None:
    for r in results:
        assert r.returncode not in (0, -signal.SIGKILL), r.stdout + r.stderr[-2000:]
        assert "NoCheckpointError" in r.stderr, r.stderr[-2000:]


def _wipe(root: Path, *ranks: int) -> None:
    """These ranks' nodes are replaced: local disk and RAM gone."""
    for rank in ranks:
        shutil.rmtree(root / f"rank-{rank}")
        shutil.rmtree(root / f"shm-{rank}")


def _replica(root: Path, holder: int, step: int) -> tuple[Path, Path, int]:
    """The record and the buffer of the replica of ``step`` that ``holder`` keeps, and its bytes of data (the
    buffer may be longer)."""
    for rec in (root / f"shm-{holder}").glob("ckpt-*-p*-s*.rec"):
        d = json.loads(rec.read_bytes())
        if d["step"] == step:
            return rec, rec.with_name(d["buffer"]), json.loads(d["manifest"])["data_bytes"]
    raise AssertionError(f"rank {holder} holds no replica of step {step}")


def _check(
    got: list[tuple[int, str, bool]], peer_ranks: set[int], steps: set[int], either: set[int] = frozenset()
) -> int:
    """Every rank restored the same step (one of ``steps``), bit-identical; ``peer_ranks`` from the peer tier,
    ``either`` from any tier, the others from their own."""
    assert len({s for s, _, _ in got}) == 1, got
    assert all(exact for _, _, exact in got), got
    assert got[0][0] in steps, got
    for r, (_, tier, _) in enumerate(got):
        if r in peer_ranks:
            assert tier == "peer", got
        elif r not in either:
            assert tier != "peer", got
    return got[0][0]


# -- a rank SIGKILLed in an exchange, the job restarted with a node replaced ----------------------------------


@pytest.mark.parametrize(
    "at,victim,lost,steps",
    [
        # world 3: rank 1 holds rank 0's replicas and sends its own to rank 2
        ("mid", 1, 0, {4}),  # holder dies with a third of rank 0's step-6 replica in: 6 overwrote nothing
        # rank 1 dies while receiving, its own send to rank 2 posted at once: it may or may not have reached rank 2
        # whole (gloo buffers it), but rank 2 commits it only verified
        pytest.param("mid", 1, 1, {4, 6}, marks=pytest.mark.slow),
        pytest.param(
            "taken", 1, 0, {4}, marks=pytest.mark.slow
        ),  # holder dies with its buffer taken (the oldest replica's record withdrawn)
        ("verified", 1, 0, {4}),  # every chunk verified, the record not yet written: not committed
        ("committed", 1, 0, {4, 6}),  # committed, the ack never sent: 6 may be served (it is whole)
    ],
)
def test_a_rank_killed_in_the_third_exchange_leaves_only_whole_replicas(tmp_path, at, victim, lost, steps):
    env = {
        "HOSTILE_N": "100000",
        "CKPT_CHUNK_BYTES": str(64 << 10),
        "CKPT_PEER_PIECE_BYTES": str(64 << 10),
        "HOSTILE_STEPS": "2,4,6",
        "HOSTILE_VICTIM": str(victim),
        "HOSTILE_AT": at,
    }
    _killed(_run(tmp_path, "kill", 3, **env), victim)
    _wipe(tmp_path, lost)
    got = _restored(_run(tmp_path, "restore", 3, **env))
    # the killed rank's own record of its newest snapshot is written in the background: a kill may come first,
    # and then its holder's replica of that step (whole and verified) is what it restores
    step = _check(got, {lost}, steps, either={victim})
    if at == "committed" and lost == 0:
        assert step == 6, got  # the holder committed it: the newest common step is served


@pytest.mark.parametrize("at", ["mid", pytest.param("taken", marks=pytest.mark.slow)])
def test_after_a_restart_the_holder_still_never_overwrites_the_newest_replica(tmp_path, at):
    """The holders' processes end (their replicas stay in RAM), the job restarts and restores, and the holder
    of rank 0 dies receiving step 6: its previous process's replicas were taken over, and the buffer step 6
    goes into must be the one of step 2, never step 4's."""
    env = {"HOSTILE_N": "100000", "CKPT_CHUNK_BYTES": str(64 << 10), "CKPT_PEER_PIECE_BYTES": str(64 << 10)}
    _save(tmp_path, 2, **env)
    results = _run(
        tmp_path, "kill", 2, HOSTILE_RESUME="1", HOSTILE_STEPS="6", HOSTILE_VICTIM="1", HOSTILE_AT=at, **env
    )
    _killed(results, 1)
    for r in results:
        assert "resumed 4 memory" in r.stdout, r.stdout
    _wipe(tmp_path, 0)
    got = _restored(_run(tmp_path, "restore", 2, **env))
    assert _check(got, {0}, {4}) == 4


@pytest.mark.slow
@pytest.mark.parametrize("at", ["mid", "taken"])
def test_a_state_that_grew_does_not_cost_the_newest_replica_when_the_holder_dies(tmp_path, at):
    """Step 6's state is four times larger than the buffers holding the replicas of 2 and 4: the holder needs a
    larger buffer, and dies receiving into it. The replica of step 4 must still be whole and served."""
    env = {
        "HOSTILE_N": "100000",
        "CKPT_CHUNK_BYTES": str(64 << 10),
        "CKPT_PEER_PIECE_BYTES": str(64 << 10),
        "HOSTILE_GROW_AT": "6",
    }
    _killed(_run(tmp_path, "kill", 2, HOSTILE_STEPS="2,4,6", HOSTILE_VICTIM="1", HOSTILE_AT=at, **env), 1)
    _wipe(tmp_path, 0)
    got = _restored(_run(tmp_path, "restore", 2, **env))
    assert _check(got, {0}, {4}) == 4


def test_a_holder_killed_while_serving_a_replica_fails_the_restore_and_the_next_restart_gets_it_whole(
    tmp_path,
):
    env = {"HOSTILE_N": "100000", "CKPT_CHUNK_BYTES": str(64 << 10), "CKPT_PEER_PIECE_BYTES": str(64 << 10)}
    _save(tmp_path, 2, **env)
    _wipe(tmp_path, 1)
    results = _run(tmp_path, "restore", 2, HOSTILE_SERVE_DIES="0", **env)  # rank 0 holds rank 1's replicas
    assert results[0].returncode == -signal.SIGKILL and "dying armed" in results[0].stdout, results[0].stderr[
        -3000:
    ]
    assert results[1].returncode != 0 and "restored" not in results[1].stdout, results[1].stdout
    got = _restored(_run(tmp_path, "restore", 2, **env))  # serving changed nothing in the holder's RAM
    assert _check(got, {1}, {4}) == 4


def test_after_a_rollback_a_replaced_rank_gets_the_new_branch_never_the_abandoned_step(tmp_path):
    """Steps 2 and 4 saved; the job restarts, goes back to step 2 and saves 3 (a new branch: 4 is abandoned).
    Rank 1's node is then replaced: every rank restores 3, rank 1 from its holder's RAM, never 4."""
    _save(tmp_path, 2)
    for r in _run(tmp_path, "save", 2, HOSTILE_ROLLBACK="2", HOSTILE_STEPS="3"):
        assert r.returncode == 0 and "resumed 2 memory" in r.stdout, r.stdout + r.stderr[-3000:]
        assert "saved [3, 2]" in r.stdout, r.stdout  # the abandoned 4's buffer took 3; 2 (the branch's) kept
    _wipe(tmp_path, 1)
    got = _restored(_run(tmp_path, "restore", 2))
    assert _check(got, {1}, {3}) == 3


def test_a_flipped_bit_in_the_newest_replica_falls_back_to_the_older_replica(tmp_path):
    _save(tmp_path, 2)
    _wipe(tmp_path, 1)
    _, buf, n = _replica(tmp_path, 0, 4)
    assert buf.stat().st_size >= n > 1000
    raw = bytearray(buf.read_bytes())
    raw[n // 2] ^= 0x01
    buf.write_bytes(bytes(raw))
    got = _restored(_run(tmp_path, "restore", 2))
    assert _check(got, {1}, {2}) == 2


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "fifo",
        pytest.param("symlink", marks=pytest.mark.slow),
        pytest.param("empty", marks=pytest.mark.slow),
    ],
)
def test_a_replica_segment_that_is_not_a_whole_regular_file_is_never_served(tmp_path, how):
    _save(tmp_path, 2)
    _wipe(tmp_path, 1)
    _, buf, n = _replica(tmp_path, 0, 4)
    if how == "truncated":  # shorter than the data its record describes
        os.truncate(buf, n // 2)
    elif how == "empty":
        os.truncate(buf, 0)
    elif how == "symlink":  # same bytes, but through a link: a segment is never followed through one
        copy = tmp_path / "elsewhere.buf"
        shutil.copyfile(buf, copy)
        buf.unlink()
        buf.symlink_to(copy)
    else:
        buf.unlink()
        os.mkfifo(buf)
    got = _restored(_run(tmp_path, "restore", 2))
    assert _check(got, {1}, {2}) == 2


@pytest.mark.parametrize(
    "lie",
    [
        pytest.param("record-step", marks=pytest.mark.slow),
        pytest.param("both-steps", marks=pytest.mark.slow),
        pytest.param("manifest-chunks", marks=pytest.mark.slow),
    ],
)
def test_a_holders_record_that_lies_is_not_served_as_the_step_it_names(tmp_path, lie):
    _save(tmp_path, 2)
    _wipe(tmp_path, 1)
    rec, _, _ = _replica(tmp_path, 0, 4)
    d = json.loads(rec.read_bytes())
    m = json.loads(d["manifest"])
    if lie == "record-step":  # the record says 6, its manifest 4
        d["step"] = 6
    elif lie == "both-steps":  # record and manifest say 6: no other rank has 6, so it is never agreed
        d["step"] = 6
        m["step"] = 6
    else:  # the checksums of another buffer: the bytes fail them on arrival
        m["chunks"] = [c ^ 1 for c in m["chunks"]]
    d["manifest"] = json.dumps(m, separators=(",", ":"))
    rec.write_bytes(json.dumps(d, separators=(",", ":")).encode())
    got = _restored(_run(tmp_path, "restore", 2))
    assert _check(got, {1}, {2}) == 2


def test_owner_and_holder_both_wiped_every_rank_says_there_is_no_checkpoint(tmp_path):
    # peers=2 in a job of 3: rank r's holder is r + 2; rank 0 and its holder rank 2 are both replaced
    env = {"HOSTILE_PEERS": "2"}
    _save(tmp_path, 3, **env)
    _wipe(tmp_path, 0, 2)
    _no_checkpoint(_run(tmp_path, "restore", 3, **env))


@pytest.mark.slow
def test_owner_and_holder_both_wiped_fall_back_to_the_remote_tier(tmp_path):
    env = {"HOSTILE_PEERS": "2", "HOSTILE_REMOTE": "1"}
    _save(tmp_path, 3, **env)
    _wipe(tmp_path, 0, 2)
    got = _restored(_run(tmp_path, "restore", 3, **env))
    # rank 2's replica is at rank 1 (kept): peer; rank 0's holder is gone: remote
    assert len({s for s, _, _ in got}) == 1 and all(e for _, _, e in got) and got[0][0] == 4, got
    assert [t for _, t, _ in got] == ["remote", "memory", "peer"], got


@pytest.mark.parametrize("world,peers,lost", [(3, 2, 1), pytest.param(3, 1, 2, marks=pytest.mark.slow)])
def test_peers_k_restores_the_replaced_rank_bit_identical_with_mixed_dtypes_and_strict_false(
    tmp_path, world, peers, lost
):
    env = {"HOSTILE_PEERS": str(peers), "HOSTILE_STRICT": "0", "HOSTILE_N": "3001"}
    _save(tmp_path, world, **env)
    _wipe(tmp_path, lost)
    got = _restored(_run(tmp_path, "restore", world, **env))
    assert _check(got, {lost}, {4}) == 4

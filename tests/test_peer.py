"""The peer tier through real gloo jobs (tests/peer_worker.py): each rank's snapshots are replicated into
another rank's RAM, so a rank whose node was replaced (its RAM and local disk gone) resumes from there."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_ok, run_ranks

HERE = Path(__file__).parent


def _run(root: Path, mode: str, world: int, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    return run_ranks(HERE / "peer_worker.py", str(root), mode, world=world, env=env)


def _lines(results: list[subprocess.CompletedProcess], prefix: str, ok: bool = True) -> list[str]:
    if ok:
        assert_ok(results)
    return [next(l for l in r.stdout.splitlines() if l.startswith(prefix)) for r in results]


def _replace_node(root: Path, rank: int) -> None:
    """Rank ``rank``'s node is replaced: its local disk and its RAM (own snapshots, replicas held) are gone."""
    shutil.rmtree(root / f"rank-{rank}")
    shutil.rmtree(root / f"shm-{rank}")


def _ls_memory(shm_dir: Path) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, ckpt.cli; sys.exit(ckpt.cli.main())", "ls", "--memory", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "CKPT_SHM_DIR": str(shm_dir)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _killed(results: list[subprocess.CompletedProcess]) -> None:
    for r in results:
        assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
        assert "killing" in r.stdout


def _replica_files(root: Path, holder: int) -> list[Path]:
    return sorted((root / f"shm-{holder}").glob("ckpt-*-p*-s*.buf"))


@pytest.mark.parametrize("world,lost", [(2, 1), (3, 1), (3, 0)])
def test_a_replaced_node_gets_its_snapshot_back_from_its_holders_ram(tmp_path, world, lost):
    assert (
        _lines(_run(tmp_path, "save", world), "saved") == ["saved [4, 2]"] * world
    )  # each holds its source's
    assert not list(tmp_path.glob("rank-*/peers")), "a replica never touches the holder's disk"
    rows = _ls_memory(tmp_path / "shm-0")  # rank 0's node: its own snapshots and rank world-1's replicas
    assert sorted((r["replica"], r["rank"], r["steps"]) for r in rows) == [
        (False, 0, [2, 4]),
        (True, world - 1, [2, 4]),
    ]
    assert all(r["local_dir"] == str((tmp_path / "rank-0").resolve()) and not r["owned"] for r in rows)
    _replace_node(tmp_path, lost)
    out = _run(tmp_path, "restore", world)
    got = _lines(out, "restored")
    assert got == [f"restored 4 {100.0 * r + 4} {'peer' if r == lost else 'memory'}" for r in range(world)], (
        got
    )
    # where the time went: the lost rank and its holder (rank lost + 1) took part in the peer exchange
    took_part = {lost, (lost + 1) % world}
    assert _lines(out, "phases") == [
        f"phases agree,confirm,load{',peer' if r in took_part else ''}" for r in range(world)
    ]


def test_the_exchanges_and_a_peer_restore_do_not_follow_the_default_device(tmp_path):
    """``torch.set_default_device`` in the training processes (``meta`` here; ``cuda`` in a real script)
    changes nothing: the headers, replica buffers and receive buffers are host memory wherever they are
    made."""
    env = {"CKPT_TEST_DEFAULT_DEVICE": "meta"}
    assert _lines(_run(tmp_path, "save", 2, env), "saved") == ["saved [4, 2]"] * 2
    _replace_node(tmp_path, 1)
    assert _lines(_run(tmp_path, "restore", 2, env), "restored") == [
        "restored 4 4.0 memory",
        "restored 4 104.0 peer",
    ]


def test_a_killed_job_resumes_bit_identical_with_the_lost_rank_from_its_peer(tmp_path):
    _killed(_run(tmp_path, "train", 2))
    _replace_node(tmp_path, 1)  # both processes died; rank 1's node is replaced
    resumed = _run(tmp_path, "resume", 2)
    assert _lines(resumed, "restored") == ["restored 6 memory", "restored 6 peer"]
    straight = _run(tmp_path, "straight", 2)
    assert _lines(resumed, "digest") == _lines(straight, "digest")


@pytest.mark.parametrize("nccl", [False, pytest.param(True, marks=pytest.mark.multigpu)])
def test_a_corrupt_replica_is_refused_and_the_next_tier_used(tmp_path, nccl):
    # over NCCL the holder reads the replica onto its GPU and sends it as it lands: the holder's own check
    # and the owner's both see the flipped byte
    env = {"CKPT_TEST_REMOTE": "1", "CKPT_PEER_NCCL": "1" if nccl else "0"}
    _killed(_run(tmp_path, "train", 2, env))
    _replace_node(tmp_path, 1)
    flipped = 0
    for buf in _replica_files(tmp_path, 0):  # rank 0 holds rank 1's replicas: flip a byte of each
        raw = bytearray(buf.read_bytes())
        raw[100] ^= 0xFF
        buf.write_bytes(bytes(raw))
        flipped += 1
    assert flipped == 2
    resumed = _run(tmp_path, "resume", 2, env)
    assert _lines(resumed, "restored") == ["restored 6 memory", "restored 6 remote"]
    assert any("fail their checksum" in r.stderr or "could not get step" in r.stderr for r in resumed[1:])
    assert _lines(resumed, "digest") == _lines(_run(tmp_path, "straight", 2), "digest")


def test_a_replica_torn_by_the_holders_death_is_never_served_and_the_previous_one_is(tmp_path):
    env = {
        "CKPT_CHUNK_BYTES": str(1 << 20),
        "CKPT_PEER_PIECE_BYTES": str(1 << 20),  # 12 pieces of 1 MiB
        "CKPT_TEST_N": str(3_000_000),
        "CKPT_PEER_TIMEOUT_S": "10",
    }
    results = _run(tmp_path, "tear", 2, env)
    for r in results:
        assert r.returncode == -signal.SIGKILL and "torn" in r.stdout, r.stderr[-3000:]
    # the source noticed, or gave up after CKPT_PEER_TIMEOUT_S at the latest; its peer tier stopped
    status, broken, seconds = _lines(results[1:], "peer", ok=False)[0].split()[1:]
    assert (status, broken) == ("failed", "True") and float(seconds) < 60, (status, broken, seconds)
    # rank 0's RAM: its own snapshots 2 and 4, and rank 1's replica of step 2 only (4's was withdrawn, never committed)
    rows = {(r["replica"], r["rank"]): r["steps"] for r in _ls_memory(tmp_path / "shm-0")}
    assert rows[(True, 1)] == [2], rows
    _replace_node(tmp_path, 1)
    got = _lines(_run(tmp_path, "restore", 2, env), "restored")
    assert got == ["restored 2 0.0 memory", "restored 2 1.0 peer"], got


def test_a_holder_that_cannot_commit_a_replica_says_so_and_the_exchanges_go_on(tmp_path):
    # rank 0's /dev/shm is full when rank 1's replica of step 4 arrives: rank 1's step 4 fails on the peer
    # tier (its holder did not commit it), nothing waits forever, and step 6 goes through again
    got = _lines(_run(tmp_path, "full", 2), "full")
    assert got == ["full ['done', 'done', 'done'] [6, 2]", "full ['done', 'failed', 'done'] [6, 4]"], got


def test_a_holder_refuses_a_header_out_of_bounds_and_the_exchanges_go_on(tmp_path):
    got = _lines(_run(tmp_path, "full", 2, {"CKPT_TEST_FAULT": "header"}), "full")
    assert got == ["full ['done', 'done', 'done'] [6, 2]", "full ['done', 'failed', 'done'] [6, 4]"], got


@pytest.mark.parametrize("fault", ["alloc", "manifest"])
@pytest.mark.parametrize("remote", [True, False])
def test_a_replaced_rank_that_cannot_take_its_replica_falls_back_and_its_holder_never_waits(
    tmp_path, fault, remote
):
    # rank 1 (replaced) cannot allocate host memory for its replica, or the replica's manifest fails to parse:
    # it says so to its holder before any data moves (or takes the data and drops it), so neither waits for the
    # other (CKPT_PEER_TIMEOUT_S is far beyond the run's time limit); it falls back to the remote tier, or,
    # without one, every rank says there is no common step
    env = {"CKPT_TEST_REMOTE": "1" if remote else "0", "CKPT_PEER_TIMEOUT_S": "900"}
    assert_ok(_run(tmp_path, "save", 2, env))
    _replace_node(tmp_path, 1)
    results = run_ranks(
        HERE / "peer_worker.py",
        str(tmp_path),
        "restore",
        world=2,
        timeout=150,
        env={**env, "CKPT_TEST_FAULT": fault},
    )
    if remote:
        assert _lines(results, "restored") == ["restored 4 4.0 memory", "restored 4 104.0 remote"]
    else:
        for r in results:
            assert r.returncode != 0 and "NoCheckpointError" in r.stderr, r.stderr[-2000:]


def test_replicas_no_rank_of_the_job_can_ask_for_are_freed_once_a_new_one_is_committed(tmp_path):
    assert (
        _lines(_run(tmp_path, "save", 3), "saved") == ["saved [4, 2]"] * 3
    )  # rank 0 holds rank 2's replicas
    assert {r["rank"] for r in _ls_memory(tmp_path / "shm-0") if r["replica"]} == {2}
    assert _lines(_run(tmp_path, "save", 2), "saved") == ["saved [4, 2]"] * 2  # the job shrinks: rank 1's now
    rows = _ls_memory(tmp_path / "shm-0")
    assert sorted((r["replica"], r["rank"], r["steps"]) for r in rows) == [
        (False, 0, [2, 4]),
        (True, 1, [2, 4]),
    ]


def test_without_any_replica_the_lost_rank_has_nothing_and_says_so(tmp_path):
    _killed(_run(tmp_path, "train", 2))
    _replace_node(tmp_path, 1)
    for f in _replica_files(tmp_path, 0):
        f.unlink()
    results = _run(tmp_path, "resume", 2)
    for r in results:  # rank 0's snapshots alone are no common step: every rank refuses alike
        assert r.returncode != 0 and "NoCheckpointError" in r.stderr, r.stderr[-2000:]


def test_the_peer_tier_keeps_its_own_cadence_and_reports_its_figures(tmp_path):
    # snapshots every step, the peer tier every 3: it exchanges steps 1, 4 and 7 and holds the newest two
    assert _lines(_run(tmp_path, "cadence", 2), "cadence") == ["cadence [7, 4] 3 4 2 3 True"] * 2


def test_a_restore_right_after_a_save_waits_for_the_exchange(tmp_path):
    # the restore may use the peer group to send copies back: it must not interleave with the exchange
    got = _lines(_run(tmp_path, "rollback", 2), "restored")
    assert got == [f"restored 7 {100.0 * r + 7} memory" for r in range(2)], got


def test_waiting_for_the_peer_tier_means_the_holder_has_committed_the_replica(tmp_path):
    assert _lines(_run(tmp_path, "durable", 2), "durable") == ["durable True"] * 2


def test_a_sigterm_drain_to_the_peer_tier(tmp_path):
    # the signal reaches rank 0 only: both ranks save step 3, wait until the other node (rank) holds it, stop
    assert _lines(_run(tmp_path, "drain", 2), "preempted") == ["preempted 3 True True"] * 2


def test_the_staged_exchange_moves_every_byte_and_checks_every_chunk(tmp_path):
    # the device path's pieces, ring and chunk checks, with CPU staging buffers over gloo
    assert _lines(_run(tmp_path, "staged", 2), "staged") == ["staged OK"] * 2


@pytest.mark.multigpu
def test_the_nccl_exchange_on_two_gpus(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert _lines(_run(tmp_path, "staged", 2, {"CKPT_TEST_DEVICE": "cuda"}), "staged") == ["staged OK"] * 2
    env = {"CKPT_PEER_NCCL": "1"}
    _killed(_run(tmp_path, "train", 2, env))
    _replace_node(tmp_path, 1)
    resumed = _run(tmp_path, "resume", 2, env)
    assert _lines(resumed, "restored") == ["restored 6 memory", "restored 6 peer"]
    assert _lines(resumed, "digest") == _lines(_run(tmp_path, "straight", 2), "digest")


@pytest.mark.parametrize(
    "knob,backend,cuda,want",
    [
        (-1, "cpu:gloo,cuda:nccl", True, True),  # the job trains over NCCL: every rank has its GPU
        (-1, "nccl", True, True),
        (-1, "gloo", True, False),  # a gloo job on a GPU machine: its ranks may share one GPU
        (-1, None, True, False),  # no default group
        (1, "gloo", True, True),  # asked for
        (0, "nccl", True, False),  # turned off
        (1, "nccl", False, False),  # no CUDA: never
    ],
)
def test_the_peer_transport_follows_the_jobs_backend(monkeypatch, knob, backend, cuda, want):
    import torch

    from ckpt.tiers import peer as peer_mod

    def get_backend(group=None):
        if backend is None:
            raise ValueError("Default process group has not been initialized")
        return backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", get_backend)
    assert peer_mod.over_nccl(knob) is want


def test_the_peer_transport_uses_the_gpu_the_jobs_group_is_bound_to(monkeypatch):
    # init_process_group(device_id=cuda:3) without torch.cuda.set_device: the current device is still 0,
    # and every rank would stage its replicas on GPU 0
    import torch

    from ckpt.tiers import peer as peer_mod

    class Group:
        bound_device_id = torch.device("cuda", 3)

    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_group", lambda: Group())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert peer_mod.rank_gpu() == torch.device("cuda", 3)
    Group.bound_device_id = None
    assert peer_mod.rank_gpu() == torch.device("cuda", 0)

    def no_group():
        raise ValueError("Default process group has not been initialized")

    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_group", no_group)
    assert peer_mod.rank_gpu() == torch.device("cuda", 0)

"""The peer tier through real gloo jobs (tests/peer_worker.py): a rank's checkpoints are also kept by
another rank, so a rank whose own copies are gone (a replaced node) resumes without a remote tier."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import assert_ok, run_ranks

HERE = Path(__file__).parent


def _run(root: Path, mode: str, world: int) -> list[subprocess.CompletedProcess]:
    return run_ranks(HERE / "peer_worker.py", str(root), mode, world=world)


def _lines(results: list[subprocess.CompletedProcess], prefix: str) -> list[str]:
    assert_ok(results)
    return [next(l for l in r.stdout.splitlines() if l.startswith(prefix)) for r in results]


@pytest.mark.parametrize("world,lost", [(2, 1), (3, 1), (3, 0)])
def test_a_rank_whose_copies_are_gone_gets_them_back_from_its_peer(tmp_path, world, lost):
    assert _lines(_run(tmp_path, "save", world), "saved") == ["saved [4, 2]"] * world   # each keeps its source's
    shutil.rmtree(tmp_path / f"rank-{lost}")   # a replaced node: its own copies and those it kept are gone
    got = _lines(_run(tmp_path, "restore", world), "restored")
    assert got == [f"restored 4 {100.0 * r + 4} local" for r in range(world)], got
    # the copy it got back is now its own local copy again
    assert (tmp_path / f"rank-{lost}" / "step-000000004" / "COMMIT").is_file()


def test_a_corrupt_peer_copy_is_not_used(tmp_path):
    assert_ok(_run(tmp_path, "save", 2))
    shutil.rmtree(tmp_path / "rank-1")
    kept = tmp_path / "rank-0" / "peers" / "rank-00001"   # rank 0 keeps rank 1's copies
    for data in kept.glob("step-*/rank-00000.bin"):
        raw = bytearray(data.read_bytes())
        raw[0] ^= 0xFF
        data.write_bytes(bytes(raw))
    results = _run(tmp_path, "restore", 2)
    for r in results:   # rank 1 has nothing usable: every rank says so instead of loading bad bytes
        assert r.returncode != 0
        assert "no step that every rank holds could be loaded" in r.stderr \
            and "step 4 unusable on rank(s) [1]" in r.stderr, r.stderr[-2000:]


def test_a_restore_right_after_a_save_waits_for_the_exchange(tmp_path):
    # the restore may use the peer group to send copies back: it must not interleave with the exchange
    got = _lines(_run(tmp_path, "rollback", 2), "restored")
    assert got == [f"restored 7 {100.0 * r + 7} memory" for r in range(2)], got


def test_waiting_for_the_peer_tier_means_the_peer_has_committed_the_copy(tmp_path):
    assert _lines(_run(tmp_path, "durable", 2), "durable") == ["durable True"] * 2


def test_a_sigterm_drain_to_the_peer_tier(tmp_path):
    # the signal reaches rank 0 only: both ranks save step 3, wait until the other node (rank) holds it, stop
    assert _lines(_run(tmp_path, "drain", 2), "preempted") == ["preempted 3 True True"] * 2

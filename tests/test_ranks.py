"""Agreement between the ranks of a real two-process gloo job (tests/ranks_worker.py).

Each rank checkpoints into its own directory. Without agreement a rank whose newest save did
not commit would resume from an older step than its peers, and a time-based policy would
save different steps on different ranks.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ckpt.format import data_name
from helpers import assert_ok as _ok, run_ranks

HERE = Path(__file__).parent


def _run(root: Path, mode: str, backend: str = "gloo", world: int = 2) -> list[subprocess.CompletedProcess]:
    return run_ranks(
        HERE / "ranks_worker.py", str(root), mode, world=world, env={"CKPT_TEST_BACKEND": backend}
    )


def _restored(results: list[subprocess.CompletedProcess]) -> list[str]:
    lines = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        lines.append(next(l for l in r.stdout.splitlines() if l.startswith("restored")))
    return lines


def _step_dir(root: Path, rank: int, step: int) -> Path:
    return root / f"rank-{rank}" / f"step-{step:09d}"


def test_ranks_restore_the_newest_step_every_rank_can_load(tmp_path):
    _ok(_run(tmp_path, "save"))
    # rank 1 died before committing step 30: it holds 10 and 20, rank 0 holds 10, 20 and 30
    shutil.rmtree(_step_dir(tmp_path, 1, 30))
    assert _restored(_run(tmp_path, "restore")) == ["restored 20 20.0"] * 2
    assert not list(tmp_path.rglob(".ckpt-job-*")), "the ranks' marker files were left behind"
    for r in _run(tmp_path, "restore-30"):  # an explicit step that one rank lacks: every rank says so
        assert (
            r.returncode != 0
            and "step 30 is not held by every rank (rank 0: [30, 20, 10]; rank 1: [20, 10])" in r.stderr
        ), r.stderr[-2000:]

    # rank 1's copy of step 20 is corrupt: both fall back to the next step they all hold
    data = _step_dir(tmp_path, 1, 20) / data_name(0)
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert _restored(_run(tmp_path, "restore")) == ["restored 10 10.0"] * 2

    # the checkpoint does not fit rank 1's state: every rank raises instead of going on alone
    results = _run(tmp_path, "restore-wide")
    assert all(r.returncode != 0 for r in results), [r.stdout for r in results]
    assert "IncompatibleCheckpointError" in results[1].stderr, results[1].stderr[-2000:]
    assert "could not load step 20" in results[0].stderr, results[0].stderr[-2000:]


def test_ranks_without_a_common_step_raise_on_every_rank(tmp_path):
    _ok(_run(tmp_path, "save"))
    for step in (10, 20):
        shutil.rmtree(_step_dir(tmp_path, 0, step))
    for step in (10, 30):
        shutil.rmtree(_step_dir(tmp_path, 1, step))
    results = _run(tmp_path, "restore")
    for r in results:
        assert r.returncode != 0
        assert (
            "no step is committed on every rank" in r.stderr
            and "rank 0: [30]" in r.stderr
            and "rank 1: [20]" in r.stderr
        ), r.stderr[-2000:]


@pytest.mark.parametrize(
    "backend", ["gloo", pytest.param("nccl", marks=pytest.mark.multigpu, id="nccl-two-gpus")]
)
def test_time_based_policy_saves_the_same_steps_on_every_rank(tmp_path, backend):
    # rank 0's clock says every step is due, rank 1's says none is: they agree to save each step
    # (under NCCL, over the CPU group the Checkpointer makes)
    lines = [
        next(l for l in r.stdout.splitlines() if l.startswith("committed"))
        for r in _run(tmp_path, "seconds", backend)
        if r.returncode == 0
    ]
    assert lines == ["committed [1, 2, 3, 4, 5]"] * 2, lines


def test_automatic_tier_cadences_hand_the_same_snapshots_to_each_tier_on_every_rank(tmp_path):
    # interval="auto": the ranks' clocks, step times and disks differ, so their tiers' cadences differ;
    # a tier takes a snapshot on every rank when it is due on any, so the local tiers hold the same steps
    # and the job tier (which needs every rank's upload) commits
    results = _run(tmp_path, "auto-tiers")
    _ok(results)
    lines = [next(l for l in r.stdout.splitlines() if l.startswith("committed")) for r in results]
    assert lines[0] == lines[1], lines
    assert "[]" not in lines[0], lines  # something was committed on both tiers


def test_skipped_saves_are_skipped_on_every_rank(tmp_path):
    # rank 1's disk is slow: with if_busy="skip" its local tier is busy for most saves, rank 0's never
    # is; both local tiers must skip the same snapshots and commit the same steps
    results = _run(tmp_path, "skip")
    _ok(results)
    lines = [next(l for l in r.stdout.splitlines() if l.startswith("committed")) for r in results]
    assert lines[0] == lines[1], lines
    assert int(lines[0].rsplit(" ", 1)[1]) > 0, lines  # some saves were skipped


@pytest.mark.parametrize(
    "mode,message,world",
    [
        ("same-dir", "is shared by ranks [0, 1]", 2),
        ("same-url", "ranks [0, 1] were given the same url, other ranks another", 3),
    ],
)
def test_ranks_sharing_a_directory_or_part_of_them_a_url_are_refused(tmp_path, mode, message, world):
    # one url for every rank is a job tier (tests/test_reshard.py); for only some of them it is a mistake
    for r in _run(tmp_path, mode, world=world):
        assert r.returncode != 0 and "accepted" not in r.stdout
        assert message in r.stderr and "give every rank its own local_dir" in r.stderr, r.stderr[-2000:]
    assert not list(tmp_path.rglob(".ckpt-job-*")), "the ranks' marker files were left behind"


@pytest.mark.skipif(__import__("ckpt").shm.shm_root() is None, reason="no RAM file system (/dev/shm) here")
@pytest.mark.parametrize("flip", [False, True], ids=["intact", "changed-on-rank-1"])
def test_a_collective_checkpointer_takes_the_ram_segments_over_when_made_and_checks_them_once(tmp_path, flip):
    """A restarted collective job: each rank's Checkpointer starts taking its predecessor's memory-tier
    segments over when it is made (mapped, and registered where there is CUDA); the restore then reads them
    as its own buffers, checked chunk by chunk first: a byte changed in rank 1's RAM sends rank 1 to its
    local tier, and the buffer stays unchecked."""
    from ckpt import shm

    _ok(_run(tmp_path, "save-keep"))
    # the snapshots each rank left in RAM: 10, 20 and 30 in three buffers, or fewer where a buffer was still
    # being allocated when a snapshot came (a loaded machine), which then went into an older one's buffer
    left = [
        sorted(
            r.step for g in shm.segments(prefix=shm.prefix_for(tmp_path / f"rank-{k}", k)) for r in g.records
        )
        for k in range(2)
    ]
    assert all(steps[-1] == 30 for steps in left), left
    if flip:
        rec = next(
            r
            for g in shm.segments(prefix=shm.prefix_for(tmp_path / "rank-1", 1, create=True))
            for r in g.records
            if r.step == 30
        )
        with open(Path(rec.path).with_name(rec.buffer), "r+b") as f:
            f.seek(9)
            b = f.read(1)
            f.seek(9)
            f.write(bytes([b[0] ^ 0x04]))
    lines, logs = [], []
    for r in _run(tmp_path, "takeover"):
        assert r.returncode == 0, r.stderr[-3000:]
        lines.append(next(l for l in r.stdout.splitlines() if l.startswith("takeover")))
        logs.append(r.stdout + r.stderr[-3000:])  # what each rank's restore passed over, and why
    for rank, line in enumerate(lines):
        bad = flip and rank == 1
        # each buffer with a snapshot of the previous job, taken over unchecked; the restored one checked after
        before = [(s, False) for s in left[rank]]
        after = before[:-1] + [(30, not bad)]
        assert line.startswith(f"takeover True {before} restored 30 "), logs[rank]
        assert line.endswith(f"{'local' if bad else 'memory'} 30.0 {after}"), logs[rank]

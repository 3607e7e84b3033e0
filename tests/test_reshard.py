"""Job tier and load-time resharding, through real multi-process gloo jobs (tests/reshard_worker.py).

Every rank gives the same url: the ranks' files of a step share one directory there and rank 0
commits the step once every rank's upload succeeded. Such a checkpoint restores on another number
of ranks, into other placements, or into one process holding whole tensors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.format import COMMIT_NAME, Commit, step_dir_name
from ckpt.reshard import overlap, shard_box
from helpers import assert_ok, run_ranks

HERE = Path(__file__).parent
WORKER = HERE / "reshard_worker.py"


def _run(root: Path, mode: str, world: int, backend: str = "gloo") -> list[subprocess.CompletedProcess]:
    env = {"CKPT_TEST_BACKEND": backend}
    if world == 1:
        r = subprocess.run(
            [sys.executable, str(WORKER), str(root), "0", "1", mode],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, **env, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        )
        return [r]
    return run_ranks(WORKER, str(root), mode, world=world, env=env)


def _line(results: list[subprocess.CompletedProcess], prefix: str) -> list[str]:
    assert_ok(results)
    return [
        next(l for l in r.stdout.splitlines() if l.startswith(prefix))
        for r in results
        if any(l.startswith(prefix) for l in r.stdout.splitlines())
    ]


def test_shard_boxes_follow_dtensor_rule():
    # 7 rows over 3 ranks: torch.chunk gives 3, 3, 1; 2 rows over 3: 1, 1, 0
    boxes = [shard_box({"shape": [7, 5], "mesh": [3], "coord": [c], "placements": ["S0"]}) for c in range(3)]
    assert boxes == [((0, 0), (3, 5)), ((3, 0), (3, 5)), ((6, 0), (1, 5))]
    assert shard_box({"shape": [2, 3], "mesh": [3], "coord": [2], "placements": ["S0"]})[1] == (0, 3)
    # two mesh dims sharding one tensor dim split it in mesh order; Replicate keeps the whole dim
    assert shard_box({"shape": [8, 4], "mesh": [2, 2], "coord": [1, 0], "placements": ["S0", "S0"]}) == (
        (4, 0),
        (2, 4),
    )
    assert shard_box({"shape": [8, 4], "mesh": [2, 2], "coord": [1, 1], "placements": ["R", "S1"]}) == (
        (0, 2),
        (8, 2),
    )
    assert overlap(((0, 0), (3, 5)), ((2, 1), (4, 4))) == ((2, 1), (1, 4))
    assert overlap(((0, 0), (3, 5)), ((3, 0), (3, 5))) is None


@pytest.mark.parametrize("placement", ["SS0:2", "P"])
def test_unknown_placements_are_refused_with_the_path(placement):
    from ckpt.errors import IncompatibleCheckpointError

    with pytest.raises(IncompatibleCheckpointError, match="model/w.*cannot be resharded"):
        shard_box({"shape": [4], "mesh": [2], "coord": [0], "placements": [placement]}, "model/w")


@pytest.mark.parametrize("save_world,load_world", [(2, 3), (3, 2), (2, 2)])
def test_dtensors_reshard_to_another_world_size_and_placements(tmp_path, save_world, load_world):
    assert _line(_run(tmp_path, "save-dt", save_world), "saved") == ["saved"] * save_world
    step = tmp_path / "job" / step_dir_name(5)
    commit = Commit.from_bytes((step / COMMIT_NAME).read_bytes(), "COMMIT")
    assert commit.world_size == save_world and len(commit.manifests) == save_world  # rank 0's global commit
    assert _line(_run(tmp_path, "load-dt", load_world), "restored") == ["restored 5 from remote"] * load_world


@pytest.mark.multigpu
def test_under_nccl_dtensors_and_an_fsdp2_model_reshard_and_consolidate_on_the_gpus(tmp_path):
    # two GPUs: the placements change as on the CPU (resharded from the job tier), then the FSDP2 model
    # and AdamW into the same FSDP2 layout (its local copies) and into one unsharded process on GPU 0
    # (consolidated from the job tier)
    assert _line(_run(tmp_path / "dt", "save-dt", 2, "nccl"), "saved") == ["saved"] * 2
    assert _line(_run(tmp_path / "dt", "load-dt", 2, "nccl"), "restored") == ["restored 5 from remote"] * 2
    saved = _line(_run(tmp_path / "fsdp", "fsdp-save", 2, "nccl"), "digest")
    for mode, world in (("fsdp-load", 2), ("fsdp-whole", 1)):
        got = _run(tmp_path / "fsdp", mode, world, "nccl")
        assert _line(got, "digest") == saved, f"{mode}: restored parameters or optimizer state differ"


def test_one_process_consolidates_a_sharded_checkpoint(tmp_path):
    assert_ok(_run(tmp_path, "save-dt", 3))
    assert _line(_run(tmp_path, "load-whole", 1), "restored") == ["restored 5 from remote"]


def test_fsdp2_model_and_optimizer_resume_on_another_world_size(tmp_path):
    saved = _line(_run(tmp_path, "fsdp-save", 2), "digest")
    for world in (3, 1):  # three FSDP2 ranks; one process with the model unsharded
        got = _run(tmp_path, "fsdp-load" if world > 1 else "fsdp-whole", world)
        assert _line(got, "restored") == ["restored 3"] * world
        assert _line(got, "digest") == saved, f"world {world}: restored parameters or optimizer state differ"


def test_a_failed_upload_on_one_rank_commits_the_step_nowhere(tmp_path):
    results = _run(tmp_path, "commit-fail", 2)
    assert _line(results, "errors") == ["errors [2]"] * 2
    assert _line(results, "remote") == ["remote [1, 3]"] * 2
    assert "not committed to the job tier" in results[0].stdout and "rank(s) [1]" in results[0].stdout
    assert "injected upload failure" in results[1].stdout
    assert not (tmp_path / "job" / step_dir_name(2) / COMMIT_NAME).exists()


def test_ranks_saving_different_steps_commit_nothing_and_say_why(tmp_path):
    results = _run(tmp_path, "steps-differ", 2)
    assert _line(results, "remote") == ["remote []"] * 2
    for r in results:
        assert (
            "uploaded different steps ([1, 2])" in r.stdout
            and "every rank must save the same steps" in r.stdout
        )


def test_replicated_tensors_are_uploaded_by_rank_0_alone_and_restored_everywhere(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CHUNK_BYTES", str(64 << 10))  # 1.2 MB of model in 64 KiB parts
    assert_ok(_run(tmp_path, "dedupe-save", 2))
    step = tmp_path / "job" / step_dir_name(1)
    parts = [len(list((step / f"rank-{r:05d}").iterdir())) for r in range(2)]
    assert parts[0] >= 18 and parts[1] == 1, parts  # rank 1 stored only the part holding its own tensor
    shutil.rmtree(tmp_path / "local-2")  # the ranks' own full copies: the restores must use the job tier
    for world in (2, 3):  # the same world (rank 1 reads the model from rank 0's files) and a larger one
        assert _line(_run(tmp_path, "dedupe-load", world), "restored") == ["restored 1 from remote"] * world


def test_the_cli_lists_inspects_and_verifies_a_job_tier(tmp_path, capsys):
    from ckpt.cli import main as cli

    assert_ok(_run(tmp_path, "save-dt", 2))
    url = f"file://{tmp_path}/job"
    assert cli(["ls", url]) == 0
    assert "    2  " in capsys.readouterr().out  # the ranks column
    assert cli(["inspect", url, "--rank", "1"]) == 0
    assert "world size 2" in capsys.readouterr().out
    assert cli(["verify", url]) == 0
    assert "step 5: OK" in capsys.readouterr().out
    part = tmp_path / "job" / step_dir_name(5) / "rank-00001" / "part-000000"
    raw = bytearray(part.read_bytes())
    raw[-1] ^= 0xFF
    part.write_bytes(bytes(raw))
    assert cli(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "step 5: FAILED" in out and "rank-00001/part-000000" in out and "checksum" in out, out


def test_a_rank_that_dies_mid_save_commits_nothing_and_the_others_hear_at_once(tmp_path):
    # a real process exits before its upload reports: rank 0's upload must fail at once (not after the
    # commit timeout), say why, and leave nothing committed
    results = _run(tmp_path, "rank-dies", 2)
    assert results[1].returncode == 3 and results[0].returncode == 0, results[0].stderr[-2000:]
    out = results[0].stdout
    assert "not every rank reported its upload" in out and "a rank may have died" in out, out
    assert "remote []" in out

"""Timelines: a resume after a rollback continues the branch written last, never the abandoned one.

Steps 100/200/300 are committed, the run is rolled back with ``restore(state, step=100)`` and saves
110/120/130: those saves start timeline 1, retention keeps them, and every later restore (a new
``Checkpointer``, a new process, another tier, every rank of a job) resumes from 130.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import shm
from ckpt.cli import main
from ckpt.format import COMMIT_NAME, data_name
from helpers import assert_ok, run_ranks

HERE = Path(__file__).parent
WORKER = HERE / "timeline_worker.py"


def _state() -> dict:
    return {"w": torch.zeros(8), "step": 0}


def _save(ck: ckpt.Checkpointer, state: dict, step: int) -> None:
    ck.wait_staged()
    state["w"].fill_(step)
    state["step"] = step
    ck.save(step, state).wait()


def _steps(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.glob("step-*") if (p / COMMIT_NAME).exists())


def _commit(d: Path, step: int) -> dict:
    return json.loads((d / f"step-{step:09d}" / COMMIT_NAME).read_bytes())


def _flip(d: Path, step: int) -> None:
    f = d / f"step-{step:09d}" / data_name(0)
    raw = bytearray(f.read_bytes())
    raw[0] ^= 0xFF
    f.write_bytes(bytes(raw))


def _three(local_dir: Path, url: str | None = None, keep: ckpt.Retention | None = None) -> None:
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=local_dir),
        policy=ckpt.Policy(keep=keep or ckpt.Retention(local=3)),
    ) as ck:
        state = _state()
        for s in (100, 200, 300):
            _save(ck, state, s)


def _rollback(local_dir: Path, url: str | None = None, keep: ckpt.Retention | None = None) -> None:
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=local_dir),
        policy=ckpt.Policy(keep=keep or ckpt.Retention(local=3)),
    ) as ck:
        state = _state()
        assert ck.restore(state, step=100) == 100
        for s in (110, 120, 130):
            _save(ck, state, s)


def test_a_resume_after_a_rollback_continues_the_new_branch(local_dir):
    _three(local_dir)
    _rollback(local_dir)
    assert _steps(local_dir) == [110, 120, 130], "retention must keep the live branch's newest steps"
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=3))
    ) as ck:
        state = _state()
        assert ck.restore(state) == 130
        assert float(state["w"][0]) == 130.0 and state["step"] == 130
        assert ck.last_restore.timeline.number == 1 and ck.timeline.number == 1


def test_the_rollback_records_its_timeline_and_old_commits_stay_in_the_old_format(local_dir):
    _three(local_dir, keep=ckpt.Retention(local=None))
    assert "timeline" not in _commit(local_dir, 300), "a run never rolled back writes the old COMMIT"
    _rollback(local_dir, keep=ckpt.Retention(local=None))
    c = _commit(local_dir, 110)
    assert c["timeline"] == 1 and c["forks"] == [[0, 100]]
    assert "timeline" not in _commit(local_dir, 100)


def test_the_fallback_never_restores_the_abandoned_branch(local_dir):
    _three(local_dir, keep=ckpt.Retention(local=None))
    _rollback(local_dir, keep=ckpt.Retention(local=None))
    for s in (110, 120, 130):
        _flip(local_dir, s)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        state = _state()
        with pytest.warns(RuntimeWarning):
            assert ck.restore(state) == 100, "200 and 300 belong to the abandoned branch"
        assert float(state["w"][0]) == 100.0
    # asked for by step, an abandoned checkpoint still restores (and starts a timeline of its own)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        state = _state()
        assert ck.restore(state, step=300) == 300 and float(state["w"][0]) == 300.0
        assert ck.timeline.number == 2 and ck.timeline.forks == ((0, 300),)
        _save(ck, state, 310)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        assert ck.restore(_state()) == 310


def test_a_rollback_inside_one_process_then_restore_from_memory(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=3))
    ) as ck:
        state = _state()
        for s in (100, 200, 300):
            _save(ck, state, s)
        assert ck.restore(state, step=100) == 100
        for s in (110, 120, 130):
            _save(ck, state, s)
        state["w"].zero_()
        assert ck.restore(state) == 130 and float(state["w"][0]) == 130.0
        assert ck.last_restore.tier == "memory"
        assert [(i.step, i.timeline) for i in ck.list()][:3] == [(130, 1), (120, 1), (110, 1)]


def test_the_newest_timeline_wins_when_a_step_is_on_two(tmp_path):
    url = f"file://{tmp_path}/remote"
    first, second = tmp_path / "first", tmp_path / "second"
    keep = ckpt.Retention(local=None, remote=None)
    _three(first, url, keep)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=second), policy=ckpt.Policy(keep=keep)
    ) as ck:  # another node: rolls back, saves 200
        state = _state()
        assert ck.restore(state, step=100) == 100
        state["w"].fill_(-200.0)
        ck.save(200, state).wait()
    # `first` still holds timeline 0's 200 and 300; the remote tier holds timeline 1's 200
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=first), policy=ckpt.Policy(keep=keep)
    ) as ck:
        state = _state()
        assert ck.restore(state, step=200) == 200 and float(state["w"][0]) == -200.0
        assert ck.last_restore.tier == "remote"
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=first), policy=ckpt.Policy(keep=keep)
    ) as ck:
        state = _state()
        assert ck.restore(state) == 200 and float(state["w"][0]) == -200.0, "300 is on the abandoned branch"


def test_remote_retention_keeps_the_live_branch_and_a_fresh_node_resumes_it(tmp_path):
    url = f"file://{tmp_path}/remote"
    keep = ckpt.Retention(local=3, remote=3)
    _three(tmp_path / "a", url, keep)
    _rollback(tmp_path / "a", url, keep)
    assert _steps(tmp_path / "remote") == [110, 120, 130]
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, local_dir=tmp_path / "fresh"), policy=ckpt.Policy(keep=keep)
    ) as ck:
        state = _state()
        assert ck.restore(state) == 130 and ck.last_restore.tier == "remote"
        assert ck.timeline.number == 1


def test_ls_lists_the_live_branch_first(local_dir, capsys):
    _three(local_dir, keep=ckpt.Retention(local=None))
    _rollback(local_dir, keep=ckpt.Retention(local=None))
    assert main(["ls", str(local_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["timeline"], r["abandoned"]) for r in rows] == [
        (130, 1, False),
        (120, 1, False),
        (110, 1, False),
        (100, 0, False),
        (300, 0, True),
        (200, 0, True),
    ]


def _worker(root: Path, mode: str) -> str:
    r = subprocess.run(
        [sys.executable, str(WORKER), str(root), "0", "1", mode], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_rollback_scenario_across_real_processes(local_dir):
    assert "saved" in _worker(local_dir, "save")
    assert "restored 100 100.0 1" in _worker(local_dir, "rollback")
    assert "restored 130 130.0 1" in _worker(local_dir, "resume")
    assert _steps(local_dir) == [110, 120, 130]


def _ranks(root: Path, mode: str, peers: bool = False) -> list[str]:
    results = run_ranks(WORKER, str(root), mode, world=2, env={"CKPT_TEST_PEERS": "1"} if peers else None)
    assert_ok(results)
    return [next(l for l in r.stdout.splitlines() if l.startswith(("restored", "saved"))) for r in results]


def test_the_ranks_agree_on_the_timeline(tmp_path):
    assert _ranks(tmp_path, "save") == ["saved"] * 2
    assert _ranks(tmp_path, "rollback") == ["restored 100 100.0 1"] * 2
    assert _ranks(tmp_path, "resume") == ["restored 130 130.0 1"] * 2
    for r in (0, 1):
        assert _steps(tmp_path / f"rank-{r}") == [110, 120, 130]


def test_ranks_that_fall_back_to_an_older_common_step_fork_together(tmp_path):
    assert _ranks(tmp_path, "save") == ["saved"] * 2
    # rank 1 died before committing 300: both resume from 200, and both start timeline 1 there
    shutil.rmtree(tmp_path / "rank-1" / "step-000000300")
    assert _ranks(tmp_path, "resume-save") == ["restored 200 200.0 1"] * 2
    # rank 0's 300 is on the abandoned branch now: the job resumes from 210 on both ranks
    assert _ranks(tmp_path, "resume") == ["restored 210 210.0 1"] * 2


def test_a_replaced_node_gets_the_live_branch_back_from_its_peer_with_its_timeline(tmp_path):
    assert _ranks(tmp_path, "save", peers=True) == ["saved"] * 2
    assert _ranks(tmp_path, "rollback", peers=True) == ["restored 100 100.0 1"] * 2
    # rank 1's node is replaced: its own copies (disk and RAM) and the replicas it held are gone; rank 0 holds its
    for d in (tmp_path / "rank-1").glob("step-*"):
        shutil.rmtree(d)
    shm.free(prefix=shm.prefix_for(tmp_path / "rank-1", 1, create=True))
    shm.free(prefix=shm.replica_prefix(tmp_path / "rank-1", 0, create=True))
    results = run_ranks(WORKER, str(tmp_path), "resume", world=2, env={"CKPT_TEST_PEERS": "1"})
    assert_ok(results)
    lines = [[l for l in r.stdout.splitlines() if l.startswith(("restored", "from"))] for r in results]
    assert lines[0][0] == lines[1][0] == "restored 130 130.0 1"
    # the replica keeps its timeline: timeline 1, which left timeline 0 after step 100
    assert lines[1][1] == "from peer 1 [[0, 100]]" and lines[0][1] == "from memory 1 [[0, 100]]", lines


@pytest.mark.parametrize(
    "fields",
    [
        {"timeline": -1},
        {"timeline": "1"},
        {"timeline": 1, "forks": [[1, 100]]},
        {"timeline": 2, "forks": [[0]]},
        {"forks": {"0": 100}},
    ],
)
def test_a_commit_with_a_malformed_timeline_is_refused_and_skipped(local_dir, fields):
    _three(local_dir)
    path = local_dir / "step-000000300" / COMMIT_NAME
    path.write_bytes(json.dumps({**json.loads(path.read_bytes()), **fields}).encode())
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        state = _state()
        with pytest.warns(RuntimeWarning, match="step-000000300/COMMIT"):
            assert ck.restore(state) == 200


@pytest.mark.parametrize("tier", ["local", "remote"])
def test_retention_deletes_nothing_while_a_commit_record_cannot_be_read(tmp_path, monkeypatch, tier):
    """Step 120 (live branch, timeline 1) has a COMMIT the disk or store fails to give: listed with timeline
    0 it would pass for the abandoned branch, and retention would delete it and keep the older 110."""
    from ckpt.policy import prune
    from ckpt.tiers import LocalTier, RemoteTier
    from ckpt.tiers import local as local_mod

    url = f"file://{tmp_path}/remote"
    keep = ckpt.Retention(local=None, remote=None)
    _three(tmp_path / "a", url, keep)
    _rollback(tmp_path / "a", url, keep)
    t = LocalTier(tmp_path / "a") if tier == "local" else RemoteTier(url)
    bad = f"step-{120:09d}"
    if tier == "local":
        real = local_mod.read_record

        def failing(path, *a, **k):
            if Path(path).parent.name == bad:
                raise OSError(5, "Input/output error", str(path))
            return real(path, *a, **k)

        monkeypatch.setattr(local_mod, "read_record", failing)
    else:
        real_get = RemoteTier._get

        def failing_get(self, step, name, *a, **k):
            if step == 120 and name == COMMIT_NAME:
                raise ConnectionError("the store dropped the connection")
            return real_get(self, step, name, *a, **k)

        monkeypatch.setattr(RemoteTier, "_get", failing_get)
    listed = {c.step: c for c in t.committed()}
    assert listed[120].known is False and all(c.known for s, c in listed.items() if s != 120)
    assert prune(t, 2) == []
    root = tmp_path / ("a" if tier == "local" else "remote")
    assert _steps(root) == [100, 110, 120, 130, 200, 300]
    monkeypatch.undo()  # the record reads again: the abandoned branch and the oldest live steps go
    assert sorted(prune(t, 2)) == [100, 110, 200, 300]
    assert _steps(root) == [120, 130]


def test_a_snapshot_is_committed_on_the_timeline_it_was_taken_on_whatever_the_tiers_say_by_then(
    tmp_path, monkeypatch
):
    """A tier may get to a snapshot after the Checkpointer moved to another timeline (a rollback between
    the save and a slow tier's write): the COMMIT must record the timeline the snapshot was taken on, or the
    next restore would take the abandoned branch's step for the live one. Here the tiers' timeline is moved
    while their writes are held back."""
    from ckpt.policy import Timeline
    from ckpt.tiers.local import LocalTier
    from ckpt.tiers.remote import RemoteTier

    gate = threading.Event()
    for cls in (LocalTier, RemoteTier):
        real = cls.write

        def held(self, step, manifest, data, _real=real):
            assert gate.wait(60)
            return _real(self, step, manifest, data)

        monkeypatch.setattr(cls, "write", held)
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "local")) as ck:
        state = _state()
        state["w"].fill_(100)
        handle = ck.save(100, state)
        ck.wait_staged()
        moved = Timeline(1, ((0, 50),))
        for tier in [ck.local, ck.remote]:
            tier.timeline = moved
        gate.set()
        handle.wait()
        assert {c.step: c.timeline for c in ck.local.committed()} == {100: Timeline()}
        assert {c.step: c.timeline for c in ck.remote.committed()} == {100: Timeline()}

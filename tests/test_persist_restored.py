"""Persist at the breakpoint: after a crash, the snapshot only the memory tier kept reaches the durable tiers.

A training process killed while its local tier was writing the newest snapshot leaves that snapshot in RAM
alone (the memory tier's shared-memory segments outlive the process, the node's next reboot does not
spare them). The process that restores it from RAM writes it to every durable tier that lacks it, in the
background, right after ``restore()``: a second failure, the node rebooting next, then loses nothing.

Every process is real (forked from the test session's fork server: no seconds of importing torch each),
the first one is SIGKILLed mid-write, and the reboot is the segments' removal from the RAM file system.
Decisions are on fields, files and printed values, never on message text.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import pytest

from ckpt import shm
from ckpt.tiers import LocalTier, RemoteTier
from helpers import _script_main, fork_server, verifies

HERE = Path(__file__).parent
WORKER = HERE / "restored_worker.py"

pytestmark = [
    pytest.mark.skipif(shm.shm_root() is None, reason="no RAM file system (/dev/shm) here"),
    pytest.mark.timeout(120),
]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """4 KiB chunks in the workers: the state's 18 KB are five of them."""
    monkeypatch.setenv("CKPT_CHUNK_BYTES", "4096")


class Worker:
    """``restored_worker.py`` in a process of its own; its output goes to a file the test reads."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="ckpt-restored-")
        self.out, err = (os.path.join(self._tmp.name, n) for n in ("out", "err"))
        env = {
            **os.environ,
            "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **(env or {}),
        }
        self.proc = fork_server().Process(
            target=_script_main, args=(str(WORKER), list(args), env, self.out, err)
        )
        self.proc.start()
        self.err = err

    def lines(self) -> list[str]:
        return Path(self.out).read_text().splitlines() if os.path.exists(self.out) else []

    def kill_at(self, word: str) -> list[str]:
        """SIGKILL it once it printed a line starting with ``word``; returns that line's fields."""
        deadline = time.monotonic() + 60
        while not any(line.startswith(word) for line in self.lines()):
            assert self.proc.is_alive() and time.monotonic() < deadline, Path(self.err).read_text()[-3000:]
            time.sleep(0.02)
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)
        assert self.proc.exitcode == -signal.SIGKILL
        return next(line for line in self.lines() if line.startswith(word)).split()

    def result(self) -> list[str]:
        self.proc.join(90)
        assert self.proc.exitcode == 0, Path(self.err).read_text()[-3000:]
        return self.lines()[-1].split()


def _job(*args: str, world: int = 2) -> list[Worker]:
    """The ranks of a gloo job on loopback, each ``restored_worker.py *args RANK WORLD``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [Worker(*args, str(r), str(world), env=env) for r in range(world)]


def _reboot(local_dir: Path, rank: int = 0) -> list[int]:
    """What a reboot does to the node's RAM: every memory-tier segment of ``local_dir`` is gone. Returns the
    steps they held."""
    prefix = shm.prefix_for(local_dir, rank)
    assert prefix is not None
    lost = sorted(r.step for g in shm.segments(prefix=prefix) for r in g.records)
    shm.free(prefix=prefix)
    assert shm.segments(prefix=prefix) == []
    return lost


def test_a_snapshot_the_local_tier_had_not_finished_is_written_there_after_the_restore(tmp_path):
    """Killed mid-write of step 3 on the local tier (steps 1, 2 there): the next process restores step 3 from
    RAM and writes it to the local tier before ck.wait() returns; after a reboot a third process restores
    step 3 from the local tier, bit-exact."""
    run = tmp_path / "run"
    _, step, saved = Worker(str(run), "stall").kill_at("stalled")
    assert LocalTier(run).committed_steps() == [2, 1]  # step 3 was being written: RAM alone holds it
    restored = Worker(str(run), "restore").result()
    assert restored == ["restored", step, "memory", saved, "1", "0"]  # one write: step 3 to the local tier
    assert LocalTier(run).committed_steps() == [3, 2] and verifies(run, 3)
    assert not [p for p in os.listdir(run) if p.startswith(".step-")]  # the killed writer's staging is gone
    assert _reboot(run) == [2, 3]  # the restoring process left the RAM as it found it
    assert Worker(str(run), "restore").result() == ["restored", step, "local", saved, "0", "0"]


def test_nothing_is_written_when_the_local_tier_holds_the_restored_step(tmp_path):
    run = tmp_path / "run"
    _, step, saved = Worker(str(run), "written").kill_at("written")
    before = os.stat(run / "step-000000003").st_ino
    assert Worker(str(run), "restore").result() == ["restored", step, "memory", saved, "0", "0"]
    assert os.stat(run / "step-000000003").st_ino == before  # the committed copy was not replaced


def test_beside_a_live_owner_of_local_dir_the_restore_writes_nothing_there(tmp_path):
    """Another live process owns ``local_dir`` (it is that directory's one writer): the restore still loads step
    3 from RAM, and leaves the directory and the RAM as they were."""
    run = tmp_path / "run"
    _, step, saved = Worker(str(run), "stall").kill_at("stalled")
    owner = LocalTier(run).acquire_owner()  # what a save or promote into the directory takes, in this process
    try:
        assert Worker(str(run), "restore").result() == ["restored", step, "memory", saved, "0", "0"]
        assert LocalTier(run).committed_steps() == [2, 1]
    finally:
        owner.release()
    assert _reboot(run) == [2, 3]


def test_the_restored_snapshot_goes_to_the_remote_tier_too(tmp_path):
    """The remote tier wrote step 1 only (its cadence); the restore writes step 3 there and to the local
    tier. After a reboot that also lost the node's disk, a process with an empty local_dir restores step 3
    from the remote tier, bit-exact."""
    run, url = tmp_path / "run", f"file://{tmp_path}/remote"
    _, step, saved = Worker(str(run), "stall", url).kill_at("stalled")
    assert RemoteTier(url).committed_steps() == [1]
    assert Worker(str(run), "restore", url).result() == ["restored", step, "memory", saved, "1", "1"]
    assert RemoteTier(url).committed_steps() == [3, 1]
    assert _reboot(run) == [2, 3]
    assert Worker(str(tmp_path / "new-node"), "restore", url).result() == [
        "restored",
        step,
        "remote",
        saved,
        "0",
        "0",
    ]


def test_in_a_job_each_rank_writes_its_local_tier_and_all_ranks_the_job_tier(tmp_path):
    """Two gloo ranks, one job tier (step 1 there), killed at step 3: rank 0 while its local tier wrote it,
    rank 1 after its local tier had it. The restarted job restores step 3 from RAM on both ranks; rank 0
    writes it to its local tier, rank 1 does not, and both upload their parts of it to the job tier, which
    commits it (every rank had it in RAM: the ranks agree before any uploads). After a reboot of both ranks'
    node, a job on new local directories restores step 3 from the job tier."""
    root, url = tmp_path / "job", f"file://{tmp_path}/remote"
    killed = _job(str(root), "stall,written", url)
    saved = [w.kill_at(word)[2] for w, word in zip(killed, ("stalled", "written"))]
    assert [LocalTier(root / f"rank-{r}").committed_steps() for r in (0, 1)] == [[2, 1], [3, 2]]
    assert RemoteTier(url).committed_steps() == [1]
    restored = [w.result() for w in _job(str(root), "restore,restore", url)]
    assert restored == [
        ["restored", "3", "memory", saved[0], "1", "1"],
        ["restored", "3", "memory", saved[1], "0", "1"],
    ]
    assert RemoteTier(url).committed_steps() == [3, 1]
    for r in (0, 1):
        assert LocalTier(root / f"rank-{r}").committed_steps()[0] == 3 and verifies(root / f"rank-{r}", 3)
        _reboot(root / f"rank-{r}", r)
    again = [w.result() for w in _job(str(tmp_path / "new-node"), "restore,restore", url)]
    assert again == [["restored", "3", "remote", saved[r], "0", "0"] for r in (0, 1)]


def test_a_rank_that_cannot_hand_over_its_restored_snapshot_tells_the_job_tier_which_skips_it(tmp_path):
    """Two gloo ranks killed while their local tiers wrote step 3 (the job tier has step 1). At the restart
    both restore step 3 from RAM, but rank 1's snapshot cannot be taken again to be written (a chunk fails
    its checksum then): rank 1 tells the job tier it has nothing, so no rank waits for it and the job tier
    does not commit a step one rank lacks; rank 0 still writes step 3 to its own local tier; rank 1's
    wait() raises the failure, the restore itself stands."""
    root, url = tmp_path / "job", f"file://{tmp_path}/remote"
    killed = _job(str(root), "stall,stall", url)
    saved = [w.kill_at("stalled")[2] for w in killed]
    restored = [w.result() for w in _job(str(root), "restore,restore-lost", url)]
    assert restored[0][:4] == ["restored", "3", "memory", saved[0]] and restored[0][4] == "1"
    assert restored[1][:4] == ["restored", "3", "memory", saved[1]]
    assert restored[1][-2:] == ["failed", "CorruptCheckpointError"]
    assert RemoteTier(url).committed_steps() == [1]
    assert LocalTier(root / "rank-0").committed_steps()[0] == 3 and verifies(root / "rank-0", 3)
    assert LocalTier(root / "rank-1").committed_steps() == [2, 1]

"""Sharded (DTensor) state: each rank saves and restores its own shards, with their layout checked.

The two-rank tests run a real FSDP2 job on the CPU (gloo, ``fully_shard``) in
tests/dtensor_worker.py; the in-process ones use a one-rank gloo group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from helpers import assert_ok, run_ranks

HERE = Path(__file__).parent
WORKER = HERE / "dtensor_worker.py"


def _line(results, prefix: str) -> str:
    return next(l for r in results for l in r.stdout.splitlines() if l.startswith(prefix))


@pytest.mark.parametrize(
    "backend", ["gloo", pytest.param("nccl", marks=pytest.mark.multigpu, id="nccl-two-gpus")]
)
def test_fsdp2_training_resumes_bit_identically_on_two_ranks(tmp_path, backend):
    env = {"CKPT_TEST_BACKEND": backend}
    straight = run_ranks(WORKER, str(tmp_path / "a"), "run", "7", env=env)
    assert_ok(straight)
    interrupted = run_ranks(WORKER, str(tmp_path / "b"), "run", "4", env=env)  # saves step 3, stops after 4
    assert_ok(interrupted)
    resumed = run_ranks(WORKER, str(tmp_path / "b"), "resume", "7", env=env)
    assert_ok(resumed)
    assert [l for r in resumed for l in r.stdout.splitlines() if l.startswith("restored")] == [
        "restored 3"
    ] * 2
    # parameters (in place, shard by shard) and AdamW moments (re-made as DTensors on their
    # parameters' mesh, the optimizer never having stepped) both came back exactly
    assert _line(resumed, "digest") == _line(straight, "digest")


def test_sharded_state_does_not_load_into_another_layout(tmp_path):
    assert_ok(run_ranks(WORKER, str(tmp_path), "run", "3"))
    results = run_ranks(WORKER, str(tmp_path), "resume-plain")
    for r in results:
        assert r.returncode != 0
    assert "was saved as a DTensor" in results[0].stderr + results[1].stderr, results[0].stderr[-2000:]


@pytest.fixture
def one_rank(tmp_path):
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_dtensor_round_trips_in_place_with_its_layout_checked(local_dir, one_rank):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = distribute_tensor(torch.randn(6, 4), one_rank, [Shard(0)])
    saved = w.full_tensor().clone()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": w}).wait()
        w.to_local().zero_()
        assert ck.restore({"w": w}) == 1
        assert torch.equal(w.full_tensor(), saved)
        other = distribute_tensor(torch.zeros(6, 4), one_rank, [Replicate()])
        with pytest.raises(
            ckpt.IncompatibleCheckpointError, match=r"placements \['S0'\].*job tier.*reshards"
        ):
            ck.restore({"w": other})
        with pytest.raises(ckpt.IncompatibleCheckpointError, match="saved as a DTensor"):
            ck.restore({"w": torch.zeros(6, 4)})


def test_a_partial_dtensor_is_refused_with_what_to_do(local_dir, one_rank):
    from torch.distributed.tensor import DTensor, Partial

    p = DTensor.from_local(torch.ones(3), one_rank, [Partial()])
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.RefusedStateError) as ei:
            ck.save(1, {"opt": {"m": p}})
        assert ei.value.path == "opt/m"
        assert ck.list() == []


def test_a_stepped_optimizers_dtensor_state_stays_dtensor_after_restore(local_dir, one_rank):
    """Restoring into an optimizer that has stepped loads its DTensor moments in place and keeps them
    DTensors (the optimizer would otherwise mix DTensor parameters with plain-tensor state)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), one_rank, [Shard(0)]))
    opt = torch.optim.AdamW([p], lr=0.1)

    def step():
        (p * p).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"p": p, "opt": opt}).wait()
        saved = opt.state[p]["exp_avg"].full_tensor().clone()
        ck.wait_staged()
        step()
        assert ck.restore({"p": p, "opt": opt}) == 1
    exp_avg = opt.state[p]["exp_avg"]
    assert isinstance(exp_avg, DTensor) and torch.equal(exp_avg.full_tensor(), saved)
    step()  # mixing DTensor parameters with plain-tensor state would fail here

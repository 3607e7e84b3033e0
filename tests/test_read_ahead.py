"""The memory tier's read-ahead (``MemoryTier.read_ahead``): while the ranks of a collective restore agree on a
step, each copies its own newest snapshot from host memory onto its GPU, and the load of that snapshot then
copies it into place device to device. What is read ahead must be exactly what the load would have read: the
same buffer holding the same image, checked where it was taken over from a previous process; anything else
is left alone and the load reads the host buffer as without it. On this machine a CPU "device" stands in for
the GPU (the copy and the checks are the same); under ``gpu``, the same on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import shm
from ckpt.tiers import memory as memory_mod

pytestmark = [
    pytest.mark.skipif(shm.shm_root() is None, reason="no RAM file system (/dev/shm) here"),
    pytest.mark.timeout(120),
]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)"
            ),
        ],
    ),
]


def _state(seed: int, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(70_000, generator=g).to(device),
        "b": torch.randn(7, generator=g).to(device),
        "n": torch.arange(seed, seed + 5).to(device),
    }


def _blank(device: str) -> dict:
    return {k: torch.full_like(v, 7) for k, v in _state(0, device).items()}


def _exact(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


class _Taken:
    """Spies on ``_ReadAhead.take``: what each call handed to the load (``None``: it read the host buffer)."""

    def __init__(self, monkeypatch) -> None:
        self.got: list[bool] = []
        real = memory_mod._ReadAhead.take

        def take(ahead, buf, manifest):
            out = real(ahead, buf, manifest)
            self.got.append(out is not None)
            return out

        monkeypatch.setattr(memory_mod._ReadAhead, "take", take)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "step, used",
    [(None, True), (2, False)],
    ids=["the newest: the copy read ahead", "an older step: its own buffer"],
)
def test_a_load_takes_the_copy_read_ahead_for_that_snapshot_alone(local_dir, monkeypatch, device, step, used):
    taken = _Taken(monkeypatch)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
    ) as ck:
        ck.save(2, _state(2, device)).wait()
        ck.save(3, _state(3, device)).wait()
        ck.memory.read_ahead(torch.device(device))
        target = _blank(device)
        assert ck.restore(target, step=step) == (step or 3) and ck.last_restore.tier == "memory"
        assert _exact(target, _state(step or 3)) and taken.got == [used]
        ck.memory.end_read_ahead()
        assert ck.memory._ahead is None


def test_a_buffer_that_took_a_newer_snapshot_since_is_read_as_it_is_now(local_dir, monkeypatch):
    """One host buffer: step 3 is read ahead, then step 4 is saved into the same buffer; the restore of step 4
    must not be handed step 3's bytes (same buffer, same size, other image)."""
    taken = _Taken(monkeypatch)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir, max_in_flight=1),
        policy=ckpt.Policy(persist_every={"local": 1000}),
    ) as ck:
        ck.save(3, _state(3)).wait()
        ck.memory.read_ahead(torch.device("cpu"))
        ck.memory._ahead._thread.join()
        assert ck.memory._ahead.data is not None  # step 3's bytes, read ahead
        ck.save(4, _state(4)).wait()
        assert len(ck.pool.buffers) == 1
        target = _blank("cpu")
        assert ck.restore(target) == 4 and _exact(target, _state(4)) and taken.got == [False]
        ck.memory.end_read_ahead()


@pytest.mark.parametrize("flip", [False, True], ids=["intact", "changed"])
def test_a_snapshot_taken_over_from_the_previous_process_is_checked_before_it_is_read_ahead(
    local_dir, monkeypatch, flip
):
    """The ranks of a collective job own their local_dir from construction on and take over the segments
    their previous processes left: what is read ahead from one is checked first, and one that fails is not
    read ahead (the load then finds it failing too, and the local tier's copy is restored)."""
    taken = _Taken(monkeypatch)
    ck = ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir))
    ck.save(3, _state(3)).wait()
    ck.close(keep_memory=True)
    if flip:  # a byte of the segment changes while no process owns it: the local tier's copy is restored
        root, prefix = shm.shm_root(), shm.prefix_for(local_dir, 0, create=True)
        rec = next(
            shm.read_snapshot_record(p)
            for p in root.iterdir()
            if p.name.startswith(prefix) and p.name.endswith(".rec")
        )
        with open(root / rec.buffer, "r+b") as f:
            f.seek(1000)
            b = f.read(1)
            f.seek(1000)
            f.write(bytes([b[0] ^ 0x02]))
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck._node.own()  # as every rank of a collective job does at construction: the segment is taken over
        ck.memory.read_ahead(torch.device("cpu"))
        ck.memory._ahead._thread.join()
        assert [b.image_step for b in ck.pool.buffers] == [3]
        assert (ck.memory._ahead.data is None) is flip  # a snapshot that fails its checks is not read ahead
        target = _blank("cpu")
        with pytest.warns(RuntimeWarning) if flip else _nothing():
            assert ck.restore(target) == 3
        assert ck.last_restore.tier == ("local" if flip else "memory") and _exact(target, _state(3))
        assert taken.got == [False] if flip else [True]
        ck.memory.end_read_ahead()


def test_ending_gives_the_copy_back_and_a_second_start_is_one_read(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
    ) as ck:
        ck.save(3, _state(3)).wait()
        ck.memory.read_ahead(torch.device("cpu"))
        first = ck.memory._ahead
        ck.memory.read_ahead(torch.device("cpu"))
        assert ck.memory._ahead is first  # one at a time
        ck.memory.end_read_ahead()
        assert first.data is None and not first._thread.is_alive() and ck.memory._ahead is None
        assert all(b.holds == 0 for b in ck.pool.buffers)  # the buffer it held is free again
        ck.memory.end_read_ahead()  # twice: nothing to do


def test_it_is_off_where_the_knob_says_so(local_dir):
    from ckpt import knobs

    with (
        ckpt.Checkpointer(
            storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
        ) as ck,
        knobs.override(CKPT_READ_AHEAD=0),
    ):
        ck.save(3, _state(3)).wait()
        ck.memory.read_ahead(torch.device("cpu"))
        assert ck.memory._ahead is None


def test_nothing_to_read_ahead_is_nothing(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.memory.read_ahead(torch.device("cpu"))
        ck.memory._ahead._thread.join()
        assert ck.memory._ahead.target is None and ck.memory._ahead.data is None
        assert ck.restore(_blank("cpu")) is None
        ck.memory.end_read_ahead()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_rank_whose_agreement_waits_for_a_late_rank_reads_ahead_and_loads_from_it(tmp_path):
    """Two gloo ranks; rank 1 comes to its restore 0.5 s late: rank 0's agreement waits, so it reads its own
    snapshot ahead and its load takes that copy; both states exact, nothing read ahead left behind."""
    from helpers import run_ranks

    results = run_ranks(Path(__file__).parent / "read_ahead_worker.py", str(tmp_path))
    lines = {}
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        rank, *rest = next(l for l in r.stdout.splitlines() if l.startswith("ahead ")).split()[1:]
        lines[int(rank)] = rest
    assert lines[0][:5] == ["3", "memory", "1", "1", "[1]"] and lines[0][5] == "0", lines
    assert lines[1][:3] == ["3", "memory", "1"] and lines[1][-1] == "0", lines  # rank 1 arrived last: any way


class _NoStateDict(torch.nn.Linear):
    def state_dict(self, *a, **kw):  # an FSDP model may answer with collectives: never called
        raise AssertionError("state_dict() called")


@pytest.mark.parametrize("device", DEVICES)
def test_the_state_gpu_is_found_without_calling_state_dict(device):
    from ckpt.restore import state_gpu as _state_gpu

    want = torch.device(device, torch.cuda.current_device()) if device == "cuda" else None
    m = _NoStateDict(3, 3).to(device)
    assert _state_gpu({"model": m, "step": 5}) == want
    opt = torch.optim.SGD(_NoStateDict(2, 2).to(device).parameters(), lr=0.1)
    assert _state_gpu({"n": 1, "opt": opt}) == want
    assert _state_gpu({"a": [1, {"b": (torch.zeros(2, device=device),)}]}) == want
    assert _state_gpu({"a": "text", "b": None, "c": torch.zeros(2)}) is None

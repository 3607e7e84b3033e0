"""Torn snapshots: every in-place write that lands before a tensor's copy fails the save loudly.

Version counters see ordinary in-place writes, but not writes through ``.data`` (which has a
counter of its own), through a numpy view, or into a numpy array of the state. Each saved tensor's
value fingerprint taken at ``save()`` is compared with the staged copy before the snapshot is
published or persisted. A slow stager (the staging thread sleeps before each copy) makes the
window wide: a write right after ``save()`` then lands entirely before the copy.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch import nn

import ckpt
from ckpt import stage as stage_mod


def _data_add(p):
    p.data.add_(1)


def _numpy_view(p):
    p.detach().numpy()[...] = 7


def _data_copy(p):
    p.data.copy_(torch.randn_like(p))


def _no_grad_data(p):
    with torch.no_grad():
        p.data.mul_(2)


WRITES = [_data_add, _numpy_view, _data_copy, _no_grad_data]


def _model():
    torch.manual_seed(0)
    return nn.Linear(16, 8)


def _restored(local_dir) -> tuple[int | None, dict]:
    fresh = nn.Linear(16, 8)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        step = ck.restore({"model": fresh})
    return step, {k: v.clone() for k, v in fresh.state_dict().items()}


@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.strip("_"))
def test_a_write_right_after_save_that_the_version_counter_misses_fails_the_save(
    local_dir, slow_staging, write
):
    model = _model()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": model}).wait()
        at_1 = {k: v.clone() for k, v in model.state_dict().items()}
        model.weight.data.add_(0.5)  # step 2's state (through .data: the counter does not see it)
        model.bias.data.add_(0.5)
        h = ck.save(2, {"model": model})
        write(model.weight)  # no wait_staged(): lands before the slow copy
        with pytest.raises(ckpt.TornSnapshotError, match=r"'model/weight'.*wait_staged") as info:
            h.wait()
        assert "model/bias" not in str(info.value)  # only the tensor that changed is named
        assert h.status == "failed" and h.errors.get("memory") is not None
        assert [i.step for i in ck.list()] == [1]  # nothing torn committed, not even in memory
    step, values = _restored(local_dir)
    assert step == 1 and all(torch.equal(values[k], at_1[k]) for k in at_1)


@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.strip("_"))
def test_with_wait_staged_first_the_same_write_is_safe(local_dir, slow_staging, write):
    model = _model()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(2, {"model": model})
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        ck.wait_staged()
        write(model.weight)
        h.wait()
    step, values = _restored(local_dir)
    assert step == 2 and all(torch.equal(values[k], at_save[k]) for k in at_save)


def test_a_write_after_the_copy_landed_is_not_reported(local_dir):
    model = _model()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(2, {"model": model})
        h.wait("memory")
        model.weight.data.add_(1)
        h.wait()
    assert _restored(local_dir)[0] == 2


def test_a_numpy_array_of_the_state_written_after_save_fails_the_save(local_dir, slow_staging):
    arr = np.arange(1000, dtype=np.float32)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"data": {"order": arr}})
        arr[500] = -1
        with pytest.raises(ckpt.TornSnapshotError, match="data/order"):
            h.wait()


def _tensors():
    torch.manual_seed(1)
    base = torch.randn(64, 33)
    return {
        "f32": torch.randn(1001),  # odd size: not whole 64-bit words
        "bf16": torch.randn(64, 7).bfloat16(),
        "f64": torch.randn(10).double(),
        "i64": torch.arange(-50, 50),
        "i8_odd": torch.randint(-100, 100, (13,), dtype=torch.int8),
        "u8": torch.randint(0, 255, (3,), dtype=torch.uint8),
        "bool": torch.rand(77) > 0.5,
        "c64": torch.randn(5, dtype=torch.complex64),
        "c128": torch.randn(4, dtype=torch.complex128),
        "conj": torch.randn(6, dtype=torch.complex64).conj(),  # a lazy view: its bytes are not its values
        "scalar": torch.tensor(3.5),
        "transposed": base.t(),  # not contiguous
        "strided": base[:, ::2],  # not dense
        "misaligned": torch.randn(100).half()[1:],  # contiguous, 2 bytes off the 8-byte grid
        "f8": torch.randn(24).to(torch.float8_e4m3fn),
        "u16": torch.randint(0, 1000, (6,)).to(torch.uint16),
        "empty": torch.empty(0, 3),
    }


def _poke(t: torch.Tensor) -> None:
    """Change one element of ``t`` in place, through ``.data`` (invisible to t's version counter)."""
    if t.numel() == 0:
        return
    d = t.data
    idx = (0,) * d.dim()
    if d.dtype == torch.bool:
        d[idx] = not bool(d[idx])
    elif d.is_complex():
        d[idx] = d[idx] + 1j
    elif d.dtype in (torch.float8_e4m3fn, torch.uint16):
        d.view(torch.uint8 if d.dtype == torch.float8_e4m3fn else torch.int16)[idx] += 1
    else:
        d[idx] = d[idx] + 1


@pytest.mark.parametrize("name", [k for k in _tensors() if k != "empty"])
def test_a_one_element_change_is_caught_for_every_dtype_and_layout(local_dir, slow_staging, name):
    state = _tensors()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, state)
        _poke(state[name])
        with pytest.raises(ckpt.TornSnapshotError, match=repr(name)):
            h.wait()


def test_every_dtype_and_layout_round_trips_without_a_false_report(local_dir, slow_staging):
    state = _tensors()
    expect = {k: v.clone() for k, v in state.items()}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, state).wait()
        out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in expect.items()}
        assert ck.restore(out) == 1
    for k, v in expect.items():
        assert torch.equal(
            out[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else out[k],
            v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
        ), k


def test_tied_tensors_and_module_buffers_do_not_trip_the_check(local_dir, slow_staging):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    shared = torch.randn(100)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"model": model, "a": shared, "b": shared})
        model(torch.randn(4, 8))  # the forward updates BatchNorm's buffers in place: copied first
        h.wait()


def test_the_fingerprint_sees_any_single_element_change_in_every_form():
    for name, t in _tensors().items():
        if t.numel() == 0:
            continue
        t = t.resolve_conj()
        words = stage_mod._fits_words(t)
        before = stage_mod._fingerprint(t, words)
        assert before == stage_mod._fingerprint(t.contiguous(), words), name  # the staged copy's form
        _poke(t)
        assert stage_mod._fingerprint(t, words) != before, name


@pytest.fixture
def one_rank(tmp_path):
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_write_into_a_dtensor_local_shard_fails_the_save(local_dir, one_rank, slow_staging):
    from torch.distributed.tensor import Shard, distribute_tensor

    w = nn.Parameter(distribute_tensor(torch.randn(6, 4), one_rank, [Shard(0)]))
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"w": w}).wait()
        h = ck.save(2, {"w": w})
        w.data.to_local().add_(1)
        with pytest.raises(ckpt.TornSnapshotError, match="'w'"):
            h.wait()
        assert [i.step for i in ck.list()] == [1]


# -- on a GPU: the write is queued on the compute stream right after save() -----------------------


def _hold_side_stream(ck: ckpt.Checkpointer, ms: float = 200) -> None:
    """Queue a GPU sleep on the snapshot's side stream, so that its copies start only after the
    compute stream's next kernels ran: a write right after save() then lands before the copy."""
    with torch.cuda.stream(ck._side_stream):
        torch.cuda._sleep(int(ms * 1e6))  # ~1-2 GHz: at least `ms` milliseconds


def _torn_or_exact(h, ck, fresh: dict, tensors, at_save: dict, name: str) -> bool:
    """The outcome of a save whose tensor ``name`` was written right after save(): ``True`` when the
    save failed with TornSnapshotError naming it, ``False`` when it committed, and then its copy,
    restored into ``fresh`` (``tensors(fresh)``: its tensors by name), must be exactly the state at
    save() (the write landed after the copy: no tear). A torn commit fails the test."""
    try:
        h.wait()
    except ckpt.TornSnapshotError as e:
        assert repr(name) in str(e)
        return True
    assert ck.restore(fresh, step=h.step) == h.step
    got = tensors(fresh)
    assert all(torch.equal(got[k], at_save[k]) for k in at_save), "a torn snapshot was committed"
    return False


@pytest.mark.gpu
@pytest.mark.parametrize("write", [_data_add, _data_copy, _no_grad_data], ids=lambda f: f.__name__.strip("_"))
def test_gpu_a_write_on_the_compute_stream_right_after_save_fails_the_save(local_dir, write):
    """The side stream is held so that the write usually lands before the copy: then the save must
    fail; when the GPU ran the copy first all the same, the committed copy must be the state at save()."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256).cuda()
    outcomes = []
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": model}).wait()
        for step in (2, 3, 4):
            _hold_side_stream(ck)
            h = ck.save(step, {"model": model})
            at_save = {
                k: v.clone() for k, v in model.state_dict().items()
            }  # on the compute stream: before the write
            write(model.weight)
            fresh = {"model": nn.Linear(256, 256).cuda()}
            outcomes.append(
                _torn_or_exact(h, ck, fresh, lambda f: f["model"].state_dict(), at_save, "model/weight")
            )
    assert any(outcomes), "the held copy never ran after the write: the check was not exercised"


@pytest.mark.gpu
def test_gpu_with_wait_staged_first_the_write_is_safe(local_dir):
    torch.manual_seed(0)
    model = nn.Linear(256, 256).cuda()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        _hold_side_stream(ck)
        h = ck.save(2, {"model": model})
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        ck.wait_staged()
        model.weight.data.add_(1)
        h.wait()
    fresh = nn.Linear(256, 256).cuda()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"model": fresh}) == 2
    assert all(torch.equal(fresh.state_dict()[k], at_save[k]) for k in at_save)


@pytest.mark.gpu
def test_gpu_every_dtype_and_layout_is_caught_and_round_trips(local_dir):
    state = {k: v.cuda() for k, v in _tensors().items()}
    state["transposed"] = state["transposed"].contiguous().t()
    state["strided"] = torch.randn(64, 33, device="cuda")[:, ::2]
    state["misaligned"] = torch.randn(100, device="cuda").half()[1:]
    expect = {k: v.clone() for k, v in state.items()}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, state).wait()  # the CUDA fingerprint equals the one of the host copy: no false report
        out = {k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in expect.items()}
        assert ck.restore(out) == 1
        caught = []
        for step, name in enumerate([k for k in state if k != "empty"], start=2):
            _hold_side_stream(ck)
            h = ck.save(step, state)
            at_save = {k: v.clone() for k, v in state.items()}
            _poke(state[name])
            fresh = {k: torch.zeros_like(v) for k, v in state.items()}
            caught.append(_torn_or_exact(h, ck, fresh, lambda f: f, at_save, name))
        assert any(caught), "the held copy never ran after the write: the check was not exercised"


@pytest.mark.gpu
def test_gpu_fingerprints_equal_the_cpu_ones_for_every_form():
    for name, t in _tensors().items():
        t = t.resolve_conj()
        words = stage_mod._fits_words(t) and stage_mod._fits_words(t.cuda())
        assert stage_mod._fingerprint(t.cuda(), words) == stage_mod._fingerprint(t, words), name
    big = torch.full((4096,), 2**62 + 12345, dtype=torch.int64)  # the int64 sum wraps around
    assert stage_mod._fingerprint(big.cuda(), True) == stage_mod._fingerprint(big, True)


@pytest.mark.gpu
def test_gpu_training_with_the_optimizer_right_after_save_is_never_reported(local_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        for step in range(20):
            model(torch.randn(32, 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
            if step % 2 == 0:
                _hold_side_stream(ck, 20)
                ck.save(step, {"model": model, "optim": opt})
        ck.wait()


@pytest.mark.gpu
def test_gpu_fingerprints_replayed_from_a_graph_equal_the_launches_and_follow_the_values():
    state = {k: v.cuda() for k, v in _tensors().items() if v.numel()}
    state["strided"] = torch.randn(64, 33, device="cuda")[:, ::2]
    srcs = [t.resolve_conj() for t in state.values()]
    words = [stage_mod._fits_words(t) for t in srcs]
    graphs = stage_mod._FingerprintGraphs()
    for round_ in range(4):  # launches, capture, replay, replay; values changed in place between rounds
        got = graphs.fingerprints(srcs, words)
        want = stage_mod._FingerprintGraphs._launch(srcs, words)
        assert torch.equal(got, want), round_
        assert (round_ >= 1) == (len(graphs._graph) == 1), round_
        for t in srcs:
            _poke(t)
    srcs[0] = srcs[0].clone()  # a tensor at another address: the next call launches, the one after recaptures
    for _ in range(3):
        assert torch.equal(
            graphs.fingerprints(srcs, words), stage_mod._FingerprintGraphs._launch(srcs, words)
        )
    assert graphs._graph[torch.cuda.current_device()][0][0][0] == srcs[0].data_ptr()

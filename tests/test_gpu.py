"""GPU behaviour of phase 1: overlap, the optimizer hook's device-side wait, buffers first, torn writes.

Marked ``gpu``: skipped without CUDA; run on the device machine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt

pytestmark = pytest.mark.gpu


def _big_model(width: int = 4096, layers: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda()


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(256, model[0].in_features, device="cuda")
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_save_returns_before_the_copy_and_the_optimizer_waits_on_the_gpu(local_dir):
    model = _big_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_m = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        # two first saves make the two snapshot buffers (host memory allocated and mapped on the caller's thread:
        # its time says nothing of the overlap), then the copy of the third, into a buffer made before, queues behind ~0.5 s of GPU spin
        # on the side stream: a save() that waited for it could not return with the stream still busy
        # (without the spin, the stream can be idle for a moment between two of the copy's paced chunks)
        for s in (1, 2):
            ck.save(s, {"model": model, "optim": opt}).wait()
        with torch.cuda.stream(ck._side_stream):
            torch.cuda._sleep(1_000_000_000)
        h = ck.save(3, {"model": model, "optim": opt})
        assert ck._side_stream.query() is False, "save() waited for the copy"
        x = torch.randn(256, 4096, device="cuda")
        model(x).float().pow(2).mean().backward()
        opt.step()  # the pre-hook makes the GPU, not the host, wait for the copy
        assert ck._side_stream.query() is False, "optimizer.step() waited on the host"
        h.wait()
        assert h.stats.stage_gbps and h.stats.stage_gbps > 1.0
    fresh = _big_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore({"model": fresh, "optim": fresh_opt}) == 3
    for k in before:
        assert torch.equal(fresh.state_dict()[k], before[k]), k
    for p, m in zip(fresh.parameters(), before_m):
        assert fresh_opt.state[p]["exp_avg"].is_cuda and torch.equal(fresh_opt.state[p]["exp_avg"], m)
        assert fresh_opt.state[p]["step"].device.type == "cpu"


def test_buffers_are_copied_before_the_next_forward(local_dir):
    model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096)).cuda()
    big = torch.randn(256 << 20, device="cuda")  # 1 GiB queued behind the buffers
    model(torch.randn(64, 4096, device="cuda"))
    before = model[1].running_mean.clone()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"model": model, "big": big})
        model(torch.randn(64, 4096, device="cuda") + 3)
        h.wait()
        out = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096)).cuda()
        ck.restore({"model": out, "big": torch.empty_like(big)})
    assert torch.equal(out[1].running_mean, before)


def test_an_unfenced_in_place_write_on_the_gpu_fails_the_save(local_dir):
    big = torch.randn(512 << 20, device="cuda")  # 2 GiB: the copy is still running when add_ is issued
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        h = ck.save(1, {"big": big})
        big.add_(1)
        with pytest.raises(ckpt.TornSnapshotError, match="'big'"):
            h.wait()
        with pytest.raises(ckpt.TornSnapshotError):
            ck.wait()


def test_restore_from_memory_lands_in_place_on_the_gpu(local_dir):
    model = _big_model(layers=2)
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": model}).wait()
        ptr = model[0].weight.data_ptr()
        ref = model[0].weight.clone()
        with torch.no_grad():
            model[0].weight.zero_()
        assert ck.restore({"model": model}) == 1
        assert ck.last_restore.tier == "memory"
    assert model[0].weight.data_ptr() == ptr and torch.equal(model[0].weight, ref)


def test_gpu_snapshot_and_restore_copies_stay_inside_registration_pieces(local_dir, monkeypatch):
    # segments are registered with the driver in pieces, and a CUDA copy spanning two is refused
    # (cudaErrorInvalidValue): with 1 MiB pieces, tensors crossing many boundaries (contiguous, transposed,
    # strided, bf16) snapshot and restore from the memory tier, bit-exact
    from ckpt import shm

    if shm.shm_root() is None:
        pytest.skip("no RAM file system for the memory tier's segments")
    monkeypatch.setattr(shm, "REGISTER_PIECE", 1 << 20)
    torch.manual_seed(0)
    state = {
        "big": torch.randn(3_000_000, device="cuda"),
        "t": torch.randn(700, 900, device="cuda").t(),
        "s": torch.randn(2_000_001, device="cuda")[::3],
        "b": torch.randn(1000, 700, device="cuda").bfloat16(),
    }
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(persist_every={"local": 1000})
    ) as ck:
        for step in (1, 2, 3):
            ck.save(step, state).wait("memory")
        segs = [b.segment for b in ck.pool.buffers if b.segment is not None]
        assert segs and all(s.registered and len(s._pieces) > 10 for s in segs)
        out = {k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in state.items()}
        assert ck.restore(out) == 3 and ck.last_restore.tier == "memory"
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_a_failed_registration_does_not_fail_the_next_cuda_operation(tmp_path):
    # A mapping of a regular file on disk cannot be registered with the CUDA driver; the runtime keeps that
    # error as the thread's last error, and torch reads it after its next kernel launch. host_register must
    # clear what it handled, or the next tensor operation of the thread (the peer tier's staging allocation
    # was the one seen) fails with the registration's error.
    import ctypes
    import mmap

    from ckpt import shm

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = tmp_path / "on-disk"
    path.write_bytes(b"\0" * (1 << 20))
    with path.open("r+b") as f:
        m = mmap.mmap(f.fileno(), 1 << 20)
    view = ctypes.c_char.from_buffer(m)
    try:
        ptr = ctypes.addressof(view)
        rc = shm.host_register(ptr, 1 << 20)
        if rc == 0:
            shm.host_unregister(ptr)
            pytest.skip(
                f"{tmp_path} is on a file system whose pages the driver registers: nothing fails here"
            )
        assert rc != 0
        assert torch.ones(4, device="cuda").add(1).sum().item() == 8.0
        assert shm.host_unregister(ptr) != 0  # not registered: the failure is reported, and cleared too
        assert torch.ones(4, device="cuda").mul(3).sum().item() == 12.0
    finally:
        del view
        m.close()


@pytest.mark.parametrize("tier", ["memory", "local"])
def test_restore_lands_after_the_work_the_caller_queued_on_the_gpu(local_dir, tier):
    # The restore's copies run on a stream of their own. Work the caller queued before restore() (here a
    # zero_() held back behind a long GPU spin) must land first: copies that ran ahead of it would be
    # overwritten, and the "restored" state would be zeros.
    model = _big_model(layers=2)
    ref = [p.detach().clone() for p in model.parameters()]
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        ck.save(1, {"model": model}).wait()
        if tier == "memory":
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the current stream
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            assert ck.restore({"model": model}) == 1
            assert ck.last_restore.tier == "memory"
    if tier == "local":
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
            torch.cuda._sleep(2_000_000_000)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            assert ck.restore({"model": model}) == 1
            assert ck.last_restore.tier == "local"
    torch.cuda.synchronize()
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref))


@pytest.mark.multigpu
def test_a_state_on_another_gpu_than_the_current_one_is_copied_on_its_own_gpus_stream(local_dir):
    # model.to("cuda:1") without torch.cuda.set_device: torch runs each copy on the current stream of the
    # copied tensor's GPU, so the snapshot's copies must be issued on a side stream of cuda:1, and the fence
    # before the optimizer step must hold cuda:1's stream
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert torch.cuda.current_device() == 0
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]).to("cuda:1")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 4096, device="cuda:1")
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        model(x).pow(2).mean().backward()
        ref = [p.detach().clone() for p in model.parameters()]
        h = ck.save(1, {"model": model})
        torch.cuda._sleep(200_000_000)  # the optimizer's writes queued right behind the save
        opt.step()  # must wait (on cuda:1) for the copy
        h.wait()
        for p in model.parameters():
            p.detach().zero_()
        assert ck.restore({"model": model}) == 1
    torch.cuda.synchronize(1)
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref))


@pytest.mark.multigpu
def test_a_state_spread_over_two_gpus_of_one_process_is_refused(local_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    state = {"a": torch.ones(1000, device="cuda:0"), "b": torch.ones(1000, device="cuda:1")}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        with pytest.raises(ckpt.errors.RefusedStateError):
            ck.save(1, state).wait()


def _segment(path, nbytes: int, chunk: int):
    """A file of random bytes standing for a replica segment, and the manifest fields a read checks."""
    import types

    from ckpt.integrity import checksum

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())
    raw = data.numpy().tobytes()
    chunks = [checksum(raw[i : i + chunk]) for i in range(0, nbytes, chunk)]
    return data, types.SimpleNamespace(chunk_bytes=chunk, chunks=chunks, data_bytes=nbytes)


def test_a_replica_read_onto_the_gpu_is_sent_piece_by_piece_as_it_lands(tmp_path):
    # the holder's side of a restore over NCCL: a segment its previous process left, read onto its GPU in the
    # background; ready() orders a stream after exactly the chunks a piece needs, across chunk boundaries
    from ckpt.tiers.peer import _ReplicaRead

    nbytes, chunk = (5 << 20) + 12345, 1 << 20
    data, manifest = _segment(tmp_path / "seg.buf", nbytes, chunk)
    reading = _ReplicaRead.start(tmp_path / "seg.buf", manifest, torch.device("cuda", 0))
    out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    piece = (3 << 20) // 2  # pieces straddle chunks
    with torch.cuda.stream(side):
        for a in range(0, nbytes, piece):
            k = min(piece, nbytes - a)
            reading.ready(a, k)
            out[a : a + k].copy_(reading.data[a : a + k])
    reading.finish()
    side.synchronize()
    assert torch.equal(out.cpu(), data)


def test_a_replica_that_fails_its_check_or_is_gone_never_leaves_the_sender_waiting(tmp_path):
    from ckpt.errors import CorruptCheckpointError
    from ckpt.tiers.peer import _ReplicaRead

    nbytes, chunk = 4 << 20, 1 << 20
    data, manifest = _segment(tmp_path / "seg.buf", nbytes, chunk)
    raw = bytearray((tmp_path / "seg.buf").read_bytes())
    raw[(2 << 20) + 7] ^= 0xFF  # chunk 2 rots in RAM
    (tmp_path / "seg.buf").write_bytes(bytes(raw))
    reading = _ReplicaRead.start(tmp_path / "seg.buf", manifest, torch.device("cuda", 0))
    reading.ready(0, nbytes)  # returns (chunk 2 is never copied: the read says so when over)
    with pytest.raises(CorruptCheckpointError):
        reading.finish()
    with pytest.raises(FileNotFoundError):  # a segment gone: refused before anything is sent
        _ReplicaRead.start(tmp_path / "gone.buf", manifest, torch.device("cuda", 0))
    short = tmp_path / "short.buf"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(OSError):
        _ReplicaRead.start(short, manifest, torch.device("cuda", 0))

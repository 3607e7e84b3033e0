"""The check of a CUDA snapshot's copy as it lands (``Snapshot._verify_cuda_copies``), driven on the CPU: the
copy's chunks land in order, each saying how far the buffer is written; each chunk of the buffer is
checksummed (the memory tier's record) once it has landed, and the tensors whose fingerprint after the copy
differs from their fingerprint at save() fail the snapshot."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt import shm, stage
from ckpt.errors import TornSnapshotError
from ckpt.format import Manifest
from ckpt.plan import Entry, layout


class _Ev:
    def synchronize(self) -> None:
        pass


class _Copy:
    def __init__(self, landed):
        self._landed = landed

    def landed(self):
        yield from self._landed


def _snap(tensors: list[torch.Tensor], chunk: int, cpu: list[int] = (), torn: int | None = None,
          checksums: bool = True):
    entries = [Entry(f"t{i}", t, t._version) for i, t in enumerate(tensors)]
    records, nbytes = layout(entries, 4096)
    buf = stage.HostBuffer(nbytes, pin=False)
    buf.tensor.fill_(7)   # stale bytes in the pads: read as they are by every checksum
    manifest = Manifest(step=1, rank=0, world_size=1, data_bytes=nbytes, chunk_bytes=chunk, chunks=[],
                        items=records, tree=None)
    snap = stage.Snapshot(1, entries, records, nbytes, manifest, buf, stage.SnapshotStats(1))
    snap.want_checksums = checksums
    checked = [i for i in range(len(tensors)) if i not in cpu]
    words, before = stage._fingerprints([(entries[i], records[i]) for i in checked])
    snap._checks = [(f"t{i}", records[i], tensors[i].dtype, tensors[i].shape, w) for i, w in zip(checked, words)]
    snap._fp_host = torch.tensor(before or [], dtype=torch.int64)
    snap._cpu_ranges = [(records[i].offset, records[i].nbytes) for i in cpu]
    for i in checked:   # the copies, landing in chunks of 3 tensors
        stage._dst(buf, records[i], tensors[i]).copy_(tensors[i])
    if torn is not None:   # written in place while the copy ran: the second fingerprints see it
        tensors[torn].view(-1)[3] += 1
    snap._fp_after = torch.tensor(stage._fingerprints([(entries[i], records[i]) for i in checked])[1] or [],
                                  dtype=torch.int64)
    snap._cuda_done = _Ev()
    order = [records[i] for i in checked]
    landed = [(_Ev(), [], order[k + 3].offset if k + 3 < len(order) else 1 << 62) for k in range(0, len(order), 3)]
    snap._copy = _Copy(landed)

    def cpu_copy():
        for i in cpu:
            stage._dst(buf, records[i], tensors[i]).copy_(tensors[i])
        snap._cpu_done.set()

    snap._cpu_thread = threading.Thread(target=cpu_copy)
    snap._cpu_thread.start()
    return snap, buf, nbytes


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (5000, 70_000, 3, 300_000, 17, 120_000, 1, 90_001):
        t = torch.randn(n, generator=g)
        out.append(t.to(torch.bfloat16) if n % 2 else t)
    out.append(torch.randint(0, 1000, (4097,), dtype=torch.int16, generator=g))
    out.append(torch.randn(33, 2, generator=g, dtype=torch.complex64))
    return out


@pytest.mark.parametrize("chunk", [4096, 65536, 1 << 20])
@pytest.mark.parametrize("cpu", [(), (2, 5)])
def test_checksums_computed_as_chunks_land_match_a_pass_over_the_whole_buffer(chunk, cpu):
    snap, buf, nbytes = _snap(_tensors(0), chunk, list(cpu))
    snap._verify_cuda_copies()
    assert snap.error is None
    assert snap.chunk_checksums == shm.chunk_checksums(buf.tensor, nbytes, chunk)


@pytest.mark.parametrize("victim", [0, 3, 8, 9])
def test_a_tensor_written_while_its_copy_ran_fails_the_snapshot_and_gets_no_checksums(victim):
    snap, _, _ = _snap(_tensors(1), 65536, torn=victim)
    snap._verify_cuda_copies()
    assert isinstance(snap.error, TornSnapshotError) and snap.error.keys == [f"t{victim}"]
    assert snap.chunk_checksums is None   # a torn snapshot gets no record


def test_without_a_shared_buffer_no_checksum_is_computed():
    snap, _, _ = _snap(_tensors(2), 65536, checksums=False)
    snap._verify_cuda_copies()
    assert snap.error is None and snap.chunk_checksums is None

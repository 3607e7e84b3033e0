"""The torn-write check of a CUDA snapshot (``Snapshot._verify_cuda_copies``), driven on the CPU: the tensors'
fingerprints at save() are compared with their fingerprints once the copy was taken (both computed where the
tensors are, the second after the last copy and before the optimizer step may run); a tensor written in
place meanwhile fails the snapshot, naming it, and no host pass over the snapshot's bytes is needed."""

from __future__ import annotations

import pytest
import torch

from ckpt import pool, stage
from ckpt.errors import TornSnapshotError
from ckpt.format import Manifest
from ckpt.plan import Entry, layout


class _Ev:
    def synchronize(self) -> None:
        pass


class _Copy:
    def landed(self):
        yield from [(_Ev(), [0]), (_Ev(), [1, 2])]


def _snap(tensors: list[torch.Tensor], torn: int | None = None):
    entries = [Entry(f"t{i}", t, t._version) for i, t in enumerate(tensors)]
    records, nbytes = layout(entries, 4096)
    buf = pool.HostBuffer(nbytes, pin=False)
    manifest = Manifest(
        step=1,
        rank=0,
        world_size=1,
        data_bytes=nbytes,
        chunk_bytes=65536,
        chunks=[],
        items=records,
        tree=None,
    )
    snap = stage.Snapshot(1, entries, records, nbytes, manifest, buf, stage.SnapshotStats(1))
    pairs = list(zip(entries, records))
    words, before = stage._fingerprints(pairs)
    snap._checks = [(e.key, r, e.tensor.dtype, e.tensor.shape, w) for (e, r), w in zip(pairs, words)]
    snap._fp_host = torch.tensor(before, dtype=torch.int64)
    if torn is not None:  # written in place while the copy ran: the second fingerprints see it
        tensors[torn].view(-1)[3] += 1
    snap._fp_after = torch.tensor(stage._fingerprints(pairs)[1], dtype=torch.int64)
    snap._cuda_done = _Ev()
    snap._copy = _Copy()
    return snap


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(5000, generator=g),
        torch.randn(17, generator=g).to(torch.bfloat16),
        torch.randint(0, 1000, (4097,), dtype=torch.int16, generator=g),
        torch.randn(33, 2, generator=g, dtype=torch.complex64),
    ]


def test_a_copy_of_unchanged_tensors_passes():
    snap = _snap(_tensors())
    snap._verify_cuda_copies()
    assert snap.error is None


@pytest.mark.parametrize("victim", [0, 1, 2, 3])
def test_a_tensor_written_while_its_copy_ran_fails_the_snapshot_naming_it(victim):
    snap = _snap(_tensors(), torn=victim)
    snap._verify_cuda_copies()
    assert isinstance(snap.error, TornSnapshotError) and snap.error.keys == [f"t{victim}"]

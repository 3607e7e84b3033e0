"""Resharding reads the manifests of every saved rank: saved ranks that disagree about a tensor's
layout (which no consistent save writes) make the checkpoint corrupt, so restore skips it, instead
of leaving part of a destination unwritten."""

from __future__ import annotations

import pytest
import torch

from ckpt.errors import CorruptCheckpointError
from ckpt.format import ItemRecord, Manifest
from ckpt.integrity import checksum
from ckpt.reshard import load_resharded


def _rank(rank: int, world: int, rows: torch.Tensor, mesh: int, coord: int) -> tuple[Manifest, bytes]:
    data = rows.contiguous().numpy().tobytes()
    item = ItemRecord("w", "float32", list(rows.shape), "cpu", 0, len(data))
    layout = {"shape": [8, 1], "mesh": [mesh], "coord": [coord], "placements": ["S0"]}
    m = Manifest(
        step=1,
        rank=rank,
        world_size=world,
        data_bytes=len(data),
        chunk_bytes=4096,
        chunks=[checksum(data)],
        items=[item],
        tree={"w": {"$t": 0, "$dt": layout}},
    )
    return m, data


def test_saved_shards_that_overlap_and_leave_a_gap_are_corrupt_not_silently_loaded():
    full = torch.arange(8.0).reshape(8, 1)
    # rows 0-3 (a 2-way layout), rows 2-3 (4-way), row 2 and row 3 (8-way): 8 elements counted, rows 4-7 missing
    ranks = [
        _rank(0, 4, full[0:4], 2, 0),
        _rank(1, 4, full[2:4], 4, 1),
        _rank(2, 4, full[2:3], 8, 2),
        _rank(3, 4, full[3:4], 8, 3),
    ]
    manifests = [m for m, _ in ranks]
    dest = torch.full((8, 1), -1.0)
    with pytest.raises(CorruptCheckpointError, match="'w'.*disagree"):
        load_resharded(manifests, 0, [dest], {0: (((0, 0), (8, 1)), [8, 1])}, lambda r, m, i: ranks[r][1])


def test_consistent_saved_shards_consolidate():
    full = torch.arange(8.0).reshape(8, 1)
    ranks = [_rank(r, 2, full[4 * r : 4 * r + 4], 2, r) for r in range(2)]
    dest = torch.full((8, 1), -1.0)
    load_resharded(
        [m for m, _ in ranks], 0, [dest], {0: (((0, 0), (8, 1)), [8, 1])}, lambda r, m, i: ranks[r][1]
    )
    assert torch.equal(dest, full)

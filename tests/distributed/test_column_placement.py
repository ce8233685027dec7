"""ColumnPlacement: the received blocks put in place (and the gradient split back) exactly as the
concatenation in rank order followed by the column permutation, for strided runs and for the
index fallback of an irregular placement, and with a column-range copier (the native one and its
pure-torch twin) where it takes over."""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.comm_ops.placement import MAX_RUNS, ColumnPlacement, arithmetic_runs
from shardkit.kernels.column_copy import column_copier, copy_column_ranges_torch

# None: the strided copies and the index fallback; the twin; the native op where it is built
COPIERS = [None, copy_column_ranges_torch] + ([column_copier()] if column_copier() is not None else [])


def _reference_order(placement: ColumnPlacement):
    """Output column -> column of the rank-ordered concatenation."""
    w = placement.width
    source = [0] * (placement.blocks * w)
    start = 0
    for dest in placement.dest:
        for k, block in enumerate(dest):
            for c in range(w):
                source[block * w + c] = start + k * w + c
        start += len(dest) * w
    return torch.tensor(source)


@pytest.mark.parametrize(
    "width, dest",
    [
        (4, [[0, 2, 4], [1, 3, 5]]),  # round-robin tables: one strided run per rank
        (3, [[1, 2], [0], [3, 4, 5]]),  # three ranks, contiguous runs
        (2, [[], [1, 0, 2]]),  # a rank with nothing, a descending step
        # more runs than MAX_RUNS on rank 0: the index fallback
        (
            1,
            [
                list(range(0, 4 * (MAX_RUNS + 2), 4)) + [1],
                [b for b in range(4 * (MAX_RUNS + 2)) if b % 4 and b != 1],
            ],
        ),
    ],
)
@pytest.mark.parametrize("rows", [5, 0])
@pytest.mark.parametrize("copier", COPIERS)
def test_assemble_and_split_are_cat_and_permute(width, dest, rows, copier):
    placement = ColumnPlacement(width, dest, copier)
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(rows * len(d) * width, generator=gen) for d in dest]
    order = _reference_order(placement)
    expected = torch.cat([p.view(rows, len(d) * width) for p, d in zip(pieces, dest)], dim=1)[:, order]
    assert torch.equal(placement.assemble(pieces, rows), expected)
    grad = torch.randn(rows, placement.blocks * width, generator=gen)
    back = torch.empty_like(grad)
    back[:, order] = grad
    expected_chunks = back.split([len(d) * width for d in dest], dim=1)
    chunks = placement.split(grad)
    assert all(torch.equal(c, e) for c, e in zip(chunks, expected_chunks))
    # back to back in one buffer, so that the all-to-all sends them without a copy
    filled = [c for c in chunks if c.numel()]
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in filled[:-1]]
    assert [c.data_ptr() for c in filled[1:]] == ends


def test_runs_and_bad_placements():
    assert arithmetic_runs([0, 2, 4, 5, 6, 3]) == [(0, 3, 0, 2), (3, 2, 5, 1), (5, 1, 3, 1)]
    with pytest.raises(ValueError, match="every output block once"):
        ColumnPlacement(2, [[0, 1], [1]])


def test_the_copier_takes_the_placements_and_row_counts_it_moves_cheaper():
    copier = copy_column_ranges_torch
    # one strided run of 32 separate blocks per rank (round-robin tables): torch's strided copy past a
    # few rows (a memcpy per row and block against one op)
    round_robin = ColumnPlacement(8, [list(range(0, 64, 2)), list(range(1, 64, 2))], copier)
    assert round_robin.uses_copier(0, 8) and not round_robin.uses_copier(0, 256)
    # consecutive blocks merged into column ranges (source column, output column, columns): the copier
    consecutive = ColumnPlacement(2, [[2, 3, 4], [0, 1, 5]], copier)
    assert [r[0].tolist() for r in consecutive._ranges] == [[[0, 4, 6]], [[0, 0, 4], [4, 10, 2]]]
    assert all(consecutive.uses_copier(r, rows) for r in (0, 1) for rows in (1, 256, 2048))
    # a rank's lookup groups of two widths (the demo's rank 0: 4 runs, 5 ranges of 1-2 blocks): the
    # copier at the batches of training (strided: 2-4x as long in the micro-benchmark)
    groups = ColumnPlacement(16, [[0, 1, 4, 10, 2, 3, 11, 12], [5, 6, 7, 8, 9]], copier)
    assert all(groups.uses_copier(0, rows) for rows in (32, 256, 2048))
    # more runs than MAX_RUNS (the index fallback's case): the copier at any row count
    blocks = 6 * MAX_RUNS
    shuffled = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
    scattered, rest = shuffled[: blocks // 2], shuffled[blocks // 2 :]
    irregular = ColumnPlacement(1, [scattered, rest], copier)
    assert len(arithmetic_runs(scattered)) > MAX_RUNS and irregular.uses_copier(0, 1 << 20)
    # without a copier: never
    assert not ColumnPlacement(2, [[2, 3, 4], [0, 1, 5]]).uses_copier(0, 1)

"""KJTAllToAll + sequence lookup + SequenceEmbeddingsAllToAll against the single-process lookup.

Each rank sends its ids to their owners, the owners look up one row per id in a table every rank
holds a copy of, and the rows travel back: every rank must get ``table[its own ids]`` in the order of
its input, and the table's gradient (summed over ranks) must equal the single-process gradient
divided by the world size (gradient division).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.sharding.dist_data import KJTAllToAll, SequenceEmbeddingsAllToAll
from shardkit.testing import run_world
from tests.sharding._inputs import NUM_IDS, batches, build_kjt, input_rows, splits_for

DIM = 4


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ids(rows):
    return torch.tensor([v for k in rows for r in rows[k] for v in r], dtype=torch.int64)


def _permutation(n, rank):
    return torch.randperm(n, generator=torch.Generator().manual_seed(rank))


def _check(world, rank, splits, mode, pass_recat, unbucketize):
    inputs = [input_rows(s, batches(s, mode)) for s in range(world)]
    table = _randn((NUM_IDS, DIM), 3).requires_grad_()
    tensors_aw = KJTAllToAll(None, splits)(build_kjt(inputs[rank], mode)).wait()
    features = tensors_aw.wait()
    local_embs = table[features.values()]  # the lookup: one row per received id
    ids = _ids(inputs[rank])
    permute = _permutation(ids.numel(), rank) if unbucketize else None
    out = SequenceEmbeddingsAllToAll(None, splits)(
        local_embs,
        features.lengths(),
        tensors_aw.input_splits["values"],
        tensors_aw.output_splits["values"],
        unbucketize_permute_tensor=permute,
        batch_size_per_rank=tensors_aw.stride_per_rank,
        sparse_features_recat=tensors_aw.recat if pass_recat else None,
    ).wait()
    expected = table.detach()[ids]
    if permute is not None:
        expected = expected[permute]
    assert torch.equal(out, expected)
    # backward
    weights = [_randn((_ids(inputs[r]).numel(), DIM), 20 + r) for r in range(world)]
    (out * weights[rank]).sum().backward()
    grad = table.grad.clone() if table.grad is not None else torch.zeros_like(table)
    dist.all_reduce(grad)
    ref = torch.zeros_like(table)
    for r in range(world):
        w = weights[r]
        if unbucketize:  # out[j] is row permute[j]: its weight goes back to that row
            w = torch.empty_like(w).index_copy_(0, _permutation(w.size(0), r), w)
        ref.index_add_(0, _ids(inputs[r]), w)
    torch.testing.assert_close(grad, ref / world, rtol=1e-12, atol=1e-12)


def _worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    for splits in splits_for(world):
        for mode in ("equal", "uneven"):
            for pass_recat in (False, True):
                _check(world, rank, splits, mode, pass_recat, unbucketize=False)
    _check(world, rank, splits_for(world)[0], "uneven", True, unbucketize=True)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sequence_round_trip_against_single_process(world):
    assert all(run_world(_worker, world, timeout=90))


def test_features_per_rank_must_match_world():
    with pytest.raises(ValueError, match="entries for a group of 1"):
        SequenceEmbeddingsAllToAll(None, [1, 2])

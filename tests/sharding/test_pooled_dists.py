"""Pooled output dists against the single-process computation on the same global data.

Every rank builds all ranks' inputs from fixed seeds. Forward: a rank's output must equal plain torch
on the global data. Backward: rank ``r`` weights its output by a fixed random tensor ``C_r``; the
reference sums every rank's weighted output, differentiates with respect to every rank's input, and
rank ``r``'s input gradient must equal the reference's divided by the world size (gradient division).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.sharding.dist_data import (
    KJTAllToAll,
    PermutePooledEmbeddings,
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter,
    VariableBatchPooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
)
from shardkit.testing import run_world
from tests.sharding._inputs import BATCH, KEYS, NUM_IDS, batches, build_kjt, input_rows, splits_for

DIM = 3


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def _check_grads(world, rank, local_input, local_out, ref_inputs, ref_outs, seed):
    """Backward of ``sum_r (out_r * C_r)`` on this rank vs the reference over all ranks."""
    weights = [_randn(out.shape, seed + r) for r, out in enumerate(ref_outs)]
    (local_out * weights[rank]).sum().backward()
    sum((out * w).sum() for out, w in zip(ref_outs, weights)).backward()
    _close(local_input.grad, ref_inputs[rank].grad / world)


# --------------------------------------------------------------------------------------------------
# table-wise style: features to their owners, pooled lookup there, pooled all-to-all back


def _pooled_lookup(table, ids, lengths):
    """Sum-pooled rows of ``table`` for each bag: ``[len(lengths), D]``."""
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]]).to(torch.int64)
    return F.embedding_bag(ids, table, offsets, mode="sum")


def _reference_pooled(table, rows, keys):
    """``[B, len(keys) * D]``: the pooled rows of ``rows`` for ``keys``, side by side."""
    cols = []
    for k in keys:
        ids = torch.tensor([v for r in rows[k] for v in r], dtype=torch.int64)
        lengths = torch.tensor([len(r) for r in rows[k]], dtype=torch.int64)
        cols.append(_pooled_lookup(table, ids, lengths))
    return torch.cat(cols, dim=1)


def _check_table_wise(world, rank, splits, mode):
    inputs = [input_rows(s, batches(s, mode)) for s in range(world)]
    table = _randn((NUM_IDS, DIM), 7).requires_grad_()
    tensors_aw = KJTAllToAll(None, splits)(build_kjt(inputs[rank], mode)).wait()
    features = tensors_aw.wait()
    # the lookup: one [sum(B), D] block per local feature, side by side
    blocks = [_pooled_lookup(table, jt.values(), jt.lengths()) for jt in features.to_dict().values()]
    total_batch = sum(tensors_aw.stride_per_rank)
    # a rank without features still takes part in the backward all-to-all, so its (empty) output
    # must require grad like everybody else's
    local_embs = torch.cat(blocks, dim=1) if blocks else table.new_zeros(total_batch, 0).requires_grad_()
    permute = list(reversed(range(len(KEYS))))
    dist_ = PooledEmbeddingsAllToAll(
        None, [n * DIM for n in splits], callbacks=[PermutePooledEmbeddings([DIM] * len(KEYS), permute)]
    )
    out = dist_(local_embs, tensors_aw.stride_per_rank).wait()
    ref_table = table.detach().clone().requires_grad_()
    ref_outs = [_reference_pooled(ref_table, inputs[r], [KEYS[p] for p in permute]) for r in range(world)]
    _close(out, ref_outs[rank])
    weights = [_randn(o.shape, 40 + r) for r, o in enumerate(ref_outs)]
    (out * weights[rank]).sum().backward()
    sum((o * w).sum() for o, w in zip(ref_outs, weights)).backward()
    grad = table.grad.clone() if table.grad is not None else torch.zeros_like(table)
    dist.all_reduce(grad)  # each rank holds the gradient of the rows its features looked up
    _close(grad, ref_table.grad / world)


def _check_all_to_all_sizes(world, rank):
    """Plain pooled all-to-all with uneven batch sizes and dims, and the default equal batches."""
    dims = [1 + (s % 3) for s in range(world)]
    for batch in (BATCH[:world], [2] * world):
        leaves = [_randn((sum(batch), dims[s]), 60 + s).requires_grad_() for s in range(world)]
        x = leaves[rank].detach().clone().requires_grad_()
        per_rank = batch if batch != [2] * world else None
        out = PooledEmbeddingsAllToAll(None, dims)(x, per_rank).wait()
        full = torch.cat(leaves, dim=1)
        starts = [sum(batch[:r]) for r in range(world)]
        ref_outs = [full[starts[r] : starts[r] + batch[r]] for r in range(world)]
        _close(out, ref_outs[rank])
        _check_grads(world, rank, x, out, leaves, ref_outs, 70)


# --------------------------------------------------------------------------------------------------
# row-wise style: reduce-scatter; and the all-gather


def _check_reduce_scatter(world, rank):
    for splits in ([2] * world, BATCH[:world]):
        leaves = [_randn((sum(splits), DIM), 80 + s).requires_grad_() for s in range(world)]
        x = leaves[rank].detach().clone().requires_grad_()
        out = PooledEmbeddingsReduceScatter(None)(x, splits if len(set(splits)) > 1 else None).wait()
        total = sum(leaves)
        starts = [sum(splits[:r]) for r in range(world)]
        ref_outs = [total[starts[r] : starts[r] + splits[r]] for r in range(world)]
        _close(out, ref_outs[rank])
        _check_grads(world, rank, x, out, leaves, ref_outs, 90)


def _check_all_gather(world, rank):
    leaves = [_randn((2, DIM), 100 + s).requires_grad_() for s in range(world)]
    x = leaves[rank].detach().clone().requires_grad_()
    out = PooledEmbeddingsAllGather(None)(x).wait()
    ref = torch.cat(leaves)
    _close(out, ref)
    _check_grads(world, rank, x, out, leaves, [ref] * world, 110)


# --------------------------------------------------------------------------------------------------
# variable batch size per feature


FEATURE_DIMS = [[2], [3, 3], [1, 2], [4]]  # dims of each rank's features; W=2 is the spec's example


def _variable_batch_table(world):
    """batch[r][g]: rank r's batch size of global feature g (features in rank order)."""
    if world == 2:  # the specification's example
        return [[2, 1, 3], [1, 2, 2]]
    num = sum(len(d) for d in FEATURE_DIMS[:world])
    gen = torch.Generator().manual_seed(120)
    return torch.randint(0, 4, (world, num), generator=gen).tolist()


def _check_variable_batch_all_to_all(world, rank):
    dims = FEATURE_DIMS[:world]
    batch = _variable_batch_table(world)
    owner_start = [sum(len(d) for d in dims[:s]) for s in range(world)]

    def blocks(s):
        """Elements of rank s's input for each destination rank."""
        own = range(owner_start[s], owner_start[s] + len(dims[s]))
        return [sum(batch[r][g] * dims[s][g - owner_start[s]] for g in own) for r in range(world)]

    leaves = [_randn(sum(blocks(s)), 130 + s).requires_grad_() for s in range(world)]
    x = leaves[rank].detach().clone().requires_grad_()
    own = range(owner_start[rank], owner_start[rank] + len(dims[rank]))
    per_rank_per_feature = [[batch[r][g] for g in own] for r in range(world)]
    out = VariableBatchPooledEmbeddingsAllToAll(None, dims)(x, per_rank_per_feature, batch[rank]).wait()
    if world == 2:
        assert out.shape == ((16,) if rank == 0 else (14,))  # the sizes the specification prints

    def piece(s, r):
        start = sum(blocks(s)[:r])
        return leaves[s][start : start + blocks(s)[r]]

    ref_outs = [torch.cat([piece(s, r) for s in range(world)]) for r in range(world)]
    _close(out, ref_outs[rank])
    _check_grads(world, rank, x, out, leaves, ref_outs, 140)


def _check_variable_batch_reduce_scatter(world, rank):
    dims = [2, 1, 3]
    batch = torch.randint(0, 4, (world, len(dims)), generator=torch.Generator().manual_seed(150)).tolist()
    block = [sum(b * d for b, d in zip(batch[r], dims)) for r in range(world)]
    leaves = [_randn(sum(block), 160 + s).requires_grad_() for s in range(world)]
    x = leaves[rank].detach().clone().requires_grad_()
    out = VariableBatchPooledEmbeddingsReduceScatter(None)(x, batch, dims).wait()
    total = sum(leaves)
    starts = [sum(block[:r]) for r in range(world)]
    ref_outs = [total[starts[r] : starts[r] + block[r]] for r in range(world)]
    _close(out, ref_outs[rank])
    _check_grads(world, rank, x, out, leaves, ref_outs, 170)


# --------------------------------------------------------------------------------------------------
# bad input


def _check_bad_input(world, rank):
    x = _randn((2 * world, 2), 180)
    # a rank whose dims disagree with the others' view: the comm op reports it on every rank
    dims = [2] * world if rank != 0 else [2] * (world - 1) + [3]
    with pytest.raises(ValueError):
        PooledEmbeddingsAllToAll(None, dims)(x).wait()
    with pytest.raises(ValueError):
        PooledEmbeddingsReduceScatter(None)(x if rank else x[:-1]).wait()


def _worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    for splits in splits_for(world):
        for mode in ("equal", "uneven"):
            _check_table_wise(world, rank, splits, mode)
    _check_all_to_all_sizes(world, rank)
    _check_reduce_scatter(world, rank)
    _check_all_gather(world, rank)
    _check_variable_batch_all_to_all(world, rank)
    _check_variable_batch_reduce_scatter(world, rank)
    if world > 1:
        _check_bad_input(world, rank)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pooled_dists_against_single_process(world):
    assert all(run_world(_worker, world, timeout=90))

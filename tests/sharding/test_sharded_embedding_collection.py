"""ShardedEmbeddingCollection equals the unsharded EmbeddingCollection on the global batch.

One ``run_world`` per world size checks every sharding type at once (one table per type, tables of
different widths so the sequence dists pad), with and without weights on the input (carried, unused),
SGD (with a data-parallel table) and Adagrad, and a variable batch per feature: each feature's rows,
and every shard's weights after fused optimizer steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingCollection, EmbeddingConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)


def _module(optimizer: OptimType, with_dp: bool) -> EmbeddingCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(rows, dim, name=name, feature_names=feats)
        for name, rows, dim, feats, _ in case.TABLES
        if with_dp or name != "t_dp"
    ]
    return EmbeddingCollection(
        tables, need_indices=True, fused_optimizer=FusedOptimizerConfig(optimizer, lr=case.LR)
    )


def _check_exact(optimizer: OptimType, weighted: bool) -> None:
    rank, world_size, local_size = case.world()
    with_dp = optimizer is OptimType.SGD
    reference = _module(optimizer, with_dp)
    plan = construct_module_sharding_plan(
        reference, case.plan_generators(world_size, local_size, with_dp), local_size, world_size
    )
    sharded = EmbeddingCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    features = [(f, rows) for t, rows, _, feats, _ in case.TABLES if with_dp or t != "t_dp" for f in feats]
    for step in range(case.STEPS):
        global_kjt, local_kjt, _ = case.global_and_local(step, rank, world_size, features, weighted)
        expected = reference(global_kjt)
        per_rank = [case.batch_rows(step, r, features) for r in range(world_size)]
        loss = 0
        grads = {}
        for name, jt in expected.items():
            gen = torch.Generator().manual_seed(100 * step + len(grads))
            grads[name] = torch.randn(jt.values().shape, generator=gen)
            loss = loss + (jt.values() * grads[name]).sum()
        (loss / world_size).backward()
        out = sharded(local_kjt)
        assert list(out.keys()) == list(expected.keys())
        loss = 0
        for name, jt in expected.items():
            counts = [sum(len(b) for b in per_rank[r][name]) for r in range(world_size)]
            mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
            torch.testing.assert_close(out[name].values(), jt.values()[mine].detach(), **TOL)
            torch.testing.assert_close(out[name].weights(), local_kjt[name].values())
            torch.testing.assert_close(out[name].lengths(), local_kjt[name].lengths())
            loss = loss + (out[name].values() * grads[name][mine]).sum()
        loss.backward()
        case.average_dense_gradients_(sharded, world_size)
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)


def _check_variable_batch() -> None:
    """A variable batch per feature, every sharding type: rows per id do not depend on the batch."""
    rank, world_size, local_size = case.world()
    reference = _module(OptimType.SGD, True)
    plan = construct_module_sharding_plan(
        reference, case.plan_generators(world_size, local_size, True), local_size, world_size
    )
    sharded = EmbeddingCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    features = [(f, rows) for _, rows, _, feats, _ in case.TABLES for f in feats]
    for step in range(case.STEPS):
        global_kjt, local_kjt, _ = case.variable_batch(step, rank, world_size, features)
        expected = reference(global_kjt)
        out = sharded(local_kjt)
        loss, expected_loss = 0, 0
        for i, (name, jt) in enumerate(expected.items()):
            bags = global_kjt.stride_per_key_per_rank()[global_kjt.keys().index(name)]
            lengths = jt.lengths().tolist()
            start = sum(lengths[: sum(bags[:rank])])
            mine = slice(start, start + sum(lengths[sum(bags[:rank]) : sum(bags[: rank + 1])]))
            torch.testing.assert_close(out[name].values(), jt.values()[mine].detach(), **TOL)
            grad = torch.randn(jt.values().shape, generator=torch.Generator().manual_seed(10 * step + i))
            expected_loss = expected_loss + (jt.values() * grad).sum()
            loss = loss + (out[name].values() * grad[mine]).sum()
        (expected_loss / world_size).backward()
        loss.backward()
        case.average_dense_gradients_(sharded, world_size)
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)


def _exactness_worker() -> bool:
    for optimizer in (OptimType.SGD, OptimType.ADAGRAD):
        for weighted in (False, True):
            _check_exact(optimizer, weighted)
    _check_variable_batch()
    return True


@pytest.mark.parametrize("world_size, local_size", [(1, None), (2, None), (3, None), (4, 2)])
def test_every_sharding_type_matches_unsharded(world_size, local_size):
    assert all(run_world(_exactness_worker, world_size, local_world_size=local_size))

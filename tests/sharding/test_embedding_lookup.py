"""A sharded lookup of tables of several widths: its groups from one autograd node
(``modules.fused_groups``) give what each group alone gives, bit for bit, and what the unsharded
module gives on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch

import shardkit.sharding.embedding_lookup as embedding_lookup
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, PoolingType
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)
WIDTHS = (4, 6, 8)


def _tables():
    """(name, rows, dim, pooling): three widths of each sharding type, SUM and MEAN."""
    tables = []
    for kind in ("tw", "rw", "cw"):
        for i, dim in enumerate(WIDTHS):
            pooling = PoolingType.MEAN if i == 1 else PoolingType.SUM
            tables.append((f"{kind}{i}", 11 + 2 * i, dim * (2 if kind == "cw" else 1), pooling))
    return tables


def _module(optimizer: str) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=[f"f_{name}"], pooling=pooling)
        for name, rows, dim, pooling in _tables()
    ]
    return EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig(optimizer, lr=case.LR))


def _generators(world_size: int):
    kinds = {
        "tw": lambda: table_wise(rank=0),  # three widths on rank 0: three groups there
        "rw": row_wise,  # a block of each table on every rank: three groups on each
        "cw": lambda: column_wise(ranks=[0, world_size - 1]),
    }
    return {name: kinds[name[:2]]() for name, *_ in _tables()}


def _worker(empty) -> int:
    rank, world_size, local_size = case.world()
    features = [(f"f_{name}", rows) for name, rows, *_ in _tables()]
    real = embedding_lookup.lookup_pooled_groups
    fused_calls = []

    def counted(*args):
        out = real(*args)
        fused_calls.append(out is not None)
        return out

    embedding_lookup.lookup_pooled_groups = counted
    try:
        # not row-wise Adagrad: its per-row accumulator is per column block under column-wise sharding
        # (docs/sharding.md), so the column-wise tables would differ from the unsharded module's
        for optimizer in ("SGD", "ADAGRAD", "ADAM"):
            reference = _module(optimizer)
            plan = construct_module_sharding_plan(reference, _generators(world_size), local_size, world_size)
            env = ShardingEnv.from_process_group(None)
            fused = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
            alone = EmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
            for step in range(case.STEPS):
                global_kjt, local_kjt, batch = case.global_and_local(
                    step, rank, world_size, features, False, empty
                )
                expected = reference(global_kjt)
                grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
                (expected.values() * grad).sum().div(world_size).backward()
                mine = case.my_rows(rank, batch)
                embedding_lookup.lookup_pooled_groups = lambda *args: None
                try:
                    out_alone = alone(local_kjt)
                    (out_alone.values() * grad[mine]).sum().backward()
                finally:
                    embedding_lookup.lookup_pooled_groups = counted
                out = fused(local_kjt)
                (out.values() * grad[mine]).sum().backward()
                assert torch.equal(out.values(), out_alone.values())
                torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **TOL)
            theirs = alone.local_shards()
            for key, weight in fused.local_shards().items():
                assert torch.equal(weight, theirs[key]), key
                name, r0, r1, c0, c1 = key
                torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)
    finally:
        embedding_lookup.lookup_pooled_groups = real
    return sum(fused_calls)


@pytest.mark.parametrize("world_size, empty", [(2, ()), (2, (1,)), (3, (0,))])
def test_groups_from_one_node_train_as_each_group_alone(world_size, empty):
    calls = run_world(_worker, world_size, empty)
    # every rank holds a row block of each of the three row-wise widths: one fused call a step at least
    assert all(c >= 3 * case.STEPS for c in calls), calls

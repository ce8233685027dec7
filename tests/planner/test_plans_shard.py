"""Planned plans are plans the sharded modules accept: the real EmbeddingBagCollection sharder shards a
collection by the planner's plan, and its forward equals the unsharded module's.

Each rank builds the same collection from one seed, plans collectively (free choice, then every
sharding type forced in turn), shards, and compares its output with the unsharded module on its own
batch.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from shardkit.sharding import embeddingbag
from shardkit.sharding.types import ShardingEnv
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

# 13 and 7 rows split unevenly; with min_partition 16, 64 columns make up to 4 column shards, 32 two
SHAPES = [(13, 64), (7, 64), (100, 64), (50, 32)]
BATCH = 3


def _collection() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
        for i, (n, d) in enumerate(SHAPES)
    ]
    return EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(OptimType.SGD))


def _batch(rank: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(100 + rank)
    lengths = torch.randint(0, 3, (len(SHAPES) * BATCH,), generator=gen)
    ids = [
        torch.randint(0, SHAPES[k][0], (int(n),), generator=gen)
        for k in range(len(SHAPES))
        for n in lengths[k * BATCH : (k + 1) * BATCH]
    ]
    return KeyedJaggedTensor.from_lengths_sync([f"f{k}" for k in range(len(SHAPES))], torch.cat(ids), lengths)


def _shard_by_plans(world: int, local: int, forced_types):
    env = ShardingEnv.from_process_group(None)
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=local)
    outcomes = []
    for forced in forced_types:
        ebc = _collection()
        names = [c.name for c in ebc.embedding_bag_configs()]
        constraints = (
            None
            if forced is None
            else {n: ParameterConstraints(sharding_types=[forced], min_partition=16) for n in names}
        )
        sharder = embeddingbag.EmbeddingBagCollectionSharder()
        plan = EmbeddingShardingPlanner(topology, constraints=constraints).collective_plan(ebc, [sharder])
        sharded = sharder.shard(ebc, plan.plan[""], env)
        with torch.no_grad():
            expected = ebc(_batch(env.rank)).values()
            actual = sharded(_batch(env.rank)).values()
        types = sorted({ps.sharding_type for ps in plan.plan[""].values()})
        outcomes.append((forced, types, torch.allclose(actual, expected, atol=1e-6)))
    return outcomes


@pytest.mark.parametrize(
    "world, local, forced_types",
    [
        (2, 2, [None, "data_parallel", "table_wise", "row_wise", "column_wise"]),
        (4, 2, ["table_row_wise", "table_column_wise", "grid_shard"]),
        (3, 3, ["row_wise", "column_wise"]),
    ],
)
def test_planned_plans_shard_and_match_the_unsharded_module(world, local, forced_types):
    for rank_outcomes in run_world(_shard_by_plans, world, world, local, forced_types, timeout=120):
        for forced, types, equal in rank_outcomes:
            assert forced is None or types == [forced]
            assert equal, (forced, types)

"""The optimizer a sharder's ``fused_params`` asks for is the one that trains the tables (issue 23).

Before, small tables were planned data-parallel with the DENSE kernel, which leaves them to the
model's dense optimizer: a program asking for fused ADAM and one asking for ADAGRAD trained the same
way (torchrec's bert4rec example, ported). Now a DENSE table is planned only where the constraints
name it, and a data-parallel table gets the FUSED kernel, which applies the fused optimizer to the
all-reduced gradient.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.types import EmbeddingComputeKernel, ShardingEnv, ShardingType
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

SHAPES = [(6, 4), (9, 8)]  # small tables: the cheapest plan for them was data-parallel
LR = 0.05
STEPS = 3


def _collection(optimizer=None) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
        for i, (n, d) in enumerate(SHAPES)
    ]
    fused = None if optimizer is None else FusedOptimizerConfig(optimizer, lr=LR)
    return EmbeddingBagCollection(tables, fused_optimizer=fused)


def _batch(step: int, rank: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 3, (len(SHAPES) * 2,), generator=gen)
    ids = [
        torch.randint(0, SHAPES[k][0], (int(n),), generator=gen)
        for k in range(len(SHAPES))
        for n in lengths[2 * k : 2 * k + 2]
    ]
    return KeyedJaggedTensor.from_lengths_sync([f"f{k}" for k in range(len(SHAPES))], torch.cat(ids), lengths)


def _global_batch(step: int, world: int) -> KeyedJaggedTensor:
    per_rank = [_batch(step, r).to_dict() for r in range(world)]
    keys = [f"f{k}" for k in range(len(SHAPES))]
    values = torch.cat([p[k].values() for k in keys for p in per_rank])
    lengths = torch.cat([p[k].lengths() for k in keys for p in per_rank])
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)


def _plan(optimizer_name: str, world: int, constraints=None):
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": optimizer_name, "learning_rate": LR})
    topology = Topology(world_size=world, compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology, constraints=constraints).plan(_collection(), [sharder])
    return plan.plan[""]


@pytest.mark.parametrize("optimizer", ["ADAM", "ADAGRAD", "SGD", "ROWWISE_ADAGRAD"])
def test_the_planner_gives_fused_params_tables_a_fused_kernel(optimizer):
    # data-parallel included: its FUSED kernel applies the optimizer to the all-reduced gradient
    for name, ps in _plan(optimizer, 2).items():
        assert ps.compute_kernel == EmbeddingComputeKernel.FUSED.value, (name, ps.sharding_type)


def test_data_parallel_still_plans_where_the_constraints_name_it():
    dp = ShardingType.DATA_PARALLEL.value
    constraints = {f"t{i}": ParameterConstraints(sharding_types=[dp]) for i in range(len(SHAPES))}
    plan = _plan("ADAM", 2, constraints)
    assert {ps.sharding_type for ps in plan.values()} == {dp}


def _train(optimizer_name: str):
    """Plan with the sharder's fused_params, shard, train STEPS steps with no dense optimizer; return
    the sharded tables and the unsharded module trained on the global batch with the same optimizer."""
    env = ShardingEnv.from_process_group(None)
    world, rank = env.world_size, env.rank
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": optimizer_name, "learning_rate": LR})
    module = _collection()
    plan = EmbeddingShardingPlanner(Topology(world_size=world, compute_device="cpu")).collective_plan(
        module, [sharder]
    )
    sharded = sharder.shard(module, plan.plan[""], env)
    reference = _collection(OptimType(optimizer_name))
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        grad = torch.randn(2 * world, sum(d for _, d in SHAPES), generator=gen)
        reference(_global_batch(step, world)).values().mul(grad).sum().div(world).backward()
        sharded(_batch(step, rank)).values().mul(grad[2 * rank : 2 * rank + 2]).sum().backward()
    got = {f"t{i}": sharded.full_table(f"t{i}") for i in range(len(SHAPES))}
    want = {k[len("embedding_bags.") : -len(".weight")]: v for k, v in reference.state_dict().items()}
    return [name for name in got if not torch.allclose(got[name], want[name], atol=1e-5, rtol=1e-5)]


@pytest.mark.parametrize("optimizer", ["ADAM", "ADAGRAD"])
def test_a_planned_collection_trains_with_the_fused_params_optimizer(optimizer):
    # before the rule the tables were data-parallel and did not move (no dense optimizer here)
    for mismatched in run_world(_train, 2, optimizer, timeout=120):
        assert mismatched == []

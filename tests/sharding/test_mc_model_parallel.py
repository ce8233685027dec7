"""An MC-EBC inside a model under DistributedModelParallel with a planned sharding (MC tables planned
with their slot count) trains like its unsharded equivalent, and the sparse-dist train pipeline gives
the plain loop's outputs and weights (2 ranks, one launch)."""

from __future__ import annotations

import copy
import random

import torch
from torch import nn

from shardkit.datasets import Batch
from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel
from shardkit.modules import (
    DistanceLFU_EvictionPolicy,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
    OptimType,
)
from shardkit.pipeline import TrainPipelineSparseDist
from shardkit.sharding.mc_embeddingbag import ShardedManagedCollisionEmbeddingBagCollection
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)
LR = 0.05
STEPS = 6


class MCModel(nn.Module):
    """An MC-EBC of two raw-id features and a linear head; forward(batch) -> (loss, logits)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(32, 4, name="users", feature_names=["user"]),
            EmbeddingBagConfig(16, 4, name="item_table", feature_names=["item"]),
        ]
        modules = {
            "users": MCHManagedCollisionModule(32, None, LFU_EvictionPolicy(), 1, buckets=4, name="users"),
            "item_table": MCHManagedCollisionModule(
                16, None, DistanceLFU_EvictionPolicy(), 2, buckets=4, name="item_table"
            ),
        }
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(OptimType.ADAGRAD, lr=LR)),
            ManagedCollisionCollection(modules, tables),
        )
        self.head = nn.Linear(8 + 2, 1)

    def forward(self, batch: Batch):
        pooled = self.mc(batch.sparse_features)[0]
        logits = self.head(torch.cat([pooled.values(), batch.dense_features], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def rank_batch(step: int, rank: int) -> Batch:
    rng = random.Random(97 * step + rank)
    users = [rng.randrange(2**63 - 1) for _ in range(50)]
    items = [rng.randrange(2**62) for _ in range(20)]
    size = 3  # equal batches: the mean loss of each rank averages to the global mean
    bags = {
        "user": [[rng.choice(users[: 10 + step])] for _ in range(size)],
        "item": [[rng.choice(items) for _ in range(rng.randrange(0, 3))] for _ in range(size)],
    }
    gen = torch.Generator().manual_seed(step * 10 + rank)
    return Batch(
        torch.randn(size, 2, generator=gen),
        case.to_kjt(bags),
        torch.randint(0, 2, (size,), generator=gen).float(),
    )


def global_batch(step: int, world_size: int) -> Batch:
    parts = [rank_batch(step, r) for r in range(world_size)]
    keys = parts[0].sparse_features.keys()
    bags = {k: [] for k in keys}
    for part in parts:
        for k in keys:
            jt = part.sparse_features[k]
            values, lengths = jt.values().tolist(), jt.lengths().tolist()
            start = 0
            for n in lengths:
                bags[k].append(values[start : start + n])
                start += n
    return Batch(
        torch.cat([p.dense_features for p in parts]), case.to_kjt(bags), torch.cat([p.labels for p in parts])
    )


def dmp_and_optimizer(model: MCModel):
    dmp = DistributedModelParallel(copy.deepcopy(model))
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=LR)
    return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])


def _worker() -> bool:
    rank, world_size, _ = case.world()
    reference = MCModel()
    dmp, optimizer = dmp_and_optimizer(reference)
    assert isinstance(dmp.module.mc, ShardedManagedCollisionEmbeddingBagCollection)
    plan = dmp.plan.get_plan_for_module("mc")
    assert {ps.sharding_type for ps in plan.values()} <= {"row_wise", "table_wise", "column_wise"}
    for name, rows in (("users", 32), ("item_table", 16)):
        assert (
            sum(s.shard_sizes[0] for s in plan[name].sharding_spec.shards if s.shard_offsets[1] == 0) == rows
        )
    dense_ref = torch.optim.SGD(reference.head.parameters(), lr=LR)
    mine = case.my_rows(rank, [3] * world_size)
    plain_logits = []
    for step in range(STEPS):
        loss_ref, logits_ref = reference(global_batch(step, world_size))
        dense_ref.zero_grad()
        loss_ref.backward()
        dense_ref.step()
        optimizer.zero_grad()
        loss, logits = dmp(rank_batch(step, rank))
        loss.backward()
        optimizer.step()
        torch.testing.assert_close(
            logits,
            logits_ref[mine],
            **TOL,
            msg=f"step {step} plan {[(n, p.sharding_type) for n, p in plan.items()]}",
        )
        plain_logits.append(logits)
    torch.testing.assert_close(dmp.module.head.weight, reference.head.weight, **TOL)
    pipelined_model = MCModel()
    pipe_dmp, pipe_optimizer = dmp_and_optimizer(pipelined_model)
    pipeline = TrainPipelineSparseDist(pipe_dmp, pipe_optimizer, torch.device("cpu"))
    assert pipeline.pipelined_modules == ["mc"]
    data = iter([rank_batch(step, rank) for step in range(STEPS)])
    for step in range(STEPS):
        torch.testing.assert_close(pipeline.progress(data), plain_logits[step], **TOL)
    for (key, got), want in zip(
        pipe_dmp.module.mc._embedding_module.local_shards().items(),
        dmp.module.mc._embedding_module.local_shards().values(),
    ):
        torch.testing.assert_close(got, want, **TOL, msg=str(key))
    return True


def test_mc_model_under_dmp_planner_and_pipeline():
    assert all(run_world(_worker, 2))

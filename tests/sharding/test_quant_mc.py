"""Quantized managed-collision collections (EC and EBC): from_float keeps the trained slots, serving never
evicts, and the sharded forms (table-, row-, column-wise) equal the unsharded ones at worlds 1-3."""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    OptimType,
)
from shardkit.quant.mc_modules import (
    QuantManagedCollisionEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from shardkit.sharding.quant_mc_embedding import (
    QuantManagedCollisionEmbeddingBagCollectionSharder,
    QuantManagedCollisionEmbeddingCollectionSharder,
)
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

ROWS, DIM, SPACE = 18, 8, 1000  # slots per table (divisible by 1-3 buckets), dim, raw id space


def _kjt(seed: int, batch: int, keys=("a", "b")) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, SPACE, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(list(keys), values, lengths=lengths)


def _trained(pooled: bool, buckets: int = 1):
    """A float MC module trained a few steps (its maps hold slots, some evicted and reused)."""
    torch.manual_seed(0)
    config_type = EmbeddingBagConfig if pooled else EmbeddingConfig
    tables = [config_type(ROWS, DIM, name=f"t_{k}", feature_names=[k]) for k in ("a", "b")]
    mcc = ManagedCollisionCollection(
        {
            t.name: MCHManagedCollisionModule(
                zch_size=ROWS,
                device=torch.device("cpu"),
                eviction_policy=LFU_EvictionPolicy(),
                eviction_interval=2,
                input_hash_size=SPACE,
                buckets=buckets,
            )
            for t in tables
        },
        tables,
    )
    fused = FusedOptimizerConfig(OptimType.SGD, lr=0.1)
    if pooled:
        module = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables, fused_optimizer=fused), mcc
        )
    else:
        module = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables, fused_optimizer=fused), mcc)
    for step in range(6):
        out, _ = module(_kjt(step, 6))
        values = out.values() if pooled else torch.cat([jt.values() for jt in out.values()])
        values.sum().backward()
    return module.eval()


def _values(out, pooled: bool):
    return out.values() if pooled else {k: jt.values() for k, jt in out.items()}


@pytest.mark.parametrize("pooled", [True, False], ids=["ebc", "ec"])
def test_quantized_mc_serves_the_trained_slots_without_evicting(pooled):
    trained = _trained(pooled)
    quant_type = (
        QuantManagedCollisionEmbeddingBagCollection if pooled else QuantManagedCollisionEmbeddingCollection
    )
    served = quant_type.from_float(trained)
    served.train()  # asked to train: the MC collection stays in eval
    maps = copy.deepcopy(served._managed_collision_collection.state_dict())
    for seed in range(10, 14):
        kjt = _kjt(seed, 5)
        remapped = trained._managed_collision_collection(kjt)
        want = trained._embedding_module(remapped)
        got = served(kjt)
        if pooled:
            torch.testing.assert_close(got.values(), want.values(), atol=0.02, rtol=0)  # int8 rounding
        else:
            for key in want:
                torch.testing.assert_close(got[key].values(), want[key].values(), atol=0.02, rtol=0)
    after = served._managed_collision_collection.state_dict()
    for key, value in maps.items():  # tensors, or tuples of tensors (the eviction windows)
        pairs = zip(after[key], value) if isinstance(value, tuple) else [(after[key], value)]
        assert all(torch.equal(a, b) for a, b in pairs), key


def _sharded_worker(pooled: bool) -> bool:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    trained = _trained(pooled, buckets=world_size)  # row-wise MC: one bucket per rank
    quant_type = (
        QuantManagedCollisionEmbeddingBagCollection if pooled else QuantManagedCollisionEmbeddingCollection
    )
    sharder_type = (
        QuantManagedCollisionEmbeddingBagCollectionSharder
        if pooled
        else QuantManagedCollisionEmbeddingCollectionSharder
    )
    reference = quant_type.from_float(trained)
    gens = {
        "t_a": row_wise(compute_kernel="quant"),
        "t_b": table_wise(rank=world_size - 1, compute_kernel="quant"),
    }
    if world_size > 1:
        gens["t_b"] = column_wise(ranks=[0, world_size - 1], compute_kernel="quant")
    plan = construct_module_sharding_plan(reference, gens, sharder=sharder_type(), world_size=world_size)
    sharded = sharder_type().shard(copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None))
    for seed in range(20, 23):  # serving is per sample (no eviction): each rank's batch has its reference
        batches = [_kjt(seed * 10 + r, 2 + r) for r in range(world_size)]
        want_parts = [_values(reference(b), pooled) for b in batches]
        got = _values(sharded(batches[rank]), pooled)
        if pooled:
            torch.testing.assert_close(got, want_parts[rank], rtol=1e-5, atol=1e-6)
        else:
            for key in got:
                assert torch.equal(got[key], want_parts[rank][key]), key
    return True


@pytest.mark.parametrize("pooled", [True, False], ids=["ebc", "ec"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_sharded_quantized_mc_equals_unsharded(world_size, pooled):
    assert all(run_world(_sharded_worker, world_size, pooled))

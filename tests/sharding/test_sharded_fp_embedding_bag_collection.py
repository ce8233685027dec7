"""Position-weighted features, sharded every way, equal the unsharded FeatureProcessedEmbeddingBagCollection.

Forward values, table weights after fused steps, the position weights' gradient (the sum over
ranks of each rank's part) and the input weights' gradient match the unsharded module on the global
batch. Bags longer than ``max_feature_length`` fail on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FeatureProcessedEmbeddingBagCollection,
    FusedOptimizerConfig,
    OptimType,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from shardkit.sharding.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, grid_shard
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)
PROCESSED = [
    "f_tw",
    "f_cw1",
    "f_rw",
    "f_rw_small",
    "f_dp",
    "f_twrw",
    "f_twcw",
]  # f_cw2 and f_tw2 keep their weights


def _module(collection: bool = False) -> FeatureProcessedEmbeddingBagCollection:
    """Position weights per feature (a dict), or torchrec's ``PositionWeightedModuleCollection`` (whose
    unprocessed features weigh 1 instead of keeping their input weights)."""
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=feats, pooling=pooling)
        for name, rows, dim, feats, pooling in case.TABLES
    ]
    ebc = EmbeddingBagCollection(
        tables, is_weighted=True, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=case.LR)
    )
    processors = (
        PositionWeightedModuleCollection({f: 4 for f in PROCESSED})
        if collection
        else {f: PositionWeightedModule(4) for f in PROCESSED}
    )
    module = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    for f in PROCESSED:
        with torch.no_grad():
            _position_weight(module, f).uniform_(0.5, 1.5)
    return module


def _position_weight(module, feature: str) -> torch.Tensor:
    processors = (
        module.feature_processors if hasattr(module, "feature_processors") else module._feature_processors
    )
    if isinstance(processors, PositionWeightedModuleCollection):
        return processors.position_weights[feature]
    return processors[feature].position_weight


def _worker() -> bool:
    for collection in (False, True):
        _check(collection)
    return True


def _check(collection: bool) -> None:
    rank, world_size, local_size = case.world()
    reference = _module(collection)
    generators = case.plan_generators(world_size, local_size, True)
    if collection:  # the second pass grid-shards f_twrw's table: a column block per node
        generators["t_twrw"] = grid_shard(host_indexes=range(world_size // local_size))
    plan = construct_module_sharding_plan(
        reference.embedding_bag_collection, generators, local_size, world_size
    )
    sharded = FeatureProcessedEmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    features = [(f, rows) for _, rows, _, feats, _ in case.TABLES for f in feats]
    for step in range(case.STEPS):
        global_kjt, local_kjt, batch = case.global_and_local(step, rank, world_size, features, weighted=True)
        # learnable input weights: the unprocessed features' reach the input, the processed ones' get 0
        global_kjt, local_kjt = case.with_leaf_weights(global_kjt), case.with_leaf_weights(local_kjt)
        expected = reference(global_kjt)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().div(world_size).backward()
        out = sharded(local_kjt)
        mine = case.my_rows(rank, batch)
        torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **TOL)
        (out.values() * grad[mine]).sum().backward()
        if collection:  # every weight is replaced: the input weights reach nothing, here as unsharded
            assert local_kjt.weights().grad is None and global_kjt.weights().grad is None
        else:
            expected_grads = case.weight_grads(global_kjt, mine)
            for key, got in case.weight_grads(local_kjt).items():
                torch.testing.assert_close(
                    got, expected_grads[key], **TOL, msg=f"input weight grads of {key}"
                )
        for f in PROCESSED:
            weight = _position_weight(sharded, f)
            # a rank whose shards looked up no id of f has no part of its gradient
            mine_grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
            dist.all_reduce(mine_grad)
            torch.testing.assert_close(
                mine_grad,
                _position_weight(reference, f).grad,
                **TOL,
                msg=lambda m, f=f: f"{f}: {m}",
            )
            _position_weight(sharded, f).grad = None
            _position_weight(reference, f).grad = None
        case.average_dense_gradients_(sharded, world_size)
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        ref = reference.embedding_bag_collection.table_weight(name)[r0:r1, c0:c1]
        torch.testing.assert_close(weight, ref.detach(), **TOL)

    # a bag of 5 ids on one rank only, for a processor that knows 4 positions
    values, lengths = local_kjt.values(), local_kjt.lengths().clone()
    if rank == 1:
        key = local_kjt.keys().index("f_rw")
        lengths[sum(local_kjt.stride_per_key()[:key])] += 5
        offset = local_kjt.offset_per_key()[key]
        values = torch.cat([values[:offset], torch.zeros(5, dtype=values.dtype), values[offset:]])
    weights = torch.ones(values.numel())
    bad = type(local_kjt)(local_kjt.keys(), values, weights, lengths=lengths)
    with pytest.raises(ValueError, match="max_feature_length"):
        sharded(bad)


@pytest.mark.parametrize("world_size, local_size", [(2, None), (4, 2)])
def test_position_weighted_matches_unsharded(world_size, local_size):
    assert all(run_world(_worker, world_size, local_world_size=local_size))

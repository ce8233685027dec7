"""Sharded quantized EmbeddingBagCollections equal the unsharded quantized module, at worlds 1-4.

One launch per world size runs every case: int8 / int4 / int2 / fp16 / bf16 / fp32 tables, table-wise,
row-wise (uneven blocks, fewer rows than ranks) and column-wise (uneven blocks, two on one rank),
SUM and MEAN, weighted, an fp16 output, the feature-processed collection; then bad plans and bad
input, which must fail on every rank. Tolerance: fp32 reassociation (row-wise partial sums).
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.model_parallel import DistributedModelParallel
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FeatureProcessedEmbeddingBagCollection,
    PoolingType,
    PositionWeightedModule,
)
from shardkit.quant import QuantEmbeddingBagCollection, QuantFeatureProcessedEmbeddingBagCollection
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    QuantFeatureProcessedEmbeddingBagCollectionSharder,
    ShardedQuantEmbeddingBagCollection,
    create_infer_embedding_bag_sharding,
    flatten_feature_lengths,
)
from shardkit.sharding.quant_sharding import InferRwPooledEmbeddingSharding, QuantShardedGroupedLookup
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from shardkit.sharding.types import EmbeddingComputeKernel
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-5)
QUANT = EmbeddingComputeKernel.QUANT.value
# (table, rows, dim, features, pooling, data type, sharding)
TABLES = [
    ("tw_i8", 11, 8, ["a"], PoolingType.SUM, DataType.INT8, "tw"),
    ("tw_i2", 6, 5, ["b"], PoolingType.MEAN, DataType.INT2, "tw"),
    ("rw_i4", 13, 6, ["c", "d"], PoolingType.SUM, DataType.INT4, "rw"),
    ("rw_small", 2, 4, ["e"], PoolingType.MEAN, DataType.INT8, "rw"),
    ("cw_i4", 9, 7, ["f"], PoolingType.SUM, DataType.INT4, "cw"),
    ("cw_fp16", 8, 5, ["g"], PoolingType.MEAN, DataType.FP16, "cw"),
    ("rw_bf16", 10, 4, ["h"], PoolingType.SUM, DataType.BF16, "rw"),
    ("tw_fp32", 5, 3, ["i"], PoolingType.SUM, DataType.FP32, "tw"),
    ("cw_i2", 12, 9, ["j"], PoolingType.SUM, DataType.INT2, "cw"),
]
FEATURES = [(f, rows) for _, rows, _, feats, *_ in TABLES for f in feats]


def _trained(weighted: bool) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=feats, pooling=pooling, data_type=dtype)
        for name, rows, dim, feats, pooling, dtype, _ in TABLES
    ]
    return EmbeddingBagCollection(configs, is_weighted=weighted)


def _generators(world_size: int, **overrides):
    gens = {}
    for name, *_, kind in TABLES:
        if kind == "tw":
            gens[name] = table_wise(rank=len(gens) % world_size, compute_kernel=QUANT)
        elif kind == "rw":
            gens[name] = row_wise(compute_kernel=QUANT)
        else:  # uneven blocks, the last two on the last rank
            gens[name] = column_wise(ranks=[0, world_size - 1, world_size - 1], compute_kernel=QUANT)
    gens.update(overrides)
    return gens


class _Wrapper(torch.nn.Module):
    def __init__(self, ebc: QuantEmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features):
        return self.ebc(features)


def _check(sharded, reference, rank, world_size, weighted, step_seed=0) -> None:
    for step in range(2):
        global_kjt, local_kjt, batch = case.global_and_local(
            step + step_seed, rank, world_size, FEATURES, weighted
        )
        expected = reference(global_kjt)
        out = sharded(local_kjt)
        assert out.keys() == expected.keys() and out.values().dtype == expected.values().dtype
        assert not out.values().requires_grad
        torch.testing.assert_close(out.values(), expected.values()[case.my_rows(rank, batch)], **TOL)


def _worker() -> bool:
    rank, world_size, _ = case.world()
    env = ShardingEnv.from_process_group(None)
    sharder = QuantEmbeddingBagCollectionSharder()
    for weighted, output_dtype in [(False, torch.float32), (True, torch.float32), (False, torch.float16)]:
        reference = QuantEmbeddingBagCollection.from_float(_trained(weighted), output_dtype=output_dtype)
        plan = construct_module_sharding_plan(reference, _generators(world_size), world_size=world_size)
        sharded = sharder.shard(copy.deepcopy(reference), plan, env)
        assert isinstance(sharded, ShardedQuantEmbeddingBagCollection)
        assert list(sharded.parameters()) == []
        _check(sharded, reference, rank, world_size, weighted)

    # the specification's factory: one inference sharding of a type, over placed tables
    reference = QuantEmbeddingBagCollection.from_float(_trained(False))
    plan = plan_of(reference, world_size)
    row_wise_tables = [
        sharded_table(c, plan[c.name], world_size)
        for c in reference.embedding_bag_configs()
        if plan[c.name].sharding_type == "row_wise"
    ]
    infer = create_infer_embedding_bag_sharding("row_wise", row_wise_tables, env)
    assert isinstance(infer, InferRwPooledEmbeddingSharding)
    assert isinstance(infer.create_lookup(), QuantShardedGroupedLookup)
    with pytest.raises(ValueError, match="no inference sharding of type 'table_row_wise'"):
        create_infer_embedding_bag_sharding("table_row_wise", row_wise_tables, env)

    # a model holding the quantized collection, sharded by DistributedModelParallel with the planner's plan
    reference = QuantEmbeddingBagCollection.from_float(_trained(False))
    model = DistributedModelParallel(
        _Wrapper(copy.deepcopy(reference)), sharders=[sharder], init_data_parallel=False
    )
    assert isinstance(model.module.ebc, ShardedQuantEmbeddingBagCollection)
    _check(lambda kjt: model(kjt), reference, rank, world_size, False, step_seed=3)

    # feature processors in front of the quantized collection
    trained = _trained(True)
    processors = {"a": PositionWeightedModule(4), "c": PositionWeightedModule(4)}
    for p in processors.values():
        with torch.no_grad():
            p.position_weight.uniform_(0.5, 1.5)
    fp_reference = QuantFeatureProcessedEmbeddingBagCollection.from_float(
        FeatureProcessedEmbeddingBagCollection(trained, processors)
    )
    plan = construct_module_sharding_plan(
        fp_reference.embedding_bag_collection, _generators(world_size), world_size=world_size
    )
    fp_sharded = QuantFeatureProcessedEmbeddingBagCollectionSharder().shard(
        copy.deepcopy(fp_reference), plan, env
    )
    _check(fp_sharded, fp_reference, rank, world_size, True, step_seed=5)

    # bad plans: an unsupported sharding type, a training kernel; the same error on every rank
    reference = QuantEmbeddingBagCollection.from_float(_trained(False))
    for override, message in [
        ({"rw_i4": table_row_wise(host_index=0, compute_kernel=QUANT)}, "'rw_i4' (table_row_wise, quant)"),
        ({"tw_i8": data_parallel(compute_kernel=QUANT)}, "'tw_i8' (data_parallel, quant)"),
        ({"tw_fp32": table_wise(rank=0)}, "'tw_fp32' (table_wise, dense)"),
    ]:
        bad_plan = construct_module_sharding_plan(
            reference, _generators(world_size, **override), world_size=world_size
        )
        case.raises_value_error(
            lambda p=bad_plan: sharder.shard(reference, p, env), message, "supports the sharding types"
        )

    # bad input on one rank: an id past its table; every rank raises, naming that rank
    sharded = sharder.shard(reference, plan_of(reference, world_size), env)
    _, local_kjt, _ = case.global_and_local(0, rank, world_size, FEATURES, False)
    if rank == world_size - 1:
        values = local_kjt.values().clone()
        values[local_kjt.offset_per_key()[local_kjt.keys().index("f")]] = 9
        local_kjt = type(local_kjt)(local_kjt.keys(), values, lengths=local_kjt.lengths())
    case.raises_value_error(
        lambda: sharded(local_kjt), f"rank {world_size - 1}", "id 9 of feature 'f' is out of range [0, 9)"
    )
    assert flatten_feature_lengths(local_kjt) is local_kjt
    return True


def plan_of(module, world_size):
    return construct_module_sharding_plan(module, _generators(world_size), world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_quantized_equals_unsharded(world_size):
    assert all(run_world(_worker, world_size))

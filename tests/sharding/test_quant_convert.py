"""A trained sharded model's checkpoint, saved at 2 ranks, served quantized at 3 ranks.

Launch 1 (2 ranks): a float EmbeddingBagCollection, sharded row-wise / table-wise, takes two fused
SGD steps and is saved with ``shardkit.checkpoint.save``. Launch 2 (3 ranks, another plan with
column-wise tables split across ranks): the float module is built on meta, sharded, loaded from the
checkpoint (each rank reads its shards), then ``quantize_sharded`` quantizes each rank's shards. Its
outputs must equal quantizing the whole trained module and looking up unsharded (fp32 reassociation),
and its stored rows must equal the unsharded quantized module's rows, column blocks included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit import checkpoint
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels.quant_rows import slice_columns
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    OptimType,
    PoolingType,
)
from shardkit.quant import QuantEmbeddingBagCollection
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.quant_convert import quantize_sharded
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

# (table, rows, dim, data type, pooling)
TABLES = [
    ("a", 11, 8, DataType.INT8, PoolingType.SUM),
    ("b", 9, 7, DataType.INT4, PoolingType.MEAN),
    ("c", 13, 6, DataType.INT2, PoolingType.SUM),
    ("d", 6, 5, DataType.FP16, PoolingType.SUM),
]
FEATURES = [(f"f_{name}", rows) for name, rows, *_ in TABLES]


def _float_module(device=None) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(rows, dim, name=n, feature_names=[f"f_{n}"], data_type=dt, pooling=p)
        for n, rows, dim, dt, p in TABLES
    ]
    return EmbeddingBagCollection(
        configs, device=device, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=0.5)
    )


def _train_and_save(path: str) -> bool:
    rank, world_size, _ = case.world()
    generators = {"a": row_wise(), "b": table_wise(rank=1), "c": row_wise(), "d": table_wise(rank=0)}
    module = _float_module()
    plan = construct_module_sharding_plan(module, generators)
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(None))
    for step in range(2):
        _, local, _ = case.global_and_local(step, rank, world_size, FEATURES, weighted=False)
        sharded(local).values().pow(2).sum().backward()  # the fused SGD updates the rows it read
    checkpoint.save(path, sharded)
    return True


def _load_and_quantize(path: str) -> bool:
    rank, world_size, _ = case.world()
    env = ShardingEnv.from_process_group(None)
    generators = {
        "a": column_wise(ranks=[0, 1, 2], compute_kernel="dense"),  # a row's range spans 3 ranks
        "b": row_wise(compute_kernel="dense"),
        "c": column_wise(ranks=[2, 0], compute_kernel="dense"),
        "d": table_wise(rank=1, compute_kernel="dense"),
    }
    template = _float_module(torch.device("meta"))
    plan = construct_module_sharding_plan(template, generators)
    float_sharded = EmbeddingBagCollectionSharder().shard(template, plan, env)
    checkpoint.load(path, float_sharded)
    served = quantize_sharded(float_sharded, plan, env)

    # the reference (whole tables on every rank: the test's, not the conversion's)
    trained = _float_module()
    with torch.no_grad():
        for name, *_ in TABLES:
            trained.table_weight(name).copy_(float_sharded.full_table(name))
    reference = QuantEmbeddingBagCollection.from_float(trained)
    for (name, r0, r1, c0, c1), rows in served.local_shards().items():
        whole = reference.table_weight(name)[r0:r1]
        dim = reference.embedding_bag_configs()[[t[0] for t in TABLES].index(name)].embedding_dim
        expected = slice_columns(whole, dim, reference.table_storage(name), c0, c1)
        assert torch.equal(rows, expected), f"stored rows of {name} [{r0}, {r1}) x [{c0}, {c1})"
    for step in range(2):
        global_kjt, local, batch = case.global_and_local(
            step + 10, rank, world_size, FEATURES, weighted=False
        )
        expected = reference(global_kjt).values()[case.my_rows(rank, batch)]
        torch.testing.assert_close(served(local).values(), expected, rtol=1e-5, atol=1e-5)

    # another data type for every table; a non-finite value on one rank fails on every rank
    int4 = quantize_sharded(float_sharded, plan, env, data_type=DataType.INT4)
    assert {group.storage for lookup in int4.lookups for group in lookup.lookups} <= {"int4"}
    global_kjt, local, batch = case.global_and_local(20, rank, world_size, FEATURES, weighted=False)
    expected = QuantEmbeddingBagCollection.from_float(trained, data_type=DataType.INT4)(global_kjt).values()
    torch.testing.assert_close(
        int4(local).values(), expected[case.my_rows(rank, batch)], rtol=1e-5, atol=1e-5
    )
    if rank == 1:  # the last use of float_sharded: corrupted in place
        with torch.no_grad():
            shards = float_sharded.local_shards()
            shards[next(key for key in shards if key[0] == "b")][0, 0] = float("nan")  # an int4 table
    with pytest.raises(ValueError, match="cannot quantize the sharded tables: rank 1: table 'b'"):
        quantize_sharded(float_sharded, plan, env)
    dist.barrier()
    return True


def test_checkpoint_at_two_ranks_served_quantized_at_three(tmp_path):
    path = str(tmp_path / "trained")
    assert all(run_world(_train_and_save, 2, path))
    assert all(run_world(_load_and_quantize, 3, path))

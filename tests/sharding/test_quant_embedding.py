"""ShardedQuantEmbeddingCollection: sequence lookups of quantized tables, table-, row- and column-wise
(kernels quant and quant_uvm_caching), equal to the unsharded QuantEmbeddingCollection on the global
batch at worlds 1-4 (each id's dequantized row: no sums, so equal, not close); fp16 output; need_indices;
bad plans fail on every rank."""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import DataType, EmbeddingCollection, EmbeddingConfig
from shardkit.quant import QuantEmbeddingCollection
from shardkit.sharding.cache_params import CacheParams
from shardkit.sharding.quant_embedding import QuantEmbeddingCollectionSharder, ShardedQuantEmbeddingCollection
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

# (table, rows, features, data type, sharding); one dim for all (an EC's tables share it)
DIM = 8
TABLES = [
    ("tw_i8", 11, ["a"], DataType.INT8, "tw"),
    ("rw_i4", 13, ["b", "c"], DataType.INT4, "rw"),
    ("cw_fp16", 9, ["d"], DataType.FP16, "cw"),
    ("rw_small", 2, ["e"], DataType.INT2, "rw"),
    ("tw_fp32", 5, ["f"], DataType.FP32, "tw"),
]
FEATURES = [(f, rows) for _, rows, feats, *_ in TABLES for f in feats]


def _quantized(need_indices: bool, output_dtype=torch.float32) -> QuantEmbeddingCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingConfig(rows, DIM, name=name, feature_names=feats, data_type=dtype)
        for name, rows, feats, dtype, _ in TABLES
    ]
    return QuantEmbeddingCollection.from_float(
        EmbeddingCollection(configs, need_indices=need_indices), output_dtype=output_dtype
    )


def _plan(module, world_size: int, kernel: str = "quant", **overrides):
    gens = {}
    for name, *_, kind in TABLES:
        if kind == "tw":
            gens[name] = table_wise(rank=len(gens) % world_size, compute_kernel=kernel)
        elif kind == "rw":
            gens[name] = row_wise(compute_kernel=kernel)
        else:
            gens[name] = column_wise(ranks=[0, world_size - 1], compute_kernel=kernel)
    gens.update(overrides)
    plan = construct_module_sharding_plan(module, gens, world_size=world_size)
    if kernel != "quant":
        for ps in plan.values():
            ps.cache_params = CacheParams(load_factor=0.1)
    return plan


def _check(sharded, reference, rank, world_size, need_indices) -> None:
    for step in range(3):
        global_kjt, local_kjt, batch = case.global_and_local(step, rank, world_size, FEATURES, False)
        expected = reference(global_kjt)
        out = sharded(local_kjt)
        assert list(out) == list(expected)
        mine = case.my_rows(rank, batch)
        for key, jt in out.items():
            want = expected[key]
            offsets = want.offsets()
            lo, hi = int(offsets[mine.start]), int(offsets[mine.stop])
            assert jt.values().dtype == want.values().dtype
            assert torch.equal(jt.values(), want.values()[lo:hi]), (step, key)
            assert torch.equal(jt.lengths(), want.lengths()[mine]), (step, key)
            if need_indices:
                assert torch.equal(jt.weights(), want.weights()[lo:hi].to(jt.weights().dtype)), key


def _worker() -> bool:
    rank, world_size, _ = case.world()
    env = ShardingEnv.from_process_group(None)
    sharder = QuantEmbeddingCollectionSharder()
    for need_indices, output_dtype, kernel in [
        (False, torch.float32, "quant"),
        (True, torch.float32, "quant_uvm_caching"),
        (False, torch.float16, "quant"),
    ]:
        reference = _quantized(need_indices, output_dtype)
        sharded = sharder.shard(copy.deepcopy(reference), _plan(reference, world_size, kernel), env)
        assert isinstance(sharded, ShardedQuantEmbeddingCollection)
        assert list(sharded.parameters()) == []
        _check(sharded, reference, rank, world_size, need_indices)
    reference = _quantized(False)
    bad = _plan(reference, world_size, tw_i8=table_row_wise(host_index=0, compute_kernel="quant"))
    case.raises_value_error(lambda: sharder.shard(reference, bad, env), "'tw_i8' (table_row_wise, quant)")
    training = _plan(reference, world_size, tw_i8=table_wise(rank=0))
    case.raises_value_error(lambda: sharder.shard(reference, training, env), "'tw_i8'")
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_quantized_collection_equals_unsharded(world_size):
    assert all(run_world(_worker, world_size))


def test_sharder_refuses_a_float_module():
    module = EmbeddingCollection([EmbeddingConfig(4, DIM, name="t", feature_names=["f"])])
    with pytest.raises(TypeError, match="QuantEmbeddingCollection.from_float"):
        ShardedQuantEmbeddingCollection(module, {}, ShardingEnv.from_local(1, 0))

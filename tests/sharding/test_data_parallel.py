"""Data-parallel tables use the dense or the fused kernel (exactness: the sharded-module tests)."""

from __future__ import annotations

import pytest

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding.data_parallel import DpPooledEmbeddingSharding
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.replicated_fused_lookup import ReplicatedShardedLookup
from shardkit.sharding.sharding_plan import data_parallel
from shardkit.sharding.types import EmbeddingComputeKernel


def test_other_kernels_are_rejected():
    config = EmbeddingBagConfig(4, 2, name="d", feature_names=["f"])
    table = sharded_table(
        config, data_parallel(EmbeddingComputeKernel.FUSED_UVM.value)("d", (4, 2), 2, 2, "cpu"), 2
    )
    with pytest.raises(ValueError, match="'d'.*dense kernel.*fused one.*got 'fused_uvm'"):
        DpPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 0), True)


def test_fused_kernel_replicas_carry_the_fused_optimizer():
    config = EmbeddingBagConfig(4, 2, name="d", feature_names=["f"])
    table = sharded_table(
        config, data_parallel(EmbeddingComputeKernel.FUSED.value)("d", (4, 2), 2, 2, "cpu"), 2
    )
    optimizer = FusedOptimizerConfig(OptimType.ADAM, lr=0.1)
    sharding = DpPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 1), True, optimizer)
    lookup = sharding.create_lookup()
    assert isinstance(lookup, ReplicatedShardedLookup)
    assert list(lookup.local_shards()) == [("d", 0, 4, 0, 2)]
    assert lookup.lookups[0].optimizer.config == optimizer and lookup.lookups[0].world_size == 2


def test_dense_kernel_holds_the_whole_table():
    config = EmbeddingBagConfig(4, 2, name="d", feature_names=["f"])
    table = sharded_table(config, data_parallel()("d", (4, 2), 2, 2, "cpu"), 2)
    sharding = DpPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 1), True)
    lookup = sharding.create_lookup()
    assert list(lookup.local_shards()) == [("d", 0, 4, 0, 2)]
    assert lookup.lookups[0].optimizer is None

"""A fused data-parallel table beside its unsharded twin, for the replicated-exchange tests."""

import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, data_parallel


def reference_and_replica(rows: int, dim: int, optimizer):
    """(the unsharded module, its data-parallel sharded copy): one table ``d`` of ``rows x dim`` on
    feature ``f`` with the fused ``optimizer`` (lr 0.1), both starting from the same weights. Collective
    (the sharding): every rank of the default group calls it."""

    def ebc():
        torch.manual_seed(0)
        config = EmbeddingBagConfig(rows, dim, name="d", feature_names=["f"])
        return EmbeddingBagCollection([config], fused_optimizer=FusedOptimizerConfig(optimizer, lr=0.1))

    reference, module = ebc(), ebc()
    plan = construct_module_sharding_plan(module, {"d": data_parallel()})
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(None))
    return reference, sharded

"""Layer 2: sharding plans, sharded-module interfaces and the distribution modules.

``types`` holds the plan types (``ShardingType``, ``ParameterSharding``, ``ShardingPlan``, ...) and the
interfaces every sharded module implements (``ShardedModule``, ``ModuleSharder``); ``dist_data`` the
modules that move features and embeddings between ranks. See docs/sharding.md.
"""

from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.sharding_spec import EnumerableShardingSpec, ShardMetadata
from shardkit.sharding.types import (
    CommOp,
    ComputeKernel,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ModuleShardingPlan,
    NullShardedModuleContext,
    NullShardingContext,
    ParameterSharding,
    ParameterStorage,
    ShardedModule,
    ShardingEnv,
    ShardingPlan,
    ShardingPlanner,
    ShardingType,
    get_tensor_size_bytes,
)

__all__ = [
    "CommOp",
    "ComputeKernel",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "EnumerableShardingSpec",
    "KJTList",
    "ModuleSharder",
    "ModuleShardingPlan",
    "NullShardedModuleContext",
    "NullShardingContext",
    "ParameterSharding",
    "ParameterStorage",
    "ShardMetadata",
    "ShardedModule",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingPlanner",
    "ShardingType",
    "get_tensor_size_bytes",
]

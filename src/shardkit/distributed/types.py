"""torchrec's ``torchrec.distributed.types`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.distributed.awaitable import (
    Awaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)
from shardkit.distributed.codecs import NoOpQuantizedCommCodec, QuantizedCommCodec, QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.sharding.cache_params import CacheAlgorithm, CacheParams, CacheStatistics
from shardkit.sharding.sharding_spec import EnumerableShardingSpec, ShardMetadata
from shardkit.sharding.types import (
    CommOp,
    ComputeKernel,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ModuleShardingPlan,
    NullShardedModuleContext,
    NullShardingContext,
    ParameterSharding,
    ParameterStorage,
    ShardedModule,
    ShardingPlan,
    ShardingPlanner,
    ShardingType,
    get_tensor_size_bytes,
)

__all__ = [
    "Awaitable",
    "CacheAlgorithm",
    "CacheParams",
    "CacheStatistics",
    "CommOp",
    "ComputeKernel",
    "EmbeddingModuleShardingPlan",
    "EnumerableShardingSpec",
    "GetItemLazyAwaitable",
    "LazyAwaitable",
    "LazyGetItemMixin",
    "LazyNoWait",
    "ModuleSharder",
    "ModuleShardingPlan",
    "NoOpQuantizedCommCodec",
    "NoWait",
    "NullShardedModuleContext",
    "NullShardingContext",
    "ParameterSharding",
    "ParameterStorage",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "ShardMetadata",
    "ShardedModule",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingPlanner",
    "ShardingType",
    "get_tensor_size_bytes",
]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(__name__, ["GenericMeta", "ShardingEnv2D", "scope"])

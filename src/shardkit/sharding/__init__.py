"""Layer 2: sharding plans, sharded embedding modules, their sharders and their state.

- ``types``: the plan types (``ShardingType``, ``ParameterSharding``, ``ShardingPlan``, ...) and the
  interfaces every sharded module implements (``ShardedModule``, ``ModuleSharder``);
- ``sharding_plan``: the plan constructors (``table_wise()``, ``row_wise()``, ...,
  ``construct_module_sharding_plan``);
- the sharded modules and their sharders (``embeddingbag``, ``embedding_bag_module`` for a plain
  ``nn.EmbeddingBag``, ``embedding``, ``fp_embeddingbag``; managed collision: ``mc_modules``,
  ``mc_embeddingbag``, ``mc_embedding``), built
  from one ``EmbeddingShardingImpl`` per sharding type (``data_parallel``, ``table_wise``, ``column_wise``,
  ``row_wise``, ``table_row_wise``, ``table_column_wise``, ``grid_sharding``);
- their state (``state_layout``, ``sharded_state``, ``sharded_module_state``) and the specification's
  ``utils``; ``dist_data`` holds the modules that move features and embeddings between ranks.

See docs/sharding.md and docs/sharded_state.md.
"""

from shardkit.sharding.cache_params import (
    CacheAlgorithm,
    CacheParams,
    CacheStatistics,
    SampledCacheStatistics,
    cache_params_from_fused_params,
)
from shardkit.sharding.column_wise import CwPooledEmbeddingSharding, CwSequenceEmbeddingSharding
from shardkit.sharding.data_parallel import DpPooledEmbeddingSharding, DpSequenceEmbeddingSharding
from shardkit.sharding.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from shardkit.sharding.embedding_bag_module import EmbeddingBagSharder, ShardedEmbeddingBag
from shardkit.sharding.embedding_sharder import BaseEmbeddingSharder
from shardkit.sharding.embedding_sharding import EmbeddingShardingImpl, ShardingContext
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from shardkit.sharding.fp_embeddingbag import (
    FeatureProcessedEmbeddingBagCollectionSharder,
    ShardedFeatureProcessedEmbeddingBagCollection,
)
from shardkit.sharding.grid_sharding import GridPooledEmbeddingSharding
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.mc_embedding import (
    ManagedCollisionEmbeddingCollectionContext,
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)
from shardkit.sharding.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionContext,
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from shardkit.sharding.mc_modules import (
    ManagedCollisionCollectionAwaitable,
    ManagedCollisionCollectionContext,
    ManagedCollisionCollectionSharder,
    ShardedManagedCollisionCollection,
    create_mc_sharding,
)
from shardkit.sharding.row_wise import RwPooledEmbeddingSharding, RwSequenceEmbeddingSharding
from shardkit.sharding.sharded_embedding_module import (
    EmbeddingModuleContext,
    ShardedEmbeddingModule,
)
from shardkit.sharding.sharded_module_state import ShardedFusedOptimizer
from shardkit.sharding.sharded_state import (
    StateValue,
    dtensor_shard_dim,
    full_table,
    load_full_table,
    load_state_value,
    to_state_value,
)
from shardkit.sharding.sharding_plan import (
    ParameterShardingGenerator,
    build_parameter_sharding,
    column_shards,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    grid_shards,
    placement,
    row_shards,
    row_wise,
    table_column_wise,
    table_configs,
    table_row_wise,
    table_wise,
)
from shardkit.sharding.sharding_spec import EnumerableShardingSpec, ShardMetadata
from shardkit.sharding.state_layout import ShardLayout, row_state_layout, table_layout
from shardkit.sharding.table_column_wise import TwCwPooledEmbeddingSharding, TwCwSequenceEmbeddingSharding
from shardkit.sharding.table_row_wise import TwRwPooledEmbeddingSharding, TwRwSequenceEmbeddingSharding
from shardkit.sharding.table_wise import TwPooledEmbeddingSharding, TwSequenceEmbeddingSharding
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
from shardkit.sharding.utils import (
    CopyableMixin,
    add_params_from_parameter_sharding,
    add_prefix_to_state_dict,
    append_prefix,
    copy_to_device,
    filter_state_dict,
    get_unsharded_module_names,
    merge_fused_params,
    none_throws,
    optimizer_type_to_emb_opt_type,
)

__all__ = [
    "ManagedCollisionCollectionAwaitable",
    "ManagedCollisionCollectionContext",
    "ManagedCollisionCollectionSharder",
    "ManagedCollisionEmbeddingBagCollectionContext",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ManagedCollisionEmbeddingCollectionContext",
    "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionCollection",
    "ShardedManagedCollisionEmbeddingBagCollection",
    "ShardedManagedCollisionEmbeddingCollection",
    "create_mc_sharding",
    # plan and module types
    "CacheAlgorithm",
    "CacheParams",
    "CacheStatistics",
    "SampledCacheStatistics",
    "cache_params_from_fused_params",
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
    # plan constructors
    "ParameterShardingGenerator",
    "build_parameter_sharding",
    "column_shards",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "placement",
    "row_shards",
    "row_wise",
    "table_column_wise",
    "table_configs",
    "table_row_wise",
    "grid_shard",
    "grid_shards",
    "table_wise",
    # sharded modules and sharders
    "BaseEmbeddingSharder",
    "EmbeddingBagCollectionSharder",
    "EmbeddingBagSharder",
    "EmbeddingCollectionSharder",
    "EmbeddingModuleContext",
    "FeatureProcessedEmbeddingBagCollectionSharder",
    "ShardedEmbeddingBag",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardedEmbeddingModule",
    "ShardedFeatureProcessedEmbeddingBagCollection",
    "ShardedFusedOptimizer",
    # per sharding type
    "CwPooledEmbeddingSharding",
    "CwSequenceEmbeddingSharding",
    "DpPooledEmbeddingSharding",
    "DpSequenceEmbeddingSharding",
    "EmbeddingShardingImpl",
    "RwPooledEmbeddingSharding",
    "RwSequenceEmbeddingSharding",
    "ShardingContext",
    "TwCwPooledEmbeddingSharding",
    "TwCwSequenceEmbeddingSharding",
    "TwPooledEmbeddingSharding",
    "TwRwPooledEmbeddingSharding",
    "GridPooledEmbeddingSharding",
    "TwRwSequenceEmbeddingSharding",
    "TwSequenceEmbeddingSharding",
    # state
    "ShardLayout",
    "StateValue",
    "dtensor_shard_dim",
    "full_table",
    "load_full_table",
    "load_state_value",
    "row_state_layout",
    "table_layout",
    "to_state_value",
    # the specification's utils
    "CopyableMixin",
    "add_params_from_parameter_sharding",
    "add_prefix_to_state_dict",
    "append_prefix",
    "copy_to_device",
    "filter_state_dict",
    "get_unsharded_module_names",
    "merge_fused_params",
    "none_throws",
    "optimizer_type_to_emb_opt_type",
]

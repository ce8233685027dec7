"""Unsharded embedding modules, their grouped (table-batched) lookup and fused sparse optimizers (L1).

See docs/modules.md. Ids are validated against their table (one host sync per lookup); switch it off
on a hot path with ``shardkit.distributed.validation.set_validation(False)`` or ``SHARDKIT_VALIDATE=0``.
"""

from shardkit.modules.embedding_bag_collection import EmbeddingBagCollection
from shardkit.modules.embedding_collection import EmbeddingCollection
from shardkit.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    data_type_to_dtype,
)
from shardkit.modules.feature_processor_ import (
    FeatureProcessor,
    FeatureProcessorsCollection,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from shardkit.modules.fp_embedding_bag_collection import FeatureProcessedEmbeddingBagCollection
from shardkit.modules.fused_optimizer_state import FusedOptimizer
from shardkit.modules.fused_optimizers import FusedOptimizerConfig, OptimType, SparseRowOptimizer
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
from shardkit.modules.grouped_tables import group_table_configs
from shardkit.modules.mc_collection import ManagedCollisionCollection
from shardkit.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from shardkit.modules.mc_eviction import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHEvictionPolicyMetadataInfo,
    average_threshold_filter,
    dynamic_threshold_filter,
)
from shardkit.modules.mc_modules import ManagedCollisionModule, MCHManagedCollisionModule
from shardkit.modules.regroup import KTRegroupAsDict

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "DistanceLFU_EvictionPolicy",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FeatureProcessedEmbeddingBagCollection",
    "FeatureProcessor",
    "FeatureProcessorsCollection",
    "FusedOptimizer",
    "FusedOptimizerConfig",
    "GroupedEmbeddingLookup",
    "KTRegroupAsDict",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHEvictionPolicy",
    "MCHEvictionPolicyMetadataInfo",
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "ManagedCollisionModule",
    "OptimType",
    "PoolingType",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
    "ShardSpec",
    "SparseRowOptimizer",
    "average_threshold_filter",
    "data_type_to_dtype",
    "dynamic_threshold_filter",
    "group_table_configs",
]

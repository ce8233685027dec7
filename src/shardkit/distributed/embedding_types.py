"""torchrec's ``torchrec.distributed.embedding_types`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.modules.feature_processor import BaseGroupedFeatureProcessor
from shardkit.modules.fused_optimizers import OptimType
from shardkit.sharding.embedding_sharder import BaseEmbeddingSharder
from shardkit.sharding.kjt_list import KJTList, ListOfKJTList
from shardkit.sharding.quant_embeddingbag import BaseQuantEmbeddingSharder
from shardkit.sharding.sharded_embedding_module import ShardedEmbeddingModule
from shardkit.sharding.sharded_embedding_table import (
    EmbeddingAttributes,
    GroupedEmbeddingConfig,
    ShardedConfig,
    ShardedEmbeddingTable,
    ShardedMetaConfig,
    compute_kernel_to_embedding_location,
)
from shardkit.sharding.sharding_interface import (
    BaseEmbeddingLookup,
    FeatureShardingMixIn,
    ModuleShardingMixIn,
)
from shardkit.sharding.types import EmbeddingComputeKernel

__all__ = [
    "BaseEmbeddingLookup",
    "BaseEmbeddingSharder",
    "BaseGroupedFeatureProcessor",
    "BaseQuantEmbeddingSharder",
    "EmbeddingAttributes",
    "EmbeddingComputeKernel",
    "FeatureShardingMixIn",
    "GroupedEmbeddingConfig",
    "KJTList",
    "ListOfKJTList",
    "ModuleShardingMixIn",
    "OptimType",
    "ShardedConfig",
    "ShardedEmbeddingModule",
    "ShardedEmbeddingTable",
    "ShardedMetaConfig",
    "compute_kernel_to_embedding_location",
]

"""torchrec's ``torchrec.distributed.embedding_sharding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.sharding.bucketize_kjt import bucketize_kjt_before_all2all
from shardkit.sharding.sharded_embedding_table import group_tables
from shardkit.sharding.sharding_awaitables import (
    KJTListAwaitable,
    KJTListSplitsAwaitable,
    ListOfKJTListAwaitable,
    ListOfKJTListSplitsAwaitable,
)
from shardkit.sharding.sharding_contexts import EmbeddingShardingContext
from shardkit.sharding.sharding_infos import EmbeddingShardingInfo
from shardkit.sharding.sharding_interface import BaseEmbeddingDist, BaseSparseFeaturesDist, EmbeddingSharding

__all__ = [
    "BaseEmbeddingDist",
    "BaseSparseFeaturesDist",
    "EmbeddingSharding",
    "EmbeddingShardingContext",
    "EmbeddingShardingInfo",
    "KJTListAwaitable",
    "KJTListSplitsAwaitable",
    "ListOfKJTListAwaitable",
    "ListOfKJTListSplitsAwaitable",
    "bucketize_kjt_before_all2all",
    "group_tables",
]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    [
        "FusedKJTListSplitsAwaitable",
        "KJTSplitsAllToAllMeta",
    ],
)

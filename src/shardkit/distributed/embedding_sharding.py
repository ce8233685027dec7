"""torchrec's ``torchrec.distributed.embedding_sharding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.modules.grouped_tables import group_tables
from shardkit.sharding.embedding_sharding import EmbeddingSharding
from shardkit.sharding.sharded_embedding_module import EmbeddingShardingContext

__all__ = ["EmbeddingSharding", "EmbeddingShardingContext", "group_tables"]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    [
        "BaseEmbeddingDist",
        "BaseSparseFeaturesDist",
        "EmbeddingShardingInfo",
        "FusedKJTListSplitsAwaitable",
        "KJTListAwaitable",
        "KJTListSplitsAwaitable",
        "KJTSplitsAllToAllMeta",
        "ListOfKJTListAwaitable",
        "ListOfKJTListSplitsAwaitable",
        "bucketize_kjt_before_all2all",
    ],
)

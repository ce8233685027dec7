"""torchrec's ``torchrec.distributed.embedding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.sharding.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection

__all__ = ["EmbeddingCollectionSharder", "ShardedEmbeddingCollection"]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    [
        "EmbeddingCollectionAwaitable",
        "EmbeddingCollectionContext",
        "create_embedding_sharding",
        "create_sharding_infos_by_sharding",
        "get_ec_index_dedup",
        "set_ec_index_dedup",
    ],
)

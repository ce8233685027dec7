"""torchrec's ``torchrec.distributed.embedding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.ec_index_dedup import get_ec_index_dedup, set_ec_index_dedup
from shardkit.sharding.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from shardkit.sharding.sharding_awaitables import EmbeddingCollectionAwaitable
from shardkit.sharding.sharding_contexts import EmbeddingCollectionContext
from shardkit.sharding.sharding_factory import create_embedding_sharding
from shardkit.sharding.sharding_infos import (
    create_ec_sharding_infos_by_sharding as create_sharding_infos_by_sharding,
)

__all__ = [
    "EmbeddingCollectionAwaitable",
    "EmbeddingCollectionContext",
    "EmbeddingCollectionSharder",
    "ShardedEmbeddingCollection",
    "create_embedding_sharding",
    "create_sharding_infos_by_sharding",
    "get_ec_index_dedup",
    "set_ec_index_dedup",
]

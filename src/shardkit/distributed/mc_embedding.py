"""torchrec's ``torchrec.distributed.mc_embedding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.mc_embedding import (
    ManagedCollisionEmbeddingCollectionContext,
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)

__all__ = [
    "ManagedCollisionEmbeddingCollectionContext",
    "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionEmbeddingCollection",
]

"""torchrec's ``torchrec.distributed.mc_embeddingbag`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionContext,
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)

__all__ = [
    "ManagedCollisionEmbeddingBagCollectionContext",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ShardedManagedCollisionEmbeddingBagCollection",
]

"""torchrec's ``torchrec.distributed.quant_embedding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.quant_embedding import QuantEmbeddingCollectionSharder, ShardedQuantEmbeddingCollection
from shardkit.sharding.quant_mc_embedding import (
    QuantManagedCollisionEmbeddingCollectionSharder,
    ShardedQuantManagedCollisionEmbeddingCollection,
)
from shardkit.sharding.quant_sharding import (
    InferCwSequenceEmbeddingSharding,
    InferRwSequenceEmbeddingSharding,
    InferTwSequenceEmbeddingSharding,
)

__all__ = [
    "InferCwSequenceEmbeddingSharding",
    "InferRwSequenceEmbeddingSharding",
    "InferTwSequenceEmbeddingSharding",
    "QuantEmbeddingCollectionSharder",
    "QuantManagedCollisionEmbeddingCollectionSharder",
    "ShardedQuantEmbeddingCollection",
    "ShardedQuantManagedCollisionEmbeddingCollection",
]

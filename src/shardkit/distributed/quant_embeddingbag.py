"""torchrec's ``torchrec.distributed.quant_embeddingbag`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    QuantFeatureProcessedEmbeddingBagCollectionSharder,
    ShardedQuantEmbeddingBagCollection,
    ShardedQuantFeatureProcessedEmbeddingBagCollection,
    flatten_feature_lengths,
)
from shardkit.sharding.quant_sharding import create_infer_embedding_bag_sharding

__all__ = [
    "QuantEmbeddingBagCollectionSharder",
    "QuantFeatureProcessedEmbeddingBagCollectionSharder",
    "ShardedQuantEmbeddingBagCollection",
    "ShardedQuantFeatureProcessedEmbeddingBagCollection",
    "create_infer_embedding_bag_sharding",
    "flatten_feature_lengths",
]

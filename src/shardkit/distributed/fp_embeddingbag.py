"""torchrec's ``torchrec.distributed.fp_embeddingbag`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.fp_embeddingbag import (
    FeatureProcessedEmbeddingBagCollectionSharder,
    ShardedFeatureProcessedEmbeddingBagCollection,
)

__all__ = ["FeatureProcessedEmbeddingBagCollectionSharder", "ShardedFeatureProcessedEmbeddingBagCollection"]

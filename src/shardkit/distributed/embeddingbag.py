"""torchrec's ``torchrec.distributed.embeddingbag`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.sharding.embedding_bag_module import EmbeddingBagSharder, ShardedEmbeddingBag
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from shardkit.sharding.sharding_awaitables import (
    EmbeddingAwaitable,
    EmbeddingBagCollectionAwaitable,
    construct_output_kt,
)
from shardkit.sharding.sharding_contexts import EmbeddingBagCollectionContext
from shardkit.sharding.sharding_factory import create_embedding_bag_sharding
from shardkit.sharding.sharding_infos import (
    create_sharding_infos_by_sharding,
    replace_placement_with_meta_device,
)

__all__ = [
    "EmbeddingAwaitable",
    "EmbeddingBagCollectionAwaitable",
    "EmbeddingBagCollectionContext",
    "EmbeddingBagCollectionSharder",
    "EmbeddingBagSharder",
    "ShardedEmbeddingBag",
    "ShardedEmbeddingBagCollection",
    "construct_output_kt",
    "create_embedding_bag_sharding",
    "create_sharding_infos_by_sharding",
    "replace_placement_with_meta_device",
]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    ["VariableBatchEmbeddingBagCollectionAwaitable"],
)

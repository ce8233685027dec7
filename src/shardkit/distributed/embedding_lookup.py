"""torchrec's ``torchrec.distributed.embedding_lookup`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.sharding.embedding_sharding import CommOpGradientScaling
from shardkit.sharding.lookup_helpers import embeddings_cat_empty_rank_handle, fx_wrap_tensor_view2d

__all__ = ["CommOpGradientScaling", "embeddings_cat_empty_rank_handle", "fx_wrap_tensor_view2d"]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    [
        "GroupedEmbeddingsLookup",
        "GroupedPooledEmbeddingsLookup",
        "InferGroupedEmbeddingsLookup",
        "InferGroupedLookupMixin",
        "InferGroupedPooledEmbeddingsLookup",
        "MetaInferGroupedEmbeddingsLookup",
        "MetaInferGroupedPooledEmbeddingsLookup",
    ],
)

"""torchrec's ``torchrec.distributed.sharding.rw_sharding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.sharding.row_wise import RwPooledEmbeddingSharding

__all__ = ["RwPooledEmbeddingSharding"]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(__name__, ["BaseRwEmbeddingSharding", "RwPooledEmbeddingDist", "RwSparseFeaturesDist"])

"""torchrec's ``torchrec.distributed.sharding.grid_sharding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.grid_sharding import GridPooledEmbeddingSharding

__all__ = ["GridPooledEmbeddingSharding"]

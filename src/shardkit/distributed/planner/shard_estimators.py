"""torchrec's ``torchrec.distributed.planner.shard_estimators`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.planner.estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator

__all__ = ["EmbeddingPerfEstimator", "EmbeddingStorageEstimator"]

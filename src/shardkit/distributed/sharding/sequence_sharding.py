"""torchrec's ``torchrec.distributed.sharding.sequence_sharding`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.sharding_contexts import SequenceShardingContext

__all__ = ["SequenceShardingContext"]

"""torchrec's ``torchrec.distributed.planner.partitioners`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.planner.partitioners import GreedyPerfPartitioner

__all__ = ["GreedyPerfPartitioner"]

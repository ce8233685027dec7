"""torchrec's ``torchrec.distributed.planner`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.planner.constraints import ParameterConstraints
from shardkit.planner.planners import EmbeddingShardingPlanner
from shardkit.planner.topology import Topology

__all__ = ["EmbeddingShardingPlanner", "ParameterConstraints", "Topology"]

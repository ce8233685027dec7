"""torchrec's ``torchrec.distributed.planner.types`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
from shardkit.planner.constraints import ParameterConstraints
from shardkit.planner.errors import PlannerError
from shardkit.planner.topology import Topology
from shardkit.planner.types import ShardingOption

__all__ = ["ParameterConstraints", "PlannerError", "ShardingOption", "Topology"]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    [
        "Enumerator",
        "Partitioner",
        "Perf",
        "Proposer",
        "Shard",
        "ShardEstimator",
        "Storage",
        "StorageReservation",
    ],
)

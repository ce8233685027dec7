"""Layer 3: the sharding planner (topology, constraints, estimators, partitioner -> ShardingPlan).

``EmbeddingShardingPlanner(topology, constraints=...).plan(module, sharders)`` places every table of
the modules the sharders handle, balancing the estimated time of each rank within its memory;
``last_report`` explains the choice. See docs/planner.md (cost model and calibration: docs/planner/).
"""

from shardkit.planner.calibration import calibrate, measure_all_to_all_bw, measure_lookup_bw
from shardkit.planner.constraints import DEFAULT_MIN_PARTITION, ParameterConstraints
from shardkit.planner.cost_model import CostModel
from shardkit.planner.enumerators import EmbeddingEnumerator, shardable_modules
from shardkit.planner.errors import PlannerError, UnplacedShard
from shardkit.planner.estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from shardkit.planner.partitioners import GreedyPerfPartitioner, Partition
from shardkit.planner.planners import EmbeddingShardingPlanner, default_topology
from shardkit.planner.proposers import GreedyThresholdProposer
from shardkit.planner.report import PlanReport
from shardkit.planner.storage_reservation import HeuristicalStorageReservation, dense_parameter_bytes
from shardkit.planner.topology import GIB, Topology
from shardkit.planner.types import ShardingOption, TableInfo

__all__ = [
    "DEFAULT_MIN_PARTITION",
    "GIB",
    "CostModel",
    "EmbeddingEnumerator",
    "EmbeddingPerfEstimator",
    "EmbeddingShardingPlanner",
    "EmbeddingStorageEstimator",
    "GreedyPerfPartitioner",
    "GreedyThresholdProposer",
    "HeuristicalStorageReservation",
    "ParameterConstraints",
    "Partition",
    "PlanReport",
    "PlannerError",
    "ShardingOption",
    "TableInfo",
    "Topology",
    "UnplacedShard",
    "calibrate",
    "default_topology",
    "dense_parameter_bytes",
    "measure_all_to_all_bw",
    "measure_lookup_bw",
    "shardable_modules",
]

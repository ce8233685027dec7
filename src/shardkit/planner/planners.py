"""EmbeddingShardingPlanner: enumerate -> estimate -> propose -> partition -> ShardingPlan.

``plan(module, sharders)`` finds the submodules the sharders handle, lists every allowed sharding of
each of their tables, estimates each option's memory and time, partitions a family of proposals and
keeps the feasible one whose slowest rank is fastest. ``collective_plan`` does that on rank 0 and
broadcasts the result, so every rank shards with the same plan. ``last_report`` explains the plan.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.agreement import group_size
from shardkit.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from shardkit.distributed.topology import get_local_size
from shardkit.modules import OptimType
from shardkit.planner.constraints import ParameterConstraints
from shardkit.planner.enumerators import EmbeddingEnumerator
from shardkit.planner.errors import PlannerError, format_bytes
from shardkit.planner.estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from shardkit.planner.partitioners import GreedyPerfPartitioner, Partition
from shardkit.planner.plan_estimate import placed_partition, plan_options
from shardkit.planner.proposers import GreedyThresholdProposer
from shardkit.planner.report import PlanReport
from shardkit.planner.storage_reservation import HeuristicalStorageReservation
from shardkit.planner.topology import Topology
from shardkit.planner.types import ShardingOption
from shardkit.sharding.sharding_plan import build_parameter_sharding
from shardkit.sharding.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingPlan,
    ShardingPlanner,
    ShardingType,
)

# refinement gives up after this many switches in a row that did not make the plan faster: each
# costs a partition, and on large models the first few decide
_MAX_MISSES = 3
_MAX_LISTED = 20  # tables named in an infeasibility message
_COLUMN_SPLIT = {ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value}


def _faster(a: Partition, b: Partition) -> bool:
    return (a.max_load, a.total_load) < (b.max_load, b.total_load)


def _unplaced_bytes(p: Partition) -> float:
    return sum(u.hbm_needed + u.ddr_needed for u in p.unplaced)


def default_topology() -> Topology:
    """The job's topology: torch.distributed's world (1 when not initialized), the launcher's ranks per
    node, CUDA when available."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Topology(world_size=world, compute_device=device, local_world_size=get_local_size(world))


class EmbeddingShardingPlanner(ShardingPlanner):
    """Plans the sharding of every table of the modules the sharders handle.

    Args:
        topology: ranks, memory and speeds (default :func:`default_topology`).
        batch_size: per-rank batch size of the features without a ``batch_sizes`` constraint.
        constraints: table name -> ``ParameterConstraints``.
        storage_reservation: memory kept from the tables (default ``HeuristicalStorageReservation()``).
        optimizer: the fused optimizer whose state the tables carry (default: the module's own).
        max_refinements: feedback rounds after the first proposals (one partition each; a round
            that does not make the plan faster is undone, and three such rounds in a row end it).

    After ``plan`` / ``collective_plan``, ``last_report`` is the ``PlanReport`` of the returned plan.
    """

    def __init__(
        self,
        topology: Optional[Topology] = None,
        batch_size: int = 512,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        storage_reservation: Optional[HeuristicalStorageReservation] = None,
        optimizer: Optional[OptimType] = None,
        max_refinements: int = 16,
    ) -> None:
        self.topology = topology or default_topology()
        self.enumerator = EmbeddingEnumerator(self.topology, batch_size, constraints, optimizer)
        self.storage_reservation = storage_reservation or HeuristicalStorageReservation()
        self.storage_estimator = EmbeddingStorageEstimator()
        self.perf_estimator = EmbeddingPerfEstimator()
        self.proposer = GreedyThresholdProposer()
        self.partitioner = GreedyPerfPartitioner()
        self.max_refinements = max_refinements
        self.last_report: Optional[PlanReport] = None

    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """The plan for ``module``; raises ``PlannerError`` naming what did not fit when nothing fits."""
        plan, self.last_report = self.plan_with_report(module, sharders)
        return plan

    def collective_plan(
        self,
        module: nn.Module,
        sharders: List[ModuleSharder[nn.Module]],
        pg: Optional[dist.ProcessGroup] = None,
    ) -> ShardingPlan:
        """The plan made on rank 0 of ``pg`` (default group when None), identical on every rank.

        Collective. A planning error on rank 0 raises there and as ``RemoteInvocationError`` (with the
        message) on every other rank; so does a topology whose ``world_size`` is not the group's size
        (``ValueError`` naming both sizes), checked before planning.
        """
        plan, self.last_report = invoke_on_rank_and_broadcast_result(
            pg, 0, self._plan_for_group, module, sharders, group_size(pg)
        )
        return plan

    def _plan_for_group(
        self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]], group_world: int
    ) -> Tuple[ShardingPlan, PlanReport]:
        if self.topology.world_size != group_world:
            raise ValueError(
                f"collective_plan: the topology has world_size {self.topology.world_size} but the process "
                f"group has {group_world} ranks; give Topology(world_size={group_world}), or call plan() "
                "to plan for another cluster without running on it"
            )
        return self.plan_with_report(module, sharders)

    def plan_with_report(
        self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]
    ) -> Tuple[ShardingPlan, PlanReport]:
        """``(plan, report)``: what ``plan`` returns and what it records in ``last_report``."""
        start = time.perf_counter()
        topology = self.topology
        hbm_free, ddr_free = self.storage_reservation.reserve(topology, module, sharders)
        options = [self.enumerator.enumerate(t, s) for t, s in self.enumerator.tables(module, sharders)]
        if not options:
            raise PlannerError(f"no sharder handles any submodule of {type(module).__name__}")
        flat = [o for opts in options for o in opts]
        self.storage_estimator.estimate(flat, topology)
        self.perf_estimator.estimate(flat, topology)
        best: Optional[Tuple[List[ShardingOption], Partition]] = None
        closest: Optional[Partition] = None  # the infeasible partition that left the fewest bytes out
        count = 0
        for proposal in self.proposer.propose(options, topology.world_size, hbm_free, ddr_free):
            count += 1
            partition = self.partitioner.partition(proposal, topology, hbm_free, ddr_free)
            if partition.feasible:
                if best is None or _faster(partition, best[1]):
                    best = (proposal, partition)
            elif closest is None or _unplaced_bytes(partition) < _unplaced_bytes(closest):
                closest = partition
        if best is None:
            raise self._infeasible(closest, hbm_free, ddr_free)
        tried: Set[int] = set()  # ids of options whose switch did not make the plan faster
        misses = 0
        for _ in range(self.max_refinements):
            proposal = self.proposer.refine(options, best[0], best[1], tried)
            if proposal is None or misses == _MAX_MISSES:
                break
            count += 1
            partition = self.partitioner.partition(proposal, topology, hbm_free, ddr_free)
            if partition.feasible and _faster(partition, best[1]):
                best, misses = (proposal, partition), 0
            else:
                tried.update(id(new) for new, old in zip(proposal, best[0]) if new is not old)
                misses += 1
        elapsed = time.perf_counter() - start
        return self._to_plan(best[1]), PlanReport.build(best[1], topology, hbm_free, ddr_free, count, elapsed)

    def estimate(
        self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]], plan: ShardingPlan
    ) -> PlanReport:
        """The cost model's report of a given ``plan`` of ``module`` (e.g. a hand-written one), on the
        same scale as the planner's own: per-table and per-rank time and memory, the slowest rank's
        time (``max_time_s``). ``KeyError`` naming a table the plan does not cover."""
        start = time.perf_counter()
        hbm_free, ddr_free = self.storage_reservation.reserve(self.topology, module, sharders)
        tables = [t for t, _ in self.enumerator.tables(module, sharders)]
        options = plan_options(tables, plan, self.topology)
        self.storage_estimator.estimate(options, self.topology)
        self.perf_estimator.estimate(options, self.topology)
        partition = placed_partition(options, self.topology, hbm_free, ddr_free)
        return PlanReport.build(partition, self.topology, hbm_free, ddr_free, 0, time.perf_counter() - start)

    def _to_plan(self, partition: Partition) -> ShardingPlan:
        t = self.topology
        plans: Dict[str, EmbeddingModuleShardingPlan] = {}
        for o in partition.options:
            split = o.sizes[:, 1] if o.sharding_type in _COLUMN_SPLIT else o.sizes[:, 0]
            if o.sharding_type == ShardingType.GRID_SHARD.value:  # one width per column block (node)
                split = o.sizes[:: t.local_world_size, 1]
            sharding = build_parameter_sharding(
                o.sharding_type,
                (o.table.rows, o.table.cols),
                o.ranks.tolist(),
                sizes=split.tolist(),
                compute_kernel=o.compute_kernel,
                device_type=t.compute_device,
                local_size=t.local_world_size,
                world_size=t.world_size,
            )
            # an offloading kernel's options carry the cache params it was estimated with (a caching
            # one's with the load factor the planner chose); an in-memory table has no cache to configure
            sharding.cache_params = o.cache_params
            plans.setdefault(o.table.module_path, EmbeddingModuleShardingPlan())[o.table.name] = sharding
        return ShardingPlan(plans)

    def _disk_summary(self, partition: Partition) -> str:
        if partition.disk_needed <= 0:
            return ""
        cap = self.topology.disk_cap
        available = "unlimited" if cap is None else format_bytes(cap * self.topology.world_size)
        return f", offload disk {format_bytes(partition.disk_needed)} needed of {available}"

    def _infeasible(self, partition: Partition, hbm_free, ddr_free) -> PlannerError:
        """The error of the proposal that came closest: the tables that fit nowhere even then."""
        # one line per table (its first shard that did not fit), at most _MAX_LISTED tables
        first = {}
        for u in partition.unplaced:
            first.setdefault(u.table, u)
        lines = "\n  ".join(str(u) for u in list(first.values())[:_MAX_LISTED])
        if len(first) > _MAX_LISTED:
            lines += (
                f"\n  ... and {len(first) - _MAX_LISTED} more tables (PlannerError.unplaced lists them all)"
            )
        return PlannerError(
            f"no sharding plan fits the memory of {self.topology.world_size} ranks. With the "
            f"proposal that came closest, these tables did not fit:\n  {lines}\n"
            f"in all: HBM {format_bytes(partition.hbm_needed)} needed of {format_bytes(sum(hbm_free))}, "
            f"DDR {format_bytes(partition.ddr_needed)} needed of {format_bytes(sum(ddr_free))} available for "
            f"tables (after the storage reservation){self._disk_summary(partition)}",
            partition.unplaced,
        )


__all__ = ["EmbeddingShardingPlanner", "default_topology"]

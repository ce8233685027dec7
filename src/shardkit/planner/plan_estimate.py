"""Estimate a given plan: the cost model's figures for a plan the planner did not choose.

``EmbeddingShardingPlanner.estimate(module, sharders, plan)`` turns each table's ``ParameterSharding``
back into a ``ShardingOption`` with the plan's shards and ranks, runs the same estimators the planner
uses and sums the shards' times and memory per rank, as the partitioner does for its own proposals
(plus the plan's fixed overheads, ``CostModel.plan_overhead``, and each rank's lookup groups,
``CostModel.lookup_group_cost``). A hand-written plan and the planner's
plan are then compared on the same scale, and a benchmark can put both next to measured step times.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from shardkit.planner.errors import UnplacedShard
from shardkit.planner.estimators import (
    dense_replica_groups,
    lookup_group_bags,
    lookup_group_keys,
    permuted_replica_modules,
    replica_groups,
)
from shardkit.planner.partitioners import Partition
from shardkit.planner.topology import Topology
from shardkit.planner.types import ShardingOption, TableInfo
from shardkit.sharding.types import ParameterSharding, ShardingPlan, ShardingType


def option_of(table: TableInfo, ps: ParameterSharding, topology: Topology) -> ShardingOption:
    """The ``ShardingOption`` of ``table`` that ``ps`` describes, its shards placed on the plan's ranks."""
    world = topology.world_size
    if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
        sizes = [[table.rows, table.cols]] * world
        offsets = [[0, 0]] * world
        ranks = list(range(world))
    else:
        if ps.sharding_spec is None or ps.ranks is None:
            raise ValueError(f"plan for table {table.fqn!r} ({ps.sharding_type}) has no shards to estimate")
        shards = ps.sharding_spec.shards
        sizes = [list(s.shard_sizes) for s in shards]
        offsets = [list(s.shard_offsets) for s in shards]
        ranks = list(ps.ranks)
        if len(ranks) != len(shards) or any(not 0 <= r < world for r in ranks):
            raise ValueError(
                f"plan for table {table.fqn!r}: ranks {ranks} do not match its {len(shards)} shards on "
                f"{world} ranks"
            )
    return ShardingOption(
        table,
        ps.sharding_type,
        ps.compute_kernel,
        torch.tensor(sizes, dtype=torch.int64),
        torch.tensor(offsets, dtype=torch.int64),
        torch.tensor(ranks, dtype=torch.int64),
        cache_params=ps.cache_params,
    )


def plan_options(tables: Sequence[TableInfo], plan: ShardingPlan, topology: Topology) -> List[ShardingOption]:
    """One option per table, from ``plan`` (``KeyError`` naming a table the plan does not cover)."""
    options = []
    for table in tables:
        module_plan = plan.plan.get(table.module_path)
        if module_plan is None or table.name not in module_plan:
            raise KeyError(f"the plan has no sharding for table {table.fqn!r} (module {table.module_path!r})")
        options.append(option_of(table, module_plan[table.name], topology))
    return options


def placed_partition(
    options: Sequence[ShardingOption],
    topology: Topology,
    hbm_free: Sequence[float],
    ddr_free: Sequence[float],
) -> Partition:
    """The ``Partition`` of estimated options whose shards are already on their ranks: per-rank time
    (plus the plan's overhead) and memory; a shard over its rank's remaining memory is listed unplaced."""
    world = topology.world_size
    load, hbm, ddr, disk = [0.0] * world, list(hbm_free), list(ddr_free), [topology.disk_free] * world
    disk_used = [0.0] * world
    unplaced: List[UnplacedShard] = []
    cost_model = topology.cost_model
    held: List[set] = [set() for _ in range(world)]  # the lookup groups each rank holds so far
    for o in options:
        perf, sh, sd = o.perf.tolist(), o.hbm.tolist(), o.ddr.tolist()
        keys = lookup_group_keys(o)
        group_s = cost_model.lookup_group_cost(lookup_group_bags(o, world))
        sk = [0.0] * len(sd) if o.disk is None else o.disk.tolist()
        for k, r in enumerate(o.ranks.tolist()):
            if sh[k] > hbm[r] or sd[k] > ddr[r] or sk[k] > disk[r]:
                unplaced.append(
                    UnplacedShard(
                        table=o.table.fqn,
                        sharding_type=o.sharding_type,
                        compute_kernel=o.compute_kernel,
                        shard_index=k,
                        hbm_needed=sh[k],
                        ddr_needed=sd[k],
                        hbm_free=hbm[r],
                        ddr_free=ddr[r],
                        disk_needed=sk[k],
                        disk_free=disk[r],
                    )
                )
            load[r] += perf[k]
            if keys[k] is not None and keys[k] not in held[r]:  # the rank's first shard of the group
                load[r] += group_s
                held[r].add(keys[k])
            hbm[r] -= sh[k]
            ddr[r] -= sd[k]
            disk[r] -= sk[k]
            disk_used[r] += sk[k]
    overhead = cost_model.plan_overhead(
        (o.sharding_type for o in options),
        replica_groups(options),
        dense_replica_groups(options, world),
        permuted_replica_modules(options),
    )
    return Partition(
        options=list(options),
        load=[x + overhead for x in load],
        hbm_used=[f - h for f, h in zip(hbm_free, hbm)],
        ddr_used=[f - d for f, d in zip(ddr_free, ddr)],
        unplaced=unplaced,
        hbm_needed=sum(float(o.hbm.sum()) for o in options),
        ddr_needed=sum(float(o.ddr.sum()) for o in options),
        disk_used=disk_used,
        disk_needed=sum(0.0 if o.disk is None else float(o.disk.sum()) for o in options),
    )


__all__ = ["option_of", "placed_partition", "plan_options"]

"""Partitioner: place the shards of a proposal on ranks, balancing time within each rank's memory.

Greedy, longest job first: options whose ranks are fixed (DATA_PARALLEL, ROW_WISE) go first, since
they leave no choice; then the others by decreasing size, where an option's size is the larger of its
share of the proposal's total time and of its total memory (so a table large in either respect is
placed while there is still room). A free shard (TABLE_WISE, COLUMN_WISE) goes to the rank whose
time would be lowest with it, among the ranks with memory for it; a node-bound option
(TABLE_ROW_WISE, TABLE_COLUMN_WISE) to the node whose slowest rank would be fastest. Each step is a scan
over the ranks in plain Python (per-rank figures are floats; torch ops on 64-element tensors would
cost more in dispatch than they save), so 1000 tables over 64 ranks partition in tens of milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence

from shardkit.planner.errors import UnplacedShard
from shardkit.planner.estimators import (
    dense_replica_groups,
    lookup_group_bags,
    lookup_group_keys,
    permuted_replica_modules,
    replica_groups,
)
from shardkit.planner.topology import Topology
from shardkit.planner.types import FIXED, FREE, ShardingOption


@dataclasses.dataclass
class Partition:
    """The outcome of partitioning one proposal.

    Attributes:
        options: the proposal's options with their shards placed (table order), the unplaced ones
            left out.
        load: estimated seconds per step of each rank.
        hbm_used, ddr_used: bytes each rank's shards take.
        unplaced: shards that did not fit (empty when the partition is feasible).
        hbm_needed, ddr_needed: bytes all shards of the proposal need, placed or not.
        disk_used, disk_needed: the same for the CPU offload tier (``Topology.disk_cap``).
    """

    options: List[ShardingOption]
    load: List[float]
    hbm_used: List[float]
    ddr_used: List[float]
    unplaced: List[UnplacedShard]
    hbm_needed: float
    ddr_needed: float
    disk_used: List[float] = dataclasses.field(default_factory=list)
    disk_needed: float = 0.0

    @property
    def feasible(self) -> bool:
        return not self.unplaced

    @property
    def max_load(self) -> float:
        return max(self.load)

    @property
    def total_load(self) -> float:
        return sum(self.load)


class _Shards:
    """An option's per-shard figures as Python floats (read many times in the placement loops)."""

    def __init__(self, o: ShardingOption, topology: Topology) -> None:
        self.perf = o.perf.tolist()
        self.hbm = o.hbm.tolist()
        self.ddr = o.ddr.tolist()
        self.disk = [0.0] * len(self.ddr) if o.disk is None else o.disk.tolist()
        self.ranks = o.ranks.tolist()
        self.groups = lookup_group_keys(o)
        # what a rank pays for holding a lookup group of these shards (once per group it holds)
        self.group_s = topology.cost_model.lookup_group_cost(lookup_group_bags(o, topology.world_size))

    def fits(self, k: int, hbm: float, ddr: float, disk: float) -> bool:
        """Whether shard ``k`` fits a rank with this much free memory and disk."""
        return hbm >= self.hbm[k] and ddr >= self.ddr[k] and disk >= self.disk[k]


class GreedyPerfPartitioner:
    """Longest-job-first placement of a proposal (see the module docstring)."""

    def partition(
        self,
        proposal: Sequence[ShardingOption],
        topology: Topology,
        hbm_free: Sequence[float],
        ddr_free: Sequence[float],
    ) -> Partition:
        world = topology.world_size
        load = [0.0] * world
        hbm, ddr = list(hbm_free), list(ddr_free)
        disk = [topology.disk_free] * world  # infinite when the topology does not limit it
        disk_used = [0.0] * world
        shards = [_Shards(o, topology) for o in proposal]
        # a rank pays a lookup group's cost once per group it holds (its first shard of the group)
        groups = _RankGroups(world)
        total_perf = sum(sum(s.perf) for s in shards) or 1.0
        total_mem = sum(sum(s.hbm) + sum(s.ddr) for s in shards) or 1.0

        def size(i: int) -> float:
            s = shards[i]
            return max(sum(s.perf) / total_perf, (sum(s.hbm) + sum(s.ddr)) / total_mem)

        order = sorted(range(len(proposal)), key=lambda i: (proposal[i].kind != FIXED, -size(i)))
        placed: List[Optional[ShardingOption]] = [None] * len(proposal)
        unplaced: List[UnplacedShard] = []
        for i in order:
            o, s = proposal[i], shards[i]
            if o.kind == FIXED:
                ranks = self._check_fixed(o, s, hbm, ddr, disk, unplaced)
            elif o.kind == FREE:
                ranks = self._place_free(o, s, load, hbm, ddr, disk, unplaced, groups)
            else:
                ranks = self._place_on_host(o, s, topology, load, hbm, ddr, disk, unplaced)
            if ranks is None:
                continue
            for k, r in enumerate(ranks):
                load[r] += s.perf[k] + groups.join(r, s.groups[k], s.group_s)
                hbm[r] -= s.hbm[k]
                ddr[r] -= s.ddr[k]
                disk[r] -= s.disk[k]
                disk_used[r] += s.disk[k]
            placed[i] = o.placed(ranks)
        # what every rank pays once per step for the plan as a whole (the same on every rank, so it
        # does not change where shards go, but it does make a plan mixing more sharding types slower)
        overhead = topology.cost_model.plan_overhead(
            (o.sharding_type for o in proposal),
            replica_groups(proposal),
            dense_replica_groups(proposal, world),
            permuted_replica_modules(proposal),
        )
        return Partition(
            options=[o for o in placed if o is not None],
            load=[x + overhead for x in load],
            hbm_used=[f - h for f, h in zip(hbm_free, hbm)],
            ddr_used=[f - d for f, d in zip(ddr_free, ddr)],
            unplaced=unplaced,
            hbm_needed=sum(sum(s.hbm) for s in shards),
            ddr_needed=sum(sum(s.ddr) for s in shards),
            disk_used=disk_used,
            disk_needed=sum(sum(s.disk) for s in shards),
        )

    @staticmethod
    def _check_fixed(o, s: _Shards, hbm, ddr, disk, unplaced) -> Optional[List[int]]:
        ok = True
        for k, r in enumerate(s.ranks):
            if not s.fits(k, hbm[r], ddr[r], disk[r]):
                unplaced.append(_unplaced(o, s, k, hbm[r], ddr[r], disk[r]))
                ok = False
        return s.ranks if ok else None

    @staticmethod
    def _place_free(o, s: _Shards, load, hbm, ddr, disk, unplaced, groups) -> Optional[List[int]]:
        allowed = o.table.allowed_ranks if o.table.allowed_ranks is not None else range(len(load))
        # tentative figures: a shard that does not fit must not leave its siblings' reservations behind
        load, hbm, ddr, disk = list(load), list(hbm), list(ddr), list(disk)
        joined = set()  # (rank, group) of this option's shards placed so far
        ranks: List[int] = []
        for k in range(len(s.perf)):
            best, best_time = -1, math.inf
            key = s.groups[k]
            for r in allowed:
                group_s = 0.0 if (r, key) in joined else groups.cost(r, key, s.group_s)
                seconds = load[r] + s.perf[k] + group_s
                if s.fits(k, hbm[r], ddr[r], disk[r]) and seconds < best_time:
                    best, best_time = r, seconds
            if best < 0:
                roomiest = max(allowed, key=lambda r: hbm[r] + ddr[r])
                unplaced.append(_unplaced(o, s, k, hbm[roomiest], ddr[roomiest], disk[roomiest]))
                return None
            ranks.append(best)
            load[best] = best_time
            joined.add((best, key))
            hbm[best] -= s.hbm[k]
            ddr[best] -= s.ddr[k]
            disk[best] -= s.disk[k]
        return ranks

    @staticmethod
    def _place_on_host(
        o, s: _Shards, topology: Topology, load, hbm, ddr, disk, unplaced
    ) -> Optional[List[int]]:
        best_ranks, best_score = None, math.inf
        for host in range(topology.num_nodes):
            ranks = [r + host * topology.local_world_size for r in s.ranks]
            if not all(s.fits(k, hbm[r], ddr[r], disk[r]) for k, r in enumerate(ranks)):
                continue
            score = max(load[r] + s.perf[k] for k, r in enumerate(ranks))
            if score < best_score:
                best_ranks, best_score = ranks, score
        if best_ranks is None:
            roomiest = max(range(len(hbm)), key=lambda r: hbm[r] + ddr[r])
            biggest = max(range(len(s.perf)), key=lambda k: s.hbm[k] + s.ddr[k])
            unplaced.append(_unplaced(o, s, biggest, hbm[roomiest], ddr[roomiest], disk[roomiest]))
        return best_ranks


class _RankGroups:
    """The lookup groups (``estimators.lookup_group_keys``) each rank holds so far, and what joining
    one costs: the group's seconds for a rank's first shard of it, 0 after (and for a None key)."""

    def __init__(self, world: int) -> None:
        self.held: List[set] = [set() for _ in range(world)]

    def cost(self, rank: int, key, group_s: float) -> float:
        """Seconds a shard of group ``key`` (a group costing ``group_s``) would add on ``rank`` beside
        its own time."""
        return 0.0 if key is None or key in self.held[rank] else group_s

    def join(self, rank: int, key, group_s: float) -> float:
        """Record a shard of group ``key`` on ``rank``; returns what it added (:meth:`cost`)."""
        added = self.cost(rank, key, group_s)
        if key is not None:
            self.held[rank].add(key)
        return added


def _unplaced(
    o: ShardingOption, s: _Shards, shard: int, hbm_free: float, ddr_free: float, disk_free: float
) -> UnplacedShard:
    return UnplacedShard(
        table=o.table.fqn,
        sharding_type=o.sharding_type,
        compute_kernel=o.compute_kernel,
        shard_index=shard,
        hbm_needed=s.hbm[shard],
        ddr_needed=s.ddr[shard],
        hbm_free=hbm_free,
        ddr_free=ddr_free,
        disk_needed=s.disk[shard],
        disk_free=disk_free,
    )


__all__ = ["GreedyPerfPartitioner", "Partition"]

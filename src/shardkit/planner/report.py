"""PlanReport: the chosen plan explained, as text and as a JSON-able dict.

Per table: sharding type, compute kernel, ranks, shard sizes, estimated memory and time. Per rank: its
memory and time, and the imbalance of the slowest rank over a perfect balance (the total time divided
by the number of ranks). See docs/planner.md ("Reading the printed plan").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Sequence

from shardkit.planner.errors import format_bytes
from shardkit.planner.partitioners import Partition
from shardkit.planner.topology import Topology


def _shard_sizes(sizes: List[List[int]]) -> str:
    """``[[100, 8], [100, 8], [99, 8]]`` -> ``"2x[100,8] 1x[99,8]"`` (runs of equal shards)."""
    runs: List[List[Any]] = []
    for rows, cols in sizes:
        if runs and runs[-1][0] == (rows, cols):
            runs[-1][1] += 1
        else:
            runs.append([(rows, cols), 1])
    return " ".join(f"{n}x[{r},{c}]" for (r, c), n in runs)


def _ranks(ranks: Sequence[int], world: int) -> str:
    ranks = list(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return "all" if len(ranks) == world and ranks[0] == 0 else f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


@dataclasses.dataclass
class PlanReport:
    """What the planner chose and why it thinks it is good.

    Attributes:
        tables: one dict per table (module order): ``table``, ``sharding_type``, ``compute_kernel``,
            ``ranks``, ``shard_sizes``, ``hbm_bytes``, ``ddr_bytes`` (all shards together),
            ``time_s`` (sum over shards) and ``max_shard_time_s``.
        ranks: one dict per rank: ``rank``, ``hbm_bytes``, ``ddr_bytes``, ``hbm_free_bytes``,
            ``ddr_free_bytes``, ``time_s``, ``shards``.
        max_time_s, perfect_time_s: slowest rank's time, and total time / world size.
        imbalance: ``max_time_s / perfect_time_s`` (1.0 is a perfect balance).
        proposals: how many proposals were partitioned; planning_s: wall time of the planning.
        cost_model: the constants the estimates used.
    """

    tables: List[Dict[str, Any]]
    ranks: List[Dict[str, Any]]
    max_time_s: float
    perfect_time_s: float
    imbalance: float
    proposals: int
    planning_s: float
    cost_model: Dict[str, float]

    @classmethod
    def build(
        cls, partition: Partition, topology: Topology, hbm_free, ddr_free, proposals: int, planning_s: float
    ) -> PlanReport:
        world = topology.world_size
        tables, shard_count = [], [0] * world
        for o in partition.options:
            for r in o.ranks.tolist():
                shard_count[r] += 1
            tables.append(
                {
                    "table": o.table.fqn,
                    "sharding_type": o.sharding_type,
                    "compute_kernel": o.compute_kernel,
                    "ranks": o.ranks.tolist(),
                    "shard_sizes": o.sizes.tolist(),
                    "hbm_bytes": float(o.hbm.sum()),
                    "ddr_bytes": float(o.ddr.sum()),
                    "time_s": o.total_perf,
                    "max_shard_time_s": o.max_perf,
                }
            )
        ranks = [
            {
                "rank": r,
                "hbm_bytes": float(partition.hbm_used[r]),
                "ddr_bytes": float(partition.ddr_used[r]),
                "hbm_free_bytes": float(hbm_free[r] - partition.hbm_used[r]),
                "ddr_free_bytes": float(ddr_free[r] - partition.ddr_used[r]),
                "time_s": float(partition.load[r]),
                "shards": shard_count[r],
            }
            for r in range(world)
        ]
        perfect = partition.total_load / world
        return cls(
            tables=tables,
            ranks=ranks,
            max_time_s=partition.max_load,
            perfect_time_s=perfect,
            imbalance=partition.max_load / perfect if perfect > 0 else 1.0,
            proposals=proposals,
            planning_s=planning_s,
            cost_model=topology.cost_model.to_dict(),
        )

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        world = len(self.ranks)
        table_rows = [
            (
                "table",
                "sharding",
                "kernel",
                "ranks",
                "shards [rows,cols]",
                "HBM",
                "DDR",
                "time ms",
                "max shard ms",
            )
        ]
        for t in self.tables:
            table_rows.append(
                (
                    t["table"],
                    t["sharding_type"],
                    t["compute_kernel"],
                    _ranks(t["ranks"], world),
                    _shard_sizes(t["shard_sizes"]),
                    format_bytes(t["hbm_bytes"]),
                    format_bytes(t["ddr_bytes"]),
                    f"{t['time_s'] * 1e3:.3f}",
                    f"{t['max_shard_time_s'] * 1e3:.3f}",
                )
            )
        rank_rows = [("rank", "shards", "HBM used", "HBM free", "DDR used", "DDR free", "time ms")]
        for r in self.ranks:
            rank_rows.append(
                (
                    str(r["rank"]),
                    str(r["shards"]),
                    format_bytes(r["hbm_bytes"]),
                    format_bytes(r["hbm_free_bytes"]),
                    format_bytes(r["ddr_bytes"]),
                    format_bytes(r["ddr_free_bytes"]),
                    f"{r['time_s'] * 1e3:.3f}",
                )
            )
        summary = (
            f"max rank time {self.max_time_s * 1e3:.3f} ms, "
            f"perfect balance {self.perfect_time_s * 1e3:.3f} ms, "
            f"imbalance {self.imbalance:.3f} ({self.proposals} proposals, planned in {self.planning_s:.3f} s)"
        )
        return f"tables:\n{_table(table_rows)}\n\nranks:\n{_table(rank_rows)}\n\n{summary}"


__all__ = ["PlanReport"]

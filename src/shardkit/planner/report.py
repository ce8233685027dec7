"""PlanReport: the chosen plan explained, as text and as a JSON-able dict.

Per table: sharding type, compute kernel, ranks, shard sizes, estimated memory and time. Per rank: its
memory and time, and the imbalance of the slowest rank over a perfect balance (the total time divided
by the number of ranks). See docs/planner.md ("Reading the printed plan").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence

from shardkit.planner.errors import format_bytes
from shardkit.planner.estimators import cached_row_bytes, load_factor
from shardkit.planner.partitioners import Partition
from shardkit.planner.topology import Topology
from shardkit.planner.types import CACHING_KERNELS, OFFLOAD_KERNELS, ShardingOption
from shardkit.sharding.cache_params import cache_rows


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


def _cache(o: ShardingOption, on_gpu: bool) -> Optional[Dict[str, Any]]:
    """An offloading option's tiers: its cache's load factor, rows and bytes (all shards, rows by
    ``cache_rows``' rule), expected hit rate, and the bytes of its slow tier (DDR on CUDA, the offload
    disk on CPU); None for an in-memory kernel."""
    if o.compute_kernel not in OFFLOAD_KERNELS:
        return None
    caching = o.compute_kernel in CACHING_KERNELS
    lf = load_factor(o) if caching else 0.0
    per_value, per_row = cached_row_bytes(o)[:2]
    sizes = o.sizes.tolist()
    rows = [cache_rows(r, lf) if caching else 0 for r, _ in sizes]
    slow = o.ddr if on_gpu else o.disk
    return {
        "load_factor": lf if caching else None,
        "cache_rows": sum(rows),
        "cache_bytes": float(sum(n * (per_value * c + per_row) for n, (_, c) in zip(rows, sizes))),
        "expected_hit_rate": o.hit_rate,
        "hit_rate_source": o.hit_rate_source,
        "slow_tier": "DDR" if on_gpu else "disk",
        "slow_tier_bytes": 0.0 if slow is None else float(slow.sum()),
    }


@dataclasses.dataclass
class PlanReport:
    """What the planner chose and why it thinks it is good.

    Attributes:
        tables: one dict per table (module order): ``table``, ``sharding_type``, ``compute_kernel``,
            ``ranks``, ``shard_sizes``, ``hbm_bytes``, ``ddr_bytes``, ``disk_bytes`` (all shards
            together; disk: the CPU offload tier), ``time_s`` (sum over shards), ``max_shard_time_s``
            and ``cache``: for an offloading kernel a dict of ``load_factor``, ``cache_rows``,
            ``cache_bytes``, ``expected_hit_rate``, ``hit_rate_source``, ``slow_tier``,
            ``slow_tier_bytes`` (None for in-memory kernels).
        ranks: one dict per rank: ``rank``, ``hbm_bytes``, ``ddr_bytes``, ``disk_bytes``,
            ``hbm_free_bytes``, ``ddr_free_bytes``, ``time_s``, ``shards``.
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
        on_gpu = topology.compute_device == "cuda"
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
                    "disk_bytes": 0.0 if o.disk is None else float(o.disk.sum()),
                    "time_s": o.total_perf,
                    "max_shard_time_s": o.max_perf,
                    "cache": _cache(o, on_gpu),
                }
            )
        ranks = [
            {
                "rank": r,
                "hbm_bytes": float(partition.hbm_used[r]),
                "ddr_bytes": float(partition.ddr_used[r]),
                "disk_bytes": float(partition.disk_used[r]) if partition.disk_used else 0.0,
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
        out = f"tables:\n{_table(table_rows)}\n\nranks:\n{_table(rank_rows)}\n\n{summary}"
        caches = self._cache_rows()
        if caches:
            out += f"\n\noffloaded tables (cache in the fast tier, table in the slow tier):\n{_table(caches)}"
        return out

    def _cache_rows(self) -> List[Sequence[str]]:
        """The printed lines of the offloaded tables (none when no table is offloaded)."""
        rows: List[Sequence[str]] = []
        for t in self.tables:
            c = t.get("cache")
            if c is None:
                continue
            hit = c["expected_hit_rate"]
            rows.append(
                (
                    t["table"],
                    t["compute_kernel"],
                    "-" if c["load_factor"] is None else f"{c['load_factor']:.4g}",
                    str(c["cache_rows"]),
                    format_bytes(c["cache_bytes"]),
                    "-" if hit is None else f"{hit:.3f} ({c['hit_rate_source']})",
                    f"{format_bytes(c['slow_tier_bytes'])} {c['slow_tier']}",
                )
            )
        if rows:
            rows.insert(
                0, ("table", "kernel", "load factor", "cache rows", "cache", "expected hit rate", "slow tier")
            )
        return rows


__all__ = ["PlanReport"]

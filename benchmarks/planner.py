"""Sharding planner: planning time, and how well the plan balances the estimated per-rank time.

Run from the repository root: ``python -m benchmarks.planner [--repeats 3 --device cuda]``.

For 10, 100 and 1000 random tables (rows 1e3 to 1e6, dims 16 to 256, pooling factors 1 to 50, one
feature each, batch 512 per rank, fused row-wise Adagrad) over 8 and 64 ranks (8 per node), on the
cost model's default constants for ``--device``:

- ``plan_s``: median wall time of ``EmbeddingShardingPlanner.plan`` (enumerate, estimate, propose,
  partition, build the plan and its report);
- ``max/perfect``: the plan's estimated slowest-rank time over a perfect balance of the same plan
  (its total estimated time / ranks); 1.0 is perfect;
- ``rr_tw/plan``: the naive hand plan (every table whole, round robin over the ranks, ignoring
  memory) - its estimated slowest-rank time over the planner's. Both are estimates of the same
  cost model, so this is the balance the planner buys, not a measured speed-up;
- ``types``: how many tables got each sharding type.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from typing import Any, Dict, List, Optional

from benchmarks.common import write_results
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.planner import (
    EmbeddingEnumerator,
    EmbeddingPerfEstimator,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from shardkit.sharding.types import EmbeddingComputeKernel, ModuleSharder, ShardingType

_ABBREV = {
    "data_parallel": "DP",
    "table_wise": "TW",
    "column_wise": "CW",
    "row_wise": "RW",
    "table_row_wise": "TWRW",
    "table_column_wise": "TWCW",
}


class _PlanningSharder(ModuleSharder):
    """Declares every sharding type with the fused kernel for EmbeddingBagCollection (planning only)."""

    @property
    def module_type(self) -> type:
        return EmbeddingBagCollection

    def shard(self, module, params, env, device=None):
        raise NotImplementedError("the planner benchmark only plans")

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [t.value for t in ShardingType]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.FUSED.value]


def _model(num_tables: int, seed: int):
    rng = random.Random(seed)
    tables, constraints = [], {}
    for i in range(num_tables):
        name = f"t{i}"
        tables.append(
            EmbeddingBagConfig(
                num_embeddings=rng.choice([10**3, 10**4, 10**5, 10**6]),
                embedding_dim=rng.choice([16, 32, 64, 128, 256]),
                name=name,
                feature_names=[f"f{i}"],
            )
        )
        constraints[name] = ParameterConstraints(pooling_factors=[rng.choice([1.0, 5.0, 20.0, 50.0])])
    # fused row-wise Adagrad: what a recommender trains with (its state counts toward memory)
    optimizer = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD)
    return EmbeddingBagCollection(tables, device="meta", fused_optimizer=optimizer), constraints


def _round_robin_table_wise(topology: Topology, module, constraints, batch_size: int) -> float:
    """Estimated slowest-rank time of the hand plan "table i whole on rank i mod W"."""
    enumerator = EmbeddingEnumerator(topology, batch_size, constraints)
    options = []
    for table, sharder in enumerator.tables(module, [_PlanningSharder()]):
        tw = [o for o in enumerator.enumerate(table, sharder) if o.sharding_type == "table_wise"]
        options.append(tw[0])
    EmbeddingPerfEstimator().estimate(options, topology)
    load = [0.0] * topology.world_size
    for i, o in enumerate(options):
        load[i % topology.world_size] += o.total_perf
    return max(load)


def run(tables: int, ranks: int, device: str, repeats: int, batch_size: int) -> Dict[str, Any]:
    module, constraints = _model(tables, seed=tables)
    topology = Topology(world_size=ranks, compute_device=device, local_world_size=min(8, ranks))
    planner = EmbeddingShardingPlanner(topology, batch_size=batch_size, constraints=constraints)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = planner.plan(module, [_PlanningSharder()])
        times.append(time.perf_counter() - start)
    report = planner.last_report
    naive = _round_robin_table_wise(topology, module, constraints, batch_size)
    types = Counter(_ABBREV[ps.sharding_type] for ps in plan.plan[""].values())
    return {
        "name": f"{tables} tables / {ranks} ranks",
        "tables": tables,
        "ranks": ranks,
        "plan_s": sorted(times)[len(times) // 2],
        "max/perfect": report.imbalance,
        "rr_tw/plan": naive / report.max_time_s,
        "proposals": report.proposals,
        "types": " ".join(f"{k}:{v}" for k, v in sorted(types.items())),
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cost model to plan for")
    parser.add_argument("--batch", type=int, default=512, help="per-rank batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    rows = [run(t, r, args.device, args.repeats, args.batch) for t in args.tables for r in args.ranks]
    config = {"device": args.device, "batch": args.batch, "repeats": args.repeats, "local_world_size": 8}
    write_results("planner", config, rows, args.out)


if __name__ == "__main__":
    main()

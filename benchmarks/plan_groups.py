"""A uniform plan timed whole and lookup group by lookup group, against the calibrated cost model.

Run from the repository root: ``python -m benchmarks.plan_groups [--set demo] [--kind data_parallel ...]``.

Why: ``plan_quality`` found the calibrated estimates of the small-table sets' plans 20-40 % too low while
calibrate()'s own steps fit within a few percent (docs/planner/calibration.md, "Known limit"). This
splits such a plan along the model's structure. One ``calibrate()`` runs on ``--world`` CPU ranks (gloo),
then the same ranks time, in alternating rounds, the training step (forward, backward with the fused SGD
update) of the whole table set and of each width's tables alone. Tables of one width make one lookup
group (one replica group when data-parallel), so each of those is one group as a plan of its own. The
table set is plan_quality's (``--set``), every table sharded ``--kind``. Ids are uniform random per
rank, in bags of uniform length in ``[0, 2 x pooling]``. Several kinds (``--kind data_parallel
column_wise table_wise``) are timed in the same rounds under the one calibration: each ``calibrate()``
fits its own constants, so estimates from separate runs differ by their calibrations as well (two
separate runs of one kind put the same plans at 0.89x and 1.61x their measurement).

Each row gives the variant's measured time (the slowest rank's median over rounds of its round mean), the
calibrated estimate (``EmbeddingShardingPlanner.estimate``) and their ratio. Each kind's last line is
``shared``: the groups' times summed less the whole plan's time, over the number of groups less one,
for the measurement and for the estimate. That is the part of a step the groups share, which each group alone
pays and a plan of several groups pays once. A model whose shared part is larger than the measured one
charges each extra group too little. ``./dev bench --quick plan_groups`` is a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.common import write_results


def _variants(tables) -> Dict[str, List[int]]:
    """``name -> table indices``: the whole set, then each width's tables."""
    widths = sorted({dim for _, dim, _ in tables})
    out = {"all": list(range(len(tables)))}
    for width in widths:
        out[f"width {width}"] = [i for i, (_, dim, _) in enumerate(tables) if dim == width]
    return out


def worker(set_name: str, kinds: List[str], rounds: int, steps: int, quick: bool) -> Dict[str, Any]:
    """On every rank: calibrate, then time and estimate each kind's variants (a collective)."""
    from benchmarks.plan_quality import _batch, _Model, _planner, fresh, table_sets
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.distributed.validation import set_validation
    from shardkit.planner import calibrate
    from shardkit.planner.calibration_steps import alternating_seconds
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

    torch.set_num_threads(1)
    set_validation(False)
    rank, world = dist.get_rank(), dist.get_world_size()
    calibrated = calibrate("cpu")
    tables, batch = table_sets(quick)[set_name]
    names, estimates, step_fns = [], [], []
    for kind, (name, index) in itertools.product(kinds, _variants(tables).items()):
        subset = [tables[i] for i in index]
        meta = _Model(subset, torch.device("meta"))
        sharders = [EmbeddingBagCollectionSharder()]
        planner = _planner(subset, batch, world, calibrated, kind)
        plan = [planner.plan(meta, sharders)]
        dist.broadcast_object_list(plan, 0)  # every rank the same plan
        estimates.append(planner.estimate(meta, sharders, plan[0]).max_time_s)
        torch.manual_seed(0)
        model = _Model(subset, torch.device("cpu"))
        env = ShardingEnv.from_process_group(dist.group.WORLD)
        sharded = sharders[0].shard(model.ebc, plan[0].plan["ebc"], env, torch.device("cpu"))
        features = _batch(subset, batch, seed=rank)
        step_fns.append(lambda s=sharded, f=features: s(fresh(f)).values().sum().backward())
        names.append(f"{kind} {name}" if len(kinds) > 1 else name)
    # calibrate()'s own alternating rounds (each round a new order, the same on every rank)
    seconds = alternating_seconds(step_fns, None, torch.device("cpu"), rounds, steps, warmup=3)
    medians = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return {"names": names, "measured_s": medians.tolist(), "estimated_s": estimates}


def with_shared(rows: List[Dict[str, Any]], kind: str) -> List[Dict[str, Any]]:
    """One kind's rows (the whole set first, then each width's tables) and, with two groups or more, the
    ``shared`` row: the groups alone pay the shared part once each, the whole plan once, so it is
    (sum of the groups - whole) / (groups - 1), measured and estimated."""
    if len(rows) <= 2:
        return rows
    extra = len(rows) - 2
    keys = ("measured_ms", "estimated_ms")
    shared = {key: (sum(r[key] for r in rows[1:]) - rows[0][key]) / extra for key in keys}
    ratio = shared["estimated_ms"] / shared["measured_ms"]
    return rows + [{"name": f"{kind} shared".strip(), **shared, "est/meas": ratio}]


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.plan_groups import worker as run  # by module name: the workers unpickle it
    from shardkit.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="demo", choices=["demo", "many_small", "few_large"])
    parser.add_argument(
        "--kind",
        nargs="+",
        default=["data_parallel"],
        choices=["data_parallel", "table_wise", "row_wise", "column_wise"],
        help="one or more sharding types, timed in the same rounds under one calibration",
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant and round")
    parser.add_argument("--full", action="store_true", help="plan_quality's full-size table sets")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    sizes = (args.set, args.kind, args.rounds, args.steps, not args.full)
    result = run_world(run, args.world, *sizes, timeout=900)[0]
    measured = [
        {"name": n, "measured_ms": 1e3 * m, "estimated_ms": 1e3 * e, "est/meas": e / m}
        for n, m, e in zip(result["names"], result["measured_s"], result["estimated_s"])
    ]
    per_kind = len(measured) // len(args.kind)  # the whole set, then each width's tables, per kind
    rows = []
    for k, kind in enumerate(args.kind):
        rows += with_shared(measured[k * per_kind : (k + 1) * per_kind], kind if len(args.kind) > 1 else "")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("plan_groups", config, rows, args.out)


if __name__ == "__main__":
    main()

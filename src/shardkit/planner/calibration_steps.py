"""Calibration of the fixed costs of a sharded training step, measured on the ranks that will train.

The bandwidth terms of the cost model (``calibration.py``) say what bytes cost; on small batches and
many tables the step is dominated by what does not scale with bytes: the Python and dispatch work of
each shard, each sharding type's collectives (their launch and latency, the splits exchange) and the
step's own plumbing. ``measure_step_overheads`` times training steps (forward, backward with the fused
SGD update) of tiny sharded ``EmbeddingBagCollection`` s on the group, all ranks at once (so ranks that
share cores are measured sharing them), and fits:

- ``t = base + sum over the types T used of (group_T + k_T x per_shard_T)``, ``k_T`` the shards of type
  ``T`` per rank, by non-negative least squares over tiny configurations (``fixed_cost_configs``): each
  type alone at ``k`` = 1 and ``COUNTS[1]``, table-wise with each other type, all four together. ``base``
  is the step's own overhead, ``group_T`` what a plan pays once for using type ``T`` at all (its
  collectives), ``per_shard_T`` each shard's;
- a data-parallel table of ``BIG_ROWS`` rows against a tiny one: the extra time beyond its gradient's
  all-reduce, in passes over the table at the lookup bandwidth (``replica_grad_passes``);
- one large table-wise table per rank read at a large batch against its fixed costs: the extra time
  beyond the dists' bytes is the lookup, forward and backward (gradient scatter + fused update): with
  the model's ``bwd_compute_factor`` it gives the lookup bandwidth of a training step, which replaces
  the lone ``embedding_bag``'s (it is timed in the same rounds as the rest, under the same load);
- the same tables row-wise and column-wise: their time beyond fixed costs and bytes, per id their
  shards look up (``id_overhead_s``: routing work).

The model with the fitted constants reproduces the large configurations' measured times
(tests/planner/test_calibration_steps.py). Measured at ``BATCH`` bags per rank: how the fixed costs
grow with the batch is not measured.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_size
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.planner.constraints import ParameterConstraints
from shardkit.planner.cost_model import CostModel
from shardkit.planner.topology import Topology
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.sharding.types import EmbeddingModuleShardingPlan, ShardingPlan
from shardkit.sparse import KeyedJaggedTensor

TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")
COUNTS = (1, 8)  # shards of one type per rank in the two steps the per-shard cost is fitted from
ROUNDS = 4  # alternating rounds of the timed steps
STEPS_PER_ROUND = 2
DIM = 8  # columns per rank's shard (a column-wise table has DIM x world columns)
BATCH = 32  # bags per rank, one id each: the bytes terms stay negligible
BIG_ROWS = 1 << 16  # rows of the data-parallel table whose whole-table passes are measured
# the large table-wise lookup that measures the backward's cost: as calibrate()'s timed lookup
BIG_DIM, BIG_BATCH, BIG_POOLING = 64, 512, 20
BIG_LOOKUP_ROWS = 1 << 16  # 16 MiB at BIG_DIM (a few seconds of set-up less than real sizes)


def big_dim(sharding_type: str, world: int) -> int:
    """Columns per shard of the big configurations: a column-wise table has BIG_DIM in all."""
    return max(1, BIG_DIM // world) if sharding_type == "column_wise" else BIG_DIM


BIG_TYPES = ("table_wise", "row_wise", "column_wise")
# the big lookup's share of its step that is at least its lookup (noise must not make it free)
MIN_LOOKUP_SHARE = 0.1


def _generator(sharding_type: str, index: int, world: int):
    if sharding_type == "table_wise":
        return table_wise(rank=index % world)
    if sharding_type == "row_wise":
        return row_wise()
    if sharding_type == "column_wise":
        return column_wise(ranks=list(range(world)))
    return data_parallel(compute_kernel="fused")


def _module_and_plan(
    types: Sequence[str], rows: Sequence[int], dim: int, world: int, device: torch.device
) -> Tuple[EmbeddingBagCollection, EmbeddingModuleShardingPlan]:
    """One table per entry of ``types`` and its plan (a column-wise table has ``dim`` x world columns)."""
    configs = [
        EmbeddingBagConfig(
            r, dim * world if t == "column_wise" else dim, name=f"c{i}", feature_names=[f"c{i}"]
        )
        for i, (t, r) in enumerate(zip(types, rows))
    ]
    module = EmbeddingBagCollection(
        configs, device=device, fused_optimizer=FusedOptimizerConfig("SGD", lr=0.0)
    )
    counters: Dict[str, int] = {}
    generators = {}
    for i, t in enumerate(types):
        generators[f"c{i}"] = _generator(t, counters.get(t, 0), world)
        counters[t] = counters.get(t, 0) + 1
    plan = construct_module_sharding_plan(
        module, generators, world_size=world, local_size=world, device_type=device.type
    )
    return module, plan


def training_step(
    types: Sequence[str],
    pg: Optional[dist.ProcessGroup],
    device: torch.device,
    rows: Optional[Sequence[int]] = None,
    dim: int = DIM,
    batch: int = BATCH,
    pooling: int = 1,
) -> Callable[[], None]:
    """A training step of one table per entry of ``types`` (that sharding; ``rows`` each, default
    64 x world; ``dim`` columns per shard) on ``batch`` bags of ``pooling`` uniform random ids per rank,
    sharded on ``pg`` (collective: every rank of ``pg`` builds it with the same arguments)."""
    world = group_size(pg)
    rows = list(rows) if rows is not None else [64 * world] * len(types)
    module, plan = _module_and_plan(types, rows, dim, world, device)
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(pg), device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    values = torch.cat([torch.randint(0, r, (batch * pooling,), generator=gen) for r in rows]).to(device)
    features = KeyedJaggedTensor(
        [f"c{i}" for i in range(len(types))],
        values,
        lengths=torch.full((len(types) * batch,), pooling, dtype=torch.int64),
    )

    def step() -> None:
        sharded(features).values().sum().backward()

    return step


def estimated_seconds(
    types: Sequence[str],
    rows: Sequence[int],
    dim: int,
    batch: int,
    pooling: int,
    world: int,
    model: CostModel,
) -> float:
    """The cost model's step time of the same configuration as :func:`training_step` (the slowest rank's)."""
    from shardkit.planner.planners import EmbeddingShardingPlanner  # the planner uses calibrate's results

    module, plan = _module_and_plan(types, rows, dim, world, torch.device("meta"))
    constraints = {f"c{i}": ParameterConstraints(pooling_factors=[float(pooling)]) for i in range(len(types))}
    planner = EmbeddingShardingPlanner(
        Topology(world_size=world, compute_device="cpu", cost_model=model), batch, constraints
    )
    return planner.estimate(module, [EmbeddingBagCollectionSharder()], ShardingPlan({"": plan})).max_time_s


def alternating_seconds(
    steps: Sequence[Callable[[], None]],
    pg: Optional[dist.ProcessGroup],
    device: torch.device,
    rounds: int = ROUNDS,
    per_round: int = STEPS_PER_ROUND,
    warmup: int = 2,
) -> List[float]:
    """Seconds per step of each of ``steps``: every round runs ``per_round`` steps of each in turn (so a
    machine's load drifting during the measurement hits them all alike); per step function, the median
    over rounds of the round's mean. This rank's figures (the caller agrees on the slowest)."""
    for step in steps:
        for _ in range(warmup):
            step()
    times: List[List[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            dist.barrier(group=pg)
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i].append((time.perf_counter() - start) / per_round)
    return [statistics.median(t) for t in times]


def fixed_cost_configs(world: int) -> List[List[str]]:
    """The tiny configurations the fixed costs are fitted from (one sharding type per table): each
    type alone at ``COUNTS`` shards per rank, table-wise with each other type, and all types together."""
    tw = ["table_wise"] * world  # one table-wise table per rank
    configs = [[t] * (k * world if t == "table_wise" else k) for t in TYPES for k in COUNTS]
    configs += [tw + [t] for t in TYPES if t != "table_wise"]
    configs.append(tw + [t for t in TYPES if t != "table_wise"])
    return configs


def shards_per_rank(types: Sequence[str], world: int) -> Dict[str, float]:
    """Shards of each type a rank holds in a configuration (table-wise tables spread over the ranks)."""
    counts = {t: float(sum(1 for x in types if x == t)) for t in TYPES}
    counts["table_wise"] /= world
    return counts


def fit_overheads(configs: Sequence[Sequence[str]], times: Sequence[float], world: int) -> Dict[str, object]:
    """Least squares fit of ``time = step + sum over the types used of (group_T + shards_T x shard_T)``
    to the configurations' step times, every constant >= 0 (a constant the unconstrained fit makes
    negative is fixed at 0 and the rest refitted: noise must not make a cost negative). Returns
    ``step_overhead_s``, ``group_overhead_s`` and ``shard_overhead_s``."""
    rows = []
    for types in configs:
        counts = shards_per_rank(types, world)
        rows.append([1.0] + [1.0 if counts[t] else 0.0 for t in TYPES] + [counts[t] for t in TYPES])
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(list(times), dtype=torch.float64)
    free = list(range(a.shape[1]))
    x = torch.zeros(a.shape[1], dtype=torch.float64)
    while free:
        solution = torch.linalg.lstsq(a[:, free], y[:, None]).solution[:, 0]
        if bool((solution >= 0).all()):
            x[free] = solution
            break
        free = [j for j, v in zip(free, solution.tolist()) if v > 0]  # drop the negative ones, refit
    n = len(TYPES)
    values = x.tolist()
    return {
        "step_overhead_s": values[0],
        "group_overhead_s": dict(zip(TYPES, values[1 : 1 + n])),
        "shard_overhead_s": dict(zip(TYPES, values[1 + n :])),
    }


def measure_step_overheads(
    pg: Optional[dist.ProcessGroup], device: torch.device, model: CostModel
) -> Dict[str, object]:
    """The fitted constants (module doc) from the slowest rank's step times: the same on every rank.
    ``model``: the constants so far (the calibrated collective bandwidth, the backward factor); the
    result replaces its fixed costs, ``lookup_bw`` (the training step's lookup bandwidth, for the
    device's lookup field) and ``id_overhead_s``."""
    world = group_size(pg)
    configs = fixed_cost_configs(world)
    steps = [training_step(types, pg, device) for types in configs]
    steps.append(training_step(["data_parallel"], pg, device, rows=[BIG_ROWS]))
    # world tables of one type read at a large batch (a table-wise one per rank; a row-wise or
    # column-wise table has a shard on every rank): per id and per byte costs
    big = [[t] * world for t in BIG_TYPES]
    big_rows = [BIG_LOOKUP_ROWS] * world
    for types in big:
        dim = big_dim(types[0], world)
        steps.append(training_step(types, pg, device, big_rows, dim, BIG_BATCH, BIG_POOLING))
    times = alternating_seconds(steps, pg, device)
    # the sharded modules hold the group (through reference cycles of modules, hooks and autograd
    # state): free them now, or the group outlives destroy_process_group (docs/running.md)
    del steps
    gc.collect()
    agreed = torch.tensor(times, dtype=torch.float64)
    if dist.get_backend(pg) == "nccl":
        agreed = agreed.to(device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=pg)
    times = agreed.tolist()
    n = len(configs)
    big_replica, big_times = times[n], dict(zip(BIG_TYPES, times[n + 1 :]))
    fitted = fit_overheads(configs, times[:n], world)
    fixed = model.replace(**fitted, lookup_overhead_s=0.0, id_overhead_s={})

    def bytes_only(types, bw: float, **extra) -> float:
        """The model's time of a big configuration beyond its fixed costs, at lookup bandwidth ``bw``."""
        m = fixed.replace(
            ddr_lookup_bw=bw,
            hbm_lookup_bw=bw,
            step_overhead_s=0.0,
            group_overhead_s={},
            shard_overhead_s={},
            **extra,
        )
        dim = big_dim(types[0], world)
        return estimated_seconds(types, big_rows, dim, BIG_BATCH, BIG_POOLING, world, m)

    def fixed_part(t: str) -> float:
        return fixed.plan_overhead([t]) + fixed.shard_overhead(t) * (1 if t == "table_wise" else world)

    # table-wise: its lookups' bytes (forward + backward) give the training step's lookup bandwidth;
    # the model is a + b / bw in it (a: the dists' bytes)
    a = bytes_only(big[0], 1e30)
    b = bytes_only(big[0], 1.0) - a
    extra = max(
        big_times["table_wise"] - fixed_part("table_wise") - a, MIN_LOOKUP_SHARE * big_times["table_wise"]
    )
    lookup_bw = b / extra
    # the other types: what their step costs beyond bytes, per id their shards look up (routing work)
    ids_per_rank = {
        "row_wise": world * BIG_BATCH * BIG_POOLING,
        "column_wise": world * world * BIG_BATCH * BIG_POOLING,
    }
    id_overhead = {"table_wise": 0.0}
    for t in BIG_TYPES[1:]:
        rest = big_times[t] - fixed_part(t) - bytes_only([t] * world, lookup_bw)
        id_overhead[t] = max(0.0, rest / ids_per_rank[t])
    fitted["lookup_bw"] = lookup_bw
    fitted["id_overhead_s"] = id_overhead
    # a fused replica's backward: its gradient's all-reduce (in the bandwidth terms) + whole-table passes
    # at the step's lookup bandwidth (the one the estimator divides them by)
    table_bytes = (BIG_ROWS - 64 * world) * DIM * 4
    all_reduce = 2.0 * (world - 1) / world * table_bytes / model.intra_node_bw
    rest = (
        big_replica
        - fixed.plan_overhead(["data_parallel"])
        - fixed.shard_overhead("data_parallel")
        - all_reduce
    )
    fitted["replica_grad_passes"] = max(0.0, rest * lookup_bw / table_bytes)
    # the same inputs fitted on every rank can differ in the last bits (LAPACK): rank 0's for all
    shared = [fitted]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(pg, 0) if pg is not None else 0, group=pg)
    return shared[0]


__all__ = [
    "COUNTS",
    "TYPES",
    "alternating_seconds",
    "fit_overheads",
    "fixed_cost_configs",
    "shards_per_rank",
    "measure_step_overheads",
    "training_step",
]

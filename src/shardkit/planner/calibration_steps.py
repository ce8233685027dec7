"""Calibration of the cost model from timed training steps, measured on the ranks that will train.

The bandwidth terms of the cost model (``calibration.py``) say what bytes cost on the wire; the rest of
a sharded training step is fitted here. ``measure_step_overheads`` times training steps (forward,
backward with the fused SGD update) of synthetic sharded ``EmbeddingBagCollection`` s on the group,
all ranks at once (so ranks that share cores are measured sharing them), and fits every constant of

    step = step_overhead_s + sum over the types T used of group_overhead_s[T]
           + sum over the slowest rank's shards of (shard_overhead_s[T] + ids x id_overhead_s[T]
             + ids x id_miss_s x miss(shard bytes) + (1 + bwd) ids x c x e / lookup_bw
             + for a fused data-parallel replica: rows applied x (replica_row_s + c x replica_value_s)
             + replica_grad_passes x r c e / lookup_bw (a table-sized gradient buffer))
           + replica_group_s x the groups of fused replicas (one per width) on the sparse way
           + replica_dense_s x those on the dense way (an all-reduce in place of the gather)
           + replica_permute_s if the replicas' widths interleave (each batch permuted into group order)
           + per lookup group on the slowest rank: lookup_group_s + bags x lookup_group_bag_s
           + output values x output_value_s
           + the dists' bytes (input ids, pooled rows forward and backward, a replica's exchange)
             / the collective bandwidth

by one non-negative least-squares fit of the relative errors (``fit_constants``). A column-wise
table is the table-wise dists and lookup over its column blocks, so table-wise's group, shard and id
constants are charged to column-wise too, and column-wise's fitted ones are its extra on top
(``TW_EXTENDED_BY``). Each feature is the estimator's own figure for the configuration with that
constant set to 1 and the others to 0, so the fit and the planner's estimates cannot disagree on what
a constant multiplies. ``lookup_cache_bytes`` (the ``miss`` function's cache) is not linear: the fit is
made for each of ``CACHE_CANDIDATES`` and the
smallest residual wins.

The steps timed are :mod:`shardkit.planner.calibration_configs`'s: synthetic, never the model being
planned.
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
from shardkit.planner.calibration_configs import (
    BIG_BYTES,
    MIB,
    TYPES,
    StepConfig,
    calibration_configs,
    describe,
)
from shardkit.planner.constraints import ParameterConstraints
from shardkit.planner.cost_model import CostModel
from shardkit.planner.least_squares import huber_refit, nnls
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

ID_TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")
# type -> the types whose groups and shards run its code and then some: a column-wise table is looked up
# and exchanged by the table-wise dists over its column blocks (shardkit.sharding.column_wise), so
# table-wise's fitted constants are charged to column-wise as well, and column-wise's fitted ones are
# its extra cost on top (so a column block can never be fitted cheaper than a table-wise shard)
TW_EXTENDED_BY = {"table_wise": ("column_wise",)}
# alternating rounds of the timed steps: on a machine whose cores other work shares, a step's time
# over rounds spreads by 1.5-4x (min to max) and the median of 5 rounds of one plan moved by up to 1.6x
# between two copies of it (docs/planner/plan_quality.md); 9 rounds cost ~1.8x the time of 5. 25: on an
# idle 2-rank machine, calibrations at 9 rounds put the demo's row-wise plan at 1.14-1.32x its table-wise
# one, at 25-27 rounds 1.16-1.19x (calibrate() at 2 ranks 8-10 s -> 15-17 s, at 4 ranks on 2 cores 20-22 s ->
# 38-49 s; docs/planner/calibration.md)
ROUNDS = 25
STEPS_PER_ROUND = 2
CACHE_CANDIDATES = tuple(float(MIB << k) for k in range(10))  # 1 MiB .. 512 MiB
# the row bytes a miss latency streams (CostModel.miss_latency_bytes): one cache line .. 8, or per id
MISS_LATENCY_CANDIDATES = (64.0, 128.0, 256.0, 512.0, float("inf"))
_INF = 1e30  # a bandwidth that makes its bytes free


def _generator(sharding_type: str, index: int, world: int):
    if sharding_type == "table_wise":
        return table_wise(rank=index % world)
    if sharding_type == "row_wise":
        return row_wise()
    if sharding_type == "column_wise":
        return column_wise(ranks=list(range(world)))
    return data_parallel(compute_kernel="fused")


def _module_and_plan(
    config: StepConfig, world: int, device_type: str
) -> Tuple[EmbeddingBagCollection, EmbeddingModuleShardingPlan]:
    """The configuration's module (on the meta device: the sharder creates the shards) and plan."""
    configs = [
        EmbeddingBagConfig(
            config.rows,
            config.width(i) * world if t == "column_wise" else config.width(i),
            name=f"c{i}",
            feature_names=[f"c{i}"],
        )
        for i, t in enumerate(config.types)
    ]
    module = EmbeddingBagCollection(
        configs, device=torch.device("meta"), fused_optimizer=FusedOptimizerConfig("SGD", lr=0.0)
    )
    counters: Dict[str, int] = {}
    generators = {}
    for i, t in enumerate(config.types):
        generators[f"c{i}"] = _generator(t, counters.get(t, 0), world)
        counters[t] = counters.get(t, 0) + 1
    plan = construct_module_sharding_plan(
        module, generators, world_size=world, local_size=world, device_type=device_type
    )
    return module, plan


def training_step(
    config: StepConfig, pg: Optional[dist.ProcessGroup], device: torch.device
) -> Callable[[], None]:
    """A training step of ``config`` sharded on ``pg`` (collective: every rank of ``pg`` builds it with
    the same arguments); each rank its own uniform random ids, in a new ``KeyedJaggedTensor`` every
    step, as a data loader gives them (one object reused skipped the construction and kept the
    lookups' per-input splits warm: data-parallel steps then ran ~0.2 ms faster than training does)."""
    world = group_size(pg)
    module, plan = _module_and_plan(config, world, device.type)
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(pg), device)
    n = len(config.types)
    gen = torch.Generator().manual_seed(dist.get_rank())
    values = torch.randint(0, config.rows, (n * config.batch * config.pooling,), generator=gen).to(device)
    keys = [f"c{i}" for i in range(n)]
    lengths = torch.full((n * config.batch,), config.pooling, dtype=torch.int64, device=device)

    def step() -> None:
        sharded(KeyedJaggedTensor(keys, values, lengths=lengths)).values().sum().backward()

    return step


def estimator(config: StepConfig, world: int) -> Callable[[CostModel], float]:
    """``model -> the cost model's step time of config`` (the slowest rank's), as
    ``EmbeddingShardingPlanner.estimate`` computes it; the tables and shards are built once (the fit
    evaluates every configuration under many models)."""
    from shardkit.planner.plan_estimate import placed_partition, plan_options  # the planner uses calibrate's
    from shardkit.planner.planners import EmbeddingShardingPlanner

    module, plan = _module_and_plan(config, world, "cpu")
    constraints = {
        f"c{i}": ParameterConstraints(pooling_factors=[float(config.pooling)])
        for i in range(len(config.types))
    }
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        Topology(world_size=world, compute_device="cpu"), config.batch, constraints
    )
    hbm_free, ddr_free = planner.storage_reservation.reserve(planner.topology, module, sharders)
    tables = [t for t, _ in planner.enumerator.tables(module, sharders)]
    options = plan_options(tables, ShardingPlan({"": plan}), planner.topology)
    planner.storage_estimator.estimate(options, planner.topology)

    def estimate(model: CostModel) -> float:
        topology = Topology(world_size=world, compute_device="cpu", cost_model=model)
        planner.perf_estimator.estimate(options, topology)
        return max(placed_partition(options, topology, hbm_free, ddr_free).load)

    return estimate


def estimated_seconds(config: StepConfig, world: int, model: CostModel) -> float:
    """The cost model's step time of ``config`` (the slowest rank's)."""
    return estimator(config, world)(model)


def feature_names() -> List[str]:
    """The fitted constants, in the order of the features' columns."""
    return (
        ["step"]
        + [f"group:{t}" for t in TYPES]
        + [f"shard:{t}" for t in TYPES]
        + [f"id:{t}" for t in ID_TYPES]
        + ["id_miss", "output_value", "lookup", "replica", "replica_row", "replica_value", "replica_group"]
        + ["replica_dense", "replica_permute"]
        + ["lookup_group", "lookup_group_bag"]
        + ["comm"]
    )


def _zero(model: CostModel) -> CostModel:
    """``model`` with every fitted constant 0 and every bandwidth free."""
    return model.replace(
        hbm_lookup_bw=_INF,
        ddr_lookup_bw=_INF,
        uvm_lookup_bw=_INF,
        intra_node_bw=_INF,
        cross_node_bw=_INF,
        lookup_overhead_s=0.0,
        step_overhead_s=0.0,
        group_overhead_s={},
        shard_overhead_s={},
        id_overhead_s={},
        id_miss_s=0.0,
        output_value_s=0.0,
        replica_grad_passes=0.0,
        replica_row_s=0.0,
        replica_value_s=0.0,
        replica_group_s=0.0,
        replica_dense_s=0.0,
        replica_permute_s=0.0,
        lookup_group_s=0.0,
        lookup_group_bag_s=0.0,
    )


def config_features(
    config: StepConfig,
    world: int,
    model: CostModel,
    caches: Sequence[float] = CACHE_CANDIDATES,
    miss_widths: Sequence[float] = MISS_LATENCY_CANDIDATES,
) -> Tuple[float, List[float], List[float]]:
    """``(known, features, miss)`` of a configuration: the seconds no fitted constant explains (the
    estimate with every fitted constant 0), the estimator's seconds per
    unit of each constant of ``feature_names()`` but ``id_miss`` (0 there; ``lookup`` and ``comm``:
    seconds at 1 byte/s), and the ``id_miss`` feature at each cache size of ``caches`` and
    ``miss_latency_bytes`` of ``miss_widths`` (cache-major: ``miss[i * len(miss_widths) + j]``)."""
    est = estimator(config, world)
    zero = _zero(model)
    known = est(zero)
    used = set(config.types)
    values: Dict[str, float] = {"step": 1.0}
    for t in TYPES:
        # a column-wise table runs the table-wise dists and lookup over its column blocks
        # (CwPooledEmbeddingSharding is TwPooledEmbeddingSharding): table-wise's constants count for
        # column-wise groups and shards too, and column-wise's own are what it costs beyond them
        # (its features repeated once per block, more pieces per output dist), >= 0 as every one
        covered = (t,) + TW_EXTENDED_BY.get(t, ())
        values[f"group:{t}"] = float(sum(1 for c in covered if c in used))
        shard = {c: 1.0 for c in covered}
        values[f"shard:{t}"] = est(zero.replace(shard_overhead_s=shard)) if used & set(covered) else 0.0
    for t in ID_TYPES:
        covered = (t,) + TW_EXTENDED_BY.get(t, ())
        ids = {c: 1.0 for c in covered}
        values[f"id:{t}"] = est(zero.replace(id_overhead_s=ids)) if used & set(covered) else 0.0
    unit_bw = zero.replace(ddr_lookup_bw=1.0, hbm_lookup_bw=1.0)
    values["lookup"] = est(unit_bw)
    # the dists' bytes, at 1 byte/s: fitted in the same rounds as the rest (the lone all-to-all of
    # calibrate() is one moment of the machine's load; it is the fallback)
    values["comm"] = est(zero.replace(intra_node_bw=1.0, cross_node_bw=1.0))
    values["replica"] = (
        est(unit_bw.replace(replica_grad_passes=1.0)) - values["lookup"] if "data_parallel" in used else 0.0
    )
    for name in ("replica_row", "replica_value", "replica_group", "replica_dense", "replica_permute"):
        values[name] = est(zero.replace(**{f"{name}_s": 1.0})) if "data_parallel" in used else 0.0
    values["output_value"] = est(zero.replace(output_value_s=1.0))
    values["lookup_group"] = est(zero.replace(lookup_group_s=1.0))
    values["lookup_group_bag"] = est(zero.replace(lookup_group_bag_s=1.0))
    values["id_miss"] = 0.0
    # a shard misses as the larger of its bytes and its rank's share of all tables' bytes (replicas
    # whole: estimators.rank_footprint_bytes), neither more than the largest table or that share: a cache
    # of that size serves every id (the miss feature is 0 there without an estimate)
    widths = [config.width(i) * (world if t == "column_wise" else 1) for i, t in enumerate(config.types)]
    share = sum(w * (world if t == "data_parallel" else 1) for w, t in zip(widths, config.types)) / world
    largest = config.rows * max(max(widths), share) * 4
    miss = [
        est(zero.replace(id_miss_s=1.0, lookup_cache_bytes=c, miss_latency_bytes=k)) if c < largest else 0.0
        for c in caches
        for k in miss_widths
    ]
    return known, [values[name] for name in feature_names()], miss


def _extended(fitted: Dict[str, float]) -> Dict[str, float]:
    """Per-type constants from the fitted ones: a type's own plus those of the types it extends
    (``TW_EXTENDED_BY``: column-wise = table-wise's + its extra)."""
    out = dict(fitted)
    for base, extensions in TW_EXTENDED_BY.items():
        for t in extensions:
            if t in out:
                out[t] = fitted[t] + fitted.get(base, 0.0)
    return out


def fit_constants(
    configs: Sequence[StepConfig],
    times: Sequence[float],
    world: int,
    model: CostModel,
    caches: Sequence[float] = CACHE_CANDIDATES,
    device_type: str = "cpu",
    miss_widths: Sequence[float] = MISS_LATENCY_CANDIDATES,
) -> Dict[str, object]:
    """The constants (module doc) that fit the configurations' measured step ``times`` best in relative
    error, every one >= 0. ``model``: the lone measurements of the lookup bandwidth (``hbm_lookup_bw``
    for ``device_type`` cuda, else ``ddr_lookup_bw``) and of the all-to-all (``intra_node_bw``), which
    charge their bytes when the fit finds them free (the rest is then fitted around them). The
    returned constants reproduce ``fitted_s`` exactly through the estimator. Returns
    ``step_overhead_s``, ``group_overhead_s``, ``shard_overhead_s``, ``id_overhead_s``, ``id_miss_s``,
    ``lookup_cache_bytes``, ``lookup_bw``, ``comm_bw``, ``replica_grad_passes``, ``residual`` (the root
    mean square relative error of the fit) and ``fitted_s`` (the fitted model's time of each
    configuration)."""
    rows = [config_features(c, world, model, caches, miss_widths) for c in configs]
    t = torch.tensor(list(times), dtype=torch.float64)
    known = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    base = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    names = feature_names()
    miss_col = names.index("id_miss")

    def base_with_miss(pair: int) -> torch.Tensor:
        """The features with the miss column of (cache, miss width) pair ``pair`` (cache-major)."""
        a = base.clone()
        a[:, miss_col] = torch.tensor([r[2][pair] for r in rows], dtype=torch.float64)
        return a

    # the bandwidths calibrate() measured alone: the lookup's (ddr on CPU, hbm on CUDA), the all-to-all's
    lone_lookup = model.hbm_lookup_bw if device_type == "cuda" else model.ddr_lookup_bw
    fallback = {names.index("lookup"): lone_lookup, names.index("comm"): model.intra_node_bw}

    def solve(a: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """NNLS of the relative errors, each configuration's weighted by ``weights`` (default 1)."""
        w = torch.ones_like(t) if weights is None else weights
        charged: Dict[int, float] = {}  # bandwidth columns charged at their fallback (seconds per byte)
        first = None
        while True:
            free = a.clone()
            fixed = known.clone()
            for col, per_byte in charged.items():
                fixed = fixed + a[:, col] * per_byte
                free[:, col] = 0.0
            # relative errors: a 2 ms step counts as much as a 200 ms one
            x = nnls(free / t[:, None] * w.sqrt()[:, None], (t - fixed) / t * w.sqrt())
            for col, per_byte in charged.items():
                x[col] = per_byte
            first = x if first is None else first
            # a bandwidth whose bytes the fit found free: the timings could not tell its bytes from the
            # other costs (noise). Try its lone measurement instead (the rest refitted), and keep
            # whichever fits better: the lone figure is one moment of the machine and can be worse
            vanished = [
                col
                for col in fallback
                if col not in charged and float((a[:, col] * x[col] / t).max()) <= 1e-6
            ]
            if not vanished:
                break
            charged.update({col: 1.0 / fallback[col] for col in vanished})
        x = min((first, x), key=lambda y: float((w * ((a @ y + known) / t - 1.0) ** 2).sum()))
        for col in fallback:  # bytes found free: a bandwidth of 1e18 B/s (their time is < 1e-6 anyway)
            x[col] = max(float(x[col]), 1e-18)
        return x

    best = None
    for pair in range(len(caches) * len(miss_widths)):
        a = base_with_miss(pair)
        x = solve(a)
        residual = float((((a @ x + known) / t - 1.0) ** 2).mean().sqrt())
        if best is None or residual < best[0] - 1e-12:
            best = (residual, pair, x)
    residual, pair, x = best
    cache, miss_width = caches[pair // len(miss_widths)], miss_widths[pair % len(miss_widths)]
    x = huber_refit(solve, base_with_miss(pair), known, t, x)
    residual = float((((base_with_miss(pair) @ x + known) / t - 1.0) ** 2).mean().sqrt())
    v = dict(zip(names, x.tolist()))
    lookup_bw = 1.0 / v["lookup"]
    comm_bw = 1.0 / v["comm"]
    return {
        "step_overhead_s": v["step"],
        "group_overhead_s": _extended({t: v[f"group:{t}"] for t in TYPES}),
        "shard_overhead_s": _extended({t: v[f"shard:{t}"] for t in TYPES}),
        "id_overhead_s": _extended({t: v[f"id:{t}"] for t in ID_TYPES}),
        "id_miss_s": v["id_miss"],
        "lookup_cache_bytes": cache,
        "miss_latency_bytes": miss_width,
        "output_value_s": v["output_value"],
        "lookup_bw": lookup_bw,
        "comm_bw": comm_bw,
        # the feature was seconds per pass at a bandwidth of 1 byte/s
        "replica_grad_passes": v["replica"] * lookup_bw,
        "replica_row_s": v["replica_row"],
        "replica_value_s": v["replica_value"],
        "replica_group_s": v["replica_group"],
        "replica_dense_s": v["replica_dense"],
        "replica_permute_s": v["replica_permute"],
        "lookup_group_s": v["lookup_group"],
        "lookup_group_bag_s": v["lookup_group_bag"],
        "residual": residual,
        "fitted_s": (base_with_miss(pair) @ x + known).tolist(),
    }


def round_order(n: int, round_index: int) -> List[int]:
    """The order in which round ``round_index`` runs ``n`` steps: round 0 in the given order, every
    other a permutation drawn from a generator seeded by the round (the same on every rank: the steps
    are collectives). A fixed order put the same steps first in every round (the tiny table-wise
    steps, which an idle 2-rank calibration measured 1.3-1.7x their fitted times: the order is a
    suspect, not shown to be the cause), and a rotation keeps every step after the same one."""
    if round_index == 0:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(round_index)).tolist()


def alternating_seconds(
    steps: Sequence[Callable[[], None]],
    pg: Optional[dist.ProcessGroup],
    device: torch.device,
    rounds: int = ROUNDS,
    per_round: int = STEPS_PER_ROUND,
    warmup: int = 2,
) -> List[float]:
    """Seconds per step of each of ``steps``: every round runs ``per_round`` steps of each, in the order
    ``round_order`` (so a machine's load drifting during the measurement hits them all alike, and no
    step always runs first or after the same one); per step function, the median over rounds of the
    round's mean. This rank's figures (the caller agrees on the slowest)."""
    for step in steps:
        for _ in range(warmup):
            step()
    times: List[List[float]] = [[] for _ in steps]
    for r in range(rounds):
        for i in round_order(len(steps), r):
            step = steps[i]
            dist.barrier(group=pg)
            start = time.perf_counter()
            for _ in range(per_round):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i].append((time.perf_counter() - start) / per_round)
    return [statistics.median(t) for t in times]


def measure_step_overheads(
    pg: Optional[dist.ProcessGroup], device: torch.device, model: CostModel, big_bytes: Optional[int] = None
) -> Dict[str, object]:
    """The fitted constants (``fit_constants``) from the slowest rank's step times: the same on every
    rank, plus ``configs`` (``describe`` of each configuration) and ``measured_s`` (their times).
    ``model``: the constants so far (the calibrated collective bandwidths, the lone lookup's bandwidth
    as the fallback); ``big_bytes``: the largest tables (default ``BIG_BYTES``)."""
    world = group_size(pg)
    configs = calibration_configs(world, BIG_BYTES if big_bytes is None else big_bytes)
    steps = [training_step(c, pg, device) for c in configs]
    times = alternating_seconds(steps, pg, device)
    # the sharded modules hold the group (through reference cycles of modules, hooks and autograd
    # state): free them now, or the group outlives destroy_process_group (docs/running.md)
    del steps
    gc.collect()
    agreed = torch.tensor(times, dtype=torch.float64)
    if dist.get_backend(pg) == "nccl":
        agreed = agreed.to(device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=pg)
    # rank 0 fits (seconds of estimator calls), every rank gets its constants
    rank0 = dist.get_global_rank(pg, 0) if pg is not None else 0
    fit = (
        fit_constants(configs, agreed.tolist(), world, model, device_type=device.type)
        if dist.get_rank() == rank0
        else None
    )
    shared = [fit]
    dist.broadcast_object_list(shared, src=rank0, group=pg)
    fitted = shared[0]
    fitted["configs"] = [describe(c) for c in configs]
    fitted["measured_s"] = agreed.tolist()
    return fitted


__all__ = [
    "CACHE_CANDIDATES",
    "ID_TYPES",
    "alternating_seconds",
    "config_features",
    "estimated_seconds",
    "feature_names",
    "fit_constants",
    "measure_step_overheads",
    "round_order",
    "training_step",
]

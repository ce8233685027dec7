"""Calibration of the fixed costs of a sharded training step, measured on the ranks that will train.

The bandwidth terms of the cost model (``calibration.py``) say what bytes cost; on small batches and
many tables the step is dominated by what does not scale with bytes: the Python and dispatch work of
each shard, each sharding type's collectives (their launch and latency, the splits exchange) and the
step's own plumbing. ``measure_step_overheads`` times training steps (forward, backward with the fused
SGD update) of tiny sharded ``EmbeddingBagCollection`` s on the group, all ranks at once (so ranks that
share cores are measured sharing them), and fits:

- per sharding type ``T``: ``t_T(k) = intercept_T + k x per_shard_T`` from steps whose every rank holds
  ``k`` = 1 and ``k`` = ``COUNTS[1]`` shards of type ``T`` only;
- one step mixing one shard per rank of every type: ``t_mix = base + sum_T group_T + sum_T per_shard_T``
  with ``intercept_T = base + group_T`` gives the common ``base`` (the step's own overhead) and each
  type's ``group_T`` (what a plan pays once for using the type at all);
- a data-parallel table of ``BIG_ROWS`` rows against a tiny one: the extra time beyond its gradient's
  all-reduce, in passes over the table at the lookup bandwidth (``replica_grad_passes``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_size
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.sparse import KeyedJaggedTensor

TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")
COUNTS = (1, 6)  # shards of one type per rank in the two steps the per-shard cost is fitted from
ROUNDS = 5  # alternating rounds of the timed steps
STEPS_PER_ROUND = 3
DIM = 8  # columns per rank's shard (a column-wise table has DIM x world columns)
BATCH = 32  # bags per rank, one id each: the bytes terms stay negligible
BIG_ROWS = 1 << 16  # rows of the data-parallel table whose whole-table passes are measured


def _generator(sharding_type: str, index: int, world: int):
    if sharding_type == "table_wise":
        return table_wise(rank=index % world)
    if sharding_type == "row_wise":
        return row_wise()
    if sharding_type == "column_wise":
        return column_wise(ranks=list(range(world)))
    return data_parallel(compute_kernel="fused")


def training_step(
    types: Sequence[str],
    pg: Optional[dist.ProcessGroup],
    device: torch.device,
    rows: Optional[Sequence[int]] = None,
) -> Callable[[], None]:
    """A training step of one tiny table per entry of ``types`` (that sharding), sharded on ``pg``
    (collective: every rank of ``pg`` builds it with the same arguments)."""
    world = group_size(pg)
    rows = list(rows) if rows is not None else [64 * world] * len(types)
    configs = [
        EmbeddingBagConfig(
            r, DIM * world if t == "column_wise" else DIM, name=f"c{i}", feature_names=[f"c{i}"]
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
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(pg), device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    values = torch.cat([torch.randint(0, r, (BATCH,), generator=gen) for r in rows]).to(device)
    features = KeyedJaggedTensor(
        [f"c{i}" for i in range(len(types))],
        values,
        lengths=torch.ones(len(types) * BATCH, dtype=torch.int64),
    )

    def step() -> None:
        sharded(features).values().sum().backward()

    return step


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


def fit_overheads(
    single: Dict[str, Sequence[float]], mixed: float, counts: Sequence[int] = COUNTS
) -> Dict[str, object]:
    """The constants from the step times: ``single[T]`` at ``counts`` shards per rank, ``mixed`` with
    one shard per rank of every type. Returns ``step_overhead_s``, ``group_overhead_s`` and
    ``shard_overhead_s`` (every figure clamped at 0: noise must not make a cost negative)."""
    low, high = counts
    per_shard = {t: max(0.0, (v[1] - v[0]) / (high - low)) for t, v in single.items()}
    intercept = {t: max(0.0, single[t][0] - low * per_shard[t]) for t in single}
    # intercept_T = base + group_T; mixed = base + sum(group_T) + sum(per_shard_T)
    n = len(single)
    shared = sum(intercept.values()) - (mixed - sum(per_shard.values()))
    base = min(max(0.0, shared / (n - 1)), min(intercept.values())) if n > 1 else 0.0
    return {
        "step_overhead_s": base,
        "group_overhead_s": {t: intercept[t] - base for t in single},
        "shard_overhead_s": per_shard,
    }


def measure_step_overheads(
    pg: Optional[dist.ProcessGroup], device: torch.device, lookup_bw: float, collective_bw: float
) -> Dict[str, object]:
    """The fitted constants (module doc) from the slowest rank's step times: the same on every rank.
    ``lookup_bw`` / ``collective_bw``: the calibrated bandwidths (already agreed by the ranks)."""
    world = group_size(pg)
    configs = [[t] * (k * world if t == "table_wise" else k) for t in TYPES for k in COUNTS]
    configs.append(["table_wise"] * world + [t for t in TYPES if t != "table_wise"])  # mixed
    steps = [training_step(types, pg, device) for types in configs]
    steps.append(training_step(["data_parallel"], pg, device, rows=[BIG_ROWS]))
    times = alternating_seconds(steps, pg, device)
    agreed = torch.tensor(times, dtype=torch.float64)
    if dist.get_backend(pg) == "nccl":
        agreed = agreed.to(device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=pg)
    times = agreed.tolist()
    single = {t: times[i * len(COUNTS) : (i + 1) * len(COUNTS)] for i, t in enumerate(TYPES)}
    mixed, big = times[-2], times[-1]
    fitted = fit_overheads(single, mixed)
    # a fused replica's backward: its gradient's all-reduce (in the bandwidth terms) + whole-table passes
    table_bytes = (BIG_ROWS - 64 * world) * DIM * 4
    all_reduce = 2.0 * (world - 1) / world * table_bytes / collective_bw
    small = single["data_parallel"][0]
    fitted["replica_grad_passes"] = max(0.0, (big - small - all_reduce) * lookup_bw / table_bytes)
    return fitted


__all__ = [
    "COUNTS",
    "TYPES",
    "alternating_seconds",
    "fit_overheads",
    "measure_step_overheads",
    "training_step",
]

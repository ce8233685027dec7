"""calibrate()'s fitted constants: non-negative least squares over the estimator's own features,
checked against step times made by the cost model from known constants."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.planner import CostModel
from shardkit.planner import calibration_configs as cc
from shardkit.planner import calibration_steps as cs

MIB = 1 << 20
# the constants the synthetic step times are made from (all > 0, so the fit must find each)
TRUE = CostModel.default("cpu").replace(
    ddr_lookup_bw=8e9,
    intra_node_bw=1e9,
    lookup_overhead_s=0.0,
    step_overhead_s=2e-3,
    group_overhead_s={"table_wise": 1e-3, "row_wise": 2e-3, "column_wise": 3e-3, "data_parallel": 1.5e-3},
    shard_overhead_s={"table_wise": 1e-4, "row_wise": 2e-4, "column_wise": 1.5e-4, "data_parallel": 5e-5},
    id_overhead_s={"table_wise": 2e-8, "row_wise": 5e-8, "column_wise": 3e-8, "data_parallel": 4e-8},
    id_miss_s=1e-7,
    lookup_cache_bytes=8 * MIB,
    replica_grad_passes=6.0,
    replica_row_s=3e-7,
    replica_value_s=2e-9,
    replica_group_s=4e-4,
    replica_dense_s=6e-4,
    replica_permute_s=3e-4,
    output_value_s=5e-9,
    miss_latency_bytes=128.0,
    lookup_group_s=1.5e-4,
    lookup_group_bag_s=1e-7,
)
# what calibrate knows before the fit: the measured collective bandwidth, a lone lookup's bandwidth
BEFORE = CostModel.default("cpu").replace(ddr_lookup_bw=3e9, intra_node_bw=0.3e9)


def _check(fitted, true: CostModel, rel: float = 1e-6) -> None:
    assert fitted["step_overhead_s"] == pytest.approx(true.step_overhead_s, rel=rel)
    for name in ("group_overhead_s", "shard_overhead_s", "id_overhead_s"):
        assert fitted[name] == pytest.approx(getattr(true, name), rel=rel), name
    assert fitted["id_miss_s"] == pytest.approx(true.id_miss_s, rel=rel)
    assert fitted["lookup_cache_bytes"] == true.lookup_cache_bytes
    assert fitted["miss_latency_bytes"] == true.miss_latency_bytes
    assert fitted["output_value_s"] == pytest.approx(true.output_value_s, rel=rel)
    assert fitted["lookup_bw"] == pytest.approx(true.ddr_lookup_bw, rel=rel)
    assert fitted["comm_bw"] == pytest.approx(true.intra_node_bw, rel=rel)
    assert fitted["replica_grad_passes"] == pytest.approx(true.replica_grad_passes, rel=rel)
    assert fitted["replica_row_s"] == pytest.approx(true.replica_row_s, rel=rel)
    assert fitted["replica_value_s"] == pytest.approx(true.replica_value_s, rel=rel)
    assert fitted["replica_group_s"] == pytest.approx(true.replica_group_s, rel=rel)
    assert fitted["replica_dense_s"] == pytest.approx(true.replica_dense_s, rel=rel)
    assert fitted["replica_permute_s"] == pytest.approx(true.replica_permute_s, rel=rel)
    assert fitted["lookup_group_s"] == pytest.approx(true.lookup_group_s, rel=rel)
    assert fitted["lookup_group_bag_s"] == pytest.approx(true.lookup_group_bag_s, rel=rel)


@pytest.mark.parametrize("world", [2, 4])
def test_the_fit_recovers_the_constants_the_step_times_were_made_from(world):
    configs = cc.calibration_configs(world)
    times = [cs.estimated_seconds(c, world, TRUE) for c in configs]
    fitted = cs.fit_constants(configs, times, world, BEFORE)
    _check(fitted, TRUE)
    assert fitted["residual"] < 1e-9


def test_the_cache_size_is_the_one_that_fits_best():
    world = 2
    configs = cc.calibration_configs(world)
    for cache in (2 * MIB, 32 * MIB):
        true = TRUE.replace(lookup_cache_bytes=cache)
        fitted = cs.fit_constants(
            configs, [cs.estimated_seconds(c, world, true) for c in configs], world, BEFORE
        )
        _check(fitted, true)


def test_noisy_times_never_give_a_negative_cost():
    world = 2
    configs = cc.calibration_configs(world)
    times = [cs.estimated_seconds(c, world, TRUE) for c in configs]
    gen = torch.Generator().manual_seed(0)
    noisy = [t * float(1 + 0.3 * (torch.rand((), generator=gen) - 0.5)) for t in times]
    noisy[3], noisy[5] = 3 * noisy[5], noisy[3] / 3  # row-wise: more shards measured faster
    fitted = cs.fit_constants(configs, noisy, world, BEFORE)
    assert fitted["step_overhead_s"] >= 0.0 and fitted["id_miss_s"] >= 0.0
    assert fitted["replica_grad_passes"] >= 0.0 and fitted["lookup_bw"] > 0.0
    assert min(fitted[f"replica_{k}_s"] for k in ("row", "value", "group", "dense")) >= 0.0
    for name in ("group_overhead_s", "shard_overhead_s", "id_overhead_s"):
        assert all(v >= 0.0 for v in fitted[name].values()), fitted
    assert 0.0 < fitted["residual"] < 0.5
    _check_consistent(configs, world, BEFORE, fitted)


SMALL_BIG = 1 * MIB  # the end-to-end test's largest tables: seconds of set-up, not minutes


def _calibrate_with_fake_step_times():
    from shardkit.planner import calibrate, calibration

    world, rank = dist.get_world_size(), dist.get_rank()
    # this worker process only: small tables, and the collective bandwidth the times were made with
    cs.BIG_BYTES = SMALL_BIG  # the default measure_step_overheads reads
    calibration.measure_all_to_all_bw = lambda *_, **__: TRUE.intra_node_bw
    configs = cc.calibration_configs(world, SMALL_BIG)
    true = TRUE.replace(id_miss_s=0.0)  # tables of at most 1 MiB: no cache size to find
    fake = [cs.estimated_seconds(c, world, true) * (1.0 if rank == 1 else 0.8) for c in configs]
    # rank 1 slower: ranks agree on it
    cs.alternating_seconds = lambda steps, pg, device, **_: fake[-len(steps) :]
    report = {}
    got = calibrate("cpu", rows=4096, dim=16, batch=64, pooling=4, fit_report=report).to_dict()
    return got, true.to_dict(), report


def test_calibrate_fits_the_slowest_ranks_step_times_on_every_rank(run_world):
    results = run_world(_calibrate_with_fake_step_times, 2)
    assert results[0][0] == results[1][0]
    got, true, report = results[0]
    assert report["residual"] < 1e-9 and len(report["steps"]) == len(cc.calibration_configs(2, SMALL_BIG))
    for step in report["steps"]:  # the slowest rank's times (rank 1's), and the fit reproduces them
        assert step["fitted_s"] == pytest.approx(step["measured_s"], rel=1e-6), step["config"]
    for name in (
        "step_overhead_s",
        "replica_grad_passes",
        "replica_row_s",
        "replica_value_s",
        "replica_group_s",
        "replica_dense_s",
        "output_value_s",
        "ddr_lookup_bw",
    ):
        assert got[name] == pytest.approx(true[name], rel=1e-6), name
    for name in ("group_overhead_s", "shard_overhead_s", "id_overhead_s"):
        assert got[name] == pytest.approx(true[name], rel=1e-6), name
    assert got["id_miss_s"] == 0.0


@pytest.mark.parametrize("device_type, field", [("cpu", "ddr_lookup_bw"), ("cuda", "hbm_lookup_bw")])
def test_free_lookups_stay_free_when_that_fits_better_than_the_lone_bandwidth(device_type, field):
    world = 2
    configs = cc.calibration_configs(world, 4 * MIB)
    free = TRUE.replace(ddr_lookup_bw=1e30, id_miss_s=0.0)  # no time at all per byte read
    times = [cs.estimated_seconds(c, world, free) for c in configs]
    before = BEFORE.replace(hbm_lookup_bw=7e11)
    fitted = cs.fit_constants(configs, times, world, before, device_type=device_type)
    # charging the bytes at the lone figure would fit worse than the free bytes the times say
    assert fitted["lookup_bw"] >= 1e17 and fitted["residual"] < 1e-6
    _check_consistent(configs, world, before, fitted)
    # times that do cost bytes, at a lone figure that is right: the fit finds them (no fallback)
    times = [cs.estimated_seconds(c, world, TRUE.replace(id_miss_s=0.0)) for c in configs]
    fitted = cs.fit_constants(configs, times, world, before, device_type=device_type)
    assert fitted["lookup_bw"] == pytest.approx(TRUE.ddr_lookup_bw, rel=1e-6)


def _model_of(fitted, before: CostModel) -> CostModel:
    constants = {k: v for k, v in fitted.items() if k not in ("lookup_bw", "comm_bw", "residual", "fitted_s")}
    bw = fitted["lookup_bw"]
    return before.replace(ddr_lookup_bw=bw, hbm_lookup_bw=bw, intra_node_bw=fitted["comm_bw"], **constants)


def _check_consistent(configs, world, before, fitted):
    """The returned constants, in the planner's estimator, give the fit's own times: what the fit
    claims is what the planner will estimate."""
    model = _model_of(fitted, before)
    for config, expected in zip(configs, fitted["fitted_s"]):
        assert cs.estimated_seconds(config, world, model) == pytest.approx(expected, rel=1e-9), config


def test_one_step_timed_in_a_load_spike_does_not_set_a_constant():
    # a shared machine: one tiny step measured at twice its time (the others exact). Least squares of
    # the squared errors moved the fixed costs of every type and the step by 10-20 %;
    # the Huber-weighted refit gives that step little weight and recovers the constants
    world = 2
    configs = cc.calibration_configs(world)
    times = [cs.estimated_seconds(c, world, TRUE) for c in configs]
    spike = [cc.describe(c) for c in configs].index("4 row_wise: 128x8 b32 p1")
    times[spike] *= 2.0
    fitted = cs.fit_constants(configs, times, world, BEFORE)
    _check(fitted, TRUE, rel=1e-3)
    # the residual says how far the steps are from the fit, the spike included
    assert fitted["residual"] > 0.05


@pytest.mark.parametrize("world", [2, 4])
def test_a_column_block_is_never_fitted_cheaper_than_a_table_wise_shard(world):
    # column-wise runs the table-wise dists and lookup over its column blocks (CwPooledEmbeddingSharding
    # is TwPooledEmbeddingSharding), plus its own work (features repeated per block, more output pieces):
    # its fixed, per-shard and per-id costs are table-wise's plus something >= 0. Fitted as independent
    # constants, noise let a bench9 calibration at 4 ranks give column-wise a 3.8 ms group against
    # table-wise's 6.6 ms and 0 per table-wise shard, and the planner then chose all column-wise for the
    # demo's tables (measured 1.37x all table-wise). Times made from such a model must not fit that way.
    cheap_cw = TRUE.replace(
        group_overhead_s={**TRUE.group_overhead_s, "column_wise": 0.2e-3},
        shard_overhead_s={**TRUE.shard_overhead_s, "column_wise": 2e-5},
        id_overhead_s={**TRUE.id_overhead_s, "column_wise": 0.0},
    )
    configs = cc.calibration_configs(world)
    times = [cs.estimated_seconds(c, world, cheap_cw) for c in configs]
    fitted = cs.fit_constants(configs, times, world, BEFORE)
    for name in ("group_overhead_s", "shard_overhead_s", "id_overhead_s"):
        assert fitted[name]["column_wise"] >= fitted[name]["table_wise"], (name, fitted[name])
    # the constants returned are the ones the fit's times come from (column-wise's summed in)
    _check_consistent(configs, world, BEFORE, fitted)


def test_column_wise_constants_are_table_wise_s_plus_an_extra_that_the_fit_recovers():
    # times from a model that has that structure (column-wise >= table-wise in every constant): the fit
    # recovers each type's total, as for the other types
    world = 2
    configs = cc.calibration_configs(world)
    times = [cs.estimated_seconds(c, world, TRUE) for c in configs]
    fitted = cs.fit_constants(configs, times, world, BEFORE)
    assert fitted["group_overhead_s"]["column_wise"] == pytest.approx(3e-3, rel=1e-6)
    assert fitted["shard_overhead_s"]["column_wise"] == pytest.approx(1.5e-4, rel=1e-6)
    assert fitted["id_overhead_s"]["column_wise"] == pytest.approx(3e-8, rel=1e-6)


def test_every_round_times_every_step_once_and_no_step_is_always_first():
    n = 12
    orders = [cs.round_order(n, r) for r in range(cs.ROUNDS)]
    assert orders[0] == list(range(n))
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert len({order[0] for order in orders}) > 1
    # the predecessors change too (a rotation would keep every step after the same one)
    after = {tuple(sorted({o[o.index(3) - 1] for o in orders if o.index(3) > 0}))}
    assert len(next(iter(after))) > 1
    assert cs.round_order(n, 5) == cs.round_order(n, 5)  # the same on every rank: the steps are collectives


def test_a_wide_table_at_a_large_batch_is_among_the_steps():
    """The slope of a step in its ids at plan_quality's large batches (1024-2048 bags of 20 ids)."""
    configs = cc.calibration_configs(2)
    assert any(c.batch >= 4 * cc.BIG_BATCH and c.dim >= 128 and c.pooling == cc.BIG_POOLING for c in configs)


@pytest.mark.parametrize("world", [2, 4])
def test_the_dense_ways_fixed_cost_and_in_cache_replica_rows_have_steps_of_their_own(world):
    """``replica_dense_s`` is fitted from two dense-way steps of different table sizes (one alone could
    not tell the fixed cost from ``replica_grad_passes``' passes over the table: an idle 2-rank fit
    made 893 passes of its 512 KiB table), and the small in-cache replica group takes the sparse way
    with thousands of rows (the per-row update where no miss term can take it)."""
    configs = cc.calibration_configs(world)
    column = cs.feature_names().index("replica_dense")
    charged = {}
    for config in configs:
        _, features, _ = cs.config_features(config, world, BEFORE)
        if features[column] > 1e-9:  # (the other steps: free bandwidths' 1e-30 s a byte)
            charged[cc.describe(config)] = features[column]
    # the two large dense-way steps, each paying one group's fixed cost, and the tiny replicas at
    # DENSE_BATCH bags, one dense group per width
    tiny = 64 * world
    big = f"x{cc.BIG_DIM} b{cc.BIG_BATCH} p{cc.BIG_POOLING}"
    large = {f"1 data_parallel: {rows}{big}": 1 for rows in (2048, 512)}
    groups = {f"{k} data_parallel: {tiny}x{cc.DIM}..{cc.DIM * k} b{cc.DENSE_BATCH} p1": k for k in (4, 16)}
    # and the 8 replicas of 4 interleaved widths at DENSE_BATCH: their 4 groups
    groups[f"8 data_parallel: {tiny}x{cc.DIM}..{cc.DIM * 4} x2 b{cc.DENSE_BATCH} p1"] = 4
    if world == 4:  # the smaller lookup-group replicas at the larger batch touch most rows at 4 ranks
        small_group = f"{cc.GROUP_TABLES} data_parallel: {cc.GROUP_ROWS}x8..24 x8 b{max(cc.GROUP_BATCHES)} p2"
        groups[small_group] = 3
    assert charged == pytest.approx({**large, **groups})
    small = [c for c in configs if c.types == ("data_parallel",) * 8 and c.rows == cc.SMALL_REPLICA_ROWS]
    assert len(small) == 1
    (config,) = small
    assert config.rows * config.dim * 4 <= min(cs.CACHE_CANDIDATES)  # no miss, whatever the cache
    ids = config.batch * config.pooling
    touched = config.rows * (1 - (1 - 1 / config.rows) ** ids)
    assert len(config.types) * touched > 1000  # thousands of rows updated per rank
    # the two constants are fitted apart: times made with only the fixed cost give no passes, and back
    only_fixed = TRUE.replace(replica_grad_passes=0.0)
    times = [cs.estimated_seconds(c, world, only_fixed) for c in configs]
    fitted = cs.fit_constants(configs, times, world, BEFORE)
    assert fitted["replica_dense_s"] == pytest.approx(TRUE.replica_dense_s, rel=1e-6)
    assert fitted["replica_grad_passes"] == pytest.approx(0.0, abs=1e-6)

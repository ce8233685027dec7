"""calibrate()'s fixed-cost constants: fitted from timed training steps, identical on every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardkit.planner import CostModel
from shardkit.planner import calibration_steps as cs
from shardkit.planner.calibration_steps import COUNTS, TYPES, fit_overheads

BASE = 1e-3
GROUP = {"table_wise": 2e-3, "row_wise": 3e-3, "column_wise": 4e-3, "data_parallel": 5e-3}
PER_SHARD = {"table_wise": 0.1e-3, "row_wise": 0.2e-3, "column_wise": 0.3e-3, "data_parallel": 0.4e-3}


def _times(base=BASE, group=GROUP, per_shard=PER_SHARD):
    single = {t: [base + group[t] + k * per_shard[t] for k in COUNTS] for t in TYPES}
    mixed = base + sum(group.values()) + sum(per_shard.values())
    return single, mixed


def test_fit_recovers_the_constants_the_times_were_made_from():
    single, mixed = _times()
    fitted = fit_overheads(single, mixed)
    assert fitted["step_overhead_s"] == pytest.approx(BASE)
    assert fitted["group_overhead_s"] == pytest.approx(GROUP)
    assert fitted["shard_overhead_s"] == pytest.approx(PER_SHARD)


def test_noisy_times_never_give_a_negative_cost():
    single, mixed = _times()
    single["row_wise"] = [5e-3, 4e-3]  # more shards measured faster: noise
    fitted = fit_overheads(single, mixed * 10)  # a mixed step far slower than its parts: noise
    assert fitted["shard_overhead_s"]["row_wise"] == 0.0
    assert fitted["step_overhead_s"] >= 0.0
    assert all(v >= 0.0 for v in fitted["group_overhead_s"].values())


def _fake_times(world: int, rank: int):
    single, mixed = _times()
    big_replica = single["data_parallel"][0] + 0.05
    big = [single["table_wise"][0] + 0.08, single["row_wise"][0] + 0.2, single["column_wise"][0] + 0.3]
    times = [single[t][i] for t in TYPES for i in range(len(COUNTS))] + [mixed, big_replica, *big]
    return [x + 1e-3 * rank for x in times]  # rank 1 slower: the ranks must agree on the slowest


def _calibrate_with_fake_step_times(fake: bool):
    from shardkit.planner import calibrate

    world, rank = dist.get_world_size(), dist.get_rank()
    if fake:
        cs.alternating_seconds = lambda steps, pg, device, **_: _fake_times(world, rank)[: len(steps)]
    return calibrate("cpu", rows=4096, dim=16, batch=64, pooling=4).to_dict()


def test_calibrate_fits_the_measured_step_times_on_every_rank(run_world):
    """The constants come from the (here: given) step times of the slowest rank, and the model with
    them reproduces the large steps it was fitted to."""
    results = run_world(_calibrate_with_fake_step_times, 2, True)
    assert results[0] == results[1]
    got = results[0]
    slowest = _fake_times(2, 1)
    n = len(TYPES) * len(COUNTS)
    single = {t: slowest[i * len(COUNTS) : (i + 1) * len(COUNTS)] for i, t in enumerate(TYPES)}
    expected = fit_overheads(single, slowest[n])
    assert got["step_overhead_s"] == pytest.approx(expected["step_overhead_s"])
    assert got["group_overhead_s"] == pytest.approx(expected["group_overhead_s"])
    assert got["shard_overhead_s"] == pytest.approx(expected["shard_overhead_s"])
    assert got["id_overhead_s"]["row_wise"] > 0 and got["id_overhead_s"]["column_wise"] > 0
    model = CostModel(**got)
    rows = [cs.BIG_LOOKUP_ROWS] * 2
    for i, t in enumerate(cs.BIG_TYPES):
        estimate = cs.estimated_seconds([t] * 2, rows, cs.BIG_DIM, cs.BIG_BATCH, cs.BIG_POOLING, 2, model)
        assert estimate == pytest.approx(slowest[n + 2 + i], rel=1e-6), t
    replica = cs.estimated_seconds(["data_parallel"], [cs.BIG_ROWS], cs.DIM, cs.BATCH, 1, 2, model)
    assert replica == pytest.approx(slowest[n + 1], rel=0.02)  # its 32 ids' bytes are not in the fit


def test_calibrate_times_real_steps_on_two_ranks(run_world):
    results = run_world(_calibrate_with_fake_step_times, 2, False)
    assert results[0] == results[1]
    got = results[0]
    assert set(got["group_overhead_s"]) == set(TYPES) and set(got["shard_overhead_s"]) == set(TYPES)
    # a training step with collectives takes time: the fitted fixed costs are not all zero
    assert got["step_overhead_s"] + sum(got["group_overhead_s"].values()) > 0.0

"""calibrate()'s fixed-cost constants: fitted from timed training steps, identical on every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardkit.planner import CostModel
from shardkit.planner import calibration_steps as cs
from shardkit.planner.calibration_steps import TYPES, fit_overheads, fixed_cost_configs, shards_per_rank

BASE = 1e-3
GROUP = {"table_wise": 2e-3, "row_wise": 3e-3, "column_wise": 4e-3, "data_parallel": 5e-3}
PER_SHARD = {"table_wise": 0.1e-3, "row_wise": 0.2e-3, "column_wise": 0.3e-3, "data_parallel": 0.4e-3}


def _times(world: int = 2, base=BASE, group=GROUP, per_shard=PER_SHARD):
    times = []
    for types in fixed_cost_configs(world):
        counts = shards_per_rank(types, world)
        times.append(base + sum(group[t] + counts[t] * per_shard[t] for t in TYPES if counts[t]))
    return times


def test_fit_recovers_the_constants_the_times_were_made_from():
    for world in (2, 4):
        fitted = fit_overheads(fixed_cost_configs(world), _times(world), world)
        assert fitted["step_overhead_s"] == pytest.approx(BASE)
        assert fitted["group_overhead_s"] == pytest.approx(GROUP)
        assert fitted["shard_overhead_s"] == pytest.approx(PER_SHARD)


def test_noisy_times_never_give_a_negative_cost():
    configs = fixed_cost_configs(2)
    times = _times()
    times[2], times[3] = 9e-3, 4e-3  # row-wise: more shards measured faster (noise)
    times[-1] *= 0.2  # all four types together faster than each alone (noise)
    fitted = fit_overheads(configs, times, 2)
    assert fitted["step_overhead_s"] >= 0.0
    for name in ("group_overhead_s", "shard_overhead_s"):
        assert all(v >= 0.0 for v in fitted[name].values()), fitted
    assert fitted["shard_overhead_s"]["row_wise"] == 0.0


def _fake_times(world: int, rank: int):
    tiny = _times(world)
    big_replica = BASE + GROUP["data_parallel"] + PER_SHARD["data_parallel"] + 0.05
    big = [BASE + GROUP[t] + 0.1 * (i + 1) for i, t in enumerate(cs.BIG_TYPES)]
    return [x + 1e-3 * rank for x in [*tiny, big_replica, *big]]  # rank 1 slower: ranks agree on it


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
    configs = fixed_cost_configs(2)
    n = len(configs)
    expected = fit_overheads(configs, slowest[:n], 2)
    assert got["step_overhead_s"] == pytest.approx(expected["step_overhead_s"])
    assert got["group_overhead_s"] == pytest.approx(expected["group_overhead_s"])
    assert got["shard_overhead_s"] == pytest.approx(expected["shard_overhead_s"])
    assert got["id_overhead_s"]["row_wise"] > 0 and got["id_overhead_s"]["column_wise"] > 0
    model = CostModel(**got)
    rows = [cs.BIG_LOOKUP_ROWS] * 2
    for i, t in enumerate(cs.BIG_TYPES):
        dim = cs.big_dim(t, 2)
        estimate = cs.estimated_seconds([t] * 2, rows, dim, cs.BIG_BATCH, cs.BIG_POOLING, 2, model)
        assert estimate == pytest.approx(slowest[n + 1 + i], rel=1e-6), t
    replica = cs.estimated_seconds(["data_parallel"], [cs.BIG_ROWS], cs.DIM, cs.BATCH, 1, 2, model)
    assert replica == pytest.approx(slowest[n], rel=0.02)  # its 32 ids' bytes are not in the fit


def test_calibrate_times_real_steps_on_two_ranks(run_world):
    results = run_world(_calibrate_with_fake_step_times, 2, False)
    assert results[0] == results[1]
    got = results[0]
    assert set(got["group_overhead_s"]) == set(TYPES) and set(got["shard_overhead_s"]) == set(TYPES)
    # a training step with collectives takes time: the fitted fixed costs are not all zero
    assert got["step_overhead_s"] + sum(got["group_overhead_s"].values()) > 0.0

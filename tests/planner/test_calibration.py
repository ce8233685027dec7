"""calibrate() on one process: it measures the lookup and leaves what it cannot measure alone."""

from __future__ import annotations

from shardkit.planner import CostModel, EmbeddingShardingPlanner, Topology, calibrate
from tests.planner._sharder import ebc_sharder, meta_ebc, random_tables

SMALL_LOOKUP = {"rows": 4096, "dim": 16, "batch": 64, "pooling": 4}


def test_calibrate_replaces_the_lookup_bandwidth_only():
    base = CostModel.default("cpu").replace(lookup_overhead_s=1e-3)
    measured = calibrate("cpu", base=base, **SMALL_LOOKUP)
    assert measured.ddr_lookup_bw > 0 and measured.ddr_lookup_bw != base.ddr_lookup_bw
    # no process group: the communication constants stay as given
    assert measured.replace(ddr_lookup_bw=base.ddr_lookup_bw) == base


def test_the_planner_uses_calibrated_constants():
    model = CostModel.default("cpu").replace(ddr_lookup_bw=1e6)
    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu", cost_model=model))
    planner.plan(meta_ebc(random_tables(4, seed=0, max_rows=1000)), [ebc_sharder()])
    assert planner.last_report.cost_model["ddr_lookup_bw"] == 1e6
    slow = planner.last_report.max_time_s
    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"))
    planner.plan(meta_ebc(random_tables(4, seed=0, max_rows=1000)), [ebc_sharder()])
    assert planner.last_report.max_time_s < slow

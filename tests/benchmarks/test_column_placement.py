"""The column placement benchmark runs, and reports for each layout and row count the way the placement
chose next to every way's time (no timing is checked: only that the report is complete and consistent)."""

from __future__ import annotations

import json

import pytest

from benchmarks import column_placement
from shardkit.kernels.column_copy import column_copier


@pytest.mark.skipif(column_copier() is None, reason="no native copier (SHARDKIT_NATIVE=0 or not built)")
def test_the_benchmark_reports_every_layout_and_the_choice(tmp_path):
    column_placement.main(["--rows", "32", "300", "--rounds", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "column_placement.json").read_text())
    rows = result["rows"]
    assert [(r["name"], r["rows"]) for r in rows] == [
        (name, n) for name in column_placement.LAYOUTS for n in (32, 300)
    ]
    for r in rows:
        assert r["chosen"] in ("copier", "strided", "index") and r["torch_chosen"] in ("strided", "index")
        assert r["fixed_rule"] in ("copier", "strided", "index") and r["torch_rule"] in ("strided", "index")
        fastest = min(r["copier_us"], r["strided_us"], r["index_us"])
        assert r[f"{r['chosen']}_us"] / fastest == r["chosen_over_fastest"] >= 1.0
        torch_fastest = min(r["strided_us"], r["index_us"])
        assert r[f"{r['torch_chosen']}_us"] / torch_fastest == r["torch_chosen_over_fastest"] >= 1.0
        assert r["fixed_rule_over_fastest"] >= 1.0 and r["torch_rule_over_fastest"] >= 1.0
    assert result["config"]["cpu_model"]


def test_the_fixed_rule_is_the_one_it_replaced():
    # the Zen 3 constants' crossovers recorded in docs/performance.md: the demo's rank 0 at 6400 rows,
    # 8 round-robin tables at 250, three scattered blocks at 1333
    from shardkit.distributed.comm_ops.placement import ColumnPlacement
    from shardkit.kernels.column_copy import copy_column_ranges_torch

    layouts = column_placement.LAYOUTS
    cases = {"demo_rank0": 6400, "round_robin_8": 250, "scattered_3": 1334}
    for name, crossover in cases.items():
        width, dest = layouts[name]
        p = ColumnPlacement(width, dest, copy_column_ranges_torch)
        assert column_placement.fixed_rule_copier(p, 0, crossover - 1)
        assert not column_placement.fixed_rule_copier(p, 0, crossover)
    # without a copier: strided up to MAX_RUNS runs, the index copy past them
    width, dest = layouts["runs_16_w64"]
    assert column_placement.torch_rule(ColumnPlacement(width, dest), 0) == "index"
    width, dest = layouts["round_robin_64"]
    assert column_placement.torch_rule(ColumnPlacement(width, dest), 0) == "strided"

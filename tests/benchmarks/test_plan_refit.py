"""plan_refit: a recorded run refitted by the same code reproduces its estimates exactly (so a change in
the refitted column is the cost-model change's, not the tool's); dropped and unknown steps are left out
of the fit and counted; the verdicts and the per-type bias on hand-made rows."""

from __future__ import annotations

import pytest
import torch
from benchmarks.plan_quality import _Model, _planner, table_sets
from benchmarks.plan_refit import refit, refit_run, summary, type_bias

from shardkit.planner.calibration_configs import calibration_configs, describe
from shardkit.planner.calibration_steps import estimated_seconds, fit_constants
from shardkit.planner.cost_model import CostModel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder


@pytest.fixture(scope="module")
def recorded_run():
    """A plan_quality run as written (the parts plan_refit reads): its calibration timings at 2 ranks
    (the default CPU model's step times, each off by a fixed few per cent, as a measurement is), the
    constants calibrate() fitted to them, and the demo's uniform plans with their estimates."""
    world = 2
    configs = calibration_configs(world)
    truth = CostModel.default("cpu")
    times = [estimated_seconds(c, world, truth) * (1.0 + 0.03 * ((i % 5) - 2)) for i, c in enumerate(configs)]
    fitted = fit_constants(configs, times, world, truth)
    model = truth.replace(
        ddr_lookup_bw=fitted["lookup_bw"],
        intra_node_bw=fitted["comm_bw"],
        **{k: v for k, v in fitted.items() if hasattr(truth, k)},
    )
    tables, batch = table_sets(True)["demo"]
    meta = _Model(tables, torch.device("meta"))
    sharders = [EmbeddingBagCollectionSharder()]
    rows = []
    for i, sharding_type in enumerate(("table_wise", "row_wise", "data_parallel")):
        plan = _planner(tables, batch, world, model, sharding_type).plan(meta, sharders)
        est_ms = _planner(tables, batch, world, model, None).estimate(meta, sharders, plan).max_time_s * 1e3
        measured = est_ms * (1.0, 1.2, 0.7)[i]
        rows.append(
            {
                "name": f"demo W2: all {sharding_type}",
                "est_cal_ms": est_ms,
                "measured_ms": measured,
                "ci_lo_ms": measured * 0.97,
                "ci_hi_ms": measured * 1.03,
            }
        )
    calibration = {
        "constants": model.to_dict(),
        "fit": {"steps": [{"config": describe(c), "measured_s": t} for c, t in zip(configs, times)]},
    }
    return {"config": {"quick": True, "calibrated": {"W2": calibration}}, "rows": rows}


def test_the_same_code_refits_a_recorded_run_to_its_own_estimates(recorded_run):
    rows, fits = refit_run(recorded_run)
    assert [f["steps"] for f in fits] == [len(calibration_configs(2))]
    assert fits[0]["steps_unknown"] == fits[0]["steps_dropped"] == fits[0]["steps_untimed"] == 0
    assert [r["uniform"] for r in rows] == ["table_wise", "row_wise", "data_parallel"]
    for r in rows:
        assert r["refit_ms"] == pytest.approx(r["recorded_ms"], rel=1e-9)


def test_dropped_and_unknown_steps_are_left_out_of_the_fit_and_counted(recorded_run):
    calibration = recorded_run["config"]["calibrated"]["W2"]
    steps = calibration["fit"]["steps"]
    with_unknown = {**calibration, "fit": {"steps": [*steps, {"config": "no such step", "measured_s": 1.0}]}}
    _, info = refit(with_unknown, 2)
    assert (info["steps"], info["steps_unknown"]) == (len(steps), 1)
    dropped = sum("data_parallel" in s["config"] for s in steps)
    assert dropped > 0
    _, info = refit(calibration, 2, drop=["data_parallel"])
    assert (info["steps"], info["steps_dropped"]) == (len(steps) - dropped, dropped)
    _, info = refit(calibration, 2, drop=[""])  # an empty text (a shell's "") drops nothing
    assert (info["steps"], info["steps_dropped"]) == (len(steps), 0)
    with pytest.raises(ValueError, match="no calibration step at 2 ranks"):
        refit(calibration, 2, drop=[":"])  # every step's description has one
    without_first = {**calibration, "fit": {"steps": steps[1:]}}
    _, info = refit(without_first, 2)
    assert info["steps_untimed"] == 1


def _row(run, case, uniform, measured, estimate, spread=0.02):
    return {
        "run": run,
        "case": case,
        "uniform": uniform,
        "measured_ms": measured,
        "ci_ms": (measured * (1 - spread), measured * (1 + spread)),
        "refit_ms": estimate,
    }


def test_verdicts_score_each_case_of_each_run_alone():
    rows = [
        _row("a", "demo W2", "table_wise", 1.0, 1.1),
        _row("a", "demo W2", "row_wise", 2.0, 1.9),
        _row("a", "demo W2", "data_parallel", 3.0, 1.5),  # 50 % low, and put before row-wise
        _row("b", "demo W2", "table_wise", 1.0, 1.0),
        _row("b", "demo W2", "row_wise", 1.01, 2.0),  # a tie with table-wise (intervals overlap): not scored
    ]
    verdict = summary(rows, "refit_ms")
    assert verdict["within_25pct"] == "3/5"  # 1.1/1.0, 1.9/2.0, 1.0/1.0
    # run a: 3 separated pairs, the data-parallel / row-wise one misordered; run b: its only pair a tie
    assert verdict["ordered_beyond_noise"] == "2/3"


def test_type_bias_is_each_plans_error_over_its_cases_median():
    rows = [
        _row("a", "demo W2", "table_wise", 1.0, 1.0),
        _row("a", "demo W2", "row_wise", 1.0, 1.2),
        _row("a", "demo W2", "data_parallel", 1.0, 0.9),
        _row("b", "demo W2", "table_wise", 2.0, 3.0),  # run b's machine ran slower than calibrated ...
        _row("b", "demo W2", "row_wise", 2.0, 3.6),
        _row("b", "demo W2", "data_parallel", 2.0, 2.7),  # ... the same bias against the median
        _row("b", "demo W2", None, 2.0, 9.0),  # the planner's row: not a uniform plan, not scored
    ]
    bias = type_bias(rows, "refit_ms")
    assert bias[("demo W2", "table_wise")] == pytest.approx([1.0, 1.0])
    assert bias[("demo W2", "row_wise")] == pytest.approx([1.2, 1.2])
    assert bias[("demo W2", "data_parallel")] == pytest.approx([0.9, 0.9])

"""Judge a cost-model change on recorded measurements: refit recorded plan_quality runs with this code.

``python -m benchmarks.plan_refit RUN.json [RUN.json ...] [--drop-step TEXT ...]``: for every
``benchmarks.plan_quality`` JSON given and every world size it calibrated, the calibration steps it
timed (``config.calibrated.W<n>.fit.steps``) are fitted again by this checkout's
``calibration_steps.fit_constants``, and each plan the run measured is estimated with the refitted
constants. The plans are rebuilt as the run built them (its recorded constants, or the default ones for
the ``planner`` row) by this checkout's planner, so only the estimates change (a change to how the
planner places tables, rather than to what it estimates, is not judged here: its plans may differ from
the measured ones). Printed per plan: the measured time, the recorded estimate and the refitted one;
over all the runs, for each column: the estimates within 25 % and the pairs ordered beyond the noise
(plan_quality's verdicts, on the recorded 95 % intervals of the medians), the mean
``|log(estimate / measured)|``, and each uniform plan's bias (its estimate / measured over the case's
median of that ratio in the same run, the median over runs: a type the model prices too high or too
low against the others, whatever the machine's speed in that launch).

Why: launches of plan_quality differ by as much as the effects of a cost-model change (the machine's
speed drifts between calibrate() and the measured plans), so a change measured in new launches against
old ones is judged on the launches' noise. Refitting the same timings with and without the change holds
the measurements fixed. A change that adds a calibration step needs launches with it; ``--drop-step``
then refits without the steps whose description contains the text (the same launches with and without
the step). A recorded step this code no longer defines is left out of the fit and counted in
``steps_unknown``; a step this code defines that the run did not time cannot be fitted and is counted in
``steps_untimed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.common import print_table, write_results
from benchmarks.plan_quality import _Model, _planner, table_sets
from benchmarks.round_noise import overlaps
from shardkit.planner.calibration_configs import calibration_configs, describe
from shardkit.planner.calibration_steps import fit_constants
from shardkit.planner.cost_model import CostModel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

_FIELDS = {f.name for f in dataclasses.fields(CostModel)}


def recorded_model(constants: Dict[str, Any]) -> CostModel:
    """The run's calibrated ``CostModel`` (constants this code does not know are left out)."""
    return CostModel(**{k: v for k, v in constants.items() if k in _FIELDS})


def refit(
    calibration: Dict[str, Any], world: int, drop: Sequence[str] = ()
) -> Tuple[CostModel, Dict[str, Any]]:
    """The constants this code fits to a run's calibration timings at ``world`` ranks, and what was
    fitted: ``steps`` (used), ``steps_dropped`` (by ``drop``), ``steps_unknown`` (recorded, not defined
    here), ``steps_untimed`` (defined here, not recorded), ``residual``, ``new_constants`` (the fitted
    constants the run's code did not have)."""
    recorded = recorded_model(calibration["constants"])
    defined = {describe(c): c for c in calibration_configs(world)}
    timed = {s["config"]: s["measured_s"] for s in calibration["fit"]["steps"]}
    dropped = [name for name in timed if any(text and text in name for text in drop)]
    used = [name for name in timed if name in defined and name not in dropped]
    if not used:
        raise ValueError(
            f"plan_refit: no calibration step at {world} ranks left to fit ({len(timed)} recorded, "
            f"{len(dropped)} dropped by --drop-step {list(drop)}, the rest not defined by this code)"
        )
    fitted = fit_constants([defined[n] for n in used], [timed[n] for n in used], world, recorded)
    constants = {k: v for k, v in fitted.items() if k in _FIELDS}
    model = recorded.replace(ddr_lookup_bw=fitted["lookup_bw"], intra_node_bw=fitted["comm_bw"], **constants)
    info = {
        "steps": len(used),
        "steps_dropped": len(dropped),
        "steps_unknown": sum(1 for n in timed if n not in defined),
        "steps_untimed": sum(1 for n in defined if n not in timed),
        "residual": fitted["residual"],
        # constants the run's code did not have (a change's new ones), as fitted here
        "new_constants": {k: v for k, v in constants.items() if k not in calibration["constants"]},
    }
    return model, info


def _plan_model(labels: List[str], recorded: CostModel) -> Tuple[CostModel, Optional[str]]:
    """The cost model and sharding type plan_quality built a row's plan with (any of its labels)."""
    label = labels[0]
    if label == "planner":
        return CostModel.default("cpu"), None
    if label.startswith("all "):
        return recorded, label[len("all ") :]
    return recorded, None  # planner+cal


def refit_run(
    run: Dict[str, Any], drop: Sequence[str] = ()
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """One plan_quality run's plans with their refitted estimates (rows) and its fits (one per world)."""
    sets = table_sets(bool(run["config"]["quick"]))
    sharders = [EmbeddingBagCollectionSharder()]
    metas: Dict[str, _Model] = {}
    rows, fits = [], []
    for key, calibration in run["config"]["calibrated"].items():
        world = int(key[1:])
        model, info = refit(calibration, world, drop)
        fits.append({"world": world, **info})
        recorded = recorded_model(calibration["constants"])
        for row in run["rows"]:
            case, joined = row["name"].split(": ", 1)
            set_name, case_world = case.split()
            if case_world != key:
                continue
            tables, batch = sets[set_name]
            if set_name not in metas:
                metas[set_name] = _Model(tables, torch.device("meta"))
            meta = metas[set_name]
            labels = joined.split("/")
            plan_model, sharding_type = _plan_model(labels, recorded)
            plan = _planner(tables, batch, world, plan_model, sharding_type).plan(meta, sharders)
            estimate = _planner(tables, batch, world, model, None).estimate(meta, sharders, plan).max_time_s
            uniform = [label[len("all ") :] for label in labels if label.startswith("all ")]
            rows.append(
                {
                    "case": case,
                    "plan": joined,
                    "uniform": uniform[0] if uniform else None,
                    "measured_ms": row["measured_ms"],
                    "ci_ms": (row["ci_lo_ms"], row["ci_hi_ms"]),
                    "recorded_ms": row["est_cal_ms"],
                    "refit_ms": estimate * 1e3,
                }
            )
    return rows, fits


def _by_case(rows: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """``rows`` grouped by case of each run (``run`` absent: one run)."""
    cases: Dict[Tuple[Any, str], List[Dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r.get("run"), r["case"]), []).append(r)
    return list(cases.values())


def _ordered_pairs(estimates: List[float], rows: List[Dict[str, Any]]) -> Tuple[int, int]:
    """(pairs ordered right, pairs the measurement separates): plan_quality's verdict on the recorded
    intervals of the medians (overlapping intervals are ties, not scored)."""
    right = pairs = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if overlaps(rows[i]["ci_ms"], rows[j]["ci_ms"]):
                continue
            pairs += 1
            right += (rows[i]["measured_ms"] < rows[j]["measured_ms"]) == (estimates[i] < estimates[j])
    return right, pairs


def summary(rows: List[Dict[str, Any]], column: str) -> Dict[str, Any]:
    """Verdicts of the estimates in ``column`` (``recorded_ms`` / ``refit_ms``) over ``rows`` (each case
    of each run scored alone, then summed)."""
    within = right = pairs = 0
    logs = []
    for case_rows in _by_case(rows):
        estimates = [r[column] for r in case_rows]
        ok, n = _ordered_pairs(estimates, case_rows)
        right, pairs = right + ok, pairs + n
        for r, e in zip(case_rows, estimates):
            within += abs(e / r["measured_ms"] - 1.0) <= 0.25
            logs.append(abs(math.log(e / r["measured_ms"])))
    return {
        "estimates": column,
        "within_25pct": f"{within}/{len(rows)}",
        "ordered_beyond_noise": f"{right}/{pairs}",
        "mean_abs_log_err": statistics.mean(logs) if logs else None,
    }


def type_bias(rows: List[Dict[str, Any]], column: str) -> Dict[Tuple[str, str], List[float]]:
    """(case, uniform type) -> over the runs, that plan's estimate / measured over the median of that
    ratio among the case's uniform plans of the same run."""
    out: Dict[Tuple[str, str], List[float]] = {}
    for case_rows in _by_case(rows):
        group = [r for r in case_rows if r["uniform"] is not None]
        if not group:  # a case of the planner's plans only: no type to score
            continue
        ratios = [r[column] / r["measured_ms"] for r in group]
        middle = statistics.median(ratios)
        for r, ratio in zip(group, ratios):
            out.setdefault((r["case"], r["uniform"]), []).append(ratio / middle)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="plan_quality JSON files")
    parser.add_argument("--drop-step", nargs="*", default=[], help="refit without the steps containing TEXT")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    rows, fits = [], []
    for path in args.runs:
        with open(path) as f:
            run = json.load(f)
        run_rows, run_fits = refit_run(run, args.drop_step)
        rows += [{"run": path, **r} for r in run_rows]
        fits += [{"run": path, **f} for f in run_fits]
    verdicts = [summary(rows, column) for column in ("recorded_ms", "refit_ms")]
    recorded_bias, refit_bias = type_bias(rows, "recorded_ms"), type_bias(rows, "refit_ms")
    bias_rows = [
        {
            "case": case,
            "type": sharding_type,
            "runs": len(ratios),
            "recorded_bias": statistics.median(recorded_bias[(case, sharding_type)]),
            "refit_bias": statistics.median(ratios),
            "refit_min": min(ratios),
            "refit_max": max(ratios),
        }
        for (case, sharding_type), ratios in sorted(refit_bias.items())
    ]
    config = {
        "runs": args.runs,
        "drop_step": args.drop_step,
        "fits": fits,
        "verdicts": verdicts,
        "bias": bias_rows,
    }
    write_results(
        "plan_refit", config, [{k: v for k, v in r.items() if k != "ci_ms"} for r in rows], args.out
    )
    for table in (fits, bias_rows, verdicts):  # the summaries last, below the long table of plans
        print()
        print_table(table)


if __name__ == "__main__":
    main()

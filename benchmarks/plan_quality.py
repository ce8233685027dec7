"""Plan quality: does the planner pick the fastest plan, and how close are its estimates to measured steps?

Run from the repository root: ``python -m benchmarks.plan_quality [--quick]``.

For three table sets (``demo``: the 8 tables of ``shardkit demo``; ``many_small``: many small tables at
a small batch; ``few_large``: a few large tables at a large batch) on 2 and 4 CPU ranks (gloo), every
rank builds, on the same model:

- ``planner``: the planner's plan with the cost model's default CPU constants;
- ``planner+cal``: the planner's plan after ``calibrate()`` (run once per world size on these ranks, so a
  machine whose ranks share cores is measured as such);
- one uniform plan per sharding type (data-parallel, table-wise, row-wise, column-wise): the planner
  restricted to that type (table-wise tables placed by it). Table-row-wise needs several nodes: on one
  host it is row-wise's layout with a costlier exchange, and the planner does not offer it.

and measures the training step of each (forward, backward with the fused SGD update, through
``DistributedModelParallel``; every rank its own batch of uniform random ids) in alternating rounds:
every round runs ``--steps`` steps of every plan in turn, the order rotated by one plan each round (a
fixed order measured the first plan 0.1-1 ms differently from the second even when both were the same
plan: the "placement" differences of the ninth session's runs), after ``--warmup`` steps each; a plan's
figure is the median over its rounds of the slowest rank's mean step time in the round. A plan whose
fastest warm-up step (the first aside) takes ``SLOW_FACTOR`` x the fastest plan's is clearly not the
fastest: it runs one step a round instead of ``--steps`` (every plan is timed in every round: under
load a noisy warm-up took plans of 1.2x out of all rounds but one). Next to each
measured time the table prints the planner's estimate of that plan (``EmbeddingShardingPlanner.estimate``,
the slowest rank's estimated time) with the default and the calibrated constants, the ranks by
calibrated estimate and by measurement, and whether the planner's calibrated plan is within 10% of the
fastest measured plan; per case, whether all estimates are within 25%, whether the orders agree
exactly, ``misordered_pairs``: of the pairs of plans measured more than 10% apart, how many
the estimates order the other way, and ``order_beyond_noise``: the same over the pairs the measurement
separates (the 95 % intervals of their medians do not overlap, ``_separated``; plans whose intervals
overlap are ties the measurement cannot order, and are not scored; ``same_order`` scores them).

The noise band, beside the strict verdicts (which stay as they are): every case also times a second
copy of the calibrated planner's plan in the same rounds (``control_ratio``: its median over the
first copy's, 1 without noise), gives each plan's median a 95 % interval (``ci_lo_ms``, ``ci_hi_ms``:
``round_noise.median_ci``; ``ci_coverage`` when there are too few rounds for 95 %) and says whether
the calibrated planner's plan and the fastest one overlap (``planner_ties_fastest``) and whether
every estimate is within 25 % of some point of its plan's interval (``estimates_within_25pct_of_ci``).
The load's change between calibrate() and the case: three of calibrate()'s own steps (``ANCHORS``)
are timed again in the case's rounds; ``drift`` is the median of their time now over their time in
calibrate(), and ``drift_adj_err`` the estimate x drift against the measurement (labelled as
adjusted: it separates the model's error from the machine's change, it does not replace
``cal_err``). ``loadavg``: /proc/loadavg before and after the case; ``steal`` / ``calibrate_steal``: the
share of the CPUs' time the hypervisor gave to others during the case / during calibrate() (a VM's
host busy elsewhere, which the load average does not show). Absolute times on a shared
machine are noise; the ranks and ratios are the result.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import write_results
from benchmarks.round_noise import coverage, median_ci, overlaps, relative_spread, within_of_interval
from shardkit.cli.demo_dlrm import TABLE_SHAPES as DEMO_TABLE_SHAPES  # (rows, dim, mean ids per bag)
from shardkit.distributed.validation import set_validation
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sparse import KeyedJaggedTensor

# calibration steps re-timed in every case's rounds (calibration_steps.describe of
# calibration_configs(world)): a tiny table-wise step (fixed costs) and the wide table-wise and
# 64 MiB row-wise ones (per id and per byte); their times against calibrate()'s say how the load changed
ANCHORS = (
    "{world} table_wise: {tiny}x8 b32 p1",
    "{world} table_wise: 131072x128 b512 p20",
    "{world} row_wise: 262144x64 b512 p20",
)
LR = 0.01
SLOW_FACTOR = 4.0
DISTINCT = 0.10  # measured times this far apart are ordered; closer ones are within the noise
UNIFORM = ["data_parallel", "table_wise", "row_wise", "column_wise"]
_ABBREV = {"data_parallel": "DP", "table_wise": "TW", "row_wise": "RW", "column_wise": "CW"}


def table_sets(quick: bool) -> Dict[str, Tuple[List[Tuple[int, int, float]], int]]:
    """name -> (tables as (rows, dim, pooling), batch per rank)."""
    many = 48 if quick else 128
    small = [(1000 * (1 + i % 10), (8, 16, 32)[i % 3], float(1 + i % 3)) for i in range(many)]
    large = [(200_000 if quick else 300_000, 128, 20.0)] * 4
    big_batch = 1024 if quick else 2048
    return {"demo": (DEMO_TABLE_SHAPES, 256), "many_small": (small, 64), "few_large": (large, big_batch)}


class _Model(nn.Module):
    def __init__(self, tables: List[Tuple[int, int, float]], device: torch.device) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"])
            for i, (rows, dim, _) in enumerate(tables)
        ]
        self.ebc = EmbeddingBagCollection(
            configs, device=device, fused_optimizer=FusedOptimizerConfig("SGD", lr=LR)
        )

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(features).values().sum()


def _batch(tables, batch: int, seed: int) -> KeyedJaggedTensor:
    """Bags of uniform random ids, lengths uniform in [0, 2 * pooling] (mean ``pooling``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.randint(0, int(2 * p) + 1, (batch,), generator=gen) for (_, _, p) in tables])
    per_table = lengths.view(len(tables), batch).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, rows, (n,), generator=gen) for (rows, _, _), n in zip(tables, per_table)]
    )
    return KeyedJaggedTensor([f"f{i}" for i in range(len(tables))], values, lengths=lengths)


def fresh(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The same batch as a new object, as a data loader hands each step one: a reused object skips the
    construction's checks and per-key totals and keeps the lookups' per-input splits warm, which
    training never does."""
    return KeyedJaggedTensor(features.keys(), features.values(), lengths=features.lengths())


def _planner(tables, batch: int, world: int, cost_model, sharding_type: Optional[str]):
    from shardkit.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    types = None if sharding_type is None else [sharding_type]
    # min_partition 8: column-wise is an option for the 16-column tables too; the fused kernel only: a
    # DENSE table (offered when the constraints name data_parallel) is trained by a dense optimizer
    # that these steps do not run, so its step would not be a whole training step
    constraints = {
        f"t{i}": ParameterConstraints(
            sharding_types=types, compute_kernels=["fused"], pooling_factors=[p], min_partition=8
        )
        for i, (_, _, p) in enumerate(tables)
    }
    topology = Topology(world_size=world, compute_device="cpu", cost_model=cost_model)
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch, constraints=constraints)


def _describe(plan) -> str:
    counts: Dict[str, int] = {}
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            counts[ps.sharding_type] = counts.get(ps.sharding_type, 0) + 1
    return " ".join(f"{_ABBREV.get(t, t)}{n}" for t, n in sorted(counts.items()))


def _key(plan) -> str:
    return repr(
        sorted((m, t, ps.sharding_type, ps.ranks) for m, mp in plan.plan.items() for t, ps in mp.items())
    )


def _plans_and_estimates(tables, batch, world, default, calibrated, meta, sharders):
    """The distinct plans (key -> plan) and one row per plan: its labels, types and estimates."""
    candidates: List[Tuple[str, Any]] = [
        ("planner", _planner(tables, batch, world, default, None).plan(meta, sharders)),
        ("planner+cal", _planner(tables, batch, world, calibrated, None).plan(meta, sharders)),
    ]
    for st in UNIFORM:
        try:
            candidates.append(
                (f"all {st}", _planner(tables, batch, world, calibrated, st).plan(meta, sharders))
            )
        except ValueError:  # PlannerError: not valid for these tables
            continue
    plans: Dict[str, Any] = {}
    labels: Dict[str, List[str]] = {}
    for label, plan in candidates:
        key = _key(plan)
        plans.setdefault(key, plan)
        labels.setdefault(key, []).append(label)
    rows = []
    for key, plan in plans.items():
        est = {
            name: _planner(tables, batch, world, cm, None).estimate(meta, sharders, plan).max_time_s
            for name, cm in (("default", default), ("calibrated", calibrated))
        }
        rows.append({"key": key, "labels": labels[key], "types": _describe(plan), "est": est})
    return plans, rows


def calibrate_worker() -> Dict[str, Any]:
    """On every rank: ``calibrate()`` (collective); its constants and how long it took."""
    from shardkit.planner import calibrate

    torch.set_num_threads(1)
    set_validation(False)
    start = time.perf_counter()
    report: Dict[str, Any] = {}
    calibrated = calibrate("cpu", fit_report=report)
    return {"constants": calibrated.to_dict(), "seconds": time.perf_counter() - start, "fit": report}


def round_order(plans: int, round_index: int) -> List[int]:
    """The order in which round ``round_index`` times the ``plans`` plans: rotated by one each round,
    so that over ``plans`` rounds every plan runs once in every position."""
    return [(i + round_index) % plans for i in range(plans)]


def anchor_configs(world: int) -> List[Any]:
    """The calibration steps ``case_worker`` times again beside the plans (``ANCHORS``), as
    ``calibration_steps.StepConfig`` s of ``calibration_configs(world)``."""
    from shardkit.planner.calibration_configs import calibration_configs, describe

    by_name = {describe(c): c for c in calibration_configs(world)}
    out = []
    for pattern in ANCHORS:
        name = pattern.format(world=world, tiny=64 * world)
        if name not in by_name:
            raise KeyError(f"plan_quality: no calibration step {name!r} to re-time (have {sorted(by_name)})")
        out.append(by_name[name])
    return out


def case_worker(
    set_name: str,
    quick: bool,
    rounds: int,
    steps: int,
    warmup: int,
    constants: Dict[str, Any],
    anchors: Optional[List[Any]] = None,
) -> Dict[str, Any]:
    """On every rank: plan, build every plan's DMP, time them in alternating rounds, with a second copy
    of the calibrated planner's plan (the control: two copies of one plan differ by noise alone) and
    the calibration steps ``anchors`` (their times against calibrate()'s: the load's drift)."""
    from shardkit.model_parallel import DistributedModelParallel
    from shardkit.planner import CostModel
    from shardkit.planner.calibration_steps import training_step
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

    torch.set_num_threads(1)
    set_validation(False)
    world, rank = dist.get_world_size(), dist.get_rank()
    tables, batch = table_sets(quick)[set_name]
    calibrated = CostModel(**constants)
    default = CostModel.default("cpu")
    sharders = [EmbeddingBagCollectionSharder()]
    meta = _Model(tables, torch.device("meta"))

    # rank 0 plans and estimates, every rank shards with its plans (the ranks must agree exactly)
    shared: List[Any] = [
        _plans_and_estimates(tables, batch, world, default, calibrated, meta, sharders) if rank == 0 else None
    ]
    dist.broadcast_object_list(shared, src=0)
    plans, rows = shared[0]

    features = _batch(tables, batch, seed=rank)
    models = []
    for key in plans:
        torch.manual_seed(0)
        models.append(
            DistributedModelParallel(_Model(tables, torch.device("cpu")), plan=plans[key], sharders=sharders)
        )
    control = next(i for i, r in enumerate(rows) if "planner+cal" in r["labels"])
    torch.manual_seed(0)
    models.append(
        DistributedModelParallel(
            _Model(tables, torch.device("cpu")), plan=plans[rows[control]["key"]], sharders=sharders
        )
    )
    anchors = anchors or []
    anchor_steps = [training_step(c, None, torch.device("cpu")) for c in anchors]
    # warm-up; a plan whose warm-up step is SLOW_FACTOR x the fastest's is clearly not the fastest:
    # it runs one step a round (not --steps), which keeps --quick within minutes
    first = []
    for m in models:
        m(fresh(features)).backward()  # the first step pays one-time costs
        times = []
        for _ in range(max(1, warmup - 1)):
            t0 = time.perf_counter()
            m(fresh(features)).backward()
            times.append(time.perf_counter() - t0)
        first.append(min(times))  # the least disturbed of the other warm-up steps
    first_t = torch.tensor(first, dtype=torch.float64)
    dist.all_reduce(first_t, op=dist.ReduceOp.MAX)
    slow = [t > SLOW_FACTOR * float(first_t.min()) for t in first_t.tolist()]
    for step in anchor_steps:
        for _ in range(warmup):
            step()
    # every timed thing: the plans, the control copy, the anchors (a step function each)
    runs = [lambda m=m: m(fresh(features)).backward() for m in models] + anchor_steps
    slow += [False] * len(anchor_steps)
    per_round: List[List[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i in round_order(len(runs), r):
            n = 1 if slow[i] else steps
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                runs[i]()
            per_round[i].append((time.perf_counter() - t0) / n)
    # the slowest rank's time per round
    agreed = []
    for times in per_round:
        mine = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        agreed.append(mine.tolist())
    for row, times in zip(rows, agreed):
        row["measured_s"] = statistics.median(times)
        row["rounds_s"] = times
    n_plans = len(rows)
    return {
        "rows": rows,
        "control": {"of": control, "rounds_s": agreed[n_plans]},
        "anchors": [{"rounds_s": t} for t in agreed[n_plans + 1 :]],
    }


def _rank(values: List[float]) -> List[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for position, i in enumerate(order):
        ranks[i] = position + 1
    return ranks


def _misordered(estimates: List[float], measured: List[float], margin: float = DISTINCT) -> str:
    """``"k/n"``: of the ``n`` pairs of plans whose measured times differ by more than ``margin``
    (noise cannot swap them), the ``k`` the estimates order the other way."""
    pairs = wrong = 0
    for i in range(len(measured)):
        for j in range(len(measured)):
            if measured[i] * (1.0 + margin) < measured[j]:  # i clearly faster than j
                pairs += 1
                wrong += estimates[i] > estimates[j]
    return f"{wrong}/{pairs}"


def _separated(a: List[float], b: List[float]) -> bool:
    """Whether the measurement orders two plans beyond its noise: the 95 % intervals of their medians
    (``round_noise.median_ci``) do not overlap; pairs whose intervals overlap are ties. Under 9 rounds
    an interval is the whole range: every round of one faster than every round of the other (two
    plans of 5 rounds from one distribution separate so by chance with probability 2 / C(10, 5) < 1 %).
    From 9 rounds on it is narrower than the range, so that one round in a load spike no longer makes
    every pair a tie (15 rounds: the 4th to the 12th fastest round)."""
    return not overlaps(median_ci(a), median_ci(b))


def _order_beyond_noise(estimates: List[float], rounds: List[List[float]]) -> str:
    """``"k/n"``: of the ``n`` pairs of plans the measurement separates (``_separated``), the ``k`` the
    estimates order the other way (a tie in the estimates counts as misordered)."""
    pairs = wrong = 0
    for i in range(len(rounds)):
        for j in range(i + 1, len(rounds)):
            if _separated(rounds[i], rounds[j]):
                pairs += 1
                faster_measured = statistics.median(rounds[i]) < statistics.median(rounds[j])
                faster_estimated = estimates[i] < estimates[j]
                wrong += faster_measured != faster_estimated
    return f"{wrong}/{pairs}"


def summarize(
    set_name: str, world: int, result: Dict[str, Any]
) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The printed rows of one case and its verdicts (planner within 10%, estimates within 25%, order)."""
    rows = result["rows"]
    measured = [r["measured_s"] for r in rows]
    cal = [r["est"]["calibrated"] for r in rows]
    by_est, by_meas = _rank(cal), _rank(measured)
    fastest = min(measured)
    fastest_ci = median_ci(rows[measured.index(fastest)]["rounds_s"])
    drift = load_drift(result.get("anchors", []), result.get("anchor_cal_s", []))
    out = []
    planner_ratio = planner_ci = None
    for r, re_, rm in zip(rows, by_est, by_meas):
        ratio = r["measured_s"] / fastest
        ci = median_ci(r["rounds_s"])
        if "planner+cal" in r["labels"]:
            planner_ratio, planner_ci = ratio, ci
        out.append(
            {
                "name": f"{set_name} W{world}: {'/'.join(r['labels'])}",
                "types": r["types"],
                "est_default_ms": r["est"]["default"] * 1e3,
                "est_cal_ms": r["est"]["calibrated"] * 1e3,
                "measured_ms": r["measured_s"] * 1e3,
                # the 95 % interval of the median (round_noise.median_ci; the whole range under 6 rounds)
                "ci_lo_ms": ci[0] * 1e3,
                "ci_hi_ms": ci[1] * 1e3,
                "spread": relative_spread(r["rounds_s"]),
                "cal_err": r["est"]["calibrated"] / r["measured_s"] - 1.0,
                "est_in_ci_25pct": within_of_interval(r["est"]["calibrated"], ci, 0.25),
                "drift_adj_err": None
                if drift is None
                else r["est"]["calibrated"] * drift / r["measured_s"] - 1.0,
                "rank_est": re_,
                "rank_meas": rm,
                "vs_fastest": ratio,
                "rounds": len(r["rounds_s"]),
            }
        )
    control = result.get("control")
    control_ratio = (
        None
        if control is None
        else statistics.median(control["rounds_s"]) / rows[control["of"]]["measured_s"]
    )
    verdict = {
        "case": f"{set_name} W{world}",
        "planner_vs_fastest": planner_ratio,
        "planner_within_10pct": planner_ratio is not None and planner_ratio <= 1.10,
        "max_abs_cal_err": max(abs(o["cal_err"]) for o in out),
        "estimates_within_25pct": all(abs(o["cal_err"]) <= 0.25 for o in out),
        "same_order": by_est == by_meas,
        "misordered_pairs": _misordered(cal, measured),
        "order_beyond_noise": _order_beyond_noise(cal, [r["rounds_s"] for r in rows]),
        # the noise band: the same plan timed twice in the same rounds (1 = no noise) ...
        "control_ratio": control_ratio,
        # ... whether the planner's and the fastest plan's intervals overlap (a tie the run cannot
        # order) and whether every estimate is within 25 % of some point of its plan's interval
        "planner_ties_fastest": planner_ci is not None and overlaps(planner_ci, fastest_ci),
        "estimates_within_25pct_of_ci": all(o["est_in_ci_25pct"] for o in out),
        # the calibration steps re-timed in these rounds over their calibrate() times: the load's change
        # since calibrate(); estimates x drift against the measurement, labelled as adjusted
        "drift": drift,
        "max_abs_drift_adj_err": None if drift is None else max(abs(o["drift_adj_err"]) for o in out),
        "ci_coverage": coverage(max(len(r["rounds_s"]) for r in rows)),
        "loadavg": result.get("loadavg"),
        # the host's share of the CPUs during the case and during calibrate() (steal, /proc/stat)
        "steal": result.get("steal"),
        "calibrate_steal": result.get("calibrate_steal"),
        "calibrate_s": result["calibrate_s"],
    }
    return out, verdict


def load_drift(anchors: List[Dict[str, Any]], calibration_s: List[float]) -> Optional[float]:
    """The median over the anchor steps of (their median time in the case's rounds / their time in
    calibrate()): > 1 when the machine got slower since the calibration (more load), None without
    anchors."""
    if not anchors:
        return None
    ratios = [statistics.median(a["rounds_s"]) / c for a, c in zip(anchors, calibration_s)]
    return statistics.median(ratios)


def loadavg() -> Optional[str]:
    """``/proc/loadavg``'s first three figures (None where there is none)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def cpu_times() -> Optional[Tuple[int, int]]:
    """``/proc/stat``'s (steal, total) clock ticks of all CPUs so far (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_share(before: Optional[Tuple[int, int]], after: Optional[Tuple[int, int]]) -> Optional[float]:
    """The share of the CPUs' time between two :func:`cpu_times` that the hypervisor gave to others
    (steal): on a VM, a host busy elsewhere shows here while the guest's load average does not."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _calibration_seconds(fit: Dict[str, Any], config: Any) -> float:
    """calibrate()'s measured time of ``config`` (its fit report's step of that description)."""
    from shardkit.planner.calibration_configs import describe

    for step in fit["steps"]:
        if step["config"] == describe(config):
            return step["measured_s"]
    raise KeyError(f"plan_quality: calibrate() timed no step {describe(config)!r}")


def main(argv: Optional[List[str]] = None) -> None:
    # the workers unpickle functions by module name, which must not be __main__
    from benchmarks.common import print_table
    from benchmarks.plan_quality import calibrate_worker
    from benchmarks.plan_quality import case_worker as worker
    from shardkit.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller table sets and fewer rounds (~3 min)")
    parser.add_argument("--sets", nargs="+", default=["demo", "many_small", "few_large"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 21, --quick 15)")
    parser.add_argument("--steps", type=int, help="steps per plan and round (default 4; --quick too)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    # 15 rounds: the median of 5 rounds of one plan moved by up to 1.6x between two copies of it
    # (demo tables, 2 ranks, shared machine); 15 give a 95 % interval of the median between the 4th and
    # 12th round (round_noise.median_ci)
    rounds = args.rounds or (15 if args.quick else 21)
    # 4 steps a round in --quick too: a 2-step round (~8 ms) is moved a lot by one scheduler hiccup
    steps = args.steps or 4
    rows, verdicts, calibrations = [], [], {}
    for world in args.worlds:
        # the machine and the number of ranks, not the tables, set the constants: once per world size
        ticks = cpu_times()
        calibration = run_world(calibrate_worker, world, timeout=600)[0]
        calibration["steal"] = steal_share(ticks, cpu_times())
        calibrations[f"W{world}"] = calibration
        fit = calibration["fit"]
        print(
            f"W{world}: calibrate() {calibration['seconds']:.1f} s, fit residual {fit['residual']:.3f}, "
            f"steal {calibration['steal']}",
            flush=True,
        )
        print_table(
            [
                {
                    "W": world,
                    "calibration step": x["config"],
                    "measured_ms": 1e3 * x["measured_s"],
                    "fitted_ms": 1e3 * x["fitted_s"],
                    "err": x["fitted_s"] / x["measured_s"] - 1.0,
                }
                for x in fit["steps"]
            ]
        )
        anchors = anchor_configs(world)
        anchor_cal_s = [_calibration_seconds(fit, c) for c in anchors]
        for set_name in args.sets:
            before, ticks = loadavg(), cpu_times()
            result = run_world(
                worker,
                world,
                set_name,
                args.quick,
                rounds,
                steps,
                args.warmup,
                calibration["constants"],
                anchors,
                timeout=900,
            )[0]
            result["calibrate_s"] = calibration["seconds"]
            result["anchor_cal_s"] = anchor_cal_s
            result["loadavg"] = f"{before} -> {loadavg()}"
            result["steal"] = steal_share(ticks, cpu_times())
            result["calibrate_steal"] = calibration["steal"]
            case_rows, verdict = summarize(set_name, world, result)
            print_table(case_rows)
            print(verdict, flush=True)
            rows += case_rows
            verdicts.append(verdict)
    print()
    print_table(verdicts)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config.update(rounds=rounds, steps=steps, verdicts=verdicts, calibrated=calibrations, backend="gloo")
    write_results("plan_quality", config, rows, args.out)


if __name__ == "__main__":
    main()

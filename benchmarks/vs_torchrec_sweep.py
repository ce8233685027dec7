"""shardkit vs torchrec over a grid of shapes: the sharded EmbeddingBagCollection training step.

``python -m benchmarks.vs_torchrec_sweep [--quick]`` (also ``python -m benchmarks.vs_torchrec --sweep``,
``SHARDKIT_TORCHREC_PYTHON=~/peers/torchrec/bin/python ./dev bench vs_torchrec_sweep [--quick]``). Needs
torchrec 1.8 + fbgemm-gpu next to shardkit; a Python without them re-runs this under
``$SHARDKIT_TORCHREC_PYTHON`` when set, with this checkout's shardkit first on the path.

The grid. Axes: batch per rank 32 / 256 / 2048 (index ``i``); tables 8 / 64 / 256 (``j``); sharding
type table_wise / row_wise / column_wise / table_row_wise / data_parallel (``k``; grid_shard is left out:
torchrec needs 128-column blocks, one per node, so dims of 256+; ``vs_torchrec --types grid_shard``
measures it); dim 16 / 64 / 128; fused optimizer SGD / Adagrad / row-wise Adagrad. A full factorial is
3 x 3 x 5 x 3 x 3 = 405 rows; the sweep is the 45 rows of batch x tables x type crossed fully, with

    dim       = DIMS[(i + j + k) % 3]
    optimizer = OPTIMIZERS[(i + 2 * j + k) % 3]

so that for every sharding type the nine (batch, tables) cells take all nine (dim, optimizer) pairs
(the map (i, j) -> (i + j, i + 2j) mod 3 is one-to-one), and every pair of values of any two axes
appears. Table sizes: the ``T`` tables of a row have rows spaced geometrically from 1e3 up to ``top``
(table ``t``: ``1e3 * (top / 1e3) ** (t / (T - 1))``), ``top`` the largest value <= 1e6 whose table set
fits 2**27 fp32 values (512 MiB; 2**23 = 32 MiB for data_parallel, whose tables are replicated and get dense
gradients): 8 tables at dim 16 or 64 reach 1e6, 256 tables at dim 128 reach ~1.6e4. Mean ids per bag
(bag lengths uniform in [1, 2 * pooling - 1]): 20 for 8 tables, 4 for 64, 2 for 256, so that a sample
has 160 - 512 ids. ``--quick``: the 9 rows with ``k == (i + 2 * j + 1) % 5`` (each batch x tables cell
once, each sharding type at least once, every dim and optimizer; its batch-2048 x 256-table row has dim
16: at dim 128 that row's pooled output alone is 256 MiB per rank and the step is gloo-bound, ~10 s).

Data-parallel rows: torchrec has one kernel (DENSE: DDP all-reduces whole-table gradients and the
dense optimizer, torch.optim's, steps whole tables); shardkit runs its default for a collection with a
fused optimizer (FUSED: the touched rows' gradients are gathered and the fused optimizer steps those
rows; ``--dp-kernel dense`` runs its DENSE kernel with the same torch.optim optimizer instead). The
training is the same: the optimizers have no weight decay, so a dense step leaves an untouched row
(zero gradient) and its state as they were.

Each row runs in a fresh pair of processes (2 gloo ranks, 1 torch thread each, one node) that build
both libraries' models on the same weights (forward checked against ``F.embedding_bag``), warm both up,
time one more step of each and pick one step count for both (about ``--round-s`` seconds per round, at
least 1 step), then alternate the libraries for ``--rounds`` rounds (fewer, down to 2, where one step is
longer than a round: the timed part of a row stays near ``rounds x round-s`` per library). Many short
rounds, best of each, because on a shared machine a load spike then costs one round, not the row.
Every library gets at least ``--min-steps`` (6) timed steps a row, as more rounds
(:func:`schedule`): a row whose step is as long as a round (row 41, b2048 x 256 tables, ~1 s a step
idle, several s loaded) got 2 rounds of 1 step, and its best-of-2 single steps read 0.73x in one run
and 1.84x in the next; at 6 single-step rounds a load spike or a slow step costs one of six. Only the
rows whose step is longer than about ``rounds x round-s / min-steps`` take longer: with the twelfth
session's idle step times, 5 of the 45 rows at the defaults (timed part of the sweep 248 -> 290 s) and
9 at ``--rounds 4 --round-s 0.25`` (96 -> 154 s).
shardkit runs with its defaults; variables exported before the run reach both libraries' workers, e.g.
``SHARDKIT_SHM_EXCHANGE=0`` (turns off shardkit's shared-memory exchange, on by default: torchrec calls
gloo itself).
Reported: the best round's steps per second (slowest rank), the least main-thread CPU ms per step
(busiest rank) over the rounds, and the ratios shardkit/torchrec of both (> 1: shardkit is faster).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.common import write_results
from benchmarks.vs_torchrec import (
    _batches,
    _full_tables,
    handled_without_peers,
    prepare,
    timed,
)

BATCHES = [32, 256, 2048]
TABLE_COUNTS = [8, 64, 256]
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
DIMS = [16, 64, 128]
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad"]
POOLING = {8: 20, 64: 4, 256: 2}
MIN_ROWS, MAX_ROWS = 1_000, 1_000_000
BUDGET = {"data_parallel": 2**23}  # fp32 values of the whole table set
DEFAULT_BUDGET = 2**27
# the duration printed at the start (a rough model of the idle 2-core machine): per row, SETUP_S for
# processes, build and checks, plus 2 x (warm-up + 1 probe + rounds x iters) steps of about
# STEP_S + (pooled output bytes per rank) / OUTPUT_BYTES_PER_S seconds each
SETUP_S = 8.0
STEP_S = 0.005
OUTPUT_BYTES_PER_S = 60e6
# timed steps per library and row, at least (see schedule)
MIN_STEPS = 6


def expected_seconds(
    config: Dict[str, Any], rounds: int, round_s: float, warmup: int, min_steps: int = MIN_STEPS
) -> float:
    """Rough seconds one row takes (see SETUP_S)."""
    step = STEP_S + 4 * config["batch"] * config["tables"] * config["dim"] / OUTPUT_BYTES_PER_S
    iters, rounds = schedule(step, rounds, round_s, min_steps)
    return SETUP_S + 2 * step * (warmup + 1 + rounds * iters)


def sizes(tables: int, dim: int, kind: str) -> List[int]:
    """Rows of each table: geometric from 1e3 to the largest top <= 1e6 that fits the budget."""
    budget = BUDGET.get(kind, DEFAULT_BUDGET)

    def spread(top: float) -> List[int]:
        if tables == 1:
            return [int(top)]
        return [round(MIN_ROWS * (top / MIN_ROWS) ** (t / (tables - 1))) for t in range(tables)]

    lo, hi = math.log10(MIN_ROWS), math.log10(MAX_ROWS)
    if sum(spread(MAX_ROWS)) * dim <= budget:
        return spread(MAX_ROWS)
    for _ in range(40):  # bisect log10(top)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(spread(10**mid)) * dim <= budget else (lo, mid)
    return spread(10**lo)


def grid(quick: bool = False) -> List[Dict[str, Any]]:
    """The sweep's rows (see the module docstring for the design)."""
    rows = []
    for i, batch in enumerate(BATCHES):
        for j, tables in enumerate(TABLE_COUNTS):
            for k, kind in enumerate(TYPES):
                if quick and k != (i + 2 * j + 1) % len(TYPES):
                    continue
                dim = DIMS[(i + j + k) % 3]
                rows.append(
                    {
                        "kind": kind,
                        "batch": batch,
                        "tables": tables,
                        "dim": dim,
                        "optimizer": OPTIMIZERS[(i + 2 * j + k) % 3],
                        "pooling": POOLING[tables],
                        "table_rows": sizes(tables, dim, kind),
                    }
                )
    return rows


def schedule(probe: float, rounds: int, round_s: float, min_steps: int = MIN_STEPS) -> tuple:
    """``(iters, rounds)``: steps per round and rounds per library for a row whose step took ``probe`` s.

    About ``round_s`` seconds per round (1 to 200 steps); a row whose step is longer than a round gets
    fewer rounds (at least 2), not a longer run, except that every library runs at least ``min_steps``
    timed steps (``ceil(min_steps / iters)`` rounds): with 1-2 steps a round, best-of-2 single steps
    read one load spike or one slow step as the row's result (row 41 read 0.73x, then 1.84x).
    """
    iters = int(min(200, max(1, round(round_s / probe))))
    by_time = max(2, min(rounds, int(rounds * round_s / (iters * probe))))
    return iters, max(by_time, math.ceil(min_steps / iters))


def sweep_worker(
    config: Dict[str, Any], rounds: int, round_s: float, warmup: int, min_steps: int = MIN_STEPS
) -> Dict[str, Any]:
    """One row on this rank: both libraries' models, warm-up, a common step count, alternating rounds."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    kind = config["kind"]
    raw = _batches(config, dist.get_rank())
    tables = _full_tables(config)
    steps, diffs = {}, {}
    for lib in ("torchrec", "shardkit"):
        steps[lib], diffs[lib] = prepare(lib, kind, config, tables, raw)
    del tables
    for lib in steps:
        for i in range(warmup):
            steps[lib](i)
    probe = max(timed(steps[lib], 1)[0] for lib in steps)  # one more untimed step each
    iters, rounds = schedule(probe, rounds, round_s, min_steps)
    best: Dict[str, List[float]] = {lib: [math.inf, math.inf] for lib in steps}
    for r in range(rounds):
        for lib in ("torchrec", "shardkit") if r % 2 == 0 else ("shardkit", "torchrec"):
            wall, cpu = timed(steps[lib], iters)
            best[lib] = [min(best[lib][0], wall), min(best[lib][1], cpu)]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, diffs)
    return {
        "iters": iters,
        "rounds": rounds,
        **{f"{lib}_steps_per_s": iters / best[lib][0] for lib in steps},
        **{f"{lib}_cpu_ms": 1e3 * best[lib][1] / iters for lib in steps},
        **{f"{lib}_fwd_diff": max(g[lib] for g in gathered) for lib in steps},
    }


def label(config: Dict[str, Any]) -> str:
    """``b256 t64 d16 sgd rows=1e3..1e6 table_wise``: one row's configuration, compactly."""
    rows = config["table_rows"]
    opt = {"sgd": "sgd", "adagrad": "adagrad", "rowwise_adagrad": "rw_adagrad"}[config["optimizer"]]
    return (
        f"b{config['batch']} t{config['tables']} d{config['dim']} {opt} "
        f"rows={min(rows):.0e}..{max(rows):.0e} {config['kind']}"
    ).replace("e+0", "e")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 9-row subset (< 3 min idle)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="alternate the libraries this many times (6; quick 4)"
    )
    parser.add_argument("--round-s", type=float, default=None, help="seconds per round (0.5; quick 0.25)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per library (+1 probe)")
    parser.add_argument(
        "--min-steps",
        type=int,
        default=MIN_STEPS,
        help=f"timed steps per library and row, at least (more rounds for long steps; {MIN_STEPS})",
    )
    parser.add_argument("--only", nargs="+", type=int, help="run only these row numbers (1-based)")
    parser.add_argument(
        "--dp-kernel",
        choices=["fused", "dense"],
        default="fused",
        help="shardkit's kernel in data_parallel rows (fused: its default for a fused collection)",
    )
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    parsed = parser.parse_args(argv)
    if handled_without_peers("vs_torchrec_sweep", argv, parsed.out):
        return
    from benchmarks.vs_torchrec_sweep import sweep_worker as worker  # workers unpickle it by module name
    from shardkit.testing import WorldError, run_world, shutdown_workers

    # many short alternating rounds, best of each: a load spike on a shared machine costs one round
    round_s = parsed.round_s or (0.25 if parsed.quick else 0.5)
    parsed.rounds = parsed.rounds or (4 if parsed.quick else 6)
    configs = grid(parsed.quick)
    for config in configs:
        if config["kind"] == "data_parallel":
            config["dp_kernel"] = parsed.dp_kernel
    numbered = list(enumerate(configs, 1))
    if parsed.only:
        numbered = [(n, c) for n, c in numbered if n in parsed.only]
    if parsed.min_steps < 1:
        parser.error(f"--min-steps must be >= 1, got {parsed.min_steps}")
    expected = sum(
        expected_seconds(c, parsed.rounds, round_s, parsed.warmup, parsed.min_steps) for _, c in numbered
    )
    print(
        f"vs_torchrec_sweep: {len(numbered)} rows, expected ~{expected / 60:.1f} min on an idle 2-core "
        f"machine (more when loaded); {parsed.rounds} alternating rounds of ~{round_s} s per library",
        flush=True,
    )
    print("  #  config" + " " * 40 + "shardkit/s  torchrec/s  ratio  cpu-ratio", flush=True)
    began = time.perf_counter()
    results = []
    for n, config in numbered:
        row: Dict[str, Any] = {"name": label(config), "row": n, **{k: v for k, v in config.items()}}
        row["table_rows"] = f"{min(config['table_rows'])}..{max(config['table_rows'])}"
        try:
            got = run_world(
                worker, 2, config, parsed.rounds, round_s, parsed.warmup, parsed.min_steps, timeout=900
            )[0]
        except WorldError as err:
            print(err, file=sys.stderr)  # every rank's traceback
            row["error"] = [line for line in str(err).splitlines() if line.strip()][-1].strip()
            print(f"{n:3d}  {row['name']:<47} FAILED: {row['error']}", flush=True)
            results.append(row)
            continue
        finally:
            shutdown_workers()  # a fresh process pair for every row
        row.update(got)
        row["ratio"] = got["shardkit_steps_per_s"] / got["torchrec_steps_per_s"]
        row["cpu_ratio"] = got["torchrec_cpu_ms"] / got["shardkit_cpu_ms"]
        results.append(row)
        print(
            f"{n:3d}  {row['name']:<47} {got['shardkit_steps_per_s']:10.1f}  "
            f"{got['torchrec_steps_per_s']:10.1f}  {row['ratio']:5.2f}  {row['cpu_ratio']:9.2f}",
            flush=True,
        )
    measured = [r for r in results if "ratio" in r]
    if measured:
        worst = min(measured, key=lambda r: r["ratio"])
        below = sum(r["ratio"] < 1.0 for r in measured)
        short = sum(r["ratio"] < 1.5 for r in measured)
        print(
            f"vs_torchrec_sweep: {len(measured)} rows in {(time.perf_counter() - began) / 60:.1f} min; "
            f"worst ratio {worst['ratio']:.2f} (row {worst['row']}); {below} below 1.0, {short} below 1.5; "
            f"{len(results) - len(measured)} failed",
            flush=True,
        )
    config = {
        "quick": parsed.quick,
        "rounds": parsed.rounds,
        "round_s": round_s,
        "warmup": parsed.warmup,
        "min_steps": parsed.min_steps,
        "world": 2,
        "backend": "gloo",
        "threads_per_rank": 1,
        "dp_kernel": parsed.dp_kernel,
    }
    write_results("vs_torchrec_sweep", config, results, parsed.out)


if __name__ == "__main__":
    main()

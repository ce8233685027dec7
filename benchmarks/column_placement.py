"""The column placement's choice of way (native copier, strided runs, one index copy), against all three
measured.

``python -m benchmarks.column_placement [--rows 32 64 256 512 2048] [--rounds 7]``: for rank 0 of six
layouts of fp32 blocks (the demo's rank 0: lookup groups of two widths; 64 and 8 tables placed
round-robin; three scattered blocks; 8 and 16 runs of 4- and 64-column blocks), at each row count, one
``place`` + ``take`` (a step's forward and backward) by each way, the ways taking turns, the fastest of
``--rounds`` calls each, one thread (as each rank of a multi-rank job). Printed with:

- ``chosen``: the way the placement chose (``ColumnPlacement``'s own trials, ``placement.measure_trials``)
  and ``fixed_rule``: the rule before it (constants measured once on a Zen 3: a strided run 8 us + 5 ns
  a row and block, the copier 9 ns a row and range; strided runs, or the index copy past ``MAX_RUNS``);
- ``torch_chosen`` / ``torch_rule``: the same without the native kernels (no copier: strided or index;
  the rule: strided up to ``MAX_RUNS`` runs).

``*_over_fastest``: the chosen way's time over the fastest allowed one's (1.0: the fastest chosen).
The placement times its ways at ``copy_choice.TRIAL_ROWS`` only and interpolates in between.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence, Tuple

import torch

from benchmarks.common import write_results
from shardkit.distributed.comm_ops import copy_choice
from shardkit.distributed.comm_ops.copy_choice import time_trials
from shardkit.distributed.comm_ops.placement import (
    MAX_RUNS,
    WAYS,
    ColumnPlacement,
    arithmetic_runs,
    trial_ways,
)
from shardkit.kernels.column_copy import column_copier
from shardkit.kernels.prefetch import cpu_model


def _runs_layout(runs: int) -> List[List[int]]:
    """Rank 0: ``runs`` single blocks in descending order (a run each) among 2 x ``runs`` blocks."""
    mine = list(range(0, 2 * runs, 2))[::-1]
    return [mine, [b for b in range(2 * runs) if b not in mine]]


# name -> (block width, dest)
LAYOUTS: Dict[str, Tuple[int, List[List[int]]]] = {
    "demo_rank0": (16, [[0, 1, 4, 10, 2, 3, 11, 12], [5, 6, 7, 8, 9]]),
    "round_robin_64": (16, [list(range(0, 128, 2)), list(range(1, 128, 2))]),
    "round_robin_8": (16, [list(range(0, 16, 2)), list(range(1, 16, 2))]),
    "scattered_3": (16, [[0, 5, 9], [1, 2, 3, 4, 6, 7, 8]]),
    "runs_8_w4": (4, _runs_layout(8)),
    "runs_16_w64": (64, _runs_layout(16)),
}
# the fixed rule this benchmark's choice replaced (twenty-seventh session), in ns
FIXED_STRIDED_RUN_NS, FIXED_STRIDED_BLOCK_NS, FIXED_COPIER_RANGE_NS = 8000.0, 5.0, 9.0


def fixed_rule_copier(placement: ColumnPlacement, rank: int, rows: int) -> bool:
    """The choice of the fixed-constant rule: copier below a crossover row count (inf: always)."""
    dest = placement.dest[rank]
    runs = len(arithmetic_runs(dest))
    per_row = placement._ranges[rank][0].size(0) * FIXED_COPIER_RANGE_NS - len(dest) * FIXED_STRIDED_BLOCK_NS
    if runs > MAX_RUNS or per_row <= 0:
        return True
    return rows < runs * FIXED_STRIDED_RUN_NS / per_row


def torch_rule(placement: ColumnPlacement, rank: int) -> str:
    """Without a copier, the rule before the trials: strided runs, the index copy past MAX_RUNS."""
    return "index" if len(placement._runs[rank]) > MAX_RUNS else "strided"


def time_ways(placement: ColumnPlacement, rank: int, rows: int, rounds: int) -> Dict[str, float]:
    """Microseconds of one place + take each way (the placement's own trial calls, timed again here:
    the fastest of ``rounds``, taking turns, after one warm-up)."""
    ((_, seconds),) = time_trials(trial_ways(placement, rank), 0, row_counts=(rows,), samples=rounds)
    return {way: s * 1e6 for way, s in zip(placement.ways, seconds)}


def run(rows_list: Sequence[int], rounds: int) -> List[dict]:
    copier = column_copier()
    if copier is None:
        raise SystemExit("the native kernels are not available: there is no copier to compare")
    rows_out = []
    for name, (width, dest) in LAYOUTS.items():
        placement = ColumnPlacement(width, dest, copier)
        plain = ColumnPlacement(width, dest)
        for rows in rows_list:
            us = time_ways(placement, 0, rows, rounds)
            chosen = placement.way(0, rows)
            fixed = "copier" if fixed_rule_copier(placement, 0, rows) else torch_rule(placement, 0)
            torch_chosen, torch_fixed = plain.way(0, rows), torch_rule(plain, 0)
            fastest, torch_fastest = min(us.values()), min(us["strided"], us["index"])
            rows_out.append(
                {
                    "name": name,
                    "width": width,
                    "runs": len(placement._runs[0]),
                    "rows": rows,
                    **{f"{w}_us": us[w] for w in WAYS},
                    "chosen": chosen,
                    "chosen_over_fastest": us[chosen] / fastest,
                    "fixed_rule": fixed,
                    "fixed_rule_over_fastest": us[fixed] / fastest,
                    "torch_chosen": torch_chosen,
                    "torch_chosen_over_fastest": us[torch_chosen] / torch_fastest,
                    "torch_rule": torch_fixed,
                    "torch_rule_over_fastest": us[torch_fixed] / torch_fastest,
                }
            )
    return rows_out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256, 512, 2048])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(args.rows, args.rounds)
    worst = {
        k[: -len("_over_fastest")]: max(r[k] for r in rows) for k in rows[0] if k.endswith("_over_fastest")
    }
    print(
        f"cpu: {cpu_model()}; worst over the fastest: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items())
    )
    config = {"rounds": args.rounds, "cpu_model": cpu_model(), "trial_rows": copy_choice.TRIAL_ROWS}
    write_results("column_placement", config, rows, args.out)


if __name__ == "__main__":
    main()

"""The column placement's choice between the native copier and strided copies, against both measured.

``python -m benchmarks.column_placement [--rows 32 64 256 512 2048] [--rounds 7]``: for rank 0 of four
layouts of 16-column fp32 blocks (the demo's rank 0: lookup groups of two widths; 64 and 8 tables
placed round-robin; three scattered blocks), at each row count, one ``place`` + ``take`` (a step's
forward and backward) by the copier and by the strided copies, the two alternating, the fastest of
``--rounds`` calls each, one thread (as each rank of a multi-rank job). Printed with the way the
placement chose when it was built (``ColumnPlacement``'s own timing, ``placement.measure_trials``)
and the way the fixed rule before it would have chosen (constants measured once on a Zen 3:
a strided run 8 us + 5 ns a row and block, the copier 9 ns a row and range).

``chosen_over_fastest``: the chosen way's time over the faster one's (1.0: the faster way chosen).
The placement times both ways at ``copy_choice.TRIAL_ROWS`` only and interpolates in between.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Dict, List, Sequence

import torch

from benchmarks.common import write_results
from shardkit.distributed.comm_ops import copy_choice
from shardkit.distributed.comm_ops.placement import MAX_RUNS, ColumnPlacement, arithmetic_runs
from shardkit.kernels.column_copy import column_copier
from shardkit.kernels.prefetch import cpu_model

WIDTH = 16
LAYOUTS: Dict[str, List[List[int]]] = {
    "demo_rank0": [[0, 1, 4, 10, 2, 3, 11, 12], [5, 6, 7, 8, 9]],
    "round_robin_64": [list(range(0, 128, 2)), list(range(1, 128, 2))],
    "round_robin_8": [list(range(0, 16, 2)), list(range(1, 16, 2))],
    "scattered_3": [[0, 5, 9], [1, 2, 3, 4, 6, 7, 8]],
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


def time_ways(placement: ColumnPlacement, rank: int, rows: int, rounds: int) -> Dict[str, float]:
    """Microseconds of one place + take each way (fastest of ``rounds``, alternating, one warm-up)."""
    out = torch.randn(rows, placement.blocks * placement.width)
    piece = torch.randn(rows * placement.columns(rank))
    ways = {
        "copier": (placement._place_copied, placement._take_copied),
        "strided": (placement._place_strided, placement._take_strided),
    }
    best = {name: math.inf for name in ways}
    for sample in range(rounds + 1):
        for name, (place, take) in ways.items():
            start = time.perf_counter()
            place(out, rank, piece)
            take(out, rank, piece)
            if sample:
                best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * 1e6 for name, seconds in best.items()}


def run(rows_list: Sequence[int], rounds: int) -> List[dict]:
    copier = column_copier()
    if copier is None:
        raise SystemExit("the native kernels are not available: there is no copier to compare")
    rows_out = []
    for name, dest in LAYOUTS.items():
        placement = ColumnPlacement(WIDTH, dest, copier)
        for rows in rows_list:
            us = time_ways(placement, 0, rows, rounds)
            chosen = "copier" if placement.uses_copier(0, rows) else "strided"
            fixed = "copier" if fixed_rule_copier(placement, 0, rows) else "strided"
            fastest = min(us.values())
            rows_out.append(
                {
                    "name": name,
                    "rows": rows,
                    "copier_us": us["copier"],
                    "strided_us": us["strided"],
                    "chosen": chosen,
                    "chosen_over_fastest": us[chosen] / fastest,
                    "fixed_rule": fixed,
                    "fixed_rule_over_fastest": us[fixed] / fastest,
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
    worst = max(r["chosen_over_fastest"] for r in rows)
    worst_fixed = max(r["fixed_rule_over_fastest"] for r in rows)
    print(f"cpu: {cpu_model()}; worst chosen/fastest {worst:.2f}, fixed rule's {worst_fixed:.2f}")
    config = {
        "width": WIDTH,
        "rounds": args.rounds,
        "cpu_model": cpu_model(),
        "trial_rows": copy_choice.TRIAL_ROWS,
    }
    write_results("column_placement", config, rows, args.out)


if __name__ == "__main__":
    main()

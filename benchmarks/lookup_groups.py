"""Tables of several widths: a rank's lookup groups from one autograd node, and a data-parallel rank's
replica groups exchanging in one collective, against each group alone, in the same processes.

Run from the repository root: ``python -m benchmarks.lookup_groups`` (``./dev bench lookup_groups``).

Per shape (sharding type, bags a rank, tables, rows a table), ``--world`` CPU ranks (gloo) build the
calibration's training step (``shardkit.planner.calibration_steps.training_step``: fused SGD, uniform
random ids, 2 a bag; kind ``unsharded``: an unsharded ``EmbeddingBagCollection`` on each rank alone)
twice: n tables of n widths (16, 20, 24, ...; n lookup groups) and, as the control, n tables of one
width (one group, where both paths are the same). Each is timed with the one-node path on and off
(off: ``lookup_pooled_groups`` answers None, so every group runs alone, as before it existed) in
alternating rounds (``calibration_steps.alternating_seconds``). Rows: the slowest rank's median ms a
step of each, and on / off of both (the control's ratio is the measurement's spread).
``./dev bench --quick lookup_groups`` is a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from benchmarks.common import write_results

UNSHARDED = "unsharded"  # the shape's kind for an unsharded EmbeddingBagCollection on each rank alone
# (sharding type, bags a rank, tables, rows a table)
SHAPES: List[Tuple[str, int, int, int]] = [
    ("table_wise", 32, 16, 1000),
    ("table_wise", 256, 16, 1000),
    ("table_wise", 32, 64, 1000),
    ("row_wise", 32, 16, 1000),
    ("column_wise", 32, 16, 1000),
    ("data_parallel", 32, 16, 1000),
    ("data_parallel", 256, 16, 1000),
    ("data_parallel", 32, 16, 16),  # most rows touched: the dense way
    (UNSHARDED, 32, 16, 1000),  # an unsharded collection on each rank alone
    (UNSHARDED, 256, 16, 1000),
]
QUICK_SHAPES = [("table_wise", 8, 2, 100), ("data_parallel", 8, 2, 100), (UNSHARDED, 8, 2, 100)]


def _unsharded_step(config, _group, device: torch.device):
    """A training step of an unsharded ``EmbeddingBagCollection`` of ``config``'s tables (fused SGD,
    ``config.batch`` bags of ``config.pooling`` uniform ids), on this rank alone: no collective."""
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
    from shardkit.sparse import KeyedJaggedTensor

    n = len(config.types)
    keys = [f"f{i}" for i in range(n)]
    tables = [
        EmbeddingBagConfig(config.rows, config.width(i), name=f"t{i}", feature_names=[keys[i]])
        for i in range(n)
    ]
    module = EmbeddingBagCollection(
        tables, device=device, fused_optimizer=FusedOptimizerConfig("SGD", lr=0.01)
    )
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, config.rows, (n * config.batch * config.pooling,), generator=gen)
    lengths = torch.full((n * config.batch,), config.pooling, dtype=torch.int64)

    def step() -> None:
        module(KeyedJaggedTensor(keys, values, lengths=lengths)).values().sum().backward()

    return step


def worker(shapes: List[Tuple[str, int, int, int]], rounds: int, steps: int) -> List[Dict[str, Any]]:
    """On every rank: per shape, the four variants timed in alternating rounds (a collective)."""
    import shardkit.modules.embedding_bag_collection as collection
    import shardkit.sharding.embedding_lookup as embedding_lookup
    from shardkit.distributed.validation import set_validation
    from shardkit.planner.calibration_configs import StepConfig
    from shardkit.planner.calibration_steps import alternating_seconds, training_step

    torch.set_num_threads(1)
    set_validation(False)
    real = embedding_lookup.lookup_pooled_groups

    def with_path(step, on: bool):
        def run() -> None:
            for owner in (embedding_lookup, collection):
                owner.lookup_pooled_groups = real if on else (lambda *args: None)
            try:
                step()
            finally:
                for owner in (embedding_lookup, collection):
                    owner.lookup_pooled_groups = real

        return run

    rows = []
    for kind, batch, tables, table_rows in shapes:
        make = _unsharded_step if kind == UNSHARDED else training_step
        types = (kind,) * tables
        widths = make(StepConfig(types, table_rows, 16, batch, 2, dim_step=4), None, torch.device("cpu"))
        control = make(StepConfig(types, table_rows, 16 + 2 * tables, batch, 2), None, torch.device("cpu"))
        fns = [
            with_path(widths, False),
            with_path(widths, True),
            with_path(control, False),
            with_path(control, True),
        ]
        seconds = torch.tensor(
            alternating_seconds(fns, None, torch.device("cpu"), rounds, steps), dtype=torch.float64
        )
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        off, on, control_off, control_on = (1e3 * s for s in seconds.tolist())
        rows.append(
            {
                "name": f"{kind} b{batch} t{tables} r{table_rows}",
                "widths_off_ms": off,
                "widths_on_ms": on,
                "widths_on/off": on / off,
                "control_off_ms": control_off,
                "control_on_ms": control_on,
                "control_on/off": control_on / control_off,
            }
        )
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.lookup_groups import worker as run  # by module name: the workers unpickle it
    from shardkit.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant and round")
    parser.add_argument("--quick", action="store_true", help="two tiny shapes (a smoke run)")
    parser.add_argument(
        "--shapes",
        nargs="+",
        help="KIND:BAGS:TABLES:ROWS each (default: SHAPES), e.g. data_parallel:32:2:1000",
    )
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [(kind, int(b), int(t), int(r)) for kind, b, t, r in (x.split(":") for x in args.shapes)]
    rows = run_world(run, args.world, shapes, args.rounds, args.steps, timeout=1800)[0]
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["shapes"] = shapes
    write_results("lookup_groups", config, rows, args.out)


if __name__ == "__main__":
    main()

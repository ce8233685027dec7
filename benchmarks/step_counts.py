"""What one sharded training step does, counted: collectives, host syncs, copies, allocations.

Run from the repository root: ``python -m benchmarks.step_counts [--world 2 --types table_wise row_wise]``.

Per sharding type, 2 CPU ranks (gloo) run the training step of ``benchmarks.sharded_ebc`` (default 8
tables x 1e5 x 64, batch 2048 per rank, fused SGD, validation off) under ``torch.profiler`` and
count, per step on rank 0, the operators of each kind below (op names as the profiler reports them)
and their self CPU time. The native kernels' internal buffers are not torch allocations and are not
counted; ``Tensor.tolist`` is not a dispatcher op and is not counted as a host sync.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any, Dict, List, Optional

from benchmarks.common import write_results

CATEGORIES = {
    "collectives": lambda n: n.startswith("c10d::") and not n.startswith("c10d::wait"),
    "host_syncs": lambda n: n in ("aten::_local_scalar_dense", "aten::item"),
    "copies": lambda n: (
        n
        in (
            "aten::copy_",
            "aten::cat",
            "aten::index_select",
            "aten::index_copy_",
            "aten::index_copy",
            "aten::index",
            "aten::clone",
            "aten::gather",
            "aten::scatter_",
            "aten::index_put_",
            "aten::repeat_interleave",
        )
    ),
    "allocations": lambda n: n in ("aten::empty", "aten::empty_strided", "aten::empty_like"),
    "fills": lambda n: n in ("aten::fill_", "aten::zero_"),
    "sorts": lambda n: n in ("aten::sort", "aten::argsort", "aten::searchsorted", "aten::unique_consecutive"),
}


def count_worker(kind: str, steps: int, sizes: Dict[str, int]) -> Dict[str, Any]:
    """Per-step counts and self-CPU milliseconds of each category on this rank."""
    from torch.profiler import profile

    from benchmarks.sharded_ebc import training_step

    sizes_args = (sizes["tables"], sizes["rows"], sizes["dim"], sizes["batch"], sizes["pooling"])
    step = training_step(kind, *sizes_args)
    for _ in range(2):
        step()
    with profile() as prof:
        for _ in range(steps):
            step()
    counts: Counter = Counter()
    millis: Counter = Counter()
    for event in prof.key_averages():
        for category, match in CATEGORIES.items():
            if match(event.key):
                counts[category] += event.count
                millis[category] += event.self_cpu_time_total / 1e3
    row: Dict[str, Any] = {}
    for category in CATEGORIES:
        row[category] = counts[category] / steps
        row[f"{category}_ms"] = millis[category] / steps
    return row


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.sharded_ebc import SHARDING_TYPES
    from benchmarks.step_counts import count_worker as worker
    from shardkit.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="samples per rank")
    parser.add_argument("--pooling", type=int, default=20, help="mean ids per bag")
    parser.add_argument("--types", nargs="+", default=SHARDING_TYPES, choices=SHARDING_TYPES)
    parser.add_argument("--label", default="", help="suffix of the JSON name (e.g. 'before')")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    rows = []
    for kind in args.types:
        sizes = {k: getattr(args, k) for k in ("tables", "rows", "dim", "batch", "pooling")}
        counts = run_world(worker, args.world, kind, args.steps, sizes, timeout=600)[0]
        rows.append({"name": kind, **counts})
    name = "step_counts" + (f"_{args.label}" if args.label else "")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "label")}
    write_results(name, {**config, "validation": False}, rows, args.out)


if __name__ == "__main__":
    main()

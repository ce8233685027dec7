"""Shared output format of the benchmark scripts: a printed table and a JSON file.

Every benchmark writes ``{"benchmark": name, "config": {...}, "rows": [{"name": ..., metric: ...}]}``
to ``--out DIR/<name>.json`` (default: a new directory outside the source tree,
``shardkit.cli.bench.default_out_dir``; the committed figures in ``benchmarks/results/`` are replaced
only when that directory is named) so that one tool can tabulate and plot them.
Report ratios measured in the same run (shardkit vs the naive approach, vs a physical limit such as a
memcpy of the same bytes): absolute times on shared machines are noise.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from shardkit.cli.bench import default_out_dir

# the committed results (the figures the docs quote); written only when named as --out
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (CUDA synchronized)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """Print rows as an aligned text table (columns = union of keys, in first-seen order)."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    cells = [[_fmt(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    print("  ".join(col.ljust(w) for col, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_results(
    name: str, config: dict[str, Any], rows: Sequence[dict[str, Any]], out_dir: Optional[Path] = None
) -> Path:
    """Print the table and write the JSON file; returns its path."""
    print_table(rows)
    out_dir = Path(out_dir) if out_dir else default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"benchmark": name, "config": {**config, "machine": machine()}, "rows": list(rows)}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path

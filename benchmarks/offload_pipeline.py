"""The pipeline rows of ``python -m benchmarks.offload``: offloaded tables trained through
``PrefetchTrainPipelineSparseDist`` next to the in-memory table through the same pipeline.

The same table and batches as the step rows (one table table-wise on a world of one, row-wise Adagrad,
Zipf ids; each cache first warmed to its steady state, ``benchmarks/offload_steady.py``), each module in
a small model (``loss = sum of the pooled values``) under
``PrefetchTrainPipelineSparseDist``:

- ``pipeline fused``: in memory;
- ``pipeline fused_uvm_caching lf=X prefetch sync``: ``prefetch_pipeline=True``, batch i+1's rows
  acquired during step i, in the pipeline's own thread (``background_prefetch = False``);
- ``pipeline fused_uvm_caching lf=X prefetch async``: the same, on the background prefetch thread,
  overlapping step i's backward (docs/offload.md, "Asynchronous prefetch").

The pipelines train in turn, ``--pipeline-block`` steps at a time (a block's time ends when its last
step's background prefetch is done too, so no work spills into the next pipeline's block); a step's
time is the median over the blocks of block time / steps. ``cpu_ms/step`` is the process's CPU time
(every thread: the prefetch thread's work counts), so an overlap shows in wall time only.
``main_cpu_ms/step`` is the main thread's CPU time (``time.thread_time``), ``bg_cpu_ms/step`` the rest
(the prefetch thread, the process's other threads), and ``critical_vs_fused`` the in-memory pipeline's
main-thread CPU time over the larger of the two: what the step would take on a machine with a core
free for the prefetch thread, ignoring waits for the GIL, measurable on a loaded machine (wall times
there are noise).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import torch
from torch import nn


class _Batch:
    """The pipeline's batch: the KJT of the table's one feature."""

    def __init__(self, kjt) -> None:
        self.kjt = kjt

    def to(self, device: torch.device, non_blocking: bool = False) -> _Batch:
        return _Batch(self.kjt.to(device, non_blocking=non_blocking))


class _Model(nn.Module):
    """forward(batch) -> (sum of the pooled values, the pooled values detached)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: _Batch):
        values = self.ebc(batch.kjt).values()
        return values.sum(), values.detach()


def _pipeline(kernel: str, load_factor: float, background: bool, args, offload_dir: str):
    from benchmarks.offload import sharded_table, warm
    from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup
    from shardkit.pipeline import PrefetchTrainPipelineSparseDist

    meta = kernel != "fused"
    sharded = sharded_table(kernel, args.rows, args.dim, load_factor, offload_dir, meta, prefetch=True)
    lookups = [m for m in sharded.modules() if isinstance(m, OffloadedEmbeddingLookup)]
    for lookup in lookups:
        lookup.background_prefetch = background
    if lookups:
        warm(sharded, args.rows, args)  # to the steady state, before the pipeline takes over the forward
    model = _Model(sharded)
    pipeline = PrefetchTrainPipelineSparseDist(model, sharded.fused_optimizer, torch.device("cpu"))
    return pipeline, lookups


def pipeline_rows(args, offload_dir: str) -> List[Dict[str, Any]]:
    """In-memory vs offloaded (sync / async prefetch) steps through PrefetchTrainPipelineSparseDist."""
    from benchmarks.offload import batches

    steps = args.warmup + args.pipeline_steps
    inputs = [_Batch(kjt) for kjt in batches(args.rows, args, steps + 2)]
    configs = [("pipeline fused", "fused", 1.0, False)]
    for lf in args.pipeline_load_factors:
        for background in (False, True):
            mode = "async" if background else "sync"
            name = f"pipeline fused_uvm_caching lf={lf} prefetch {mode}"
            configs.append((name, "fused_uvm_caching", lf, background))
    built = [_pipeline(kernel, lf, bg, args, offload_dir) for _, kernel, lf, bg in configs]
    data = [iter(inputs) for _ in configs]
    for _ in range(args.warmup):
        for (pipeline, _), it in zip(built, data):
            pipeline.progress(it)
    for _, lookups in built:
        for lookup in lookups:
            lookup.wait_for_prefetch()
            lookup.reset_cache_stats()
    wall: List[List[float]] = [[] for _ in configs]
    cpu: List[List[float]] = [[] for _ in configs]
    main_cpu: List[List[float]] = [[] for _ in configs]
    block = max(1, args.pipeline_block)
    done = 0
    while done < args.pipeline_steps:
        count = min(block, args.pipeline_steps - done)
        for (pipeline, lookups), it, w, c, m in zip(built, data, wall, cpu, main_cpu):
            start, cpu_start, main_start = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(count):
                pipeline.progress(it)
            for lookup in lookups:  # the last step's background prefetch belongs to this block
                lookup.wait_for_prefetch()
                writer = getattr(lookup.cache, "_write_behind", None)
                if writer is not None:  # and so do its evicted rows' background writes
                    writer.wait()
            w.append((time.perf_counter() - start) / count)
            c.append((time.process_time() - cpu_start) / count)
            m.append((time.thread_time() - main_start) / count)
        done += count
    medians = [sorted(t)[len(t) // 2] for t in wall]
    cpu_medians = [sorted(t)[len(t) // 2] for t in cpu]
    main_medians = [sorted(t)[len(t) // 2] for t in main_cpu]
    rows = []
    for (name, *_), (_, lookups), seconds, cpu_s, main_s in zip(
        configs, built, medians, cpu_medians, main_medians
    ):
        row: Dict[str, Any] = {"name": name, "rows": args.rows, "steps/s": 1.0 / seconds}
        row["ms/step"] = seconds * 1e3
        row["vs_fused"] = medians[0] / seconds
        row["cpu_ms/step"] = cpu_s * 1e3
        row["cpu_vs_fused"] = cpu_medians[0] / cpu_s if cpu_s > 0 else float("nan")
        # the main thread's CPU time, and the rest of the process's (the prefetch thread): on a machine
        # with a core free for that thread, a step takes about the larger of the two
        row["main_cpu_ms/step"] = main_s * 1e3
        row["bg_cpu_ms/step"] = max(cpu_s - main_s, 0.0) * 1e3
        critical = max(main_s, cpu_s - main_s)
        row["critical_vs_fused"] = main_medians[0] / critical if critical > 0 else float("nan")
        if lookups:
            stats = lookups[0].cache_stats()
            stats = next(iter(stats.values()))
            row["hit_rate"] = float(stats["hit_rate"])
            row["MB_read/step"] = stats["bytes_read"] / max(stats["calls"], 1) / 1e6
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline-load-factors",
        type=float,
        nargs="*",
        default=[0.2],
        help="load factors of the pipeline rows (none: skip them)",
    )
    parser.add_argument("--pipeline-steps", type=int, default=30, help="measured steps of each pipeline")
    parser.add_argument("--pipeline-block", type=int, default=5, help="steps a pipeline runs in a row")


__all__ = ["add_arguments", "pipeline_rows"]

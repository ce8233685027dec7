"""Where shardkit's DLRM training step spends its main thread's CPU time, phase by phase.

Run from the repository root: ``python -m benchmarks.step_phases`` (or with the torchrec peer
python, ``PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.step_phases``). It builds
``benchmarks.step_overhead``'s golden DLRM step (26 tables, batch 32 per rank, table-wise, 2 ranks on
gloo, validation off), runs ``--steps`` steps bare, then the same number with a thread-CPU timer
around each phase (pipeline stages, input dist and its check, the KJT all-to-all's phases, lookup,
output dist and its wait, dense archs, backward and its comm / lookup parts, optimizers) and prints,
for rank 0 (``--rank 1``: rank 1), each phase's inclusive main-thread CPU ms and wall ms per step
(phases nest: they do not add up); wall minus CPU is where the rank waited (for the other rank at a
collective, for gloo's threads, or for a core on a loaded machine).
Unlike cProfile, only the ~30 wrapped calls per step pay a timer, so the shares stay close to the
bare step's. ``--base-src DIR`` imports shardkit from another checkout's ``src/``. The rows (``step`` bare and
with the timers, then the phases) are printed as a table and written to ``--out DIR/step_phases.json``
(``benchmarks/common.py``).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import time
from typing import Any, Dict, List, Optional

# (module, class or None, function): the phases, each timed inclusively
PHASES = [
    ("shardkit.pipeline.pipelines", "TrainPipelineSparseDist", "progress"),
    ("shardkit.pipeline.pipelines", "TrainPipelineSparseDist", "_load"),
    ("shardkit.pipeline.pipelines", "TrainPipelineSparseDist", "_advance"),
    ("shardkit.model_parallel.model_parallel", "DistributedModelParallel", "forward"),
    ("torch", "Tensor", "backward"),
    ("shardkit.optim.keyed", "CombinedOptimizer", "step"),
    ("shardkit.optim.keyed", "CombinedOptimizer", "zero_grad"),
    ("torch.optim.adagrad", "Adagrad", "step"),
    ("shardkit.sharding.sharded_embedding_module", "ShardedEmbeddingModule", "input_dist"),
    ("shardkit.sharding.sharded_embedding_module", None, "check_input"),
    # the local part of the check, when its verdict rides in the KJT all-to-all's header (no all-gather)
    ("shardkit.sharding.sharded_embedding_module", None, "input_verdict"),
    ("shardkit.sharding.sharded_embedding_module", "_InputDistAwaitable", "_wait_impl"),
    ("shardkit.sharding.sharded_embedding_module", "_TensorsAwaitable", "_wait_impl"),
    ("shardkit.sharding.dist_data.kjt_all_to_all", "KJTAllToAllSplitsAwaitable", "__init__"),
    ("shardkit.sharding.dist_data.kjt_all_to_all", "KJTAllToAllSplitsAwaitable", "_wait_impl"),
    ("shardkit.sharding.dist_data.kjt_all_to_all", "KJTAllToAllTensorsAwaitable", "_wait_impl"),
    ("shardkit.pipeline.forwards", "PipelinedForward", "__call__"),
    ("shardkit.sharding.embedding_lookup", "ShardedGroupedLookup", "forward"),
    ("shardkit.sharding.table_wise", "TwPooledEmbeddingSharding", "output_dist"),
    ("shardkit.sharding.embeddingbag", "_PooledOutputAwaitable", "_wait_impl"),
    ("shardkit.models.dlrm", "SparseArch", "forward"),
    ("shardkit.models.dlrm", "DenseArch", "forward"),
    ("shardkit.models.dlrm", "InteractionArch", "forward"),
    ("shardkit.models.dlrm", "OverArch", "forward"),
    ("shardkit.distributed.comm_ops.request", "_Wait", "backward"),
    ("shardkit.distributed.comm_ops.request", "_Start", "backward"),
    ("shardkit.modules.lookup_kernels", "FusedLookup", "backward"),
]


def _install(spent: Dict[str, float], waited: Dict[str, float], calls: collections.Counter) -> None:
    """Wrap every phase with a thread-CPU timer and a wall-clock timer (missing ones are skipped:
    another checkout); ``waited`` collects the wall time, from which the rows' ``wall_ms`` come."""
    for module, owner_name, name in PHASES:
        owner: Any = importlib.import_module(module)
        if owner_name is not None:
            owner = getattr(owner, owner_name, None)
        if owner is None or not hasattr(owner, name):
            continue
        label = f"{owner_name or module.rsplit('.', 1)[-1]}.{name}"
        inner = getattr(owner, name)

        def timed(*args, __inner=inner, __label=label, **kwargs):
            start, start_wall = time.thread_time(), time.perf_counter()
            try:
                return __inner(*args, **kwargs)
            finally:
                spent[__label] += time.thread_time() - start
                waited[__label] += time.perf_counter() - start_wall
                calls[__label] += 1

        setattr(owner, name, timed)


def _worker(rank: int, cfg: Dict[str, Any], port: int, queue) -> None:
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if cfg["base_src"]:
        sys.path.insert(0, cfg["base_src"])
    from benchmarks.step_overhead import build

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cfg["ranks"])
    try:
        from shardkit.distributed.validation import set_validation

        set_validation(False)
        pipeline, batches, _ = build("shardkit", cfg)
        for _ in range(cfg["warmup"]):
            pipeline.progress(batches)
        steps = cfg["steps"]
        dist.barrier()
        start, start_wall = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            pipeline.progress(batches)
        bare = (time.thread_time() - start, time.perf_counter() - start_wall)
        spent: Dict[str, float] = collections.defaultdict(float)
        waited: Dict[str, float] = collections.defaultdict(float)
        calls: collections.Counter = collections.Counter()
        _install(spent, waited, calls)
        dist.barrier()
        start, start_wall = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            pipeline.progress(batches)
        wrapped = (time.thread_time() - start, time.perf_counter() - start_wall)
        if rank == cfg["rank"]:
            phases = {
                k: (1e3 * v / steps, 1e3 * waited[k] / steps, calls[k] / steps) for k, v in spent.items()
            }
            queue.put(([1e3 * t / steps for t in bare], [1e3 * t / steps for t in wrapped], phases))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> None:
    import torch.multiprocessing as mp

    from benchmarks.common import write_results
    from benchmarks.step_overhead import _free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--base-src", help="import shardkit from this directory (another checkout's src/)")
    parser.add_argument(
        "--rank", type=int, default=0, choices=(0, 1), help="the rank whose phases are printed"
    )
    parser.add_argument("--out", default=None, help="directory for step_phases.json")
    args = parser.parse_args(argv)
    load_average = list(os.getloadavg())
    cfg = {
        "ranks": 2, "tables": 26, "rows_min": 1000, "rows_max": 100_000, "dim": 16, "batch": 32,
        "pooling": 2, "sharding": "table_wise", "model": "dlrm", "steps": args.steps,
        "warmup": args.warmup, "rank": args.rank,
        "base_src": os.path.abspath(args.base_src) if args.base_src else None,
    }  # fmt: skip
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(cfg, _free_port(), queue), nprocs=2, start_method="spawn")
    bare, wrapped, phases = queue.get()
    print(
        f"rank {args.rank} main-thread CPU ms and wall ms per step (inclusive: phases nest), calls per step"
    )
    rows = [
        {"name": "step (bare)", "cpu_ms": bare[0], "wall_ms": bare[1], "calls": 1.0},
        {"name": "step (with the timers)", "cpu_ms": wrapped[0], "wall_ms": wrapped[1], "calls": 1.0},
    ]
    for label, (millis, wall, calls) in sorted(phases.items(), key=lambda kv: -kv[1][0]):
        rows.append({"name": label, "cpu_ms": millis, "wall_ms": wall, "calls": calls})
    config = {
        **cfg,
        "timer": f"rank {args.rank} main-thread CPU time and wall time",
        "load_average": load_average,
    }
    write_results("step_phases", config, rows, args.out)


if __name__ == "__main__":
    main()

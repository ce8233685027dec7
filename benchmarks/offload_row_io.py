"""The offloaded cache's miss path: native C++ row I/O against the pure-Python one, in the same run.

Run from the repository root: ``python -m benchmarks.offload_row_io [--quick]``.

Training steps of one table (the setup of ``benchmarks.offload``: 1M x 64 fp32, row-wise Adagrad,
Zipf 1.05 ids, caches warmed) with ``fused`` in memory and ``fused_uvm_caching`` at each load factor
twice: its misses read and its victims written by the native loop (``csrc/row_io.cpp``) and by the
pure-Python ``os.preadv`` path (``FileRowIO.backend = "torch"``). The modules step in turn on the same
batches, so a change of the machine's load hits them alike; each row is the median over the measured
steps of the process's CPU time (``time.process_time``, all threads: the steadier measure on a shared
machine) and of the wall time, with ``cpu_vs_fused`` = in-memory CPU time / this one's.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, List, Optional

import torch

from benchmarks.common import write_results
from benchmarks.offload import batches, cpu_model, sharded_table, step, warm


def _lookup(module):
    return module.lookups[0].lookups[0]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--load-factors", type=float, nargs="+", default=[0.05, 0.2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--warm-batches", type=int, default=10)
    parser.add_argument("--warm-scale", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="small sizes: runs in seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.pooling, args.steps, args.warmup = 50_000, 128, 8, 3, 1
        args.warm_batches, args.warm_scale = 2, 2
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    import tempfile

    configs = [("fused", 1.0, None)]
    for lf in args.load_factors:
        configs += [("fused_uvm_caching", lf, "native"), ("fused_uvm_caching", lf, "torch")]
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-rowio-", dir=args.offload_dir) as offload_dir:
        modules = []
        for kernel, lf, backend in configs:
            module = sharded_table(kernel, args.rows, args.dim, lf, offload_dir, meta=kernel != "fused")
            if backend is not None:
                row_io = _lookup(module).cache._row_io
                if backend == "native" and row_io._native(_lookup(module).cache.tensors, "auto") is None:
                    raise SystemExit("the native row I/O kernel is not available here (SHARDKIT_NATIVE=0?)")
                row_io.backend = "auto" if backend == "native" else "torch"
                warm(module, args.rows, args)
            modules.append(module)
        inputs = batches(args.rows, args, args.warmup + args.steps)
        wall: List[List[float]] = [[] for _ in modules]
        cpu: List[List[float]] = [[] for _ in modules]
        for i, kjt in enumerate(inputs):
            if i == args.warmup:
                for module, (kernel, _, _) in zip(modules, configs):
                    if kernel != "fused":
                        _lookup(module).reset_cache_stats()
            for module, w, c in zip(modules, wall, cpu):
                start, cpu_start = time.perf_counter(), time.process_time()
                step(module, kjt)
                if i >= args.warmup:
                    w.append(time.perf_counter() - start)
                    c.append(time.process_time() - cpu_start)
        rows: List[Dict[str, Any]] = []
        med = [sorted(t)[len(t) // 2] for t in cpu]
        wmed = [sorted(t)[len(t) // 2] for t in wall]
        for (kernel, lf, backend), module, c, w in zip(configs, modules, med, wmed):
            name = kernel if backend is None else f"{kernel} lf={lf} row_io={backend}"
            row: Dict[str, Any] = {"name": name, "cpu_ms/step": c * 1e3, "ms/step": w * 1e3}
            row["cpu_vs_fused"] = med[0] / c if c > 0 else float("nan")
            if backend is not None:
                stats = module.cache_stats()["t"]
                row["hit_rate"] = float(stats["hit_rate"])
                row["misses/step"] = stats["misses"] / max(1, stats["calls"])
            rows.append(row)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "offload_dir")}
    config.update(cpu_model=cpu_model(), load_average=list(os.getloadavg()))
    write_results("offload_row_io", config, rows, args.out)


if __name__ == "__main__":
    main()

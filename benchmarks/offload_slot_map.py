"""The row cache's slot map, dense against hashed (kernels/offload/slot_map.py): a steady cache's
``acquire_ids`` + dirty ``release`` per step, both maps in the same process, alternating step by step,
on the native and the pure-torch path; CPU time (median) and the bookkeeping's bytes.

    PYTHONPATH=src:. python -m benchmarks.offload_slot_map [--rows 2600000 --slots 100000 --ids 32768]
                                                           [--quick] [--out DIR]

Prints a table (one row per path) and writes ``offload_slot_map.json``.
"""

from __future__ import annotations

import argparse
import time
from typing import List, Optional

import torch

from benchmarks.common import write_results
from shardkit.kernels.embedding import native_for
from shardkit.kernels.offload.row_cache import RowCache


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=2_600_000)
    parser.add_argument("--slots", type=int, default=100_000)
    parser.add_argument("--ids", type=int, default=32_768, help="ids a step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm", type=int, default=20, help="steps before the timed ones")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU time counts spinning)")
    parser.add_argument("--quick", action="store_true", help="small sizes: runs in seconds")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.slots, args.ids, args.steps, args.warm = 50_000, 2_000, 1_024, 4, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    backing = {"w": torch.zeros(args.rows, 16), "s": torch.zeros(args.rows)}
    ranks = torch.randperm(args.rows)

    def batch(gen: torch.Generator) -> torch.Tensor:  # log-uniform ranks: a skewed, Zipf-like stream
        u = torch.rand(args.ids, generator=gen)
        return ranks[(args.rows**u).long().clamp(max=args.rows - 1)]

    rows = []
    paths = [True, False] if native_for(torch.device("cpu")) is not None else [False]
    for native in paths:
        caches = {kind: RowCache(backing, args.slots, "lru", slot_map=kind) for kind in ("dense", "hash")}
        for cache in caches.values():
            cache.use_native = native
        gen = torch.Generator().manual_seed(1)
        for ids in [batch(gen) for _ in range(args.warm)]:
            for cache in caches.values():
                ticket, _ = cache.acquire_ids(ids)
                cache.release(ticket, dirty=True)
        times = {kind: [] for kind in caches}
        for step in range(args.steps):
            ids = batch(gen)
            order = list(caches.items()) if step % 2 == 0 else list(reversed(caches.items()))
            for kind, cache in order:
                start = time.process_time()
                ticket, _ = cache.acquire_ids(ids)
                cache.release(ticket, dirty=True)
                times[kind].append(time.process_time() - start)
        ms = {kind: sorted(t)[len(t) // 2] * 1e3 for kind, t in times.items()}
        rows.append(
            {
                "name": "native" if native else "torch",
                "dense_ms": ms["dense"],
                "hash_ms": ms["hash"],
                "hash_vs_dense": ms["hash"] / ms["dense"],
                "dense_MB": caches["dense"].bookkeeping_bytes / 1e6,
                "hash_MB": caches["hash"].bookkeeping_bytes / 1e6,
            }
        )
    write_results("offload_slot_map", vars(args), rows, args.out)


if __name__ == "__main__":
    main()

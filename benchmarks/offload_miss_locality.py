"""How close together a steady row cache's misses lie in the backing file: whether coalescing the reads
of neighbouring rows (or the write-backs of neighbouring victims) into fewer, larger I/Os could pay.

A ``RowCache`` of ``--load-factor`` x ``--rows`` rows (in memory: only the rows' positions matter) is
driven to its steady state with ``benchmarks.offload``'s stream (Zipf ids, hot rows spread over the
table by a random permutation; ``offload_steady.warm_to_steady``), then ``--steps`` steps are recorded:
each step's missed rows (ascending, as they are read) and evicted dirty rows (ascending, as they are
written back). For each, the share of consecutive pairs at most 1 row apart (adjacent: one system call
already, ``row_io``), on the same 4 KiB page (``rows_per_page``), and within 64 KiB.

    PYTHONPATH=src:. python -m benchmarks.offload_miss_locality [--quick] [--out DIR]

Prints a table (one row per algorithm and kind) and writes ``offload_miss_locality.json``.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

import torch

from benchmarks.common import write_results
from benchmarks.offload_steady import warm_to_steady, zipf_sampler
from shardkit.kernels.offload.row_cache import RowCache


def _shares(name: str, batches: List[torch.Tensor], row_bytes: int) -> Dict[str, Any]:
    """Locality of ``batches`` (ascending int64 rows each): counts and shares of close pairs."""
    gaps = torch.cat([b.diff() for b in batches if b.numel() > 1] or [torch.zeros(0, dtype=torch.int64)])
    pairs = max(gaps.numel(), 1)
    return {
        "name": name,
        "rows/step": sum(b.numel() for b in batches) / max(len(batches), 1),
        "adjacent": int((gaps == 1).sum()) / pairs,
        "same_4KiB_page": int((gaps * row_bytes < 4096).sum()) / pairs,
        "within_64KiB": int((gaps * row_bytes < 65536).sum()) / pairs,
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64, help="fp32 weights a row (the row's bytes)")
    parser.add_argument("--load-factor", type=float, default=0.2)
    parser.add_argument("--ids", type=int, default=32_768, help="ids a step (benchmarks.offload: 2048 x 16)")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--steps", type=int, default=10, help="recorded steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-window", type=int, default=16)
    parser.add_argument("--warm-tolerance", type=float, default=0.01)
    parser.add_argument("--warm-cap", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="small sizes: runs in seconds")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.ids, args.steps, args.warm_cap = 50_000, 1_024, 3, 64
    torch.set_num_threads(1)
    row_bytes = args.dim * 4
    rows_out: List[Dict[str, Any]] = []
    for algorithm in ("lru", "lfu"):
        cache = RowCache(
            {"weight": torch.zeros(args.rows, args.dim)}, int(args.load_factor * args.rows), algorithm
        )
        sample = zipf_sampler(args.rows, args.zipf, args.seed, stream=1)
        warm_to_steady(cache, sample, args.ids, args)
        reads: List[torch.Tensor] = []
        writes: List[torch.Tensor] = []
        read_rows, write_back = cache._read_rows, cache._write_back

        def record_read(rows, slots, _read=read_rows, _log=reads):
            _log.append(rows.clone())
            return _read(rows, slots)

        def record_write(rows, slots, ordered=False, _write=write_back, _log=writes):
            _log.append(rows.sort().values if not ordered else rows.clone())
            return _write(rows, slots, ordered)

        cache._read_rows, cache._write_back = record_read, record_write
        for _ in range(args.steps):
            ticket, _ = cache.acquire_ids(sample(args.ids))
            cache.release(ticket, dirty=True)
        rows_out.append(_shares(f"{algorithm} misses (reads)", reads, row_bytes))
        rows_out.append(_shares(f"{algorithm} dirty victims (write-backs)", writes, row_bytes))
    write_results("offload_miss_locality", vars(args), rows_out, args.out)


if __name__ == "__main__":
    main()

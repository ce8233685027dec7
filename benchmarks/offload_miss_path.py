"""What one step's cache misses cost on CPU: the native row I/O with and without gap merging, and the
row cache's bookkeeping, each measured in the same run (docs/offload/miss_path.md).

Run from the repository root: ``python -m benchmarks.offload_miss_path [--quick] [--out DIR]``; the
rows are printed as a table and written to ``DIR/offload_miss_path.json`` (``benchmarks/common.py``).

- ``io``: a backing file of ``--rows`` x ``--dim`` fp32 weights plus row-wise Adagrad's one-float state
  (separate regions, as ``BackingStore`` lays them out), initialized through the mapping as a table is;
  each round draws ``--misses`` random rows and moves them into / out of a cache buffer with
  ``FileRowIO.read_into`` / ``write_from`` (native path), one field at a time, with
  ``merge_gap = 0`` (one call per row) and the default (rows up to 4 KiB apart share a call),
  alternating; CPU microseconds per row, median over ``--rounds``.
- ``io ... kept mapping``: the same rounds through a second file kept mapped
  (``$SHARDKIT_OFFLOAD_RESIDENT_MAP``, ``BackingStore.keep_mapped``): the rows copied with
  ``index_select`` / ``index_copy_`` on the mapped tensors, as the cache then does; its pages stay in
  the resident set (``mapped_MiB``).
- ``bookkeeping``: ``RowCache.acquire`` + ``release(dirty=True)`` of Zipf batches (``--batch`` ids,
  exponent 1.05; distinct rows as the lookup passes them) on a cache of ``--load-factor`` x rows over
  in-memory backing tensors (no file I/O: the slot map, LRU queue, pins, ... plus the misses' and
  victims' row copies between those tensors and the cache), after ``--warm`` batches that fill the
  cache; CPU milliseconds per batch, for LRU and LFU, the pure-torch bookkeeping and the native ops
  (csrc/row_cache.cpp, when built) alternating on the same batches; each also with a ``row_io`` that
  moves nothing ("bookkeeping only": no row copies at all, what the cache itself costs).

CPU time (``time.process_time``) because the machine may be shared; the figures of one run compare.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import List, Optional

import torch

from benchmarks.common import write_results


def _median(values: List[float]) -> float:
    return sorted(values)[len(values) // 2]


def io_rows(args) -> List[dict]:
    from shardkit.kernels import native_ops
    from shardkit.kernels.offload.backing_store import BackingStore
    from shardkit.kernels.offload.row_io import MERGE_GAP_BYTES, FileRowIO

    if native_ops() is None:
        print("io: the native kernels are not built here (SHARDKIT_NATIVE=0 or no compiler): skipped")
        return []
    fields = {"weight": ((args.rows, args.dim), torch.float32), "state": ((args.rows,), torch.float32)}
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-miss-") as directory:
        store = BackingStore.create(fields, {"bench": "miss_path"}, directory)
        chunk = max(1, (16 << 20) // (args.dim * 4))
        for start in range(0, args.rows, chunk):  # as reset_parameters: through the mapping, dropped
            store.tensors["weight"][start : start + chunk].normal_()
            store.drop_resident()
        store.tensors["state"].fill_(0.5)
        store.drop_resident()
        whole = store.row_io()
        per_field = {name: FileRowIO(whole.fd, {name: whole.regions[name]}, store.path) for name in fields}
        buffers = {"weight": torch.zeros(args.misses, args.dim), "state": torch.zeros(args.misses)}
        slots = torch.randperm(args.misses)
        gen = torch.Generator().manual_seed(args.seed)
        times = {}
        for _ in range(args.rounds):
            rows = torch.randperm(args.rows, generator=gen)[: args.misses].sort().values
            for name, io in per_field.items():
                for gap in (0, MERGE_GAP_BYTES):
                    io.merge_gap = gap
                    part = {name: buffers[name]}
                    start = time.process_time()
                    io.read_into(rows, part, slots, backend="native")
                    read = time.process_time() - start
                    start = time.process_time()
                    io.write_from(rows, part, slots, backend="native")
                    write = time.process_time() - start
                    times.setdefault((name, gap), ([], []))
                    times[(name, gap)][0].append(read)
                    times[(name, gap)][1].append(write)
        times.update(_kept_mapping_times(args, fields, directory, slots, gen))
        print(f"io: {args.misses} random rows of {args.rows}, median of {args.rounds} rounds, CPU us per row")
        return [
            {
                "name": f"io {name} " + (gap if isinstance(gap, str) else f"merge_gap {gap}"),
                "read_us_per_row": _median(reads) * 1e6 / args.misses,
                "write_us_per_row": _median(writes) * 1e6 / args.misses,
            }
            for (name, gap), (reads, writes) in times.items()
        ]


def _kept_mapping_times(args, fields, directory, slots, gen) -> dict:
    """Per field, the rounds' CPU seconds to read / write ``--misses`` random rows through a mapping
    kept resident: ``{(field, "kept mapping"): (reads, writes)}``."""
    from shardkit.kernels.offload.backing_store import RESIDENT_MAP_ENV, BackingStore

    before = os.environ.get(RESIDENT_MAP_ENV)
    os.environ[RESIDENT_MAP_ENV] = "1024G"
    try:
        store = BackingStore.create(fields, {"bench": "miss_path_mapped"}, directory)
        assert store.keep_mapped()
    finally:
        if before is None:
            del os.environ[RESIDENT_MAP_ENV]
        else:
            os.environ[RESIDENT_MAP_ENV] = before
    store.tensors["weight"].normal_()  # initialized through the mapping, pages kept (as a table is)
    store.tensors["state"].fill_(0.5)
    buffers = {"weight": torch.zeros(args.misses, args.dim), "state": torch.zeros(args.misses)}
    times: dict = {}
    for _ in range(args.rounds):
        rows = torch.randperm(args.rows, generator=gen)[: args.misses].sort().values
        for name in fields:
            mapped, buffer = store.tensors[name], buffers[name]
            start = time.process_time()
            buffer.index_copy_(0, slots, mapped.index_select(0, rows))
            read = time.process_time() - start
            start = time.process_time()
            mapped.index_copy_(0, rows, buffer.index_select(0, slots))
            write = time.process_time() - start
            times.setdefault((name, "kept mapping"), ([], []))
            times[(name, "kept mapping")][0].append(read)
            times[(name, "kept mapping")][1].append(write)
    return times


class _NoRowIO:
    """A ``row_io`` that moves nothing: the cache's bookkeeping alone, without its row copies."""

    def read_into(self, rows, buffers, slots) -> None:
        pass

    def write_from(self, rows, buffers, slots) -> None:
        pass


def bookkeeping_rows(args) -> List[dict]:
    from shardkit.kernels.embedding import native_for
    from shardkit.kernels.offload.row_cache import RowCache

    out: List[dict] = []
    paths = [("torch", False)] + ([("native", True)] if native_for(torch.device("cpu")) is not None else [])
    cdf = torch.arange(1, args.rows + 1, dtype=torch.float64).pow(-1.05).cumsum(0)
    cdf /= cdf[-1].clone()
    for algorithm in args.algorithms.split(","):
        gen = torch.Generator().manual_seed(args.seed)
        permutation = torch.randperm(args.rows, generator=gen)

        def batch(gen=gen, permutation=permutation) -> torch.Tensor:
            u = torch.rand(args.batch, generator=gen, dtype=torch.float64)
            return torch.unique(permutation[torch.searchsorted(cdf, u).clamp_(max=args.rows - 1)])

        caches = {}
        for name, use_native in paths:  # one cache per path (and with / without row copies), same batches
            for copies in (True, False):
                backing = {"weight": torch.zeros(args.rows, args.dim), "state": torch.zeros(args.rows)}
                label = f"{name:6s} " + ("with row copies" if copies else "bookkeeping only")
                io = None if copies else _NoRowIO()
                caches[label] = RowCache(backing, int(args.load_factor * args.rows), algorithm, row_io=io)
                caches[label].use_native = use_native
        for _ in range(args.warm):
            rows = batch()
            for cache in caches.values():
                ticket, _ = cache.acquire(rows)
                cache.release(ticket, dirty=True)
        for cache in caches.values():
            cache.counters.reset()
        spent = {name: [] for name in caches}
        for _ in range(args.rounds):  # the paths alternate: the same machine load for both
            rows = batch()
            for name, cache in caches.items():
                start = time.process_time()
                ticket, _ = cache.acquire(rows)
                cache.release(ticket, dirty=True)
                spent[name].append(time.process_time() - start)
        for name, cache in caches.items():
            c = cache.counters
            out.append(
                {
                    "name": f"bookkeeping {algorithm} {name}",
                    "ms_per_batch": _median(spent[name]) * 1e3,
                    "rows_per_batch": c.lookups / args.rounds,
                    "hit_rate": c.hits / max(c.lookups, 1),
                }
            )
    print(
        f"bookkeeping: acquire + release, CPU ms per batch (median of {args.rounds}); "
        f"{args.load_factor:g} x {args.rows} slots, in-memory backing"
    )
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--misses", type=int, default=5300, help="rows moved per io round (a step's misses)")
    parser.add_argument("--batch", type=int, default=32768, help="ids per bookkeeping batch")
    parser.add_argument("--load-factor", type=float, default=0.2)
    parser.add_argument("--warm", type=int, default=40, help="batches filling the cache first")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--algorithms", default="lru,lfu", help="bookkeeping: comma-separated")
    parser.add_argument("--quick", action="store_true", help="small sizes: runs in seconds")
    parser.add_argument("--out", default=None, help="directory for offload_miss_path.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.misses, args.batch, args.warm, args.rounds = 100_000, 1000, 4096, 10, 5
    torch.set_num_threads(args.threads)
    load_average = list(os.getloadavg())
    print(f"load average: {' '.join(f'{x:.2f}' for x in load_average)}", flush=True)
    rows = io_rows(args) + bookkeeping_rows(args)
    config = {
        k: v for k, v in vars(args).items() if k not in ("out", "quick")
    }  # the sizes actually run (--quick replaces them)
    config.update(quick=args.quick, timer="process CPU time, median over rounds", load_average=load_average)
    write_results("offload_miss_path", config, rows, args.out)


if __name__ == "__main__":
    main()

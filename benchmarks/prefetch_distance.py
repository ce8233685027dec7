"""Sweep of the native pooled forward's prefetch distance, per row width (one thread).

For each dim, a table of ``--table-mib`` MiB (bigger than the L3, so rows come from DRAM) is looked
up by ``--bags`` bags of ~``--pooling`` uniform ids; every distance (in rows) is timed in alternating
rounds and the median ms per distance printed, with the same distance also expressed in bytes ahead
(distance x row bytes). Used to choose the unit of SHARDKIT_PREFETCH_* (docs/performance.md):

    PYTHONPATH=src:. python -m benchmarks.prefetch_distance --dims 16 64 128
    PYTHONPATH=src:. python -m benchmarks.prefetch_distance --dims 64 128 --quant int8  # quantized lookup
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import write_results
from shardkit.kernels.native_build import native_ops
from shardkit.kernels.quant_embedding import _STORAGE_CODES
from shardkit.kernels.quant_rows import STORAGES, quantize_rows
from shardkit.kernels.quant_rows import row_bytes as quant_row_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--distances", type=int, nargs="+", default=[0, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--table-mib", type=int, default=128)
    p.add_argument("--bags", type=int, default=16384)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sets", type=int, default=8, help="id sets cycled through (fresh rows per call)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument(
        "--quant", choices=STORAGES, help="time the quantized lookup of rows stored this way instead"
    )
    p.add_argument("--out", default=None, help="directory for prefetch_distance.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    ops = native_ops()
    if ops is None:
        raise SystemExit("the native kernels did not build")
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    table = []
    for dim in a.dims:
        row_bytes = quant_row_bytes(dim, a.quant) if a.quant else dim * torch.finfo(dtype).bits // 8
        rows = (a.table_mib << 20) // row_bytes
        weight = torch.randn(rows, dim, generator=g)
        weight = quantize_rows(weight, a.quant) if a.quant else weight.to(dtype)
        # fresh ids per call (a cycle of sets that touch 4x the L3 together): a repeated set would
        # find its rows in the L3 from the previous call
        batches = []
        for _ in range(a.sets):
            lengths = torch.randint(1, 2 * a.pooling, (a.bags,), generator=g)
            ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
            batches.append((ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])))
        times = {d: [] for d in a.distances}
        k = 0
        for _ in range(a.rounds):
            for d in a.distances:
                ids, offsets = batches[k % len(batches)]
                k += 1
                t0 = time.perf_counter()
                if a.quant:
                    code = _STORAGE_CODES[a.quant]
                    ops.quant_embedding_forward(weight, code, dim, ids, offsets, None, None, None, True, 0, d)
                else:
                    ops.embedding_forward(weight, ids, offsets, None, None, None, True, 0, d)
                times[d].append(time.perf_counter() - t0)
        base = min(times[a.distances[0]])
        print(f"dim {dim} ({row_bytes} B rows), {rows} rows, {ids.numel()} ids per call")
        for d in a.distances:
            best, med = min(times[d]) * 1e3, statistics.median(times[d]) * 1e3
            print(
                f"  distance {d:>4} rows = {d * row_bytes:>6} B: min {best:7.2f} ms"
                f" ({best / (base * 1e3):.2f}x), median {med:7.2f} ms"
            )
            row = {"dim": dim, "row_bytes": row_bytes, "distance_rows": d, "min_ms": best, "median_ms": med}
            table.append({**row, "vs_first_distance": best / (base * 1e3)})
        del weight
    write_results("prefetch_distance", vars(a), table, a.out)


if __name__ == "__main__":
    main()

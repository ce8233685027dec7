import sys, time, torch
sys.path.insert(0, "src")
torch.set_num_threads(1)
from shardkit.distributed.comm_ops.placement import ColumnPlacement, arithmetic_runs
from shardkit.kernels.column_copy import column_copier
cp = column_copier()
def bench(f, n=300):
    for _ in range(20): f()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - t0) / n)
    return min(ts) * 1e6
layouts = {
  "demo r0 (4 runs 5 ranges)": (16, [[0, 1, 4, 10, 2, 3, 11, 12], [5, 6, 7, 8, 9]]),
  "64 tables rr stride2": (16, [list(range(0, 128, 2)), list(range(1, 128, 2))]),
  "8 tables rr stride2": (16, [list(range(0, 16, 2)), list(range(1, 16, 2))]),
  "3 runs 3 blocks scattered": (16, [[0, 5, 9], [1, 2, 3, 4, 6, 7, 8]]),
}
for name, (w, dest) in layouts.items():
    a = ColumnPlacement(w, dest, cp); b = ColumnPlacement(w, dest, None)
    chosen = ColumnPlacement(w, dest, cp)
    a._ranges = [a._column_ranges(d) for d in dest]  # force copier
    a._copier_rows = [float("inf")] * len(dest)
    for rows in (32, 256, 2048):
        grad = torch.randn(rows, a.blocks * w)
        chunk = torch.empty(rows * a.columns(0))
        runs = len(arithmetic_runs(dest[0])); ranges = a._ranges[0][0].size(0)
        tc = bench(lambda: a.take(grad, 0, chunk, 2)); ts = bench(lambda: b.take(grad, 0, chunk, 2))
        pc = bench(lambda: a.place(grad, 0, chunk)); ps = bench(lambda: b.place(grad, 0, chunk))
        print(f"{name:28s} chosen {'copier' if chosen.uses_copier(0, rows) else 'strided':7s} rows {rows:5d} runs {runs:2d} ranges {ranges:3d} | take/2 copier {tc:7.1f} strided {ts:7.1f} | place copier {pc:7.1f} strided {ps:7.1f} us")
print("chosen by the rule:")
for name, (w, dest) in layouts.items():
    a = ColumnPlacement(w, dest, cp)
    print(name, [(rows, a.uses_copier(0, rows)) for rows in (32, 256, 2048)], round(a._copier_rows[0], 1))

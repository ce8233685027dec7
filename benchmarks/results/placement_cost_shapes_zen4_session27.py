import sys, time, torch
sys.path.insert(0, "src")
torch.set_num_threads(1)
from shardkit.kernels.column_copy import column_copier
cp = column_copier()
W = 16
def bench(f, n=200):
    for _ in range(10): f()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - t0) / n)
    return min(ts) * 1e9
def strided(rows, runs, blocks, stride=2):
    # runs runs of `blocks` blocks each, stride `stride`, into an output of plenty of blocks
    total = runs * blocks * stride + runs
    out = torch.empty(rows, total, W); src = torch.randn(rows, runs * blocks, W)
    def f():
        for r in range(runs):
            d0 = r * (blocks * stride + 1)
            out[:, d0 : d0 + (blocks - 1) * stride + 1 : stride].copy_(src[:, r * blocks:(r + 1) * blocks])
    return bench(f)
def copier(rows, ranges):
    out = torch.empty(rows, 2 * ranges * W); src = torch.randn(rows, ranges * W)
    rg = torch.tensor([[k * W, 2 * k * W, W] for k in range(ranges)], dtype=torch.int64)
    return bench(lambda: cp(out, src, rg))
for rows in (8, 64, 256, 2048):
    for runs, blocks in ((1, 1), (1, 8), (1, 64), (2, 1), (4, 1), (2, 8)):
        print(f"strided rows {rows:5d} runs {runs} blocks/run {blocks:3d}: {strided(rows, runs, blocks)/1e3:8.2f} us")
    for ranges in (1, 8, 64):
        print(f"copier  rows {rows:5d} ranges {ranges:3d}: {copier(rows, ranges)/1e3:8.2f} us")

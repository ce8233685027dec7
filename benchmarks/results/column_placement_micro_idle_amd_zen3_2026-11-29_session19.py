"""Column placement micro-benchmark (nineteenth session): one rank's received piece put in place, 1 thread."""
import time, torch, sys
sys.path.insert(0, "src")
torch.set_num_threads(1)
from shardkit.distributed.comm_ops.placement import arithmetic_runs
def bench(f, n=200):
    for _ in range(10): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
for rows, ntab, w0, step in ((256, 16, 8, 4), (32, 16, 8, 4), (2048, 16, 8, 4), (256, 64, 16, 0), (256, 8, 16, 16)):
    widths = [w0 + step * i for i in range(2 * ntab)]
    width = 4 if step else w0
    import math
    width = math.gcd(*widths)
    blocks = sum(widths) // width
    # rank 0 holds even tables; output order = table order
    starts = [0]
    for wd in widths: starts.append(starts[-1] + wd // width)
    dest = [b for t in range(0, 2 * ntab, 2) for b in range(starts[t], starts[t + 1])]
    runs = arithmetic_runs(dest)
    out = torch.empty(rows, blocks, width); src = torch.randn(rows, len(dest), width)
    idx = torch.tensor(dest)
    a = bench(lambda: out.index_copy_(1, idx, src))
    def per_run():
        for s0, n, d0, st in runs:
            out[:, d0 : d0 + (n - 1) * st + 1 : st].copy_(src[:, s0 : s0 + n])
    b = bench(per_run)
    # flat element index
    col = (idx[:, None] * width + torch.arange(width)).reshape(-1)
    flat = (torch.arange(rows)[:, None] * (blocks * width) + col[None, :]).reshape(-1)
    o1 = out.view(-1); s1 = src.reshape(-1)
    c = bench(lambda: o1.index_copy_(0, flat, s1))
    from shardkit.distributed.comm_ops.placement import ColumnPlacement
    from shardkit.kernels.column_copy import column_copier
    pl = ColumnPlacement(width, [dest, [b for b in range(blocks) if b not in set(dest)]], column_copier())
    o2 = out.view(rows, -1); p2 = src.reshape(-1)
    e = bench(lambda: pl.place(o2, 0, p2))
    # each method into zeros, against the per-run copies
    results = []
    for f in (lambda: out.index_copy_(1, idx, src), lambda: o1.index_copy_(0, flat, s1), lambda: pl.place(o2, 0, p2)):
        out.zero_(); per_run(); ref = out.clone(); out.zero_(); f(); results.append(torch.equal(out, ref))
    ok = all(results)
    print(f"rows {rows} tables/rank {ntab} widths {widths[0]}..{widths[-1]} unit {width} runs {len(runs)}: index_copy_ {a:.0f} us, per-run copies {b:.0f} us, flat index_copy {c:.0f} us, placement (copier where it takes over) {e:.0f} us, all equal {ok}")

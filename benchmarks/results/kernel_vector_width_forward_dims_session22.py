import sys, time, torch
sys.path.insert(0, "/work/main/src")
torch.set_num_threads(1)
from shardkit.kernels import native_ops
ops = native_ops()
def bench(f, n=200):
    for _ in range(20): f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6
S, F = 512, 8
for dim in (8, 16, 24, 32, 48, 64, 128):
    w = torch.randn(8000, dim)
    lengths = torch.full((S * F,), 2, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 1000, (int(lengths.sum()),))
    shift = (torch.arange(S * F) // S) * 1000
    r = []
    for pf in (0, 4, 16):
        for batch in (0, S):
            a = (w, ids, offsets, shift, None, None, True, batch, pf)
            r.append(bench(lambda: ops.embedding_forward(*a)))
    print(f"dim {dim:3d}: " + " ".join(f"{x:6.1f}" for x in r), "  (prefetch 0/4/16 x bag-major/sample-major)")

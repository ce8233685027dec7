import sys, time, torch
sys.path.insert(0, "/work/main/src")
torch.set_num_threads(1)
from shardkit.kernels import native_ops
ops = native_ops()
def bench(f, n=100):
    for _ in range(10): f()
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
    psw = torch.ones(ids.numel())
    g = torch.randn(S * F, dim) * 1e-3
    t_plain = bench(lambda: ops.embedding_fused_backward(w, ids, offsets, shift, None, None, g, True, 0, 0, 0.01, 0.0, 0.0, 0.0, 0.0, [], False))
    t_w = bench(lambda: ops.embedding_fused_backward(w, ids, offsets, shift, psw, None, g, True, 0, 0, 0.01, 0.0, 0.0, 0.0, 0.0, [], False))
    print(f"dim {dim:3d}: backward SGD unweighted {t_plain:7.1f} us, weighted (block loop) {t_w:7.1f}")

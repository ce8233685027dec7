import sys, time, torch
sys.path.insert(0, "/work/main/src")
torch.set_num_threads(1)
from shardkit.kernels import native_ops
ops = native_ops()
def bench(f, n=20):
    for _ in range(3): f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6
B = 2048
for rows, dim in ((1_000_000, 16), (500_000, 64), (250_000, 128), (100_000, 48)):
    w = torch.randn(rows, dim)
    lengths = torch.full((B,), 20, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, rows, (int(lengths.sum()),))
    psw = torch.ones(ids.numel())
    t_vec = bench(lambda: ops.embedding_forward(w, ids, offsets, None, None, None, True, 0, 16))
    t_gen = bench(lambda: ops.embedding_forward(w, ids, offsets, None, psw, None, True, 0, 16))
    g = torch.randn(B, dim) * 1e-3
    t_b = bench(lambda: ops.embedding_fused_backward(w, ids, offsets, None, None, None, g, True, 0, 0, 0.01, 0.0, 0.0, 0.0, 0.0, [], False))
    t_bw = bench(lambda: ops.embedding_fused_backward(w, ids, offsets, None, psw, None, g, True, 0, 0, 0.01, 0.0, 0.0, 0.0, 0.0, [], False))
    print(f"{rows}x{dim} ({rows*dim*4/2**20:.0f} MiB), 40960 ids: forward vector {t_vec:7.1f} us generic {t_gen:7.1f} | backward rows {t_b:7.1f} block {t_bw:7.1f}")

import sys, time, torch
import os; sys.path.insert(0, os.environ.get("SRC", "/work/main/src"))
torch.set_num_threads(1)
from shardkit.kernels import embedding_forward, embedding_fused_backward, RowOptimizerArgs
def t(fn, n=300):
    for _ in range(20): fn()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best
feats, bags, rows = 16, 512, 500
for pool in (1, 2):
  for dim in (16, 24, 32, 40, 48, 56, 64, 96, 128):
    n = feats * bags
    lengths = torch.randint(0, 2 * pool + 1, (n,))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, rows, (int(lengths.sum()),))
    w = torch.randn(rows, dim)
    out = torch.empty(bags, 3 * feats * dim)[:, :feats * dim]
    fi = lambda: embedding_forward(w, ids, offsets, None, None, None, True, bags, out=out)
    f = lambda: embedding_forward(w, ids, offsets, None, None, None, True, bags)
    g = torch.randn(bags, 3 * feats * dim)[:, :feats * dim]
    args = RowOptimizerArgs("SGD", 0.0)
    b = lambda: embedding_fused_backward(w, ids, offsets, None, None, None, g, True, args, False, bags)
    tf, tfi, tb = t(f), t(fi), t(b)
    print(f"pool {pool} dim {dim:3d}: fwd {tf:7.1f} us ({tf*1e3/(n*dim):.2f} ns/value) into-slice {tfi:7.1f}  bwd {tb:7.1f} us ({tb*1e3/(n*dim):.2f} ns/value)")

import sys, time, torch
sys.path.insert(0, "/work/main/src")
torch.set_num_threads(1)
from shardkit.kernels import native_ops
from shardkit.kernels.prefetch import prefetch_rows
ops = native_ops()
rows, dim, feats, batch, pool = 131072, 64, 64, 2048, 4
gen = torch.Generator().manual_seed(0)
lengths = torch.randint(0, 2 * pool + 1, (feats * batch,), generator=gen)
offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
per = rows // feats
shift = (torch.arange(feats) * per).repeat_interleave(batch)
ids = torch.cat([torch.randint(0, per, (int(lengths[f*batch:(f+1)*batch].sum()),), generator=gen) for f in range(feats)])
w = torch.randn(rows, dim)
print("default prefetch", prefetch_rows(), "ids", ids.numel())
def t(fn, n=10):
    for _ in range(2): fn()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    return best
out = torch.empty(batch, feats * dim)
for d in (0, 4, 8, 16, 24, 32, 48):
    f = lambda: ops.embedding_forward_into(w, ids, offsets, shift, None, None, True, batch, d, out)
    g = lambda: ops.embedding_forward(w, ids, offsets, shift, None, None, True, batch, d)
    print(f"prefetch {d:3d}: into {t(f):6.2f} ms  fresh out {t(g):6.2f} ms")

# Strided runs against one index copy (the placement's pure-torch ways), place only, one thread,
# the fastest of 50 calls: rank 0 of layouts of 4-30 runs of 4-, 16- and 64-column blocks.
import random, sys, time
import torch
sys.path.insert(0, "src")
torch.set_num_threads(1)
from shardkit.distributed.comm_ops import placement as P
def t(f, n=50):
    f(); best = 1e9
    for _ in range(n):
        s = time.perf_counter(); f(); best = min(best, time.perf_counter() - s)
    return best * 1e6
for width in (4, 16, 64):
    for nruns in (4, 8, 16, 32):
        blocks = nruns * 4
        random.seed(0)
        dest0 = sorted(random.sample(range(blocks), nruns * 2))
        dest0 = dest0[::2] + dest0[1::2]  # breaks into many runs
        dest = [dest0, [b for b in range(blocks) if b not in dest0]]
        p = P.ColumnPlacement(width, dest)
        for rows in (32, 256, 2048):
            out = torch.zeros(rows, blocks * width); piece = torch.zeros(rows * p.columns(0))
            sv = t(lambda: p._place_strided(out, 0, piece)); iv = t(lambda: p._place_index(out, 0, piece))
            print(f"w{width:3d} runs {len(p._runs[0]):3d} rows {rows:5d} strided {sv:8.1f} index {iv:8.1f} us")

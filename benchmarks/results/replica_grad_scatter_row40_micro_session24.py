"""replica_grad_scatter at row 40's shape: 64 tables of 1000..3641 rows x 64, 2048 bags of 1-7 ids each, dense way."""
import time, torch
torch.set_num_threads(1)
from shardkit.kernels.replica_grad import grad_scatter
gen = torch.Generator().manual_seed(0)
T, B, D = 64, 2048, 64
rows = [int(1000 * (3641 / 1000) ** (t / (T - 1))) for t in range(T)]
starts = torch.tensor([0] + rows[:-1]).cumsum(0)
R = sum(rows)
lengths = torch.randint(1, 8, (T * B,), generator=gen)
ids = torch.cat([torch.randint(0, rows[t], (int(lengths[t * B:(t + 1) * B].sum()),), generator=gen) for t in range(T)])
offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
shift = starts.repeat_interleave(B)
grad = torch.randn(B, T * D, generator=gen)
out = torch.empty(R, D); seen = torch.zeros(R)
def run():
    seen.zero_()
    t = time.perf_counter()
    grad_scatter(out, seen, ids, offsets, shift, None, None, grad, True, B, 0.5, None, R)
    return time.perf_counter() - t
for _ in range(3): run()
ts = sorted(run() for _ in range(15))
print(f"ids {ids.numel()} rows {R}: {ts[7]*1e3:.2f} ms (min {ts[0]*1e3:.2f})")
ref = out.clone(); run(); assert torch.equal(out, ref)

import time, torch, sys
torch.set_num_threads(1)
from shardkit.kernels.replica_grad import touched_rows
for evict in (False, True):
    out = []
    for R, n in ((1000000, 1024), (1000000, 8192), (256000, 1024), (256000, 4096), (64000, 1024), (16000, 256)):
        marks = torch.zeros(R, dtype=torch.bool); pos = torch.empty(R, dtype=torch.int64)
        ids = torch.randint(0, R, (n,)); off = torch.tensor([0, n])
        big = torch.empty(64 << 20, dtype=torch.uint8)
        def run():
            if evict: big.add_(1)
            t = time.perf_counter(); touched_rows(marks, pos, ids, off, None); return time.perf_counter() - t
        for _ in range(3): run()
        ts = sorted(run() for _ in range(41))
        out.append(f"{R}/{n} {ts[20]*1e6:.1f}")
    print("cold" if evict else "warm", " ".join(out))

"""Alternating-rounds A/B harness for 2-rank step functions: median and IQR of the slowest rank."""
import time, statistics, torch, torch.distributed as dist
def measure(fns, rounds=21, steps=4, warmup=3):
    for g in fns.values():
        for _ in range(warmup): g()
    res = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        if r % 2: order = order[::-1]
        for k in order:
            dist.barrier(); t0 = time.perf_counter()
            for _ in range(steps): fns[k]()
            res[k].append((time.perf_counter() - t0) / steps)
    out = {}
    for k, v in res.items():
        t = torch.tensor(v, dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
        q = torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
        out[k] = q
    if dist.get_rank() == 0:
        for k, (a, m, b) in out.items():
            print(f"{k:28s} median {m*1e3:7.3f} ms  IQR {a*1e3:7.3f}-{b*1e3:7.3f}")
    return out

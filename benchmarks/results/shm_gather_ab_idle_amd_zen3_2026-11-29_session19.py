"""A/B in one run: the gathers through shared memory (new) or gloo (old: gather_blocks._shm_exchange -> None),
alternating rounds; sharded EBC training steps of plan_quality's table sets, one uniform plan each, W ranks."""
import sys, statistics, time, torch, torch.distributed as dist
sys.path.insert(0, "src"); sys.path.insert(0, ".")
from benchmarks.plan_quality import _Model, _batch, table_sets, _planner
import shardkit.distributed.gather_blocks as gb
from shardkit.distributed.validation import set_validation
from shardkit.planner import CostModel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.types import ShardingEnv
dist.init_process_group("gloo"); torch.set_num_threads(1); import os; set_validation(os.environ.get("VALIDATE") == "1")
world, rank = dist.get_world_size(), dist.get_rank()
new_fn = gb._shm_exchange
cases = [c.split(":") for c in sys.argv[1:]]
steps = []
for set_name, kind in cases:
    tables, batch = table_sets(True)[set_name]
    meta = _Model(tables, torch.device("meta"))
    planner = _planner(tables, batch, world, CostModel.default("cpu"), kind)
    plan = planner.plan(meta, [EmbeddingBagCollectionSharder()]); obj = [plan]; dist.broadcast_object_list(obj, 0); plan = obj[0]
    torch.manual_seed(0)
    m = _Model(tables, torch.device("cpu"))
    sh = EmbeddingBagCollectionSharder().shard(m.ebc, plan.plan["ebc"], ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    kjt = _batch(tables, batch, seed=rank)
    steps.append((lambda s, k: (lambda: s(k).values().sum().backward()))(sh, kjt))
times = {(i, v): [] for i in range(len(steps)) for v in ("gloo", "shm")}
for r in range(12):
    for v in (("gloo", "shm") if r % 2 else ("shm", "gloo")):
        gb._shm_exchange = new_fn if v == "shm" else (lambda *a: None)
        for i, step in enumerate(steps):
            for _ in range(2): step()
            dist.barrier(); t0 = time.perf_counter()
            for _ in range(5): step()
            times[(i, v)].append((time.perf_counter() - t0) / 5)
med = torch.tensor([statistics.median(times[(i, v)]) for i in range(len(steps)) for v in ("gloo", "shm")], dtype=torch.float64)
dist.all_reduce(med, op=dist.ReduceOp.MAX)
if rank == 0:
    import platform
    print(f"W{world}, validation {os.environ.get('VALIDATE') == '1'}: median of 12 alternating rounds of 5 steps, slowest rank")
    for i, (s, k) in enumerate(cases):
        g, n = med[2 * i].item(), med[2 * i + 1].item()
        print(f"{s:10s} {k:14s} gloo {g*1e3:7.3f} ms  shm {n*1e3:7.3f} ms  gloo/shm {g/n:5.2f}")
dist.destroy_process_group()

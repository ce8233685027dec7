"""A/B in one run: the pooled all-to-all's column placement with the native column-range copier (new)
or without (old: strided copies / index fallback), table-wise training steps at W2 of tables of
mixed widths, plus plan_quality's demo / many_small table-wise plans. Median of alternating rounds."""
import sys, time, statistics, torch, torch.distributed as dist
sys.path.insert(0, "src"); sys.path.insert(0, ".")
import shardkit.sharding.embeddingbag as ebc_mod
from shardkit.distributed.validation import set_validation
from shardkit.planner.calibration_steps import StepConfig, training_step
from benchmarks.plan_quality import _Model, _batch, table_sets, _planner
from shardkit.planner import CostModel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.types import ShardingEnv
dist.init_process_group("gloo"); torch.set_num_threads(1); set_validation(False)
w = dist.get_world_size(); rank = dist.get_rank(); tw = ("table_wise",) * w
real = ebc_mod.column_copier
cases = {}
for b in (32, 256, 2048):
    cases[f"16 tables/rank of 16 widths, b{b} p2"] = lambda b=b: training_step(StepConfig(tw * 16, 64 * w, dim_step=4, batch=b, pooling=2), None, torch.device("cpu"))
    cases[f"16 tables/rank of width 38, b{b} p2"] = lambda b=b: training_step(StepConfig(tw * 16, 64 * w, dim=38, batch=b, pooling=2), None, torch.device("cpu"))
def plan_step(set_name):
    tables, batch = table_sets(True)[set_name]
    meta = _Model(tables, torch.device("meta"))
    plan = _planner(tables, batch, w, CostModel.default("cpu"), "table_wise").plan(meta, [EmbeddingBagCollectionSharder()])
    obj = [plan]; dist.broadcast_object_list(obj, 0); plan = obj[0]
    torch.manual_seed(0); m = _Model(tables, torch.device("cpu"))
    sh = EmbeddingBagCollectionSharder().shard(m.ebc, plan.plan["ebc"], ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    kjt = _batch(tables, batch, seed=rank)
    return lambda: sh(kjt).values().sum().backward()
for s in ("demo", "many_small"):
    cases[f"plan_quality {s} table_wise"] = lambda s=s: plan_step(s)
steps = {}
for name, make in cases.items():
    for v in ("copier", "none"):
        ebc_mod.column_copier = real if v == "copier" else (lambda: None)
        steps[(name, v)] = make()
ebc_mod.column_copier = real
res = {k: [] for k in steps}
for f in steps.values():
    for _ in range(3): f()
for r in range(11):
    for k, f in (steps.items() if r % 2 else reversed(list(steps.items()))):
        dist.barrier(); t0 = time.perf_counter()
        for _ in range(4): f()
        res[k].append((time.perf_counter() - t0) / 4)
t = torch.tensor([statistics.median(v) for v in res.values()], dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
med = dict(zip(res, t.tolist()))
if rank == 0:
    print(f"W{w}, validation off, median of 11 alternating rounds of 4 steps, slowest rank")
    for name in cases:
        a, b = med[(name, "none")], med[(name, "copier")]
        print(f"{name:42s} without {a*1e3:8.3f} ms  copier {b*1e3:8.3f} ms  speed-up {a/b:5.2f}")
dist.destroy_process_group()

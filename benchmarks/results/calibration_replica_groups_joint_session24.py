"""Time calibrate()'s steps, candidate extra steps and plan_quality's uniform plans in the same
alternating rounds (W ranks); save everything for offline refits (offline.py)."""
import sys, json, time, gc, torch, torch.distributed as dist
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
dist.init_process_group("gloo"); torch.set_num_threads(1)
from shardkit.distributed.validation import set_validation; set_validation(False)
from shardkit.planner import CostModel
from shardkit.planner.calibration import measure_lookup_bw, measure_all_to_all_bw
from shardkit.planner.calibration_configs import calibration_configs, describe, StepConfig
import shardkit.planner.calibration_steps as cs
from benchmarks.plan_quality import _Model, fresh, table_sets, _planner, _batch, UNIFORM
from shardkit.model_parallel import DistributedModelParallel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
W = dist.get_world_size(); rank = dist.get_rank()
out_path = sys.argv[1]
dev = torch.device("cpu")
lookup_bw = measure_lookup_bw(dev)
comm_bw = measure_all_to_all_bw(None, dev)
vals = torch.tensor([lookup_bw, comm_bw], dtype=torch.float64); dist.all_reduce(vals, op=dist.ReduceOp.MIN)
lookup_bw, comm_bw = vals.tolist()
base = calibration_configs(W)
tw = ("table_wise",) * W
extras, labels = [], []
DP = "data_parallel"
def add(cfg, label):
    extras.append(cfg); labels.append(label)
for b in (64, 256):
    add(StepConfig((DP,) * 6, 20000, 16, batch=b, pooling=2, dim_step=16, cycle=3), f"dp6 20k 3 groups b{b}")
    add(StepConfig((DP,) * 6, 20000, 32, batch=b, pooling=2), f"dp6 20k 1 group b{b}")
    add(StepConfig((DP,) * 3, 50000, 16, batch=b, pooling=1, dim_step=16), f"dp3 50k 3 groups b{b}")
configs = base + extras
steps = [cs.training_step(c, None, dev) for c in configs]
sh = [EmbeddingBagCollectionSharder()]
plan_names, plans = [], []
default = CostModel.default("cpu")
for name in ("demo", "many_small"):
    tables, batch = table_sets(True)[name]
    meta = _Model(tables, torch.device("meta"))
    feats = _batch(tables, batch, seed=rank)
    for kind in UNIFORM:
        try:
            plan = _planner(tables, batch, W, default, kind).plan(meta, sh)
        except ValueError:
            continue
        torch.manual_seed(0)
        dmp = DistributedModelParallel(_Model(tables, dev), plan=plan, sharders=sh)
        steps.append((lambda d, f: (lambda: d(fresh(f)).backward()))(dmp, feats))
        plan_names.append((name, kind)); plans.append(plan)
t0 = time.time()
times = cs.alternating_seconds(steps, None, dev, rounds=int(sys.argv[2]) if len(sys.argv) > 2 else 9)
agreed = torch.tensor(times, dtype=torch.float64); dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
times = agreed.tolist()
if rank == 0:
    n = len(configs)
    json.dump({"world": W, "lookup_bw": lookup_bw, "comm_bw": comm_bw, "n_base": len(base),
               "configs": [describe(c) for c in configs], "labels": labels, "config_times": times[:n],
               "plans": [list(p) for p in plan_names], "plan_times": times[n:],
               "plan_objs": [repr(p) for p in plans], "seconds": time.time() - t0}, open(out_path, "w"), indent=1)
    print("done in", time.time() - t0)
del steps; gc.collect()
dist.destroy_process_group()

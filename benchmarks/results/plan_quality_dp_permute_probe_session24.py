"""Demo tables all data-parallel: interleaved widths (as the demo) vs sorted by width; estimate vs measured."""
import sys, torch, torch.distributed as dist
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
dist.init_process_group("gloo"); torch.set_num_threads(1)
from shardkit.distributed.validation import set_validation; set_validation(False)
from shardkit.planner.calibration import calibrate
import shardkit.planner.calibration_steps as cs
from benchmarks.plan_quality import _Model, fresh, table_sets, _planner, _batch
from shardkit.model_parallel import DistributedModelParallel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
W = dist.get_world_size(); rank = dist.get_rank(); dev = torch.device("cpu")
cal = calibrate("cpu")
demo, b0 = table_sets(True)["demo"]
ms, b1 = table_sets(True)["many_small"]
variants = {"demo": (demo, b0), "demo sorted": (sorted(demo, key=lambda t: t[1]), b0),
            "many": (ms, b1), "many sorted": (sorted(ms, key=lambda t: t[1]), b1)}
sh = [EmbeddingBagCollectionSharder()]
names, steps, ests = [], [], []
for name, (tables, batch) in variants.items():
    meta = _Model(tables, torch.device("meta"))
    feats = _batch(tables, batch, seed=rank)
    for kind in ("data_parallel", "table_wise", "column_wise"):
        try:
            p = _planner(tables, batch, W, cal, kind); plan = p.plan(meta, sh)
        except ValueError:
            continue
        ests.append(p.estimate(meta, sh, plan).max_time_s)
        torch.manual_seed(0)
        dmp = DistributedModelParallel(_Model(tables, dev), plan=plan, sharders=sh)
        steps.append((lambda d, f: (lambda: d(fresh(f)).backward()))(dmp, feats))
        names.append(f"{name} {kind[:2]}")
times = cs.alternating_seconds(steps, None, dev, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 15)
t = torch.tensor(times, dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
if rank == 0:
    for n, e, m in zip(names, ests, t.tolist()):
        print(f"{n:24s} est {e*1e3:7.3f} meas {m*1e3:7.3f} err {(e-m)/m:+.3f}")
dist.destroy_process_group()

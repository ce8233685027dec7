"""Where the calibration step and plan_quality's step differ: DMP vs the sharded module, fixed vs random lengths."""
import sys, torch, torch.distributed as dist
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
dist.init_process_group("gloo"); torch.set_num_threads(1)
from shardkit.distributed.validation import set_validation; set_validation(False)
import shardkit.planner.calibration_steps as cs
from benchmarks.plan_quality import _Model, fresh, table_sets, _planner, _batch
from shardkit.model_parallel import DistributedModelParallel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.planner import CostModel
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.sparse import KeyedJaggedTensor
W = dist.get_world_size(); rank = dist.get_rank(); dev = torch.device("cpu")
demo, b0 = table_sets(True)["demo"]
sets = {"one100k": [demo[0]], "demo": demo, "4small": [demo[1], demo[3], demo[5], demo[7]]}
sh = [EmbeddingBagCollectionSharder()]
names, steps = [], []
def fixed(tables, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.full((batch,), int(p)) for (_, _, p) in tables])
    values = torch.cat([torch.randint(0, r, (batch * int(p),), generator=gen) for (r, _, p) in tables])
    return KeyedJaggedTensor([f"f{i}" for i in range(len(tables))], values, lengths=lengths)
for name, tables in sets.items():
    meta = _Model(tables, torch.device("meta"))
    for kind in ("data_parallel", "table_wise"):
        plan = _planner(tables, b0, W, CostModel.default("cpu"), kind).plan(meta, sh)
        torch.manual_seed(0)
        dmp = DistributedModelParallel(_Model(tables, dev), plan=plan, sharders=sh)
        torch.manual_seed(0)
        bare = EmbeddingBagCollectionSharder().shard(_Model(tables, dev).ebc, plan.plan["ebc"], ShardingEnv.from_process_group(None), dev)
        for lname, f in (("rand", _batch(tables, b0, rank)), ("fixed", fixed(tables, b0, rank))):
            steps.append((lambda d, f: (lambda: d(fresh(f)).backward()))(dmp, f)); names.append(f"{name} {kind[:2]} dmp {lname}")
            steps.append((lambda d, f: (lambda: d(fresh(f)).values().sum().backward()))(bare, f)); names.append(f"{name} {kind[:2]} bare {lname}")
times = cs.alternating_seconds(steps, None, dev, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 9)
t = torch.tensor(times, dtype=torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
if rank == 0:
    for n, m in zip(names, t.tolist()):
        print(f"{n:34s} meas {m*1e3:7.3f}")
dist.destroy_process_group()

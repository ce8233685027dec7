"""DP vs TW: the same tables timed as calibrate() times them (raw sharded module, fixed lengths) and as
plan_quality times them (DMP over a model, plan_quality's variable lengths), alternating rounds, 2 ranks."""
import statistics, sys, time
import torch, torch.distributed as dist
from shardkit.planner.calibration_configs import StepConfig
from shardkit.planner.calibration_steps import training_step, round_order
from shardkit.model_parallel import DistributedModelParallel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
from shardkit.sharding.types import ShardingPlan
from shardkit.sparse import KeyedJaggedTensor
from benchmarks.plan_quality import _Model, _batch, fresh
import dataclasses

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
print(dataclasses.fields(StepConfig)) if rank == 0 else None
shapes = [(int(a), int(b), int(c), int(n)) for a, b, c, n in (s.split("x") for s in sys.argv[1].split(","))]  # rows x dim x pooling x ntables
batch = int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
tables = [(r, d, float(p)) for r, d, p, n in shapes for _ in range(n)]
sh = [EmbeddingBagCollectionSharder()]
runs, names = [], []
for kind in ("data_parallel", "table_wise"):
    gens = {f"t{i}": (data_parallel(compute_kernel="fused") if kind == "data_parallel" else table_wise(rank=i % world)) for i in range(len(tables))}
    for lengths in ("fixed", "variable"):
        torch.manual_seed(0)
        meta = _Model(tables, torch.device("meta"))
        plan = ShardingPlan({"ebc": construct_module_sharding_plan(meta.ebc, gens, world_size=world, local_size=world, device_type="cpu")})
        m = DistributedModelParallel(_Model(tables, torch.device("cpu")), plan=plan, sharders=sh)
        if lengths == "variable":
            feats = _batch(tables, batch, seed=rank)
        else:
            gen = torch.Generator().manual_seed(rank)
            keys = [f"f{i}" for i in range(len(tables))]
            lens = torch.cat([torch.full((batch,), int(p)) for _, _, p in tables])
            vals = torch.cat([torch.randint(0, r, (batch * int(p),), generator=gen) for r, _, p in tables])
            feats = KeyedJaggedTensor(keys, vals, lengths=lens)
        runs.append(lambda m=m, f=feats: m(fresh(f)).backward())
        names.append(f"{kind} DMP {lengths}")
        if lengths == "fixed":
            from shardkit.distributed.sharding_env import ShardingEnv
            raw = sh[0].shard(meta.ebc, plan.plan["ebc"], ShardingEnv.from_process_group(None), torch.device("cpu"))
            runs.append(lambda m=raw, f=feats: m(fresh(f)).values().sum().backward())
            names.append(f"{kind} raw {lengths}")
for f in runs:
    for _ in range(3):
        f()
per = [[] for _ in runs]
for r in range(rounds):
    for i in round_order(len(runs), r):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(4):
            runs[i]()
        per[i].append((time.perf_counter() - t0) / 4)
out = []
for name, t in zip(names, per):
    x = torch.tensor(t, dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    out.append((name, statistics.median(x.tolist()) * 1e3))
if rank == 0:
    for name, ms in out:
        print(f"{name:32s} {ms:.3f} ms")
dist.destroy_process_group()

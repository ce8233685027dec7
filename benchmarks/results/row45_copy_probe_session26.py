"""Where does the data-parallel step copy a [B, T*D] tensor? 2 ranks, profiler with stacks."""
import torch, torch.distributed as dist
from torch.profiler import profile, ProfilerActivity
from shardkit.distributed.validation import set_validation
from shardkit.model_parallel import DistributedModelParallel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, data_parallel
from shardkit.sharding.types import ShardingPlan
from benchmarks.plan_quality import _Model, _batch, fresh

dist.init_process_group("gloo")
torch.set_num_threads(1)
set_validation(False)
rank = dist.get_rank()
tables = [(1000, 128, 2.0)] * 32
batch = 512
meta = _Model(tables, torch.device("meta"))
gens = {f"t{i}": data_parallel(compute_kernel="fused") for i in range(len(tables))}
plan = ShardingPlan({"ebc": construct_module_sharding_plan(meta.ebc, gens, world_size=2, local_size=2, device_type="cpu")})
m = DistributedModelParallel(_Model(tables, torch.device("cpu")), plan=plan, sharders=[EmbeddingBagCollectionSharder()])
feats = _batch(tables, batch, seed=rank)
step = lambda: m.module.ebc(fresh(feats)).values().pow(2).mean().backward()
for _ in range(3):
    step()
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
    for _ in range(3):
        step()
if rank == 0:
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12))
    for evt in prof.events():
        if evt.name == "aten::copy_" and evt.input_shapes and evt.input_shapes[0] == [batch, 32 * 128]:
            print("copy_", evt.input_shapes, evt.cpu_time_total)
            p = evt.cpu_parent
            while p is not None:
                print("   parent:", p.name, p.input_shapes)
                p = p.cpu_parent
            print("   thread", evt.thread)
            break
dist.destroy_process_group()

"""A/B in one process: groups' outputs written / gradients read in place (new) vs cat + contiguous (old)."""
import sys, torch, torch.distributed as dist
sys.path.insert(0, "/work/main/benchmarks/results"); sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
dist.init_process_group("gloo"); torch.set_num_threads(1)
from shardkit.distributed.validation import set_validation; set_validation(False)
from benchmarks.plan_quality import _Model, _batch, fresh, table_sets
from shardkit.model_parallel import DistributedModelParallel
from shardkit.sharding import construct_module_sharding_plan, table_wise, column_wise, row_wise, data_parallel
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.types import ShardingPlan
from shardkit.modules import fused_groups
from shardkit.kernels import embedding as kemb
from shardkit.kernels import replica_grad as krep
from ab_harness_session22 import measure
new_fwd = fused_groups.FusedGroupsLookup.forward
new_rows = kemb.rows_of_unit_stride
def old_fwd(ctx, lookups, inputs, *buffers):
    outputs = [lookup.run_kernel(x) for lookup, x in zip(lookups, inputs)]
    ctx.lookups, ctx.inputs, ctx.widths = lookups, inputs, [o.size(1) for o in outputs]
    return torch.cat(outputs, dim=1)
def set_mode(new):
    fused_groups.FusedGroupsLookup.forward = staticmethod(new_fwd if new else old_fwd)
    kemb.rows_of_unit_stride = krep.rows_of_unit_stride = new_rows if new else (lambda m: m.contiguous())
rank = dist.get_rank()
sets = {"demo": table_sets(True)["demo"], "many_small": table_sets(True)["many_small"],
        "16 widths b256": ([(1000, 8 + 4 * i, 2.0) for i in range(16)], 256)}
fns = {}
kinds = {"tw": lambda i: table_wise(rank=[0,0,0,0,1,1,0,0][i % 8]), "rw": lambda i: row_wise(), "dp": lambda i: data_parallel()}
for name, (tables, batch) in sets.items():
    for kind, gen in kinds.items():
        m = _Model(tables, torch.device("meta"))
        mp = construct_module_sharding_plan(m.ebc, {f"t{i}": gen(i) for i in range(len(tables))}, world_size=2, local_size=2, device_type="cpu")
        d = DistributedModelParallel(_Model(tables, torch.device("cpu")), plan=ShardingPlan({"ebc": mp}), sharders=[EmbeddingBagCollectionSharder()])
        f = _batch(tables, batch, seed=rank)
        def run(d=d, f=f, new=True):
            set_mode(new)
            try: d(fresh(f)).backward()
            finally: set_mode(True)
        fns[f"{name} {kind} new"] = (lambda run=run: run(new=True))
        fns[f"{name} {kind} old"] = (lambda run=run: run(new=False))
out = measure(fns, rounds=15)
if rank == 0:
    ks = list(fns)
    for i in range(0, len(ks), 2):
        print(f"{ks[i][:-4]:28s} new/old {out[ks[i]][1]/out[ks[i+1]][1]:.3f}")
dist.destroy_process_group()

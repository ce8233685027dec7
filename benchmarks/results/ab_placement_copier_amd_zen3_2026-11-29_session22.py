"""A/B in one process: the placement's copier rule, new (cost per row count) vs old (ranges <= runs)."""
import sys, torch, torch.distributed as dist
sys.path.insert(0, "/work/main/benchmarks/results"); sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
dist.init_process_group("gloo"); torch.set_num_threads(1)
from shardkit.distributed.validation import set_validation; set_validation(False)
from benchmarks.plan_quality import _Model, _batch, fresh, table_sets
from shardkit.model_parallel import DistributedModelParallel
from shardkit.sharding import construct_module_sharding_plan, table_wise, column_wise, row_wise
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.types import ShardingPlan
from shardkit.distributed.comm_ops import placement as pl
from shardkit.distributed.comm_ops.placement import MAX_RUNS
from ab_harness_session22 import measure
new_rule = pl.ColumnPlacement.uses_copier
def old_rule(self, rank, rows):
    r = self._ranges[rank]
    return r is not None and (len(self._runs[rank]) > MAX_RUNS or r[0].size(0) <= len(self._runs[rank]))
rank = dist.get_rank()
sets = {"demo": table_sets(True)["demo"], "many_small": table_sets(True)["many_small"],
        "16 widths b256": ([(1000, 8 + 4 * i, 2.0) for i in range(16)], 256)}
fns = {}
for name, (tables, batch) in sets.items():
    for kind, gen in (("tw", lambda i: table_wise(rank=[0,0,0,0,1,1,0,0][i % 8])), ("cw", lambda i: column_wise(ranks=[0, 1])), ("rw", lambda i: row_wise())):
        if kind == "cw" and any(d % 16 for _, d, _ in tables): continue
        m = _Model(tables, torch.device("meta"))
        mp = construct_module_sharding_plan(m.ebc, {f"t{i}": gen(i) for i in range(len(tables))}, world_size=2, local_size=2, device_type="cpu")
        d = DistributedModelParallel(_Model(tables, torch.device("cpu")), plan=ShardingPlan({"ebc": mp}), sharders=[EmbeddingBagCollectionSharder()])
        f = _batch(tables, batch, seed=rank)
        def run(d=d, f=f, rule=None):
            pl.ColumnPlacement.uses_copier = rule
            try: d(fresh(f)).backward()
            finally: pl.ColumnPlacement.uses_copier = new_rule
        fns[f"{name} {kind} new"] = (lambda run=run: run(rule=new_rule))
        fns[f"{name} {kind} old"] = (lambda run=run: run(rule=old_rule))
out = measure(fns, rounds=15)
if rank == 0:
    ks = list(fns)
    for i in range(0, len(ks), 2):
        print(f"{ks[i][:-4]:28s} new/old {out[ks[i]][1]/out[ks[i+1]][1]:.3f}")
dist.destroy_process_group()

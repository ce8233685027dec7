"""Refit joint2.py's timings (current calibration_configs) with the footprint as is or DP-aware."""
import sys, json, torch
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
import shardkit.planner.calibration_steps as cs
import shardkit.planner.estimators as est
from shardkit.sharding.types import ShardingType
from shardkit.planner.calibration_configs import calibration_configs, describe
from shardkit.planner import CostModel
from benchmarks.plan_quality import _Model, _planner, table_sets
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
sh = [EmbeddingBagCollectionSharder()]
AB = {"data_parallel": "DP", "table_wise": "TW", "row_wise": "RW", "column_wise": "CW"}
ORIG = est.rank_footprint_bytes
def dp_aware(options, world):
    tables = {}
    for o in options:
        full = o.sharding_type == ShardingType.DATA_PARALLEL.value
        tables[id(o.table)] = (o.table, tables.get(id(o.table), (None, True))[1] and full)
    return sum(t.rows * t.cols * float(t.element_size) / (1 if full else max(world, 1)) for t, full in tables.values())
for path in sys.argv[1:]:
    d = json.load(open(path)); W = d["world"]
    allc = calibration_configs(W)
    assert [describe(c) for c in allc] == d["configs"]
    T = d["config_times"]
    model0 = CostModel.default("cpu").replace(ddr_lookup_bw=d["lookup_bw"], intra_node_bw=d["comm_bw"])
    default = CostModel.default("cpu")
    for label, fn in (("orig", ORIG), ("dp-aware", dp_aware)):
        est.rank_footprint_bytes = fn
        fit = dict(cs.fit_constants(allc, T, W, model0))
        fitted = fit.pop("fitted_s"); res = fit.pop("residual")
        model = model0.replace(ddr_lookup_bw=fit.pop("lookup_bw"), intra_node_bw=fit.pop("comm_bw"), **fit)
        errs = []
        for (name, kind), m in zip(d["plans"], d["plan_times"]):
            tables, batch = table_sets(True)[name]
            meta = _Model(tables, torch.device("meta"))
            plan = _planner(tables, batch, W, default, kind).plan(meta, sh)
            e = _planner(tables, batch, W, model, kind).estimate(meta, sh, plan).max_time_s
            errs.append((name[:4] + AB[kind], e / m - 1))
        dp = [f"{describe(c)[:30]} {f / t - 1:+.2f}" for c, t, f in zip(allc, T, fitted) if "data_parallel" in describe(c) and ("x8 b" in describe(c))]
        print(f"W{W} {label:9s} res {res:.3f} C {model.lookup_cache_bytes/2**20:.0f}MiB worst {max(abs(x) for _, x in errs):.2f} | " + " ".join(f"{k} {x:+.2f}" for k, x in errs))
        print("     ", "; ".join(dp))

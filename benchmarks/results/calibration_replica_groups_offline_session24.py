"""Refit joint_dp.py's timings with config subsets; print plan estimate errors (same rounds)."""
import sys, json, torch
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
import shardkit.planner.calibration_steps as cs
from shardkit.planner.calibration_configs import calibration_configs, describe, StepConfig
from shardkit.planner import CostModel
from benchmarks.plan_quality import _Model, _planner, table_sets
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
sh = [EmbeddingBagCollectionSharder()]
AB = {"data_parallel": "DP", "table_wise": "TW", "row_wise": "RW", "column_wise": "CW"}
d = json.load(open(sys.argv[1])); W = d["world"]
exec(open("benchmarks/results/calibration_replica_groups_joint_session24.py").read().split("extras, labels = [], []")[1].split("configs = base + extras")[0].replace("extras.append", "EX.append").replace("labels.append", "LB.append"), {"StepConfig": StepConfig, "EX": (EX := []), "LB": (LB := [])})
base_cfgs = calibration_configs(W)
allc = base_cfgs + EX
assert [describe(c) for c in allc] == d["configs"]
T = d["config_times"]
model0 = CostModel.default("cpu").replace(ddr_lookup_bw=d["lookup_bw"], intra_node_bw=d["comm_bw"])
default = CostModel.default("cpu")
cache = {}
def evaluate(label, idx):
    fit = dict(cs.fit_constants([allc[i] for i in idx], [T[i] for i in idx], W, model0))
    fitted = fit.pop("fitted_s"); res = fit.pop("residual")
    model = model0.replace(ddr_lookup_bw=fit.pop("lookup_bw"), intra_node_bw=fit.pop("comm_bw"), **fit)
    errs = []
    for (name, kind), m in zip(d["plans"], d["plan_times"]):
        tables, batch = table_sets(True)[name]
        meta = _Model(tables, torch.device("meta"))
        if (name, kind) not in cache:
            cache[(name, kind)] = _planner(tables, batch, W, default, kind).plan(meta, sh)
        e = _planner(tables, batch, W, model, kind).estimate(meta, sh, cache[(name, kind)]).max_time_s
        errs.append((name[:4] + AB[kind], e / m - 1))
    ex = [(LB[i - len(base_cfgs)], cs.estimated_seconds(allc[i], W, model) / T[i] - 1) for i in range(len(base_cfgs), len(allc))]
    print(f"{label:28s} res {res:.3f} worst {max(abs(x) for _, x in errs):.2f} | " + " ".join(f"{k} {x:+.2f}" for k, x in errs))
    print("   extras: " + ", ".join(f"{k} {x:+.2f}" for k, x in ex))
    return model
nb = len(base_cfgs)
print("plans measured ms:", [(n[:4] + AB[k], round(t * 1e3, 3)) for (n, k), t in zip(d["plans"], d["plan_times"])])
m = evaluate("base", list(range(nb)))
ext = {l: nb + j for j, l in enumerate(LB)}
evaluate("base+all extras", list(range(len(allc))))
for pat in ("b64", "b256", "3 groups", "dp6", "dp3"):
    evaluate("base+" + pat, list(range(nb)) + [ext[l] for l in LB if pat in l])

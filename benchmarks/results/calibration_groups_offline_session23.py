"""Refit joint.py's timings with config subsets; print plan estimate errors (same rounds' measurements)."""
import sys, json, torch
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
import shardkit.planner.calibration_steps as cs
from shardkit.planner.calibration_configs import calibration_configs, describe, StepConfig
from shardkit.planner import CostModel
from benchmarks.plan_quality import _Model, _planner, table_sets, UNIFORM
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
sh = [EmbeddingBagCollectionSharder()]
AB = {"data_parallel": "DP", "table_wise": "TW", "row_wise": "RW", "column_wise": "CW"}
d = json.load(open(sys.argv[1])); W = d["world"]
base_cfgs = calibration_configs(W)
import dataclasses
@dataclasses.dataclass(frozen=True)
class Sorted(StepConfig):
    def width(self, index):
        per = len(self.types) // self.cycle
        return self.dim + (index // per) * self.dim_step
extras = []
for t in ("table_wise", "row_wise", "column_wise", "data_parallel"):
    n = 12 * W if t == "table_wise" else 24
    for b in (64, 256):
        extras.append(StepConfig((t,) * n, 1000, 8, batch=b, pooling=2, dim_step=8, cycle=3))
for b in (64, 256):
    extras.append(StepConfig(("data_parallel",) * 24, 8000, 8, batch=b, pooling=2, dim_step=8, cycle=3))
    pass
for t in ("table_wise", "row_wise"):
    n = 12 * W if t == "table_wise" else 24
    for b in (64, 256):
        extras.append(Sorted((t,) * n, 1000, 8, batch=b, pooling=2, dim_step=8, cycle=3))
        extras.append(StepConfig((t,) * n, 1000, 16, batch=b, pooling=2))
allc = base_cfgs + extras
assert [describe(c) for c in allc] == d["configs"]
T = d["config_times"]
model0 = CostModel.default("cpu").replace(ddr_lookup_bw=d["lookup_bw"], intra_node_bw=d["comm_bw"])
default = CostModel.default("cpu")
def evaluate(label, idx):
    fit = dict(cs.fit_constants([allc[i] for i in idx], [T[i] for i in idx], W, model0))
    fitted = fit.pop("fitted_s"); res = fit.pop("residual")
    model = model0.replace(ddr_lookup_bw=fit.pop("lookup_bw"), intra_node_bw=fit.pop("comm_bw"), **fit)
    errs = []
    for (name, kind), m in zip(d["plans"], d["plan_times"]):
        tables, batch = table_sets(True)[name]
        meta = _Model(tables, torch.device("meta"))
        plan = _planner(tables, batch, W, default, kind).plan(meta, sh)
        e = _planner(tables, batch, W, model, kind).estimate(meta, sh, plan).max_time_s
        errs.append((name[:4] + AB[kind], e / m - 1))
    ex = [(d["labels"][i - len(base_cfgs)], cs.estimated_seconds(allc[i], W, model) / T[i] - 1) for i in range(len(base_cfgs), len(allc))]
    print(f"{label:28s} res {res:.3f} worst {max(abs(x) for _, x in errs):.2f} | " + " ".join(f"{k} {x:+.2f}" for k, x in errs))
    print("   extras: " + ", ".join(f"{k} {x:+.2f}" for k, x in ex))
    return model
nb = len(base_cfgs)
m = evaluate("base", list(range(nb)))
evaluate("base+extras", list(range(len(allc))))
print({k: v for k, v in m.to_dict().items() if "group" in k or "shard" in k})
names = d["configs"]
group_steps = [i for i in range(nb) if ".." in names[i] and "data_parallel" not in names[i]]
print("group steps:", [names[i] for i in group_steps])
labels = d["labels"]
ext = {l: nb + j for j, l in enumerate(labels)}
keep = [i for i in range(nb) if i not in group_steps]
sel = lambda *pats: [ext[l] for l in labels if any(p in l for p in pats)]
evaluate("V2 no group steps + all extras", keep + list(range(nb, len(allc))))
evaluate("V3 no group steps + TW/RW cyc+one", keep + sel("ta b64 cycled", "ta b256 cycled", "ro b64 cycled", "ro b256 cycled", "one width"))
evaluate("V4 base + TW/RW cyc+one", list(range(nb)) + sel("ta b64 cycled", "ta b256 cycled", "ro b64 cycled", "ro b256 cycled", "one width"))
evaluate("V5 no group steps + cyc + one", keep + sel("cycled", "one width"))
evaluate("V6 V3 + DP cycled", keep + sel("ta b64 cycled", "ta b256 cycled", "ro b64 cycled", "ro b256 cycled", "one width", "da b"))
evaluate("V7 V3 + DP 8000", keep + sel("ta b64 cycled", "ta b256 cycled", "ro b64 cycled", "ro b256 cycled", "one width", "8000"))
m = evaluate("V8 V3 + DP 8000 + CW", keep + sel("ta b64 cycled", "ta b256 cycled", "ro b64 cycled", "ro b256 cycled", "one width", "8000", "co b"))
print(m)

import sys, json, torch
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
from shardkit.planner import CostModel
from benchmarks.plan_quality import _Model, _planner, table_sets
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
sh = [EmbeddingBagCollectionSharder()]
d = json.load(open(sys.argv[1])); W = int(sys.argv[2]); name = sys.argv[3]
cal = CostModel(**d["config"]["calibrated"][f"W{W}"]["constants"])
tables, batch = table_sets(True)[name]
meta = _Model(tables, torch.device("meta"))
for label, cm in (("default", CostModel.default("cpu")), ("cal", cal)):
    plan = _planner(tables, batch, W, cm, None).plan(meta, sh)
    per = {}
    for t, ps in plan.plan["ebc"].items():
        i = int(t[1:]); r = ps.ranks[0]
        per.setdefault(r, []).append(tables[i])
    print(label, "est", _planner(tables, batch, W, cal, None).estimate(meta, sh, plan).max_time_s * 1e3)
    for r, ts in sorted(per.items()):
        widths = {}
        for rows, dim, p in ts:
            widths[dim] = widths.get(dim, 0) + 1
        print(f"  rank {r}: {len(ts)} tables, widths {dict(sorted(widths.items()))}, rows {sum(x[0] for x in ts)}, ids/bag {sum(x[2] for x in ts):.0f}, values {sum(x[0]*x[1] for x in ts)}")
    order = [plan.plan["ebc"][f"t{i}"].ranks[0] for i in range(len(tables))]
    runs = 1 + sum(order[i] != order[i - 1] for i in range(1, len(order)))
    print("  rank order:", "".join(map(str, order)), "runs", runs)

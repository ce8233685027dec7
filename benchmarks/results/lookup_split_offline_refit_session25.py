"""Scratch (twenty-fifth session): refit plan_quality runs 10-12's calibration timings (2 ranks) with and without lookup_split_s
(the same timings), and estimate the W2 plans against that run's measurements. Run in a tree with
lookup_split_experiment_session25.patch applied (the runs' JSON were then under /work/n25/out/pq_{10,11,12};
they are plan_quality_quick_lookup_split_experiment_*_run{10,11,12}.json here)."""
import json, sys
import torch
import shardkit.planner.calibration_steps as cs
import shardkit.planner.calibration_configs as cc
from shardkit.planner.cost_model import CostModel
from benchmarks.plan_quality import _Model, _planner, table_sets
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

world = 2
configs = cc.calibration_configs(world)
names = cs.feature_names()
split_index = names.index("lookup_split")
real_features = cs.config_features


def without_split(*args, **kwargs):
    known, features, miss = real_features(*args, **kwargs)
    features = list(features)
    features[split_index] = 0.0
    return known, features, miss


sets = {k: table_sets(True)[k] for k in ("demo", "many_small", "few_large")}
for run in (10, 11, 12):
    d = json.load(open(f"/work/n25/out/pq_{run}/plan_quality.json"))
    cal = d["config"]["calibrated"]["W2"]
    steps = cal["fit"]["steps"]
    assert [cc.describe(c) for c in configs] == [s["config"] for s in steps], "step lists differ"
    times = [s["measured_s"] for s in steps]
    base = CostModel(**cal["constants"])
    fits = {}
    for label, fn in (("split", real_features), ("no split", without_split)):
        cs.config_features = fn
        fitted = cs.fit_constants(configs, times, world, base)
        cs.config_features = real_features
        lookup_bw, comm_bw = fitted.pop("lookup_bw"), fitted.pop("comm_bw")
        residual = fitted.pop("residual")
        for k in ("fitted_s", "configs", "measured_s"):
            fitted.pop(k, None)
        fits[label] = (base.replace(ddr_lookup_bw=lookup_bw, intra_node_bw=comm_bw, **fitted), residual)
    rows = {r["name"]: r for r in d["rows"]}
    for set_name, (tables, batch) in sets.items():
        meta = _Model(tables, torch.device("meta"))
        sh = [EmbeddingBagCollectionSharder()]
        out = []
        for name, r in rows.items():
            if not name.startswith(f"{set_name} W2:"):
                continue
            label = name.split(": ", 1)[1]
            st = None
            for t in ("data_parallel", "row_wise", "column_wise", "table_wise"):
                if label.endswith(f"all {t}"):
                    st = t
            if st is None:
                continue
            errs = []
            for fl, (cm, _) in fits.items():
                plan = _planner(tables, batch, world, cm, st).plan(meta, sh)
                est = _planner(tables, batch, world, cm, None).estimate(meta, sh, plan).max_time_s * 1e3
                errs.append(f"{fl} {est / r['measured_ms'] - 1:+.3f}")
            out.append(f"{st:14s} " + "  ".join(errs))
        print(f"run {run} {set_name} W2 (residual split {fits['split'][1]:.3f}, no split {fits['no split'][1]:.3f}; "
              f"split {fits['split'][0].lookup_split_s*1e3:.3f} group {fits['split'][0].lookup_group_s*1e3:.3f} / "
              f"no-split group {fits['no split'][0].lookup_group_s*1e3:.3f} ms)")
        for line in out:
            print("   ", line)

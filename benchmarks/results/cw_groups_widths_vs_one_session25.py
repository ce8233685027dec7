"""Scratch (twenty-fifth session): the demo's tables at their widths (16/32/64) and all at width 16, column-wise
and table-wise, under one calibrate(), in the same rounds: does a lookup group cost column-wise what the
model charges (lookup_group_s)?  Run: ./dev python benchmarks/results/cw_groups_widths_vs_one_session25.py (from the repository root, PYTHONPATH=src:.)"""
import torch, torch.distributed as dist


def worker(rounds, steps):
    from benchmarks.plan_quality import _batch, _Model, _planner, fresh, table_sets
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.distributed.validation import set_validation
    from shardkit.planner import calibrate
    from shardkit.planner.calibration_steps import alternating_seconds
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

    torch.set_num_threads(1)
    set_validation(False)
    rank = dist.get_rank()
    cm = calibrate("cpu")
    tables, batch = table_sets(True)["demo"]
    flat = [(r, 16, p) for r, _, p in tables]
    names, est, fns = [], [], []
    for kind in ("column_wise", "table_wise"):
        for label, subset in (("widths", tables), ("all16", flat)):
            meta = _Model(subset, torch.device("meta"))
            sharders = [EmbeddingBagCollectionSharder()]
            planner = _planner(subset, batch, 2, cm, kind)
            plan = [planner.plan(meta, sharders)]
            dist.broadcast_object_list(plan, 0)
            est.append(planner.estimate(meta, sharders, plan[0]).max_time_s)
            torch.manual_seed(0)
            model = _Model(subset, torch.device("cpu"))
            sharded = sharders[0].shard(model.ebc, plan[0].plan["ebc"], ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
            feats = _batch(subset, batch, seed=rank)
            fns.append(lambda s=sharded, f=feats: s(fresh(f)).values().sum().backward())
            names.append(f"{kind} {label}")
    sec = torch.tensor(alternating_seconds(fns, None, torch.device("cpu"), rounds, steps, warmup=3), dtype=torch.float64)
    dist.all_reduce(sec, op=dist.ReduceOp.MAX)
    return names, sec.tolist(), est, cm.lookup_group_s


if __name__ == "__main__":
    import sys
    sys.path.insert(0, "benchmarks/results")
    from cw_groups_widths_vs_one_session25 import worker as run
    from shardkit.testing import run_world
    names, meas, est, lg = run_world(run, 2, 15, 4, timeout=900)[0]
    print("lookup_group_s", round(lg * 1e3, 3), "ms")
    for n, m, e in zip(names, meas, est):
        print(f"{n:24s} meas {m*1e3:.3f} est {e*1e3:.3f} est/meas {e/m:.3f}")
    for k in (0, 2):
        print(names[k].split()[0], "widths - all16: meas", round((meas[k] - meas[k+1]) * 1e3, 3), "est", round((est[k] - est[k+1]) * 1e3, 3))

"""Per-op CPU time per step (rank 0) of the demo tables at their widths and all at 16, column-wise and
table-wise, 2 ranks: where do extra lookup groups cost?"""
import sys, torch, torch.distributed as dist
from torch.profiler import profile, ProfilerActivity


def main():
    from benchmarks.plan_quality import _batch, _Model, _planner, fresh, table_sets
    from shardkit.distributed.validation import set_validation
    from shardkit.model_parallel import DistributedModelParallel
    from shardkit.planner import CostModel
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    set_validation(False)
    rank = dist.get_rank()
    cm = CostModel.default("cpu")
    tables, batch = table_sets(True)["demo"]
    flat = [(r, 16, p) for r, _, p in tables]
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    res = {}
    variants = [(k, l, s) for k in sys.argv[2].split(",") for l, s in (("widths", tables), ("all16", flat))]
    for rep in range(2):
        for kind, label, subset in variants:
            meta = _Model(subset, torch.device("meta"))
            sharders = [EmbeddingBagCollectionSharder()]
            plan = [_planner(subset, batch, 2, cm, kind).plan(meta, sharders)]
            dist.broadcast_object_list(plan, 0)
            torch.manual_seed(0)
            m = DistributedModelParallel(_Model(subset, torch.device("cpu")), plan=plan[0], sharders=sharders)
            feats = _batch(subset, batch, seed=rank)
            for _ in range(5):
                m(fresh(feats)).backward()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    m(fresh(feats)).backward()
            dist.barrier()
            d = res.setdefault((kind, label), {})
            for e in prof.key_averages():
                d.setdefault(e.key, []).append((e.self_cpu_time_total / steps, e.count / steps))
    if rank != 0:
        return
    for kind in sys.argv[2].split(","):
        w, o = res[(kind, "widths")], res[(kind, "all16")]
        tot_w = sum(min(v[0] for v in x) for x in w.values()); tot_o = sum(min(v[0] for v in x) for x in o.values())
        print(f"== {kind}: self-CPU per step widths {tot_w/1e3:.3f} ms, all16 {tot_o/1e3:.3f} ms, diff {(tot_w-tot_o)/1e3:+.3f}")
        keys = set(w) | set(o)
        diffs = []
        for k in keys:
            a = min((v[0] for v in w.get(k, [(0, 0)])))
            b = min((v[0] for v in o.get(k, [(0, 0)])))
            ca = w.get(k, [(0, 0)])[0][1]; cb = o.get(k, [(0, 0)])[0][1]
            diffs.append((a - b, k, a, b, ca, cb))
        diffs.sort(key=lambda x: -abs(x[0]))
        for dlt, k, a, b, ca, cb in diffs[:25]:
            print(f"  {dlt:+8.1f} us  {k[:60]:60s} {a:8.1f} {b:8.1f}  calls {ca:.0f}/{cb:.0f}")
    dist.destroy_process_group()


main()

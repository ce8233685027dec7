"""calibrate() several times in a row: the spread of the demo / many_small plans' estimates."""
import sys, torch, torch.distributed as dist
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
dist.init_process_group("gloo"); torch.set_num_threads(1)
from shardkit.planner.calibration import calibrate
import shardkit.planner.calibration_steps as cs, time
ROUNDS = [int(x) for x in sys.argv[2].split(',')]
def set_rounds(n):
    d = list(cs.alternating_seconds.__defaults__); d[0] = n; cs.alternating_seconds.__defaults__ = tuple(d)
from shardkit.planner import CostModel
from benchmarks.plan_quality import _Model, table_sets, _planner
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
W = dist.get_world_size(); rank = dist.get_rank()
sh = [EmbeddingBagCollectionSharder()]
plans = {}
for name in ("demo", "many_small"):
    tables, batch = table_sets(True)[name]
    meta = _Model(tables, torch.device("meta"))
    for kind in ("table_wise", "row_wise", "column_wise", "data_parallel"):
        try:
            plans[(name, kind)] = (tables, batch, meta, _planner(tables, batch, W, CostModel.default("cpu"), kind).plan(meta, sh))
        except ValueError:
            pass
for i in range(int(sys.argv[1])):
    n = ROUNDS[i % len(ROUNDS)]; set_rounds(n)
    rep = {}
    t0 = time.time(); cal = calibrate("cpu", fit_report=rep); dt = time.time() - t0
    if rank == 0:
        est = {k: _planner(t, b, W, cal, k[1]).estimate(m, sh, p).max_time_s * 1e3 for k, (t, b, m, p) in plans.items()}
        r = lambda a, b: est[(a, b)] / est[(a, "table_wise")]
        print(f"cal {i} rounds {n} {dt:.1f}s demo DP {r('demo', 'data_parallel'):.3f} RW {r('demo', 'row_wise'):.3f} CW {r('demo', 'column_wise'):.3f} many DP {r('many_small', 'data_parallel'):.3f} RW {r('many_small', 'row_wise'):.3f}", end=" ")
        print(f"res {rep['residual']:.3f} " + " ".join(f"{k[0][:4]}{k[1][:2]} {v:.3f}" for k, v in est.items()), flush=True)
dist.destroy_process_group()

"""Scratch (twenty-fifth session): a rank's step with 1, 2, 3, 4, 6 lookup groups (calibrate()'s group steps:
24 tables of 1000 rows, widths 8, 16, 24, ... in turn), table-wise and row-wise, 2 ranks, same rounds:
is each extra group's cost the same (lookup_group_s), or does the first extra one cost more?"""
import torch, torch.distributed as dist


def worker(rounds, steps, batch):
    from shardkit.distributed.validation import set_validation
    from shardkit.planner.calibration_configs import StepConfig
    from shardkit.planner.calibration_steps import alternating_seconds, training_step

    torch.set_num_threads(1)
    set_validation(False)
    names, fns = [], []
    for kind, n in (("table_wise", 24), ("row_wise", 24)):
        types = ("table_wise",) * n if kind == "table_wise" else ("row_wise",) * n
        for groups in (1, 2, 3, 4, 6):
            cfg = StepConfig(types, 1000, 8, batch, 2, dim_step=8 if groups > 1 else 0, cycle=groups if groups > 1 else 0)
            fns.append(training_step(cfg, None, torch.device("cpu")))
            names.append(f"{kind} {groups} groups")
    sec = torch.tensor(alternating_seconds(fns, None, torch.device("cpu"), rounds, steps), dtype=torch.float64)
    dist.all_reduce(sec, op=dist.ReduceOp.MAX)
    return names, sec.tolist()


if __name__ == "__main__":
    import sys
    sys.path.insert(0, "benchmarks/results")
    from group_count_probe_session25 import worker as run
    from shardkit.testing import run_world
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    names, sec = run_world(run, 2, 21, 4, batch, timeout=900)[0]
    prev = None
    for n, s in zip(names, sec):
        if n.endswith(" 1 groups"):
            prev = base = s
        print(f"{n:24s} {s*1e3:.3f} ms  +{(s-base)*1e3:.3f} over 1 group")

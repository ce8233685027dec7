import json, statistics, sys, time
import torch, torch.distributed as dist
from shardkit.distributed.validation import set_validation
from shardkit.planner import calibrate

def main():
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group('gloo')
    set_validation(False)
    runs = []
    for i in range(3):
        report = {}
        t0 = time.perf_counter()
        calibrate("cpu", fit_report=report)
        runs.append({s["config"]: s["measured_s"] for s in report["steps"]})
        if dist.get_rank() == 0:
            print(f"calibrate {i}: {time.perf_counter() - t0:.1f} s", flush=True)
    if dist.get_rank() == 0:
        for i in (1, 2):
            ratios = [runs[0][k] / runs[i][k] for k in runs[0]]
            print(f"first / calibrate {i}: median {statistics.median(ratios):.3f} range {min(ratios):.2f}-{max(ratios):.2f}")
        r12 = [runs[1][k] / runs[2][k] for k in runs[0]]
        print(f"second / third: median {statistics.median(r12):.3f}")
        json.dump(runs, open(sys.argv[1], "w"))

if __name__ == "__main__":
    main()

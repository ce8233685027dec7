import sys, torch, torch.distributed as dist
sys.path.insert(0, "/work/main/src"); sys.path.insert(0, "/work/main")
dist.init_process_group("gloo"); torch.set_num_threads(1)
from shardkit.distributed.validation import set_validation; set_validation(False)
import shardkit.planner.calibration_steps as cs
from shardkit.planner.calibration_configs import StepConfig
DP = "data_parallel"
cfgs = {"dp8_64k": StepConfig((DP,) * 8, 64000, 16, batch=256, pooling=1, dim_step=16, cycle=2),
        "dp8_4k": StepConfig((DP,) * 8, 4000, 16, batch=256, pooling=1, dim_step=16, cycle=2)}
for name, c in cfgs.items():
    step = cs.training_step(c, None, torch.device("cpu"))
    for _ in range(5): step()
    with torch.profiler.profile() as p:
        for _ in range(20): step()
    if dist.get_rank() == 0:
        print("=====", name)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
dist.destroy_process_group()

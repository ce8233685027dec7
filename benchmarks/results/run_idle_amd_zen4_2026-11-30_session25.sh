#!/usr/bin/env bash
# idle run on the Zen 4 VM (twenty-fifth session): DLRM x3, planner quality x3, the kernel alone vs fbgemm.
# The sweep ran first, on its own (sweep1). O=output folder
set -u
cd /work/main
O=${O:-/work/n25/out}
mkdir -p "$O"
PY=$HOME/peers/torchrec/bin/python
{ date -u; lscpu | grep -E "Model name|family|Model:|L2|L3"; grep -o -m1 avx512f /proc/cpuinfo; git log --oneline -1; uptime; } > "$O/machine.txt"
for i in 1 2 3; do
  PYTHONPATH=src:. $PY -m benchmarks.step_overhead --quick --floor > "$O/dlrm_$i.txt" 2>&1
done
uptime >> "$O/machine.txt"
for i in 1 2 3; do
  ./dev python -m benchmarks.plan_quality --quick --out "$O/pq_$i" > "$O/pq_$i.txt" 2>&1
done
{ date -u; uptime; } >> "$O/machine.txt"
for d in 16 64 128; do
  $PY /work/shared/peers/vs_fbgemm_kernel.py --dim $d > "$O/kernel_d$d.txt" 2>&1
done
{ date -u; uptime; } >> "$O/machine.txt"

#!/usr/bin/env bash
# idle run (nineteenth session): the sweep's data-parallel rows, DLRM x3, planner quality x3. O=output folder
set -u
cd /work/main
O=${O:-/work/n19/full}
mkdir -p "$O"
PY=$HOME/peers/torchrec/bin/python
{ date -u; lscpu | grep -E "Model name|family|Model:|L3"; git log --oneline -1; uptime; } > "$O/machine.txt"
PYTHONPATH=src:. $PY -m benchmarks.vs_torchrec_sweep --rounds 6 --round-s 0.5 --min-steps 6 --only 5 10 15 20 25 30 35 40 45 --out "$O/sweep" > "$O/sweep.txt" 2>&1
uptime >> "$O/machine.txt"
for i in 1 2 3; do
  PYTHONPATH=src:. $PY -m benchmarks.step_overhead --quick --floor > "$O/dlrm_$i.txt" 2>&1
done
uptime >> "$O/machine.txt"
for i in 1 2 3; do
  ./dev python -m benchmarks.plan_quality --quick --out "$O/pq$i" > "$O/plan_quality_$i.txt" 2>&1
  uptime >> "$O/machine.txt"
done
{ date -u; uptime; } >> "$O/machine.txt"

#!/usr/bin/env bash
# idle run: sweep, DLRM x3, planner quality. O=output folder
set -u
cd /work/main
O=${O:-/work/n18/full}
mkdir -p "$O"
PY=$HOME/peers/torchrec/bin/python
{ date -u; lscpu | grep -E "Model name|family|Model:|L3"; git log --oneline -1; uptime; } > "$O/machine.txt"
PYTHONPATH=src:. $PY -m benchmarks.vs_torchrec_sweep --rounds 6 --round-s 0.5 --min-steps 6 --out "$O/sweep" > "$O/sweep.txt" 2>&1
uptime >> "$O/machine.txt"
for i in 1 2 3; do
  PYTHONPATH=src:. $PY -m benchmarks.step_overhead --quick --floor > "$O/dlrm_$i.txt" 2>&1
done
uptime >> "$O/machine.txt"
./dev python -m benchmarks.plan_quality --quick > "$O/plan_quality.txt" 2>&1
{ date -u; uptime; } >> "$O/machine.txt"

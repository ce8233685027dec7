#!/usr/bin/env bash
set -u
cd /work/main
O=/work/n17/out
PY=$HOME/peers/torchrec/bin/python
{ date -u; lscpu | grep -E "Model name|family|Model:|L3"; git log --oneline -1; uptime; } > "$O/ab_machine.txt"
for i in 1 2; do
  for v in 0 1; do
    SHARDKIT_SHM_EXCHANGE=$v PYTHONPATH=src:. $PY -m benchmarks.step_overhead --quick > "$O/dlrm_shm_${v}_$i.txt" 2>&1
    uptime >> "$O/ab_machine.txt"
  done
done
for i in 1 2; do
  for v in 0 1; do
    SHARDKIT_SHM_EXCHANGE=$v PYTHONPATH=src:. $PY -m benchmarks.vs_torchrec_sweep --rounds 6 --round-s 0.5 --min-steps 6 --only 1 18 21 24 32 40 45 --out "$O/sweep_shm_${v}_$i" > "$O/sweep_shm_${v}_$i.txt" 2>&1
    uptime >> "$O/ab_machine.txt"
  done
done
date -u >> "$O/ab_machine.txt"

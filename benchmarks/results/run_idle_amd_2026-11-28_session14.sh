#!/bin/bash
# Idle bench, session 14. Each command in turn.
cd /work/main
O=/work/n14/out
P="env PYTHONPATH=src:. $HOME/peers/torchrec/bin/python"
lscpu > $O/cpu.txt; git rev-parse --short HEAD > $O/head.txt
t() { echo "$(date -u +%T) $1 load $(cut -d' ' -f1 /proc/loadavg)" >> $O/times.txt; }
t start
$P -m benchmarks.vs_torchrec_sweep --rounds 6 --round-s 0.5 --min-steps 6 --out $O/sweep > $O/sweep.txt 2>&1
t sweep
for i in 1 2 3; do $P -m benchmarks.step_overhead --quick --floor --out $O/dlrm$i > $O/dlrm$i.txt 2>&1; t dlrm$i; done
./dev python -m benchmarks.plan_quality --quick --out $O/plan > $O/plan.txt 2>&1
t plan
for i in 1 2; do
  $P -m benchmarks.vs_torchrec_sweep --only 21 24 32 34 39 41 42 44 --rounds 6 --round-s 0.5 --min-steps 6 --out $O/gloo$i > $O/gloo$i.txt 2>&1; t gloo$i
  SHARDKIT_SHM_EXCHANGE=1 $P -m benchmarks.vs_torchrec_sweep --only 21 24 32 34 39 41 42 44 --rounds 6 --round-s 0.5 --min-steps 6 --out $O/shm$i > $O/shm$i.txt 2>&1; t shm$i
  SHARDKIT_SHM_EXCHANGE=1 $P -m benchmarks.step_overhead --quick --out $O/dlrmshm$i > $O/dlrmshm$i.txt 2>&1; t dlrmshm$i
done
t end

#!/usr/bin/env bash
# shm exchange on/off on the rows below 1.5 (Zen 3), alternated, 2 pairs
set -u
cd /work/main
O=/work/n16/out
PY=$HOME/peers/torchrec/bin/python
for i in 1 2; do
  for v in 0 1; do
    SHARDKIT_SHM_EXCHANGE=$v PYTHONPATH=src:. $PY -m benchmarks.vs_torchrec_sweep --rounds 6 --round-s 0.5 --min-steps 6 --only 1 18 21 24 32 40 45 --out "$O/shm_${v}_$i" > "$O/shm_${v}_$i.txt" 2>&1
  done
done
{ date -u; uptime; } >> "$O/machine.txt"

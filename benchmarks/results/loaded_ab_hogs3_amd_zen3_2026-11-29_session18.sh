#!/usr/bin/env bash
# DLRM step, shm off/on alternated, with 3 busy-loop hogs on the 2 cores (a controlled "loaded" machine)
cd "$(git rev-parse --show-toplevel)"
O=${O:-/tmp/loaded_ab}; mkdir -p $O
for i in 1 2 3; do python3 -c "while True: pass" & done
sleep 1
for pair in 1 2; do for v in 0 1; do
  SHARDKIT_SHM_EXCHANGE=$v PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.step_overhead --quick > $O/shm${v}_$pair.txt 2>&1
  echo "pair $pair shm=$v: $(grep 'shardkit/torchrec' $O/shm${v}_$pair.txt | awk '{print $2}')  $(grep -E '^(torchrec|shardkit) round 0 ' $O/shm${v}_$pair.txt | awk '{print $1, $4, $5, $6}' | tr '\n' ' ')"
done; done
kill %1 %2 %3

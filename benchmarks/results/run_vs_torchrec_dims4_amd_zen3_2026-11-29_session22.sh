#!/bin/bash
# shardkit vs torchrec, tables of 4 widths (16/32/64/128), one run per shape
cd /work/main
for cfg in "32 64 10000 4" "32 256 1000 2" "256 256 1000 2" "2048 16 100000 20"; do
  set -- $cfg
  echo "== batch $1 tables $2 rows $3 pooling $4"
  PYTHONPATH=src:. timeout 900 $HOME/peers/torchrec/bin/python -m benchmarks.vs_torchrec --tables $2 --rows $3 --dims 16 32 64 128 --batch $1 --pooling $4 --rounds 4 --iters 20 --optimizer adagrad --out /work/n22/vt_mixed_b$1_t$2 2>&1 | grep -E "^(name|table_wise|row_wise|column_wise|data_parallel) "
done

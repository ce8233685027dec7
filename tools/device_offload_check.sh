#!/usr/bin/env bash
# The GPU checks of the offloaded tables' CUDA tier (issue 24: the row cache's bookkeeping on the device,
# kernels/offload/device_slots.py), in one go under ~300 s, for a CUDA machine with torch + pytest (no
# network; shardkit need not be installed: src/ goes on PYTHONPATH). Run from anywhere:
#
#   OUT=/some/dir tools/device_offload_check.sh      (OUT defaults to ./device_offload_out)
#
# Steps, each under its own limit and all under one deadline (DEADLINE seconds, default 300), each
# leaving its output even when a later one is cut off:
#   1. the cuda-marked tests of tests/kernels/offload (the stream rule: test_one_stream_on_cuda),
#      tests/modules/test_offloaded_prefetch.py, tests/sharding/test_offloaded_quant.py
#      (quant_uvm_caching with the device bookkeeping against quant), the offloaded cases of
#      tests/model_parallel/test_world1_on_device.py and the Triton kernels' offloaded and unchecked-ids
#      cases of tests/kernels/test_triton_embedding_cuda.py                     -> cuda_tests.txt
#   2. benchmarks/offload_gpu.py at lf 0.2, zero-copy, host and device bookkeeping -> offload_gpu.json
#   3. benchmarks/offload_gpu_syncs.py: host syncs, ops and host time a step, host and device paths
#      (the device one also with SHARDKIT_VALIDATE=0)                          -> offload_gpu_syncs.json
#   4. benchmarks/offload_gpu.py at lf 0.05 (as 2)                              -> offload_gpu_lf005/
# Everything is also packed into $OUT/offload_check.tar.gz (rewritten after each step); $OUT/summary.txt
# has one line per step. Without CUDA every step still runs (tests skip, benchmarks run their --quick
# CPU rows: offload_gpu_syncs counts the device path's ops and syncs on CPU tensors), which is how the
# script is checked on CPU. Exit status: 1 if a step failed.
set -u
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/device_offload_out}
mkdir -p "$OUT"
work=$(mktemp -d)
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch' 2>/dev/null && [ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ]; then
  PY=$root/.venv/bin/python
fi
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING SHARDKIT_OFFLOAD_UVA SHARDKIT_OFFLOAD_COPY_STREAM
deadline=$((SECONDS + ${DEADLINE:-300}))
summary="$work/summary.txt"
: >"$summary"
failed=0

pack() {
  cp "$summary" "$OUT/summary.txt"
  tar -czf "$OUT/offload_check.tar.gz" -C "$work" . 2>/dev/null
}

step() {  # step NAME LIMIT LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((deadline - SECONDS - 3))
  if [ "$left" -lt 10 ]; then
    echo "$name: SKIPPED (deadline)" | tee -a "$summary"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local began=$SECONDS
  echo "== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  tail -n 25 "$log"
  local verdict=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMED OUT"; failed=1
  elif [ "$rc" -ne 0 ]; then verdict="FAILED (exit $rc)"; failed=1; fi
  echo "$name: $verdict in $((SECONDS - began)) s" | tee -a "$summary"
  pack
}

{
  echo "== environment"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  git -C "$root" log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$work/env.txt"
bench_args=()
syncs_args=()
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device here: the steps below only check that this script runs" | tee -a "$summary"
  bench_args=(--quick)
  syncs_args=(--quick --device cpu)
fi

# the native CPU kernels (the host bookkeeping's) compile on first use: once here, timed, not in a test
step "native build" "${BUILD_TIMEOUT:-100}" "$work/native_build.txt" "$PY" -c \
  'from shardkit.kernels.native_build import native_ops; print("native ops:", native_ops() is not None)'

pytest_args=(-m cuda -q -p no:cacheprovider -o addopts=-rA --durations=10)
if ! "$PY" -c 'import sys, importlib.metadata as m
sys.exit(0 if any(e.name == "shardkit" for e in m.entry_points(group="pytest11")) else 1)' 2>/dev/null; then
  pytest_args+=(-p shardkit.testing.pytest_plugin)
fi
if "$PY" -c 'import xdist' 2>/dev/null; then pytest_args+=(-n 4); fi
step "CUDA tests" "${CUDA_TESTS_TIMEOUT:-120}" "$work/cuda_tests.txt" "$PY" -m pytest "${pytest_args[@]}" \
  tests/kernels/offload tests/modules/test_offloaded_prefetch.py tests/sharding/test_offloaded_quant.py \
  "tests/model_parallel/test_world1_on_device.py::test_offloaded_tables" \
  tests/kernels/test_triton_embedding_cuda.py -k "not test_triton_embedding_cuda or offloaded or unchecked"

step "offload_gpu lf 0.2" "${BENCH_TIMEOUT:-60}" "$work/offload_gpu_bench.txt" \
  "$PY" -m benchmarks.offload_gpu "${bench_args[@]}" --load-factors 0.2 --copies zero-copy \
  --bookkeeping host device --out "$work"

step "offload_gpu_syncs" "${SYNCS_TIMEOUT:-60}" "$work/offload_gpu_syncs.txt" \
  "$PY" -m benchmarks.offload_gpu_syncs "${syncs_args[@]}" --out "$work"

mkdir -p "$work/offload_gpu_lf005"
step "offload_gpu lf 0.05" "${BENCH_TIMEOUT:-60}" "$work/offload_gpu_lf005/bench.txt" \
  "$PY" -m benchmarks.offload_gpu "${bench_args[@]}" --load-factors 0.05 --copies zero-copy \
  --bookkeeping host device --out "$work/offload_gpu_lf005"

echo "== summary"
cat "$summary"
pack
exit $failed

#!/usr/bin/env bash
# The GPU checks of shardkit in one go, for a CUDA machine with torch + triton + pytest installed and no
# network (shardkit itself need not be installed: src/ goes on PYTHONPATH). Run from anywhere:
#
#   OUT=/some/dir tools/device_check.sh        (OUT defaults to ./device_check_out)
#
# Steps, each under its own time limit (seconds, overridable) so that the whole stays under ~8 minutes
# and every step leaves its output under $OUT even when a later one hangs:
#   1. the CUDA tests: `pytest -m cuda` over tests/ (Triton kernels; every sharding type, DMP + the
#      train pipelines, managed collision and quantized serving at world 1 on NCCL; the losses with
#      the Triton and torch paths; distill IPC; KJT device round trip)
#                                                        -> $OUT/cuda_tests.txt (CUDA_TESTS_TIMEOUT, 200)
#   2. benchmarks/gpu.py: Triton vs pure-torch vs nn.EmbeddingBag lookup, forward and fused
#      backward+update, and the Triton CE kernels, as ratios to the copy bandwidth
#                                                        -> $OUT/gpu.json, $OUT/gpu_bench.txt (GPU_BENCH_TIMEOUT, 90)
#   3. benchmarks/gpu_losses.py: cross-entropy and fused linear cross-entropy (fp32, bf16; T 4096 /
#      16384, V 128k / 256k), shardkit vs F.cross_entropy vs liger-kernel, time and peak memory
#                                                        -> $OUT/gpu_losses.json, $OUT/losses_bench.txt
#      (LOSSES_BENCH_TIMEOUT, 200). liger-kernel comes from the environment, or from .device_deps/
#      of the checkout (`pip install --no-deps --target .device_deps liger-kernel` on a machine with
#      the registry; carried to a GPU machine that has none).
#   4. benchmarks/offload_gpu.py: fused_uvm_caching (device cache over pinned host memory) against the
#      table in device memory, copies on the side stream and on the compute stream, the cache's
#      bookkeeping on the host and on the device (zero-copy only), plain and prefetch order
#      (tools/device_offload_check.sh runs the offload checks alone, in ~3 minutes)
#                                                       -> $OUT/offload_gpu.json, $OUT/offload_gpu_bench.txt
#      (OFFLOAD_BENCH_TIMEOUT, 120)
# Offloaded tables (issue 24): their CUDA tier (pinned host memory, device cache, side-stream copies,
# Triton kernels on the cache) runs in step 1's cuda-marked tests (tests/model_parallel/
# test_world1_on_device.py::test_offloaded_tables, tests/kernels/offload/test_row_cache.py,
# tests/modules/test_offloaded_prefetch.py, the Triton case "offloaded-cache-equals-in-memory").
# $OUT/summary.txt gets one line per step. Without a CUDA device every step still runs (the benchmarks
# say so and exit 0, the CUDA tests skip) and the script exits 0: that is how it is checked on CPU.
# Exit status: 1 if a step failed or timed out, else 0.
set -u
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/device_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# a checkout's .venv where the plain python3 has no torch (a CPU machine set up by ./dev)
if ! "$PY" -c 'import torch' 2>/dev/null && [ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ]; then
  PY=$root/.venv/bin/python
fi
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the CUDA steps need compiled kernels
rm -f "$OUT/gpu_bench.txt" "$OUT/cuda_tests.txt" "$OUT/losses_bench.txt" "$OUT/offload_gpu_bench.txt"
summary="$OUT/summary.txt"
: >"$summary"
failed=0
offload_args=()

step() {  # step NAME TIMEOUT LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local began=$SECONDS
  echo "== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  tail -n 40 "$log"
  local verdict=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMED OUT"; failed=1
  elif [ "$rc" -ne 0 ]; then verdict="FAILED (exit $rc)"; failed=1; fi
  echo "$name: $verdict in $((SECONDS - began)) s" | tee -a "$summary"
}

{
  echo "== environment"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1 || echo "triton: not importable"
} 2>&1 | tee "$OUT/env.txt"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device here: the steps below only check that this script runs" | tee -a "$summary"
  offload_args=(--quick)  # its CPU rows at full size would take minutes and gigabytes of disk
fi

pytest_args=(-m cuda -q -p no:cacheprovider --continue-on-collection-errors -o addopts=-rA --durations=15)
# the run_world fixture comes from shardkit's pytest plugin, registered by an entry point only when
# shardkit is pip-installed
if ! "$PY" -c 'import sys, importlib.metadata as m
sys.exit(0 if any(e.name == "shardkit" for e in m.entry_points(group="pytest11")) else 1)' 2>/dev/null; then
  pytest_args+=(-p shardkit.testing.pytest_plugin)
fi
# compiling one kernel variant per configuration is most of the time: spread it over processes
if "$PY" -c 'import xdist' 2>/dev/null; then pytest_args+=(-n 4); fi
step "CUDA tests" "${CUDA_TESTS_TIMEOUT:-200}" "$OUT/cuda_tests.txt" "$PY" -m pytest "${pytest_args[@]}" tests

step "benchmarks/gpu.py" "${GPU_BENCH_TIMEOUT:-90}" "$OUT/gpu_bench.txt" \
  "$PY" -m benchmarks.gpu --out "$OUT"

if [ -d "$root/.device_deps" ]; then export PYTHONPATH="$PYTHONPATH:$root/.device_deps"; fi
"$PY" -c 'import liger_kernel; print("liger-kernel", getattr(liger_kernel, "__version__", "?"))' 2>&1 \
  | tail -n 1 | tee -a "$OUT/env.txt"
step "benchmarks/gpu_losses.py" "${LOSSES_BENCH_TIMEOUT:-200}" "$OUT/losses_bench.txt" \
  "$PY" -m benchmarks.gpu_losses --out "$OUT" --profile

step "benchmarks/offload_gpu.py" "${OFFLOAD_BENCH_TIMEOUT:-120}" "$OUT/offload_gpu_bench.txt" \
  "$PY" -m benchmarks.offload_gpu "${offload_args[@]}" --out "$OUT"

echo "== summary"
cat "$summary"
exit $failed

"""Offloaded tables train in bounded memory (issue 24, item 5).

A ``fused_uvm`` / ``fused_uvm_caching`` table of 415 MiB (weights; plus its row-wise Adagrad state) is
built on the meta device, sharded by a plan (never allocated in RAM) and trained a few steps in a fresh
process; that process's peak resident set (VmHWM: anonymous and file-mapped pages) beyond its baseline
after the imports must stay within a budget of 100 MiB, a fourth of the table.

What bounds it: the cache (``load_factor`` x rows x row bytes, 5% here: 22 MiB) and its bookkeeping
(kernels/offload/slot_map.py: a hashed slot map of the cache's slots, 4-7 MiB) for
``fused_uvm_caching``, whose misses are read in chunks with the pages unmapped after each; the file
pages one step touches for ``fused_uvm`` (each row read also maps the kernel's fault-around window,
64 KiB by default: a uvm step's resident set grows with its distinct rows, which is why its step here
reads 512 ids); the chunked initialization (16 MiB at a time) for both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_offloaded_memory_worker.py")
ROWS, DIM = 1_700_000, 64  # 415 MiB of fp32 weights in the backing file
BUDGET_MIB = 100

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the peak resident set from /proc/self/status"
)


def _run(kernel: str, bags: int, pooling: int, steps: int, tmp_path) -> dict:
    args = [kernel, ROWS, DIM, bags, pooling, steps, tmp_path]
    done = subprocess.run(
        [sys.executable, WORKER, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,  # wall time on a loaded machine; ~15 s of CPU each
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "kernel, bags, pooling",
    [("fused_uvm_caching", 2048, 8), ("fused_uvm", 128, 4)],
)
def test_peak_memory_stays_within_the_budget(kernel, bags, pooling, tmp_path):
    result = _run(kernel, bags, pooling, 4, tmp_path)
    table_mib = result["file_bytes"] / 2**20
    assert table_mib >= 4 * BUDGET_MIB, result  # the table is several times the budget
    stats = result["stats"]
    assert stats["calls"] == 4 and stats["misses"] > 1000, stats  # the steps did read the file
    assert result["trained_rows"] > 1000, result  # and trained: row-wise Adagrad state of those rows
    baseline, end = result["baseline"], result["end"]
    peak = end["VmHWM"] - baseline["VmRSS"] if result["peak_reset"] else end["VmHWM"] - baseline["VmHWM"]
    assert peak <= BUDGET_MIB, (
        f"{kernel}: peak RSS {peak:.0f} MiB beyond the baseline (budget {BUDGET_MIB} MiB, table "
        f"{table_mib:.0f} MiB): {result}"
    )
    assert end["RssAnon"] - baseline["RssAnon"] <= BUDGET_MIB, result

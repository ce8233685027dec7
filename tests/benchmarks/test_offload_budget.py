"""benchmarks/offload_budget.py: the budget run of ``python -m benchmarks.offload`` (its child process's
JSON line, the peak RSS split into the table's initialization and the steps) and its goal line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from benchmarks.offload_budget import budget_goal_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_goal_line_says_met_not_met_and_quick():
    rows = [{"name": "fused (steady)", "vs_fused": 1.0}]
    assert budget_goal_line(rows, quick=False) is None  # no budget run: no line
    within = {"peak_rss_MiB": 50.5, "budget_MiB": 64.0, "init_peak_rss_MiB": 20.0, "steps_peak_rss_MiB": 50.5}
    line = budget_goal_line(rows + [within], quick=False)
    assert line.startswith("goal: peak RSS within the budget: 50.5 MiB of 64 MiB met ("), line
    over = dict(within, peak_rss_MiB=70.0)
    assert "70.0 MiB of 64 MiB NOT met" in budget_goal_line([over], quick=False)
    # --quick: fixed costs exceed its 4 MiB budget: neither met nor NOT met, and not a "goal:" line
    quick = budget_goal_line([dict(over, budget_MiB=4.0)], quick=True)
    assert "met" not in quick and not quick.startswith("goal") and "--quick" in quick, quick


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_child_reports_the_initialization_and_the_steps_apart(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.offload", "--child-big", "--quick", "--threads", "1"]
    cmd += ["--offload-dir", str(tmp_path)]
    env = {**os.environ, "SHARDKIT_MALLOC_THRESHOLD": "1048576"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["big_rows"] >= 9 * r["fits_rows"], r  # 10x the budget against half of it
    assert r["file_mb"] > 4.0, r  # the table's file is larger than the --quick budget
    for key in ("init_peak_mb", "init_rss_mb", "steps_peak_mb", "peak_mb"):
        assert r[key] == r[key], (key, r)  # measured (not nan) on Linux
    # the initialization wrote the file (16 MiB chunks: its pages count while written)
    assert r["init_peak_mb"] > 0.0, r
    # the whole run's peak is the larger of the two parts (VmHWM reset between them)
    assert r["peak_mb"] == max(r["init_peak_mb"], r["steps_peak_mb"]), r
    assert r["cache_full"] and r["hit_rate_steady"] > 0, r

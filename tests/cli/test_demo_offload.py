"""``shardkit demo --offload``: the largest table trains offloaded (fused_uvm_caching) and is exact.

The run prints which table went to the backing file and the cache's budget, the cache's hit rate and the
bytes it moved, and passes the demo's exactness check against the unsharded replica (trained with the
table in memory); a reference trained differently still fails it; options that cannot offload end in
one line and exit code 2.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from shardkit.cli import demo_dlrm
from shardkit.cli.main import main
from shardkit.datasets import TableSpec
from shardkit.sharding.types import ParameterSharding

SHORT = ["demo", "--steps", "4", "--tables", "5", "--max-rows", "300", "--batch-size", "16", "--offload"]


def _exactness_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "max abs difference" in line]


def test_offloaded_table_trains_exactly_and_reports_its_cache(capsys):
    assert main([*SHORT, "--sharding-type", "row_wise", "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    # the largest table (t2: 300 x 32 under --max-rows 300) is the one offloaded
    assert "offloaded: table t2 (300x32, 37.5 KiB) -> fused_uvm_caching" in out
    assert "a cache of 0.05 of them in RAM (memory budget ~1.9 KiB over the shards)" in out
    stats = re.search(
        r"offloaded table t2: hit rate ([\d.]+) \(([\d,]+) of ([\d,]+) rows\), ([\d,]+) rows read / "
        r"([\d,]+) written back, [\d.]+ [KM]iB moved",
        out,
    )
    assert stats, out
    hit_rate, hits, lookups, read, written = (float(g.replace(",", "")) for g in stats.groups())
    assert lookups > 0 and read > 0 and written > 0  # the rows did go through the backing file
    assert hit_rate == pytest.approx(hits / lookups, abs=1e-3)
    assert "samples/s" in out
    lines = _exactness_lines(out)
    assert len(lines) == 4 and all(line.endswith(" ok") for line in lines), lines
    assert "result: sharded == unsharded" in out


def test_offloaded_run_still_fails_a_reference_that_trains_differently(capsys, monkeypatch):
    monkeypatch.setattr(demo_dlrm, "LR", demo_dlrm.LR / 2)
    assert main([*SHORT, "--timeout", "60"]) == 1
    out = capsys.readouterr().out
    assert "offloaded table" in out and "result: MISMATCH" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--sharding-type", "data_parallel"], "--offload needs a table that is not data-parallel"),
        (["--model", "gnn"], "--offload is for --model dlrm"),
        (["--device", "cuda"], "--offload keeps the table in a file-backed tier on CPU ranks only"),
    ],
)
def test_options_that_cannot_offload_are_one_line_and_exit_code_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--offload", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert expected in captured.err


def test_offload_largest_skips_data_parallel_tables():
    def sharding(kind: str) -> ParameterSharding:
        return ParameterSharding(sharding_type=kind, compute_kernel="fused", ranks=[0])

    tables = [TableSpec("a", 1000, 16, 1.0), TableSpec("b", 500, 16, 1.0)]
    plan = SimpleNamespace(plan={"ebc": {"a": sharding("data_parallel"), "b": sharding("row_wise")}})
    assert demo_dlrm.offload_largest(plan, tables).name == "b"
    assert plan.plan["ebc"]["b"].compute_kernel == "fused_uvm_caching"
    assert plan.plan["ebc"]["b"].cache_params.load_factor == demo_dlrm.OFFLOAD_LOAD_FACTOR
    assert plan.plan["ebc"]["a"].compute_kernel == "fused"
    plan.plan["ebc"]["b"] = sharding("data_parallel")
    assert demo_dlrm.offload_largest(plan, tables) is None

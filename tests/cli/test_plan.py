import json
import sys
from pathlib import Path

import pytest

from shardkit.cli import plan
from shardkit.cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "recsys_tables.yaml"

CONFIG = {
    "world_size": 2,
    "memory_per_rank": "1GiB",
    "device": "cpu",
    "batch_size": 64,
    "tables": [
        {"name": "big", "rows": 100000, "dim": 64, "pooling_factor": 10},
        {"name": "small", "rows": 100, "dim": 8, "features": ["a", "b"]},
    ],
    "constraints": {"small": {"sharding_types": ["data_parallel"]}},
}


def write(tmp_path, config, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_json_config_prints_plan_and_per_rank_load(tmp_path, capsys):
    assert main(["plan", write(tmp_path, CONFIG)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan for 2 tables on 2 cpu ranks\n")
    assert any(line.split()[:2] == ["small", "data_parallel"] for line in out.splitlines())
    assert "ranks:" in out and "imbalance" in out


def test_json_output_is_the_plan_report(tmp_path, capsys):
    assert main(["plan", write(tmp_path, CONFIG), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["table"] for t in report["tables"]] == ["big", "small"]
    assert report["tables"][1]["sharding_type"] == "data_parallel"
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    # the pooling factor reaches the estimates: 10 ids per bag cost more than 1
    heavier = dict(CONFIG, tables=[dict(CONFIG["tables"][0], pooling_factor=1), CONFIG["tables"][1]])
    assert main(["plan", write(tmp_path, heavier, "light.json"), "--json"]) == 0
    light = json.loads(capsys.readouterr().out)
    assert light["tables"][0]["time_s"] < report["tables"][0]["time_s"]


def test_example_yaml_config_plans_two_nodes(capsys):
    pytest.importorskip("yaml")
    assert main(["plan", str(EXAMPLE), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["ranks"]) == 8 and len(report["tables"]) == 8
    country = next(t for t in report["tables"] if t["table"] == "country")
    assert country["sharding_type"] == "data_parallel"


def test_yaml_without_pyyaml_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)
    path = tmp_path / "plan.yaml"
    path.write_text("world_size: 2\n")
    assert main(["plan", str(path)]) == 2
    line = error_line(capsys)
    assert "PyYAML" in line and "pip install 'shardkit[yaml]'" in line


@pytest.mark.parametrize(
    "change, message",
    [
        ({"world_size": None}, "missing key 'world_size'"),
        ({"world_size": "two"}, "world_size must be a positive integer"),
        ({"memory_per_rank": "lots"}, "memory_per_rank must be a byte count"),
        ({"device": "tpu"}, "device must be cuda or cpu"),
        ({"local_world_size": 3}, "local_world_size 3 must divide world_size 2"),
        ({"tables": [{"name": "t", "rows": 10}]}, "tables[0]: missing key 'dim'"),
        ({"tables": [{"name": "t", "rows": True, "dim": 4}]}, "table 't' rows must be a positive integer"),
        ({"tables": [{"name": "t", "rows": 10, "dims": 4}]}, "tables[0]: unknown key 'dims'"),
        ({"constraints": {"big": {"sharding_types": ["diagonal"]}}}, "unknown sharding type 'diagonal'"),
        ({"constraints": {"nope": {}}}, "no table named 'nope'"),
        ({"constraints": {"big": {"ranks": [5]}}}, "ranks [5] outside 0..1"),
        ({"optimizer": "lion"}, "optimizer: unknown 'lion'"),
        ({"colour": "blue"}, "config: unknown key 'colour'"),
    ],
)
def test_malformed_config_is_a_one_line_error(tmp_path, capsys, change, message):
    config = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    assert main(["plan", write(tmp_path, config)]) == 2
    assert message in error_line(capsys)


def test_unreadable_or_invalid_files_are_one_line_errors(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in error_line(capsys)
    bad = tmp_path / "bad.json"
    bad.write_text("{world_size: 2")
    assert main(["plan", str(bad)]) == 2
    assert "not valid JSON" in error_line(capsys)


def test_tables_that_fit_nowhere_explain_why(tmp_path, capsys):
    config = dict(CONFIG, memory_per_rank="1MiB")
    assert main(["plan", write(tmp_path, config)]) == 1
    assert "did not fit" in capsys.readouterr().err


def test_parse_bytes_units():
    assert plan.parse_bytes("16GiB", "m") == 16 << 30
    assert plan.parse_bytes("1.5 KB", "m") == 1500
    assert plan.parse_bytes(1024, "m") == 1024


def _yaml_config(**overrides) -> str:
    """CONFIG as YAML text with some top-level or first-table values replaced by raw YAML."""
    top = {"world_size": "2", "memory_per_rank": "1GiB", "device": "cpu"}
    table = {"name": "t", "rows": "100", "dim": "8", "pooling_factor": "2"}
    for key, value in overrides.items():
        (table if key in table else top)[key] = value
    lines = [f"{k}: {v}" for k, v in top.items()]
    lines.append("tables:\n  - {" + ", ".join(f"{k}: {v}" for k, v in table.items()) + "}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (_yaml_config(memory_per_rank="1.2.3GB"), "memory_per_rank must be a byte count"),
        (_yaml_config(memory_per_rank=".nan"), "memory_per_rank must be a finite number"),
        (_yaml_config(memory_per_rank=".inf"), "memory_per_rank must be a finite number"),
        (_yaml_config(memory_per_rank="1.0e999"), "memory_per_rank must be a finite number"),
        (_yaml_config(memory_per_rank="99999999EiB"), "memory_per_rank must be a byte count"),
        (_yaml_config(memory_per_rank="1.0e30"), "more than"),
        (_yaml_config(pooling_factor=".nan"), "pooling_factor must be a finite number"),
        (_yaml_config(pooling_factor="-1"), "pooling_factor must not be negative"),
        (_yaml_config(rows="1.0e20"), "rows must be a positive integer"),
        (_yaml_config(rows=str(10**20)), "rows is 100000000000000000000, more than the largest"),
        (_yaml_config(dim=str(10**12)), "dim is 1000000000000, more than the largest supported (65536)"),
        (_yaml_config(world_size=str(10**12)), "world_size is 1000000000000, more than"),
    ],
)
def test_hostile_yaml_values_are_one_line_errors(tmp_path, capsys, text, message):
    pytest.importorskip("yaml")
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    assert main(["plan", str(path)]) == 2
    assert message in error_line(capsys)


def test_hostile_files_are_short_one_line_errors(tmp_path, capsys):
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(CONFIG).replace('"1GiB"', "NaN"))
    assert main(["plan", str(nan)]) == 2
    assert "JSON NaN is not a number" in error_line(capsys)
    binary = tmp_path / "binary.json"
    binary.write_bytes(json.dumps(CONFIG).encode()[:20] + b"\xff\xfe" + b"}")
    assert main(["plan", str(binary)]) == 2
    assert "not UTF-8 text: byte 0xff at offset 20" in error_line(capsys)
    pytest.importorskip("yaml")
    # a few hundred bytes of nested aliases (9**8 leaves): the error quotes an abbreviation
    levels = ["&a [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(7)]
    path = tmp_path / "bomb.yaml"
    path.write_text(f"world_size: [{', '.join(levels)}]\nmemory_per_rank: 1GiB\ntables: []\n")
    assert path.stat().st_size < 600
    assert main(["plan", str(path)]) == 2
    line = error_line(capsys)
    assert len(line) <= 330 and "world_size must be a positive integer" in line


def test_bench_out_naming_a_file_is_a_one_line_error(tmp_path, capsys):
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "demo_bench.py").write_text("def main(argv):\n    pass\n")
    existing = tmp_path / "results.json"
    existing.write_text("{}")
    assert main(["bench", "demo_bench", "--dir", str(scripts), "--out", str(existing)]) == 2
    assert "--out" in error_line(capsys) and existing.read_text() == "{}"


def test_offloaded_tables_show_their_cache_and_expected_hit_rate(tmp_path, capsys):
    config = dict(
        CONFIG,
        optimizer="rowwise_adagrad",
        disk_per_rank="100GiB",
        tables=[{"name": "big", "rows": 10_000_000, "dim": 64, "pooling_factor": 4}, CONFIG["tables"][1]],
        constraints={
            "big": {"compute_kernels": ["fused_uvm_caching"], "cache_params": {"load_factor": 0.05}},
            "small": {"sharding_types": ["data_parallel"]},
        },
    )
    assert main(["plan", write(tmp_path, config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("offloaded tables (cache in the fast tier, table in the slow tier):")
    columns = "table kernel load factor cache rows cache expected hit rate slow tier"
    assert lines[header + 1].split() == columns.split()
    # 5% of 10^7 rows of 64 fp32 values + a 4-byte row-wise Adagrad state each; the table on disk
    big = lines[header + 2].split()
    assert big[:4] == ["big", "fused_uvm_caching", "0.05", "500000"]
    assert " ".join(big[4:]) == "124.0 MiB 0.900 (cost model) 2.4 GiB disk"
    assert len(lines) == header + 3  # the in-memory table has no line there
    # the 1 GiB of RAM per rank holds the cache, not the 2.4 GiB table
    assert main(["plan", write(tmp_path, config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    row = report["tables"][0]
    assert row["cache"]["cache_rows"] == 500_000
    assert row["disk_bytes"] == pytest.approx(10**7 * (64 * 4 + 4))
    assert row["ddr_bytes"] < 2**30 and report["tables"][1]["cache"] is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"constraints": {"big": {"cache_params": {"load_factor": 2}}}}, "load factor must be in (0, 1]"),
        ({"constraints": {"big": {"cache_params": {"size": 2}}}}, "cache_params: unknown key 'size'"),
        ({"device": "cuda", "disk_per_rank": "1TiB"}, "disk_per_rank is the cpu offload tier"),
        ({"constraints": {"big": {"compute_kernels": ["fused_uvm_caching"]}}}, "has no sharding option"),
    ],
)
def test_malformed_cache_config_is_an_error(tmp_path, capsys, change, message):
    code = main(["plan", write(tmp_path, {**CONFIG, **change})])
    err = capsys.readouterr().err
    assert code in (1, 2) and message in err and "Traceback" not in err

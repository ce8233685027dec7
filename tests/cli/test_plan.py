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

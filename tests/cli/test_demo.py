"""``shardkit demo`` (dlrm): trains sharded, prints plan, throughput and curve, and proves it exact.

Short runs (few steps, small tables) at 2 ranks with the planner's plan and with forced sharding
types; a reference trained with another learning rate must fail the check; bad input must end in one
line on stderr and exit code 2 before any rank starts.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from shardkit.cli import demo_dlrm
from shardkit.cli.main import main

SHORT = ["demo", "--steps", "4", "--tables", "5", "--max-rows", "300", "--batch-size", "16"]


def _exactness_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "max abs difference" in line]


def test_planned_demo_prints_plan_throughput_curve_and_is_exact(capsys, tmp_path):
    # also saves a checkpoint, restores it on 3 ranks under the planner's plan for 3, checks it exact
    assert main([*SHORT, "--checkpoint", str(tmp_path / "ckpt"), "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert "DLRM: 5 tables" in out and "2 local CPU ranks (gloo)" in out
    assert "ebc.t0" in out and "imbalance" in out  # the planner's report
    assert "samples/s" in out and "step 1" in out
    lines = _exactness_lines(out)
    assert [line.split("difference of ")[1].split("  ")[0].strip() for line in lines[:4]] == [
        "losses",
        "dense weights",
        "embedding tables",
        "mc slot maps",  # the raw-id feature behind a managed-collision table (on by default)
    ]
    assert all(line.endswith(" ok") for line in lines[:4])
    assert "result: sharded == unsharded" in out
    assert [line.split()[1] for line in lines[4:]] == ["dense", "embedding", "mc"]
    assert all(line.endswith(" exact") for line in lines[4:])
    assert "result: restored on 3 ranks == saved on 2" in out
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["plan"]["ebc"]["t0"]["sharding_type"]


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_column_wise"])
def test_forced_sharding_type_is_used_for_every_table_and_is_exact(capsys, sharding_type):
    assert main([*SHORT, "--sharding-type", sharding_type]) == 0
    out = capsys.readouterr().out
    assert f"forced plan: every table {sharding_type}" in out
    plan_rows = [line for line in out.splitlines() if re.match(r"t\d+ ", line)]
    assert len(plan_rows) == 5 and all(line.split()[2] == sharding_type for line in plan_rows)
    assert len(_exactness_lines(out)) == 4 and "result: sharded == unsharded" in out
    assert "managed collision: feature 'user_id' of raw 64-bit ids" in out


def test_a_reference_that_trains_differently_fails_the_check(capsys, monkeypatch):
    # the ranks' dense optimizer runs in their own processes at the real rate; the reference's here
    # trains its dense layers at half of it
    monkeypatch.setattr(demo_dlrm, "LR", demo_dlrm.LR / 2)
    assert main(SHORT) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "result: MISMATCH" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--sharding-type", "diagonal"], "invalid choice: 'diagonal'"),
        (["--nproc", "100000"], "--nproc 100000 is more than"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--batch-size", "-5"], "--batch-size must be between 1"),
        (["--tables", "0"], "--tables must be between 1"),
        (["--max-rows", "0"], "--max-rows must be >= 1"),
        (["--steps", "many"], "invalid int value: 'many'"),
        (["--model", "gnn", "--nodes", "1"], "need --nodes >= --nproc"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds"),
        (["--timeout", "nan"], "--timeout must be a positive number of seconds"),
        (["--model", "gnn", "--checkpoint", "x"], "--checkpoint is for --model dlrm"),
        (["--checkpoint", __file__], "exists and is not a directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("shardkit demo: error: ")
    assert expected in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--device", "cuda"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "shardkit demo: error: --device cuda needs CUDA and NCCL, and this torch build or machine has neither"
    )

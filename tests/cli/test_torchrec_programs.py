"""issue 25's "done when": a program written with torchrec's import paths only (golden DLRM training,
the sharding tutorial, fbgemm's EmbOptimType and torch.ops.fbgemm) trains on 2 CPU ranks under
``shardkit launch --as-torchrec``, and ``shardkit port``'s rewrite of it runs without the mode, with
the same losses."""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from shardkit.cli.torchrec_mode import ENV_VAR, NOTICE

PROGRAM = Path(__file__).resolve().parents[1] / "fixtures" / "torchrec_programs" / "train_dlrm_torchrec.py"
STEPS = 3


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(script: Path, out_dir: Path, *options: str) -> subprocess.CompletedProcess:
    out_dir.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli.main",
        "launch",
        "-n",
        "2",
        *options,
        str(script),
        str(out_dir),
    ]
    done = subprocess.run(
        cmd + ["--steps", str(STEPS)], capture_output=True, text=True, timeout=300, env=_environment()
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _results(out_dir: Path) -> list:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def _imported_top_names(source: str) -> set:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_torchrec_program_trains_as_torchrec_and_ported(tmp_path):
    imported = _imported_top_names(PROGRAM.read_text())
    assert {"torchrec", "fbgemm_gpu"} <= imported and "shardkit" not in imported

    as_torchrec = _launch(PROGRAM, tmp_path / "as_torchrec", "--as-torchrec")
    assert as_torchrec.stderr.count(NOTICE) == 1
    results = _results(tmp_path / "as_torchrec")
    for result in results:
        assert result["torchrec_module"] == "shardkit"
        assert len(result["losses"]) == STEPS and all(math.isfinite(x) for x in result["losses"])
        # the planner followed the ParameterConstraints
        plan = result["dlrm_plan"]
        assert plan.pop("t_cat_0") == "row_wise" and set(plan.values()) == {"table_wise"} and len(plan) == 3
        assert result["tutorial_plan"] == {"large_table": "row_wise", "small_table": "table_wise"}
        assert result["tutorial_pooled_shape"] == [2, 16]
        assert result["tutorial_keys"] == ["large_feature", "small_feature"]
    assert results[0]["losses"] != results[1]["losses"]  # each rank its own samples

    ported = tmp_path / "ported" / PROGRAM.name
    ported.parent.mkdir()
    shutil.copy(PROGRAM, ported)
    port = subprocess.run(
        [sys.executable, "-m", "shardkit.cli.main", "port", "--write", str(ported)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert port.returncode == 0, port.stderr
    assert port.stdout.startswith(f"--- {ported}")
    assert _imported_top_names(ported.read_text()) & {"torchrec", "fbgemm_gpu"} == set()

    plain = _launch(ported, tmp_path / "ported_out")
    assert NOTICE not in plain.stderr
    # the same program on the same seeds: the same losses, bit for bit
    assert [r["losses"] for r in _results(tmp_path / "ported_out")] == [r["losses"] for r in results]


CUSTOM_SHARDER = PROGRAM.parent / "custom_sharder_torchrec.py"
MATCH_LINE = "custom sharder: MATCH with the unsharded twin over 3 steps at world size 2"


def _run_custom_sharder(script: Path, *options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardkit.cli.main", "launch", "-n", "2", *options, str(script)]
    return subprocess.run(
        cmd + ["--steps", "3"], capture_output=True, text=True, timeout=300, env=_environment()
    )


def test_torchrec_program_with_a_custom_sharder_matches_its_unsharded_twin(tmp_path):
    """A user's ModuleSharder / EmbeddingSharding / dists / lookup, written against torchrec's import
    paths, under DistributedModelParallel at world size 2: the program itself compares forward values
    and weights with the unsharded twin and exits non-zero on a mismatch."""
    imported = _imported_top_names(CUSTOM_SHARDER.read_text())
    assert "torchrec" in imported and "shardkit" not in imported

    as_torchrec = _run_custom_sharder(CUSTOM_SHARDER, "--as-torchrec")
    assert as_torchrec.returncode == 0, as_torchrec.stdout[-2000:] + as_torchrec.stderr[-4000:]
    assert as_torchrec.stderr.count(NOTICE) == 1
    assert as_torchrec.stdout.count(MATCH_LINE) == 1, as_torchrec.stdout

    ported = tmp_path / CUSTOM_SHARDER.name
    shutil.copy(CUSTOM_SHARDER, ported)
    port = subprocess.run(
        [sys.executable, "-m", "shardkit.cli.main", "port", "--write", str(ported)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert port.returncode == 0, port.stderr
    assert _imported_top_names(ported.read_text()) & {"torchrec", "fbgemm_gpu"} == set()
    plain = _run_custom_sharder(ported)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-4000:]
    assert NOTICE not in plain.stderr
    assert plain.stdout.count(MATCH_LINE) == 1, plain.stdout

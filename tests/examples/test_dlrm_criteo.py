"""examples/dlrm_criteo.py: reads the Criteo Kaggle TSV format and trains on 2 ranks under torchrun."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "dlrm_criteo.py"


def _example():
    spec = importlib.util.spec_from_file_location("dlrm_criteo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_line_becomes_log_counts_hashed_ids_and_empty_bags_for_missing_values():
    example = _example()
    ints = ["3", "", "-1"] + ["0"] * 10
    cats = ["68fd1e64", ""] + ["0000000a"] * 24
    label, dense, ids = example.parse_line("\t".join(["1", *ints, *cats]) + "\n", table_rows=1000)
    assert label == 1.0
    assert dense[:3] == [math.log1p(3), 0.0, 0.0] and len(dense) == 13
    assert ids[:3] == [0x68FD1E64 % 1000, None, 10] and len(ids) == 26
    batch = example.make_batch([(label, dense, ids), (0.0, dense, [7] * 26)])
    kjt = batch.sparse_features
    assert kjt.keys() == [f"C{i}" for i in range(1, 27)]
    assert kjt["C2"].lengths().tolist() == [0, 1]  # the missing value is an empty bag
    assert kjt["C1"].values().tolist() == [0x68FD1E64 % 1000, 7]
    assert batch.labels.tolist() == [1.0, 0.0] and batch.dense_features.shape == (2, 13)


def test_generated_file_has_the_criteo_layout(tmp_path):
    path = tmp_path / "criteo.tsv"
    _example().generate(str(path), rows=50)
    lines = path.read_text().splitlines()
    assert len(lines) == 50
    fields = [line.split("\t") for line in lines]
    assert all(len(f) == 40 and f[0] in ("0", "1") for f in fields)
    assert all(v == "" or len(v) == 8 and int(v, 16) >= 0 for f in fields for v in f[14:])
    assert any(v == "" for f in fields for v in f[1:])  # missing values occur


def test_trains_on_two_ranks_under_torchrun(tmp_path):
    data = tmp_path / "criteo.tsv"
    _example().generate(str(data), rows=4000)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
        "--data", str(data), "--steps", "100", "--batch-size", "64", "--table-rows", "2000",
        "--log-every", "10",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "26 tables of 2,000 x 16 over 2 rank(s)" in done.stdout
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    assert sum(losses[5:]) < sum(losses[:5])  # falls on average
    assert "samples/s" in done.stdout
    assert min(losses) < math.log(2)  # better than a coin

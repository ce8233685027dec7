"""The examples' short versions, each on 2 ranks launched like a user would (``shardkit launch``).

``tp_lm_head.py --check`` and ``gnn_graph_parallel.py --check`` (equal to 1 rank) run as the commands of
docs/examples.md in tests/docs/test_doc_commands.py, which checks their verdict line.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def launch(script: str, *args: str) -> str:
    """stdout of ``shardkit launch -n 2 examples/<script> args``; fails the test on a non-zero exit."""
    cmd = [sys.executable, "-m", "shardkit.cli.main", "launch", "-n", "2", str(EXAMPLES / script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def load(script: str):
    spec = importlib.util.spec_from_file_location(script[:-3], EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_xtoken_distill_lowers_the_distillation_loss():
    out = launch("xtoken_distill.py", "--steps", "20", "--teacher-steps", "30")
    assert "student distilled on 2 data-parallel rank(s)" in out
    lines = [line.split() for line in out.splitlines() if line.startswith(("step", "final"))]
    kd = [float(words[words.index("kd") + 1]) for words in lines]
    assert kd[-1] < kd[0] / 2


def test_xtoken_distill_without_tokenizers_is_a_one_line_error(monkeypatch, capsys):
    module = load("xtoken_distill.py")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert module.main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizers" in err


def test_ported_torchrec_golden_training_runs_and_learns():
    out = launch("train_dlrm_golden.py", "--steps", "40")
    for path in ("dlrm.model.sparse_arch.embedding_bag_collection", "ec", "fp_ebc"):
        assert f"module: {path}\n" in out
    kernels = {
        line.split("|")[2].strip() for line in out.splitlines() if line.startswith("t_") and "wise" in line
    }
    assert kernels == {"fused"}  # in-backward RowWiseAdagrad and the sharders' fused_params both select it
    tenths = [float(v) for v in out.split("mean loss per tenth:")[1].split()]
    assert len(tenths) == 10 and tenths[-1] < tenths[0] / 2  # 10 cached random batches get memorized

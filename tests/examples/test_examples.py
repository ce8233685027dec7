"""The examples' short versions, each on 2 ranks launched like a user would (``shardkit launch``)."""

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


def test_tp_lm_head_loss_curve_equals_one_rank():
    out = launch("tp_lm_head.py", "--steps", "4", "--vocab", "101", "--hidden", "16", "--seq", "8", "--check")
    assert "vocab 101 over 2 rank(s), 4 steps" in out
    assert "max abs difference of the loss curve vs 1 rank" in out and out.rstrip().endswith("ok")


def test_gnn_graph_parallel_energies_and_forces_equal_gp1():
    out = launch("gnn_graph_parallel.py", "--steps", "3", "--molecules", "2", "--atoms", "12", "--check")
    assert "graph parallel 2, 3 steps" in out
    assert "max abs difference vs graph parallel 1" in out and out.rstrip().endswith("ok")


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

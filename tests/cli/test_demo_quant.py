"""``shardkit demo --quantize``: the trained DLRM served with int8 and int4 tables on 2 ranks."""

from __future__ import annotations

import re

import torch

from shardkit.cli.demo_quant import auc
from shardkit.cli.main import main

SHORT = ["demo", "--steps", "4", "--tables", "5", "--max-rows", "300", "--batch-size", "16", "--quantize"]


def test_quantized_serving_prints_memory_and_prediction_change(capsys):
    assert main(SHORT) == 0
    out = capsys.readouterr().out
    assert "result: sharded == unsharded" in out  # the fp32 model it quantizes was exact first
    assert "quantized serving on 2 ranks" in out
    for name, at_most in (("int8", 0.4), ("int4", 0.3)):
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{name}: tables"))
        ratios = [float(x) for x in re.findall(r"\(([\d.]+)x fp32\)", line)]
        assert len(ratios) == 2 and all(0 < r <= at_most for r in ratios), line
    assert out.count("sharded vs unsharded") == 2 and "FAILED" not in out
    assert "result: quantized sharded == quantized unsharded" in out


def test_auc():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert auc(torch.tensor([0.1, 0.3, 0.2, 0.4]), labels) == 0.75


def test_timeout_reaches_the_serving_ranks_too(monkeypatch, capsys):
    # issue 23: --timeout bounded the training ranks but not the quantized serving ones
    import shardkit.testing

    real, envs = shardkit.testing.run_world, []

    def recording(*args, **kwargs):
        envs.append(kwargs.get("env"))
        return real(*args, **kwargs)

    monkeypatch.setattr(shardkit.testing, "run_world", recording)
    assert main([*SHORT, "--timeout", "77"]) == 0
    assert len(envs) == 2 and all(env == {"SHARDKIT_TIMEOUT": "77.0"} for env in envs), envs

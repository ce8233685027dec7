"""``shardkit demo --serve``: the trained DLRM packaged, served from a fresh process, answers checked."""

from __future__ import annotations

import argparse
import re

from shardkit.cli import demo_serve
from shardkit.cli.main import main

SHORT = ["demo", "--steps", "4", "--tables", "5", "--max-rows", "300", "--batch-size", "16", "--serve"]


def test_serving_prints_latency_throughput_and_checks_answers(capsys):
    assert main(SHORT) == 0
    out = capsys.readouterr().out
    assert "result: sharded == unsharded" in out  # the fp32 model it packages was exact first
    assert "loaded in a fresh process, 128 requests answered 32 per batch" in out  # 2 ranks x 4 x 16
    line = next(line for line in out.splitlines() if "requests/s" in line)
    p50, p90, p99 = (float(x) for x in re.findall(r"p\d\d ([\d.]+) ms", line))
    assert 0 < p50 <= p90 <= p99, line
    assert float(re.search(r"([\d,]+) requests/s", line).group(1).replace(",", "")) > 0
    fp32 = re.search(r"trained fp32 model: predicted CTR max abs difference ([\d.e+-]+)", out)
    assert fp32 is not None and float(fp32.group(1)) <= demo_serve.CTR_TOLERANCE
    assert "before packaging: 0.0e+00" in out  # the package changes nothing
    assert "FAILED" not in out and "result: served answers == trained model" in out


def test_a_served_answer_off_the_fp32_model_fails_the_check(monkeypatch, capsys):
    from shardkit.cli.demo_dlrm import demo_tables, make_model

    tables = demo_tables(2, 50)
    model = make_model(tables, seed=0)  # untrained: int8 still moves its answers a little
    monkeypatch.setattr(demo_serve, "CTR_TOLERANCE", 0.0)
    args = argparse.Namespace(batch_size=8, steps=1, nproc=1, seed=0)
    assert demo_serve.run(model, tables, args) is False
    out = capsys.readouterr().out
    assert "(tolerance 0) FAILED" in out and "before packaging: 0.0e+00 (tolerance 1e-06) ok" in out


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert demo_serve.percentile(values, 50) == 50.0
    assert demo_serve.percentile(values, 99) == 99.0
    assert demo_serve.percentile([3.0], 99) == 3.0


def test_serve_on_cuda_or_gnn_is_refused(capsys):
    import pytest

    for extra in (["--device", "cuda"], ["--model", "gnn"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["demo", "--serve", *extra])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--serve serves on CPU only; drop --device cuda" in err
    assert "--serve is for --model dlrm" in err

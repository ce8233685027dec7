import json
import textwrap

import pytest

from shardkit.cli import bench
from shardkit.cli.main import main

# a benchmark script in the shape of benchmarks/common.py, without torch, so that it runs instantly
FAKE = textwrap.dedent(
    """
    import argparse, json, pathlib, sys
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--size", type=int, default=1000)
    args = p.parse_args()
    if args.size < 0:
        sys.exit(3)
    rows = [
        {{"name": "naive", "ms": 2.0 * args.size}},
        {{"name": "shardkit", "ms": 1.0 * args.size, "speedup": 2.0}},
    ]
    print("table of {name}, size", args.size)
    pathlib.Path(args.out, "{name}.json").write_text(
        json.dumps({{"benchmark": "{name}", "config": {{"size": args.size}}, "rows": rows}})
    )
    """
)


@pytest.fixture
def fake_benchmarks(tmp_path, monkeypatch):
    """A benchmarks/ directory with two fake scripts, and quick sizes for them."""
    root = tmp_path / "benchmarks"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "common.py").write_text("")
    for name in ("alpha", "beta"):
        (root / f"{name}.py").write_text(FAKE.format(name=name))
    monkeypatch.setitem(bench.QUICK_ARGS, "alpha", ["--size", "3"])
    monkeypatch.setitem(bench.QUICK_ARGS, "beta", ["--size", "5"])
    return root


def test_list_names_the_scripts_but_not_common(fake_benchmarks, capsys):
    assert main(["bench", "--dir", str(fake_benchmarks), "--list"]) == 0
    assert capsys.readouterr().out.split() == ["alpha", "beta"]


def test_all_quick_runs_every_benchmark_with_its_quick_sizes(fake_benchmarks, tmp_path, capfd):
    out_dir = tmp_path / "out"
    assert main(["bench", "all", "--quick", "--dir", str(fake_benchmarks), "--out", str(out_dir)]) == 0
    printed = capfd.readouterr().out
    assert "table of alpha, size 3" in printed and "table of beta, size 5" in printed
    beta = json.loads((out_dir / "beta.json").read_text())
    assert beta["config"] == {"size": 5} and [r["name"] for r in beta["rows"]] == ["naive", "shardkit"]


def test_without_quick_the_scripts_run_with_their_defaults(fake_benchmarks, tmp_path, capfd):
    assert main(["bench", "alpha", "--dir", str(fake_benchmarks), "--out", str(tmp_path / "out")]) == 0
    assert "table of alpha, size 1000" in capfd.readouterr().out


def test_a_failing_benchmark_fails_the_command_but_not_the_others(
    fake_benchmarks, tmp_path, capfd, monkeypatch
):
    monkeypatch.setitem(bench.QUICK_ARGS, "alpha", ["--size", "-1"])
    assert main(["bench", "--quick", "--dir", str(fake_benchmarks), "--out", str(tmp_path / "out")]) == 1
    captured = capfd.readouterr()
    assert "alpha: FAILED (exit code 3)" in captured.out and "table of beta" in captured.out
    assert "1 of 2 failed: alpha" in captured.err


def test_unknown_names_and_missing_quick_sizes_are_one_line_errors(fake_benchmarks, capsys, monkeypatch):
    assert main(["bench", "gamma", "--dir", str(fake_benchmarks)]) == 2
    assert "unknown benchmark 'gamma'; known: alpha, beta, all" in capsys.readouterr().err
    monkeypatch.delitem(bench.QUICK_ARGS, "beta")
    assert main(["bench", "beta", "--quick", "--dir", str(fake_benchmarks)]) == 2
    assert "no --quick sizes for beta" in capsys.readouterr().err


def test_chart_is_a_png_next_to_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "x.json"
    rows = [{"name": "a", "ms": 1.0, "kind": "text", "rows": 10}, {"name": "b", "ms": 2.0, "speedup": 2.0}]
    path.write_text(json.dumps({"benchmark": "x", "config": {}, "rows": rows}))
    png = bench.chart(path)
    assert png == tmp_path / "x.png" and png.read_bytes().startswith(b"\x89PNG")


def test_every_benchmark_of_the_checkout_has_quick_sizes():
    assert set(bench.available(bench.default_dir())) <= set(bench.QUICK_ARGS)


def test_a_real_benchmark_runs_quick(tmp_path, capfd):
    assert main(["bench", "planner", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "planner.json").read_text())
    assert result["benchmark"] == "planner" and result["rows"][0]["name"] == "10 tables / 8 ranks"


def test_the_gpu_losses_benchmark_runs_its_cpu_smoke_shapes(tmp_path):
    from benchmarks import gpu_losses

    gpu_losses.main(["--smoke-on-cpu", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "gpu_losses.json").read_text())["rows"]
    assert {(r["kind"], r["impl"]) for r in rows} == {
        (kind, impl) for kind in ("ce", "linear_ce") for impl in ("torch", "shardkit")
    }
    # fp32 on the CPU: shardkit's loss is torch's to rounding
    assert all(r["loss_diff"] < 1e-4 for r in rows if r["dtype"] == "fp32")


def test_without_out_results_go_to_a_new_directory_outside_the_checkout(
    fake_benchmarks, tmp_path, monkeypatch, capfd
):
    # issue 23: `bench all --quick` on a CPU machine replaced the committed benchmarks/results/gpu.json
    monkeypatch.delenv("SHARDKIT_BENCH_OUT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["bench", "alpha", "--quick", "--dir", str(fake_benchmarks)]) == 0
    assert main(["bench", "alpha", "--quick", "--dir", str(fake_benchmarks)]) == 0
    assert not (fake_benchmarks / "results").exists()
    runs = sorted((tmp_path / "cache" / "shardkit" / "bench").iterdir())
    assert len(runs) == 2 and all((run / "alpha.json").is_file() for run in runs)  # one new dir per run
    assert f"results go to {runs[0]}" in capfd.readouterr().out


def test_the_default_output_is_never_the_committed_results(monkeypatch):
    monkeypatch.delenv("SHARDKIT_BENCH_OUT", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    checkout = bench.default_dir().parent.resolve()
    out = bench.default_out_dir().resolve()
    assert checkout not in out.parents and out != checkout
    from benchmarks import common

    assert common.RESULTS_DIR.resolve() not in out.parents
    monkeypatch.setenv("SHARDKIT_BENCH_OUT", "/some/chosen/dir")
    assert bench.default_out_dir() == bench.Path("/some/chosen/dir")


def test_a_missing_torchrec_is_explained_with_the_packages_to_install(tmp_path, capsys, monkeypatch):
    from benchmarks import vs_torchrec

    monkeypatch.delenv("SHARDKIT_TORCHREC_PYTHON", raising=False)  # no re-run under a peer's Python
    message = vs_torchrec.missing_peer_message(["torchrec", "fbgemm_gpu"])
    for package in ("torchrec==1.8.0", "fbgemm-gpu==1.8.0", "fbgemm-gpu-cpu==1.8.0", "pip install"):
        assert package in message
    assert "shared/peers" not in message and "setup.sh" not in message
    if vs_torchrec.missing_peers():  # this environment has no torchrec: main says so and measures nothing
        vs_torchrec.main(["--out", str(tmp_path)])
        assert "torchrec==1.8.0" in capsys.readouterr().out
        assert json.loads((tmp_path / "vs_torchrec.json").read_text())["rows"] == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only path")
def test_the_gpu_losses_benchmark_without_cuda_writes_an_empty_result(tmp_path):
    # `shardkit bench all --quick` on a CPU machine reported gpu_losses FAILED (it wrote no JSON)
    from benchmarks import gpu_losses

    gpu_losses.main(["--out", str(tmp_path), "--tokens", "8", "--vocab", "16", "--dtypes", "fp32"])
    result = json.loads((tmp_path / "gpu_losses.json").read_text())
    assert result["rows"] == [] and result["config"]["skipped"] == "no CUDA device"

"""The run-as-torchrec mode (shardkit.cli.torchrec_mode): ``shardkit run --as-torchrec`` makes
``import torchrec`` / ``import fbgemm_gpu`` resolve to shardkit in the script and in the Python processes
it starts, says so in one line on stderr, and nothing is aliased when the user did not ask."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from shardkit.cli.torchrec_mode import BOOT_DIR, ENV_VAR, NOTICE, AliasFinder, mode_environment, target_name

# what a script sees: written as JSON to argv[1]; the children report the same from their side
REPORT = textwrap.dedent(
    """
    import json, multiprocessing, subprocess, sys

    def probe():
        import importlib
        found = {}
        for name in ("torchrec", "torchrec.distributed.embeddingbag", "fbgemm_gpu.split_embedding_configs"):
            try:
                found[name] = importlib.import_module(name).__name__
            except ModuleNotFoundError as err:
                found[name] = "missing: " + str(err)
        import torch
        found["torch.ops.fbgemm"] = torch._C._dispatch_has_kernel("fbgemm::jagged_2d_to_dense")
        return found

    def child(queue):
        queue.put(probe())

    if __name__ == "__main__":
        report = {"script": probe()}
        if report["script"]["torchrec"] == "shardkit":
            import shardkit.distributed.embeddingbag as sk_ebc
            import shardkit.modules
            import torchrec.distributed.embeddingbag as trec_ebc
            from fbgemm_gpu.split_embedding_configs import EmbOptimType
            from torchrec import EmbeddingBagCollection
            from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
            report["same_objects"] = [
                trec_ebc is sk_ebc,
                EmbeddingBagCollectionSharder is sk_ebc.EmbeddingBagCollectionSharder,
                EmbeddingBagCollection is shardkit.modules.EmbeddingBagCollection,
                EmbOptimType.EXACT_ROWWISE_ADAGRAD is shardkit.modules.OptimType.ROWWISE_ADAGRAD,
            ]
            report["spec_names"] = [sk_ebc.__spec__.name, sys.modules["shardkit"].__spec__.name]
        code = "import json, sys; sys.path.insert(0, sys.argv[1]); import script; "
        code += "print(json.dumps(script.probe()))"
        command = [sys.executable, "-c", code, sys.path[0]]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        report["subprocess"] = json.loads(out.stdout)
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        process = context.Process(target=child, args=(queue,))
        process.start()
        report["spawned"] = queue.get(timeout=120)
        process.join()
        with open(sys.argv[1 + sys.argv.index("--out")], "w") as f:
            json.dump(report, f)
    """
)


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p != BOOT_DIR
    )
    return env


def _run(tmp_path, *options):
    script = tmp_path / "script.py"
    script.write_text(REPORT)
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "shardkit.cli.main", "run", *options, str(script), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stderr


def test_as_torchrec_aliases_torchrec_and_fbgemm_in_the_script_and_the_processes_it_starts(tmp_path):
    report, stderr = _run(tmp_path, "--as-torchrec")
    assert [line for line in stderr.splitlines() if "run-as-torchrec" in line] == [NOTICE]
    for where in ("script", "subprocess", "spawned"):
        assert report[where] == {
            "torchrec": "shardkit",
            "torchrec.distributed.embeddingbag": "shardkit.distributed.embeddingbag",
            "fbgemm_gpu.split_embedding_configs": "shardkit.fbgemm_gpu.split_embedding_configs",
            "torch.ops.fbgemm": True,
        }, where
    assert report["same_objects"] == [True, True, True, True]
    # the shared modules keep their own specs
    assert report["spec_names"] == ["shardkit.distributed.embeddingbag", "shardkit"]


def test_without_as_torchrec_nothing_is_aliased(tmp_path):
    report, stderr = _run(tmp_path)
    assert "run-as-torchrec" not in stderr
    for where in ("script", "subprocess", "spawned"):
        probe = report[where]
        assert probe["torchrec"] != "shardkit" and probe["torch.ops.fbgemm"] is False, where
        assert not probe["fbgemm_gpu.split_embedding_configs"].startswith("shardkit"), where


def test_importing_shardkit_and_its_cli_switches_nothing_on():
    import shardkit.cli.main
    import shardkit.cli.run  # noqa: F401
    import shardkit.fbgemm_gpu.ops  # noqa: F401
    import shardkit.fbgemm_gpu.split_table_batched_embeddings_ops_common  # noqa: F401

    shardkit.cli.main.build_parser()
    assert not any(isinstance(f, AliasFinder) for f in sys.meta_path)
    spec = importlib.util.find_spec("torchrec")  # None here; a real torchrec if one is installed
    assert spec is None or "shardkit" not in str(spec.origin)


def _python(env_extra: dict, code: str, tmp_path) -> subprocess.CompletedProcess:
    shadowed = tmp_path / "other"
    shadowed.mkdir(exist_ok=True)
    (shadowed / "sitecustomize.py").write_text("print('the shadowed sitecustomize ran')\n")
    env = _clean_env()
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, str(shadowed)])
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_the_boot_directory_acts_only_with_the_variable_and_runs_the_sitecustomize_it_shadows(tmp_path):
    code = "import importlib.util; print(importlib.util.find_spec('torchrec') is not None)"
    off = _python({}, code, tmp_path)
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines() == ["the shadowed sitecustomize ran", "False"]
    on = _python({ENV_VAR: "1"}, "import torchrec; print(torchrec.__name__)", tmp_path)
    assert on.returncode == 0, on.stderr
    assert on.stdout.splitlines() == ["the shadowed sitecustomize ran", "shardkit"]
    other_value = _python({ENV_VAR: "yes"}, code, tmp_path)
    assert other_value.stdout.splitlines()[-1] == "False"


def test_a_torchrec_module_shardkit_lacks_is_an_error_naming_it(tmp_path):
    done = _python({ENV_VAR: "1"}, "import torchrec.metrics", tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ModuleNotFoundError: No module named 'torchrec.metrics': shardkit has no shardkit.metrics"
    )
    assert "docs/names.md" in last


def test_target_names_and_mode_environment():
    assert target_name("torchrec") == "shardkit"
    assert target_name("torchrec.distributed.types") == "shardkit.distributed.types"
    assert target_name("fbgemm_gpu.split_embedding_configs") == "shardkit.fbgemm_gpu.split_embedding_configs"
    assert target_name("torchrecx") is None and target_name("torch") is None
    env = mode_environment({"PYTHONPATH": f"/a{os.pathsep}{BOOT_DIR}", "X": "1"})
    assert env == {"PYTHONPATH": f"{BOOT_DIR}{os.pathsep}/a", "X": "1", ENV_VAR: "1"}


def test_run_returns_the_scripts_exit_code_and_rejects_bad_input(tmp_path, capsys):
    from shardkit.cli.main import main

    script = tmp_path / "exit3.py"
    script.write_text("import sys; sys.exit(3)\n")
    assert main(["run", str(script)]) == 3
    with pytest.raises(SystemExit) as stop:
        main(["run", str(tmp_path / "missing.py")])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"shardkit run: error: no such script: {tmp_path / 'missing.py'}\n"


def test_dev_passes_as_torchrec_through(tmp_path):
    """``./dev run --as-torchrec`` is ``shardkit run --as-torchrec`` (./dev hands other commands over)."""
    from tests.docs.markdown_blocks import DEV

    script = tmp_path / "script.py"
    script.write_text(
        "import torchrec, torch\nprint(torchrec.__name__, torch.ops.fbgemm.jagged_2d_to_dense)\n"
    )
    done = subprocess.run(
        [str(DEV), "run", "--as-torchrec", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("shardkit fbgemm.jagged_2d_to_dense")
    assert NOTICE in done.stderr

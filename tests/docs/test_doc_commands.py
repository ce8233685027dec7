"""Every shell command of README.md and docs/examples.md, run as written from the checkout's root.

A command runs with ``bash -c`` in the checkout (a block's commands in order, two blocks at a time),
and must exit with code 0 without torch's "terminate called" abort; where a command's output has a
verdict line (``--check``, the demo's result), the verdict is checked too. The few commands that cannot
run here are listed in ``NOT_RUN`` with the reason; the list is checked against the docs so that it
cannot go stale.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.docs.markdown_blocks import ROOT, shell_commands
from tests.docs.paired_runs import PairedRuns, selected_params

PAGES = [ROOT / "README.md", ROOT / "docs" / "examples.md"]

NOT_RUN = {
    "./dev test": "the test suite itself, of which this test is a part (.ci/run runs it)",
    "pip install torch --index-url https://download.pytorch.org/whl/cu124": "downloads a CUDA torch "
    "into the current environment",
    'pip install -e ".[yaml]"': "installs into the current environment (the editable install that "
    "./dev makes is the same command with [dev])",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py": (
        "needs two machines with 8 GPUs each"
    ),
    "./dev bench all --quick": "runs every benchmark (1.5 min); tests/cli/test_bench.py runs the command "
    "on stand-in scripts and one real benchmark quick",
}

# A line the output must contain, for commands whose output says whether the result is right.
VERDICTS = {
    "./dev demo": "result: sharded == unsharded",
    "./dev demo --model gnn": "result: sharded == unsharded",
    "./dev launch -n 2 examples/tp_lm_head.py --steps 20 --check": "max abs difference of the loss curve",
    "./dev launch -n 2 examples/gnn_graph_parallel.py --steps 20 --check": "max abs difference vs graph",
    "./dev plan examples/configs/recsys_tables.yaml": "imbalance",
    "./dev launch -n 2 examples/dlrm_criteo.py --data /tmp/criteo.tsv --steps 200": "samples/s",
}

COMMANDS = [(block, command) for page in PAGES for block, command in shell_commands(page)]


def test_the_commands_are_found_and_every_command_not_run_is_in_the_docs():
    found = [command for _, command in COMMANDS]
    assert "./dev demo" in found and len(found) >= 10
    assert set(NOT_RUN) <= set(found), set(NOT_RUN) - set(found)
    assert set(VERDICTS) <= set(found), set(VERDICTS) - set(found)


def _params():
    # in document order: a command may need the file an earlier one wrote (dlrm_criteo --generate)
    return [
        pytest.param(command, id=f"{block.where} {command}")
        for block, command in COMMANDS
        if command not in NOT_RUN
    ]


def _run_in_order(commands: tuple[str, ...]) -> dict[str, subprocess.CompletedProcess]:
    """One block's commands, one after the other (a command may need what an earlier one of its block
    wrote, as a reader runs them)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))
    }
    return {
        command: subprocess.run(
            ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        for command in commands
    }


@pytest.fixture(scope="module")
def runs(request):
    """The selected commands of each block run in order; the blocks are independent: two at a time
    (tests/docs/paired_runs.py). ``runs[command]`` waits for its block's run."""
    block_of = {command: block.where for block, command in COMMANDS}
    by_block: dict[str, list[str]] = {}
    for command in selected_params(request, "command"):
        by_block.setdefault(block_of[command], []).append(command)
    group_of = {command: tuple(group) for group in by_block.values() for command in group}
    paired = PairedRuns(list(dict.fromkeys(group_of.values())), _run_in_order)
    yield lambda command: paired.result(group_of[command])[command]
    paired.close()


@pytest.mark.parametrize("command", _params())
def test_command_runs_as_written(runs, command):
    done = runs(command)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{output[-4000:]}"
    assert "terminate called" not in output, output[-4000:]
    if command in VERDICTS:
        lines = [line for line in output.splitlines() if VERDICTS[command] in line]
        assert lines, output[-4000:]
        if "--check" in command:
            assert lines[-1].rstrip().endswith("ok"), lines[-1]

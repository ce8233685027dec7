"""Every Python block of README.md and docs/**/*.md, saved as a file and run the way the docs say.

A block is a whole program. One whose first line is a ranks marker
(``# run on N ranks: ./dev launch -n N snippet.py``) runs under ``./dev launch -n N``; any other runs with
``./dev python``. Both from an empty directory, so a block cannot lean on files of the checkout or on
another block. The run must exit with code 0 and must not end in torch's "terminate called" abort.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.docs.markdown_blocks import DEV, python_block_names
from tests.docs.paired_runs import PairedRuns, selected_params

# Blocks that do not run yet (page#n: the page's n-th Python block), each with the reason; strict: once
# a block runs, its entry must go.
NOT_YET_RUNNABLE: dict = {}

BLOCKS = python_block_names()


def _marks(name):
    reason = NOT_YET_RUNNABLE.get(name)
    return [pytest.mark.xfail(reason=reason, strict=True)] if reason else []


def test_every_python_block_is_found_and_the_exceptions_exist():
    names = {name for name, _ in BLOCKS}
    assert len(BLOCKS) >= 15
    assert set(NOT_YET_RUNNABLE) <= names, set(NOT_YET_RUNNABLE) - names


# the blocks are independent programs, each in its own directory: two run at a time (paired_runs.py)


def _run_block(block) -> tuple[list[str], subprocess.CompletedProcess]:
    with tempfile.TemporaryDirectory(prefix="doc-block-") as tmp:
        script = Path(tmp) / "snippet.py"
        script.write_text(block.text)
        ranks = block.ranks()
        command = (
            [str(DEV), "python", script.name]
            if ranks is None
            else [str(DEV), "launch", "-n", str(ranks), script.name]
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))
        }
        return command, subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def runs(request):
    paired = PairedRuns(selected_params(request, "block"), _run_block)
    yield paired
    paired.close()


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=f"{name} (line {b.line})", marks=_marks(name)) for name, b in BLOCKS]
)
def test_python_block_runs_as_written(runs, block):
    command, done = runs.result(block)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{block.where}: {' '.join(command[1:])} exited {done.returncode}\n{output}"
    assert "terminate called" not in output, output

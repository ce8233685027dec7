"""docs/running.md's rules for a clean exit, and the cause it names, checked on 2 ranks under ./dev launch.

A process group that is alive when the interpreter finalizes can abort it ("terminate called without
an active exception"); whether it does is timing. What is deterministic is whether the group's gloo
threads are still running after ``destroy_process_group``: these tests look at the thread names of the
process (``/proc/self/task``) right after it, under plain torchrun (a user's own environment) and
under ``./dev launch``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.docs.markdown_blocks import DEV

SCRIPT = r"""
import os, sys
import torch.distributed as dist
if sys.argv[1] != "after":
    from shardkit.planner import calibrate
dist.init_process_group("gloo")
if sys.argv[1] == "after":
    from shardkit.planner import calibrate
if sys.argv[1] == "global":
    pg = dist.group.WORLD
calibrate("cpu", rows=1024, batch=64, pooling=2, repeats=1)
dist.destroy_process_group()
threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
# one write call per rank: the ranks share torchrun's stdout, and print() may split a line
count = sum("gloo" in t for t in threads)
os.write(1, f"rank {os.environ['RANK']} gloo threads after destroy: {count}\n".encode())
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _gloo_threads_after_destroy(tmp_path, order: str, launcher: str = "torchrun") -> list[str]:
    script = tmp_path / "exit.py"
    script.write_text(SCRIPT)
    # plain torchrun, as in a user's own environment; or ./dev launch, which pre-imports for the script
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        if launcher == "torchrun"
        else [str(DEV), "launch", "-n", "2"]
    )
    done = subprocess.run(
        [*launch, script.name, order], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    lines = sorted(line for line in done.stdout.splitlines() if "gloo threads after destroy" in line)
    assert len(lines) == 2, done.stdout + done.stderr
    return [line.split(":")[-1].strip() for line in lines]


def test_shardkit_imported_before_init_leaves_no_gloo_thread_after_destroy(tmp_path):
    assert _gloo_threads_after_destroy(tmp_path, "before") == ["0", "0"]


def test_shardkit_imported_after_init_keeps_the_group_alive(tmp_path):
    # the cause docs/running.md names (torch 2.13): if this fails, torch no longer keeps the group
    # alive, and the page's explanation and rule 1 should be revisited
    counts = _gloo_threads_after_destroy(tmp_path, "after")
    assert all(int(c) > 0 for c in counts), counts


def test_dev_launch_imports_for_the_script_so_a_late_import_leaks_nothing(tmp_path):
    assert _gloo_threads_after_destroy(tmp_path, "after", launcher="dev") == ["0", "0"]


def test_a_module_level_reference_keeps_the_group_alive(tmp_path):
    # the reason for rule 2's "when nothing refers to the group any more"
    counts = _gloo_threads_after_destroy(tmp_path, "global")
    assert all(int(c) > 0 for c in counts), counts

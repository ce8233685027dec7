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
import tempfile
from pathlib import Path

import pytest

from tests.docs.markdown_blocks import DEV
from tests.docs.paired_runs import PairedRuns, selected_params

SCRIPT = r"""
import atexit, gc, os, sys
import torch.distributed as dist


def report(when):
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    # one write call per rank: the ranks share torchrun's stdout, and print() may split a line
    count = sum("gloo" in t for t in threads)
    os.write(1, f"rank {os.environ['RANK']} gloo threads {when}: {count}\n".encode())


# registered before shardkit is imported, so it runs after shardkit's exit handler (atexit is LIFO)
atexit.register(report, "at exit")
if sys.argv[1] != "after":
    from shardkit.planner import calibrate
dist.init_process_group("gloo")
if sys.argv[1] == "after":
    from shardkit.planner import calibrate
if sys.argv[1] == "global":
    pg = dist.group.WORLD


def work():
    # calibrate's timed steps on tables of at most 1 MiB instead of 64, in 2 rounds instead of 25: the
    # same sharded modules, collectives and clean-up (what keeps or frees the group), in a fraction of
    # the time
    import functools

    import shardkit.planner.calibration_steps as steps

    steps.BIG_BYTES = 1 << 20
    steps.alternating_seconds = functools.partial(steps.alternating_seconds, rounds=2)
    if sys.argv[1] == "cycle":  # the group held by garbage that only the cycle collector frees
        gc.disable()
        holder = {"group": dist.group.WORLD}
        holder["self"] = holder
    calibrate("cpu", rows=1024, batch=64, pooling=2, repeats=1)


work()
dist.destroy_process_group()
report("after destroy")
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


# the five 2-rank jobs are independent: two run at a time (tests/docs/paired_runs.py). Each test names its
# job as a parameter, so that the module's fixture queues the jobs of the selected tests only.


def _job(order: str, launcher: str):
    return pytest.mark.parametrize("case", [(order, launcher)], ids=[f"{order}-{launcher}"])


def _run(case: tuple[str, str]) -> subprocess.CompletedProcess:
    order, launcher = case
    with tempfile.TemporaryDirectory(prefix="clean-exit-") as tmp:
        (Path(tmp) / "exit.py").write_text(SCRIPT)
        # plain torchrun, as in a user's own environment; or ./dev launch, which pre-imports for the script
        launch = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            if launcher == "torchrun"
            else [str(DEV), "launch", "-n", "2"]
        )
        return subprocess.run(
            [*launch, "exit.py", order], cwd=tmp, capture_output=True, text=True, timeout=180
        )


@pytest.fixture(scope="module")
def runs(request):
    paired = PairedRuns(selected_params(request, "case"), _run)
    yield paired
    paired.close()


def _gloo_threads(runs: PairedRuns, case: tuple[str, str]) -> dict[str, list[str]]:
    """Per rank, the gloo threads running right after ``destroy_process_group`` and at exit."""
    done = runs.result(case)
    counts = {}
    for when in ("after destroy", "at exit"):
        lines = sorted(line for line in done.stdout.splitlines() if f"gloo threads {when}" in line)
        assert len(lines) == 2, done.stdout + done.stderr
        counts[when] = [line.split(":")[-1].strip() for line in lines]
    return counts


def _gloo_threads_after_destroy(runs: PairedRuns, case: tuple[str, str]) -> list[str]:
    return _gloo_threads(runs, case)["after destroy"]


@_job("before", "torchrun")
def test_shardkit_imported_before_init_leaves_no_gloo_thread_after_destroy(runs, case):
    assert _gloo_threads_after_destroy(runs, case) == ["0", "0"]


@_job("after", "torchrun")
def test_shardkit_imported_after_init_keeps_the_group_alive(runs, case):
    # the cause docs/running.md names (torch 2.13): if this fails, torch no longer keeps the group
    # alive, and the page's explanation and rule 1 should be revisited
    counts = _gloo_threads_after_destroy(runs, case)
    assert all(int(c) > 0 for c in counts), counts


@_job("after", "dev")
def test_dev_launch_imports_for_the_script_so_a_late_import_leaks_nothing(runs, case):
    assert _gloo_threads_after_destroy(runs, case) == ["0", "0"]


@_job("global", "torchrun")
def test_a_module_level_reference_keeps_the_group_alive(runs, case):
    # the reason for rule 2's "when nothing refers to the group any more"
    counts = _gloo_threads_after_destroy(runs, case)
    assert all(int(c) > 0 for c in counts), counts


@_job("cycle", "torchrun")
def test_a_group_held_by_a_reference_cycle_is_freed_before_finalization(runs, case):
    counts = _gloo_threads(runs, case)
    # destroy_process_group cannot free it (the cycle refers to it); shardkit's exit handler can
    assert all(int(c) > 0 for c in counts["after destroy"]), counts
    assert counts["at exit"] == ["0", "0"], counts

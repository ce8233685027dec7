import os
import time

import pytest
import torch
import torch.distributed as dist

from shardkit.testing import WorldError, run_world, worker_pool
from tests.testing import _patchable


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the other ranks wait for rank 1, which never comes
    return "unreachable"


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return os.getpid()


def _env_view():
    return {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "EXTRA")}


def _pid():
    return os.getpid()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_per_rank(world_size):
    results = run_world(_rank_and_sum, world_size)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, total) for r in range(world_size)]


def test_failing_rank_reports_rank_and_traceback():
    with pytest.raises(WorldError) as info:
        run_world(_fail_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "--- rank 1 ---" in message
    assert "ValueError: boom on purpose" in message
    assert "_fail_on_rank_one" in message


def test_hanging_rank_times_out_and_is_killed():
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(_hang_on_rank_zero, 2, timeout=5)
    assert time.monotonic() - start < 30
    assert "--- rank 0 ---" in str(info.value)
    assert "did not finish within the 5 s timeout" in str(info.value)
    # where it hung: the stacks its worker wrote shortly before it was killed
    rank_zero = str(info.value).split("--- rank 1 ---")[0]
    assert "its threads' stacks shortly before the timeout" in rank_zero
    assert "_hang_on_rank_zero" in rank_zero
    # the pool replaced the killed worker and still works
    assert run_world(_rank_and_sum, 2)[0] == (0, 2, 3.0)


def test_a_tasks_timeout_does_not_count_its_workers_start():
    # fresh workers spend seconds importing torch (~9 s here on a loaded machine): a task's timeout
    # is its own time, so a short task with a short timeout passes on workers that were just started
    worker_pool().shutdown_workers()
    start = time.monotonic()
    assert run_world(_rank_and_sum, 2, timeout=3)[1] == (1, 2, 3.0)
    assert worker_pool().pids  # the workers are started and kept for the next task
    print(f"2 fresh workers plus the task: {time.monotonic() - start:.1f} s")


def test_killed_worker_leaves_no_process():
    pids = run_world(_pid, 2)
    with pytest.raises(WorldError):
        run_world(_hang_on_rank_zero, 2, timeout=3)
    assert not set(pids) & set(worker_pool().pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_are_reused_between_tasks():
    first = run_world(_pid, 2)
    second = run_world(_pid, 2)
    assert first == second
    assert len(set(first)) == 2


def _shardkit_test_marker():
    return os.environ.get("SHARDKIT_TEST_MARKER")


def test_new_workers_get_the_environment_as_it_is_when_they_start(monkeypatch):
    # workers are forked from a fork server started long before (with the environment of then): a
    # new worker must still see the harness process's environment as it is when the worker starts
    run_world(_pid, 2)  # the fork server is up
    monkeypatch.setenv("SHARDKIT_TEST_MARKER", "set after the fork server started")
    worker_pool().shutdown_workers()
    assert run_world(_shardkit_test_marker, 2) == ["set after the fork server started"] * 2
    monkeypatch.delenv("SHARDKIT_TEST_MARKER")
    worker_pool().shutdown_workers()
    assert run_world(_shardkit_test_marker, 2) == [None, None]


def test_environment_simulates_nodes_and_is_restored():
    views = run_world(_env_view, 4, local_world_size=2, env={"EXTRA": "x"})
    assert [v["LOCAL_RANK"] for v in views] == ["0", "1", "0", "1"]
    assert [v["GROUP_RANK"] for v in views] == ["0", "0", "1", "1"]
    assert all(v["LOCAL_WORLD_SIZE"] == "2" and v["EXTRA"] == "x" for v in views)
    assert run_world(_env_view, 2)[0]["EXTRA"] is None


def test_unpicklable_function_is_a_clear_error():
    with pytest.raises(TypeError, match="module-level function"):
        run_world(lambda: None, 2)


def test_process_group_set_up_failure_is_retried_then_reported(monkeypatch, capfd):
    from shardkit.testing import harness

    monkeypatch.setattr(harness, "INIT_RETRIES", 1)
    with pytest.raises(WorldError) as info:
        run_world(_pid, 2, backend="no-such-backend", timeout=60)
    assert "process group set-up failed" in str(info.value)
    assert "no-such-backend" in str(info.value)
    assert capfd.readouterr().err.count("retrying") == 1
    assert len(run_world(_pid, 2)) == 2  # the pool recovered


_GLOO_CONNECT_FAILURE = (
    "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:26293"
)


def _sub_group_connection_fails_once(marker):
    # what gloo raises, rarely, when a test's new_group cannot connect its local processes
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError(_GLOO_CONNECT_FAILURE)
    dist.barrier()
    return dist.get_rank()


def test_a_sub_group_connection_failure_is_retried(tmp_path, capfd):
    assert run_world(_sub_group_connection_fails_once, 2, str(tmp_path / "failed-once")) == [0, 1]
    assert capfd.readouterr().err.count("retrying") == 1


def _connection_failure_beside_a_real_failure():
    if dist.get_rank() == 0:
        raise ValueError("a real failure on rank 0")
    raise RuntimeError(_GLOO_CONNECT_FAILURE)


def test_a_connection_failure_beside_a_real_failure_is_not_retried(capfd):
    with pytest.raises(WorldError, match="a real failure on rank 0"):
        run_world(_connection_failure_beside_a_real_failure, 2)
    assert "retrying" not in capfd.readouterr().err


def _import_checkpoint_after_init():
    # torch keeps the default group alive after destroy_process_group when torch.distributed.checkpoint
    # is first imported after init_process_group; its gloo threads then abort a finalizing interpreter
    import torch.distributed.checkpoint  # noqa: F401

    return dist.get_rank()


def test_workers_exit_with_code_0_after_a_task_that_leaks_its_process_group():
    import subprocess
    import sys

    # a fresh interpreter, so that torch.distributed.checkpoint is not imported yet in its workers
    code = (
        "from shardkit.testing.harness import WorkerPool\n"
        "from tests.testing.test_harness import _import_checkpoint_after_init as fn\n"
        "pool = WorkerPool()\n"
        "kw = dict(timeout=60, backend='gloo', local_world_size=None, env=None)\n"
        "assert pool.run(fn, 2, (), {}, **kw) == [0, 1]\n"
        "processes = [w.process for w in pool._workers]\n"
        "pool.shutdown()\n"
        "print([p.exitcode for p in processes])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 0]", done.stdout + done.stderr
    assert "terminate called" not in done.stderr


@pytest.mark.parametrize("parent_check", [True, False], ids=["in the parent", "in the workers"])
def test_a_script_without_main_guard_gets_a_one_line_error(tmp_path, parent_check):
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    # the parent spots the unguarded call in the script's source; the workers, which import the script,
    # catch what the parent could not see (here: the parent's check switched off)
    switch_off = "" if parent_check else "harness._called_from_unguarded_main_code = lambda depth: False\n"
    script.write_text(
        "import torch.distributed as dist\n"
        "from shardkit.testing import harness, run_world\n"
        f"{switch_off}\n\n"
        "def rank():\n    return dist.get_rank()\n\n\n"
        "def main():\n    print(run_world(rank, 2))\n\n\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith('RuntimeError: run_world needs an `if __name__ == "__main__":` guard'), last
    assert "bootstrapping" not in done.stderr and "WorldError" not in done.stderr


def test_a_guarded_script_runs(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "guarded.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from shardkit.testing import run_world\n\n\n"
        "def rank():\n    return dist.get_rank()\n\n\n"
        'if __name__ == "__main__":\n    print(run_world(rank, 2))\n'
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1]"


def _dead_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not reaped (yet)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_workers_exit_when_the_harness_process_is_killed(tmp_path):
    # a worker stuck in a task never reads its pipe again: it must notice by itself that the process
    # that started it is gone (a forked worker's parent is the fork server, not that process)
    import subprocess
    import sys

    script = tmp_path / "killed.py"
    script.write_text(
        "import os, time\n"
        "from shardkit.testing import run_world\n\n\n"
        "def pid():\n    return os.getpid()\n\n\n"
        "def hang():\n    time.sleep(600)\n\n\n"
        'if __name__ == "__main__":\n'
        "    print(*run_world(pid, 2), flush=True)\n"
        "    run_world(hang, 2, timeout=600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(word) for word in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # not read to its end: workers that outlive the script would hold it open
    assert len(pids) == 2
    deadline = time.monotonic() + 60
    while not all(map(_dead_or_zombie, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in pids if not _dead_or_zombie(pid)]
    for pid in alive:
        os.kill(pid, 9)  # do not leave them behind
    assert not alive, f"workers {alive} outlived the process that started them"


def _arrive_late_on_rank_1(delay_s: float) -> float:
    # runs while the task is unpickled, before the rank joins the rendezvous: like a worker that is
    # still importing torch or the test module on a loaded machine
    if os.environ.get("RANK") == "1":
        time.sleep(delay_s)
    return delay_s


class _LateOnRank1:
    """An argument whose unpickling delays rank 1's arrival at the process group's set-up."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __reduce__(self):
        return (_arrive_late_on_rank_1, (self.delay_s,))


def _group_timeout_and_sum(_late) -> tuple:
    from shardkit.distributed.timeouts import process_group_timeout

    t = torch.ones(1)
    dist.all_reduce(t)
    return process_group_timeout().total_seconds(), t.item()


def test_a_short_shardkit_timeout_bounds_the_collectives_not_a_late_ranks_arrival():
    # issue 23 (flaky tests): SHARDKIT_TIMEOUT=2 also bounded the rendezvous, so a worker arriving
    # 2 s late on a loaded machine failed the set-up of tests that stall a rank on purpose
    late = _LateOnRank1(4.0)
    results = run_world(_group_timeout_and_sum, 2, late, timeout=60, env={"SHARDKIT_TIMEOUT": "1"})
    assert results == [(1.0, 2.0), (1.0, 2.0)]


def _patch_the_module_and_build_its_state():
    # as a test's worker function patches the code under test; nothing restores it here
    _patchable.measure = lambda: "patched"
    _patchable.BIG_BYTES = 64
    # lazily built state that a later task must keep (reloading a native library would fail)
    _patchable._LIBRARY = "loaded"
    _patchable._loaded = True
    return _patchable.state()


def _module_state():
    return _patchable.state()


def test_a_tasks_patches_do_not_leak_into_the_next_task_on_the_same_workers():
    # the hang of tests/planner/test_collective_plan.py[3] after test_calibration_steps.py: the 2-rank
    # task patched calibrate's bandwidth measurement in workers 0 and 1, so in the next 3-rank task those
    # skipped its all-to-all while the new worker 2 ran it (different collectives: a hang)
    assert run_world(_patch_the_module_and_build_its_state, 2) == [("patched", 64, "loaded", True)] * 2
    after = run_world(_module_state, 3)
    assert [state[:2] for state in after] == [("real", 1 << 20)] * 3
    # the reused workers 0 and 1 keep what was built lazily (the new worker 2 has not built it)
    assert [state[2:] for state in after] == [("loaded", True), ("loaded", True), (None, False)]

"""Entry point of a harness worker process: runs one rank of one task at a time, forever.

Kept free of imports from the rest of shardkit so that a worker starts as fast as ``import torch``.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker stuck in a collective never reads its pipe again, so EOF alone cannot end it when the
    # parent dies; poll the parent pid instead.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _reset_shardkit_state() -> None:
    # Module-level state (graph-parallel groups, cached node groups) refers to the process group that
    # is about to be destroyed; reset it so the next task on this worker starts clean.
    state = sys.modules.get("shardkit.distributed.state")
    if state is not None:
        state.reset_all()


def _group_timeout_s(task: dict) -> float:
    # SHARDKIT_TIMEOUT (seconds) bounds each collective; the task's timeout bounds the whole task
    raw = task["env"].get("SHARDKIT_TIMEOUT") or os.environ.get("SHARDKIT_TIMEOUT")
    if not raw:
        return task["timeout"]
    from shardkit.distributed.timeouts import parse_timeout

    return parse_timeout(raw, "SHARDKIT_TIMEOUT")


def _raise_naming_silent_ranks(err: Exception) -> None:
    # imported on the error path only: a worker starts as fast as ``import torch``
    from shardkit.distributed.timeouts import naming_silent_ranks

    with naming_silent_ranks():
        raise err


def _run_task(task: dict) -> tuple:
    # every thread's stack goes to the task's stacks file at ``stacks_at`` (wall clock, set by the parent
    # shortly before it would kill a hanging worker; a worker that started late gets there sooner), so
    # that the test's error shows where it hung
    stacks = open(task["stacks_path"], "w") if task.get("stacks_path") else None
    if stacks is not None:
        faulthandler.dump_traceback_later(max(0.1, task["stacks_at"] - time.time()), file=stacks)
    try:
        return _run_task_body(task)
    finally:
        if stacks is not None:
            faulthandler.cancel_dump_traceback_later()
            stacks.close()


def _run_task_body(task: dict) -> tuple:
    import torch.distributed as dist

    saved_env = {k: os.environ.get(k) for k in task["env"]}
    for key, value in task["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    for entry in reversed(task["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    rank = task["rank"]
    try:
        fn, args, kwargs = pickle.loads(task["payload"])
        try:
            dist.init_process_group(
                task["backend"],
                store=dist.FileStore(task["store_path"], task["world_size"]),
                rank=rank,
                world_size=task["world_size"],
                # The rendezvous and the opening barrier wait for the slowest rank to *arrive* (a worker
                # just started imports torch, unpickling the task imports the test module): seconds
                # apart on a loaded machine. They get the task's timeout; SHARDKIT_TIMEOUT, meant for
                # the collectives of ``fn``, is applied once every rank is in (a 2 s SHARDKIT_TIMEOUT
                # used to fail the set-up itself when one worker started late: issue 23, flaky tests).
                timeout=timedelta(seconds=task["timeout"]),
            )
        except Exception:  # noqa: BLE001 - reported apart: the parent may retry the task
            return ("init-error", rank, traceback.format_exc())
        # gloo may finish init on one rank while a peer is still connecting to it: a rank that ran a
        # collective-free fn and tore its group down at once would break the peer's connection.
        # Barriers on both sides keep every rank's group alive until all ranks are done with it.
        dist.barrier()
        group_timeout_s = _group_timeout_s(task)
        if group_timeout_s != task["timeout"]:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=group_timeout_s))
        try:
            result = fn(*args, **kwargs)
        except Exception as err:
            _raise_naming_silent_ranks(err)
        dist.barrier()
        reply = ("ok", rank, pickle.dumps(result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        reply = ("error", rank, traceback.format_exc())
    finally:
        try:
            _reset_shardkit_state()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return reply


def worker_main(conn, parent_pid: int) -> None:
    """Serve tasks from ``conn`` until it closes or a ``None`` task arrives, then exit at once.

    The exit skips the interpreter's finalization (``os._exit``): a process group that torch keeps
    alive after ``destroy_process_group`` (it does when a task first imported
    ``torch.distributed.checkpoint`` after ``init_process_group``) has gloo threads that abort a
    finalizing interpreter with "terminate called without an active exception".
    """
    code = 1
    try:
        _serve(conn, parent_pid)
        code = 0
    except BaseException:  # noqa: BLE001 - printed here because os._exit below skips Python's report
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(conn, parent_pid: int) -> None:
    import torch

    # ranks share 2 cores; intra-op threads per rank only add contention
    torch.set_num_threads(1)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        task = pickle.loads(data)
        if task is None:
            return
        try:
            conn.send_bytes(pickle.dumps(_run_task(task)))
        except Exception:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send_bytes(pickle.dumps(("error", task["rank"], traceback.format_exc())))

"""Entry point of a harness worker process: runs one rank of one task at a time, forever.

Kept free of imports from the rest of shardkit so that a worker starts as fast as ``import torch``.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import operator
import os
import pickle
import sys
import threading
import time
import traceback
import types
from datetime import timedelta
from typing import Any, Callable


def _exit_when_orphaned() -> None:
    # A worker stuck in a collective never reads its pipe again, so EOF alone cannot end it when the
    # harness's process dies; wait on multiprocessing's sentinel of that process instead (a pipe it
    # holds open). Not the parent pid: a forked worker's parent is the fork server, which lives on
    # while its children hold its "alive" pipe.
    multiprocessing.parent_process().join()
    os._exit(1)


def _reset_shardkit_state() -> None:
    # Module-level state (graph-parallel groups, cached node groups) refers to the process group that
    # is about to be destroyed; reset it so the next task on this worker starts clean.
    state = sys.modules.get("shardkit.distributed.state")
    if state is not None:
        state.reset_all()


# seconds a failed task's ranks wait in the roll call that names the silent ranks; the parent gives
# the other ranks more than this once one has failed (harness.FAILURE_GRACE_S)
ROLL_CALL_GRACE_S = 5.0

# torch modules whose collectives tests wrap (to count or fail them) besides shardkit's and the test's own
_PATCHED_TORCH_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
_CONSTANT_TYPES = (bool, int, float, str, bytes)


def _restorable(name: str, value: Any) -> bool:
    """Whether a module attribute is one that a task patches: a function or class (the code under test,
    replaced by a fake) or an UPPER_CASE scalar constant (lowered for speed, a switch turned on).

    Lazily built state (a loaded native library, a registered op, an executor, a cached group: lower
    case, or None until built) is not: it must live as long as the worker (re-registering would fail).
    """
    if name.startswith("__"):
        return False
    if isinstance(value, (types.FunctionType, type)):
        return True
    return isinstance(value, _CONSTANT_TYPES) and name.lstrip("_").isupper()


def _module_snapshot(fn: Callable) -> list:
    """Every attribute of shardkit's modules, of the modules of ``fn``'s top-level package (the test's),
    and of torch.distributed, as (module, copy of its namespace), taken before a task runs ``fn``.

    Workers are reused: a test function that patches such an attribute (``calibration.measure_... =
    fake``) would otherwise leave the patch in the workers it ran on, and a later task on more ranks
    would run the patched code on the reused workers and the real code on the new ones (different
    collectives: a hang). A module first imported inside ``fn`` is not covered.
    """
    packages = {"shardkit", str(getattr(fn, "__module__", None) or "shardkit").partition(".")[0]}
    return [
        (module, dict(vars(module)))
        for name, module in list(sys.modules.items())
        if module is not None and (name.partition(".")[0] in packages or name in _PATCHED_TORCH_MODULES)
    ]


def _undo_patches(snapshot: list) -> None:
    """Restore the patchable attributes (``_restorable``) that the task rebound or deleted."""
    for module, saved in snapshot:
        now = vars(module)
        # the usual case, untouched (rebinding keeps a name's place in the dict): at C speed
        if len(now) == len(saved) and all(map(operator.is_, now.values(), saved.values())):
            continue
        for name, value in saved.items():
            if now.get(name, _undo_patches) is not value and _restorable(name, value):
                setattr(module, name, value)


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

    # leaving: a rank that fails on its own is marked so in the store before it destroys its group,
    # so the ranks that its closed connections cut off raise their own error at once instead of
    # waiting out a roll call for it (and naming it silent); ROLL_CALL_GRACE_S < FAILURE_GRACE_S of
    # the harness, so that a rank in a roll call reports before it would be killed
    with naming_silent_ranks(grace_s=ROLL_CALL_GRACE_S, leaving=True):
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
    snapshot: list = []
    try:
        fn, args, kwargs = pickle.loads(task["payload"])
        snapshot = _module_snapshot(fn)
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
            # the closing barrier too: a rank that waits here for a silent one, or is cut off here by a
            # peer that timed out in fn (gloo closes its connections), names the silent rank
            dist.barrier()
        except Exception as err:
            _raise_naming_silent_ranks(err)
        reply = ("ok", rank, pickle.dumps(result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        reply = ("error", rank, traceback.format_exc())
    finally:
        try:
            _undo_patches(snapshot)
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


def worker_main(conn, environ: dict) -> None:
    """Serve tasks from ``conn`` until it closes or a ``None`` task arrives, then exit at once.

    ``environ`` is the harness process's environment when it started this worker (a worker forked
    by the fork server inherits the server's, which may be older).

    The exit skips the interpreter's finalization (``os._exit``): a process group that torch keeps
    alive after ``destroy_process_group`` (it does when a task first imported
    ``torch.distributed.checkpoint`` after ``init_process_group``) has gloo threads that abort a
    finalizing interpreter with "terminate called without an active exception".
    """
    os.environ.clear()
    os.environ.update(environ)
    code = 1
    try:
        _serve(conn)
        code = 0
    except BaseException:  # noqa: BLE001 - printed here because os._exit below skips Python's report
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(conn) -> None:
    import torch  # already imported in a worker forked by the fork server (harness.FORKSERVER_PRELOAD)

    # ranks share 2 cores; intra-op threads per rank only add contention
    torch.set_num_threads(1)
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    # the parent starts a task's clock only now: booting (torch's import) is not the task's time
    conn.send_bytes(pickle.dumps(("ready", None, None)))
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

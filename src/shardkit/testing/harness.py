"""Run a function on N local CPU ranks (gloo) in reusable worker processes.

Starting Python with torch costs seconds on a small machine, so workers are forked from a fork server
that has imported torch once (``FORKSERVER_PRELOAD``), and reused: each task initializes a fresh
process group (new FileStore), runs the function, undoes the function's patches of module functions
and constants (``_worker._undo_patches``), resets shardkit's module-level state and destroys the
group. A task that fails recycles its workers; a task that outlives its timeout has its workers
killed, so a hanging collective fails the test instead of the suite, and no process outlives the
parent.
"""

from __future__ import annotations

import ast
import atexit
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping, Optional

from shardkit.testing._worker import ROLL_CALL_GRACE_S, worker_main

DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDKIT_TEST_TIMEOUT", "120"))
# After one rank fails, how long the others get to finish before they are killed. They usually fail
# fast (the failed rank closes its connections), but a rank cut off by a peer's timeout first holds a
# roll call (ROLL_CALL_GRACE_S) to name the silent rank, and may start it seconds after the first
# failure (the first failed rank's own roll call, of the test's grace, ended before it closed its
# connections): it must report, not be killed in it.
FAILURE_GRACE_S = ROLL_CALL_GRACE_S + 5.0


# How long new workers get to start (spawn, import torch) before the pool gives up on them. A task's
# timeout starts once its workers are up, so a task on freshly started workers on a loaded machine
# is not failed for the time its workers spent importing torch.
BOOT_TIMEOUT_S = 300.0

# How often a task whose process group could not be set up is run again (see WorkerPool.run).
INIT_RETRIES = 2
_INIT_ERROR = "process group set-up failed:\n"
# What gloo raises when the connections of a group (the default one or a sub-group made by the test
# with new_group) could not be set up between local processes: the machine, not the code under test.
_GLOO_CONNECT_ERROR = "Gloo connectFullMesh failed"
_KILLED_AFTER_FAILURE = "did not finish after another rank failed"
_TIMED_OUT = "did not finish within the"
# the fraction of a task's timeout after which its workers write every thread's stack (faulthandler):
# before the parent kills a worker that hangs, so that the test's error shows where it hung
STACKS_AT_FRACTION = 0.9
# gloo's words for a connection its peer closed ("Read error ...: Connection reset by peer" too)
_PEER_CLOSED = ("Connection closed by peer", "Connection reset by peer")
# Exit code of a worker that found run_world called while it imported the user's script (no
# ``if __name__ == "__main__":`` guard); the parent turns it into one line instead of N tracebacks.
NO_MAIN_GUARD_EXIT = 87
NO_MAIN_GUARD_MESSAGE = (
    'run_world needs an `if __name__ == "__main__":` guard around the code of your script that calls '
    "it: its worker processes are started with spawn and import the script (docs/testing.md)"
)


def _stacks_of(path: str) -> str:
    """The stacks a timed-out worker wrote (at ``STACKS_AT_FRACTION`` of its timeout), or ""."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"its threads' stacks shortly before the timeout:\n{text}\n" if text else ""


def _connection_set_up_failures(errors: Mapping[int, str]) -> list[int]:
    """The ranks whose group connections could not be set up, when that is all that went wrong.

    A task is only worth running again when every other rank that failed did so as a consequence:
    killed after the failure, or cut off by the failed rank's closed connections. A rank that failed
    for any other reason is a real failure, and the task is reported as it is.
    """
    set_up = [r for r, body in errors.items() if body.startswith(_INIT_ERROR) or _GLOO_CONNECT_ERROR in body]
    consequences = [
        r
        for r, body in errors.items()
        if r not in set_up
        and (body.startswith(_KILLED_AFTER_FAILURE) or any(w in body for w in _PEER_CLOSED))
    ]
    return set_up if len(set_up) + len(consequences) == len(errors) else []


class WorldError(AssertionError):
    """One or more ranks failed or hung; the message has each rank's traceback or state."""


# modules the fork server imports once, so that a new worker forked from it starts in milliseconds
# instead of importing torch itself (seconds of one core: the suite starts dozens of workers)
FORKSERVER_PRELOAD = ["torch", "torch.distributed"]


def _worker_context():
    """multiprocessing's ``forkserver`` context with torch preloaded, or ``spawn`` where the platform has
    no fork server. A forked worker starts from a process that has only imported torch (never used it:
    no CUDA, no thread pools), and either kind imports the main script (``if __name__ == "__main__":``)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # process-wide: the fork server is one per process, started on its first use
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child_conn = ctx.Pipe()
        # the parent's environment as it is now: a forked worker would otherwise have the fork
        # server's, as it was when the server started
        args = (child_conn, dict(os.environ))
        self.process = ctx.Process(target=worker_main, args=args, daemon=True)
        self.process.start()
        child_conn.close()
        self.booted = False  # set once the worker reports that it is ready for tasks

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        self.process.join(timeout=5)
        self.kill()


class WorkerPool:
    """Worker processes reused across tasks; a task on N ranks uses the first N workers."""

    def __init__(self) -> None:
        self._ctx = _worker_context()
        self._workers: list[_Worker] = []
        self._tmpdir = tempfile.mkdtemp(prefix="shardkit-world-")
        self._task_counter = 0

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def _ensure(self, n: int) -> None:
        self._workers = [w for w in self._workers if w.process.is_alive()] + []
        while len(self._workers) < n:
            self._workers.append(_Worker(self._ctx))
        self._wait_booted(self._workers[:n])

    def _wait_booted(self, workers: list) -> None:
        """Wait until every worker in ``workers`` has started; raise if one dies or never starts."""
        starting = {w.conn: w for w in workers if not w.booted}
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while starting:
            ready = wait(list(starting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.shutdown_workers()
                raise RuntimeError(
                    f"run_world: {len(starting)} worker process(es) did not start within "
                    f"{BOOT_TIMEOUT_S:.0f} s (spawn + import torch)"
                )
            for conn in ready:
                worker = starting.pop(conn)
                try:
                    worker.booted = pickle.loads(conn.recv_bytes())[0] == "ready"
                except (EOFError, OSError):
                    worker.process.join(timeout=5)  # the exit code is known once the process is reaped
                    code = worker.process.exitcode
                    self.shutdown_workers()  # new workers would fail the same way
                    if code == NO_MAIN_GUARD_EXIT:
                        raise RuntimeError(NO_MAIN_GUARD_MESSAGE) from None
                    raise RuntimeError(
                        f"run_world: a worker process died while starting (exit code {code}); "
                        "its output above says why"
                    ) from None

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = _Worker(self._ctx)

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple,
        kwargs: Mapping[str, Any],
        *,
        timeout: float,
        backend: str,
        local_world_size: Optional[int],
        env: Optional[Mapping[str, Optional[str]]],
    ) -> list[Any]:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        local = local_world_size or world_size
        if world_size % local != 0:
            raise ValueError(f"local_world_size {local} does not divide world_size {world_size}")
        try:
            payload = pickle.dumps((fn, tuple(args), dict(kwargs)))
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(
                f"run_world needs a module-level function and picklable arguments: {err}"
            ) from err
        for attempt in range(1 + INIT_RETRIES):
            results, errors = self._run_once(world_size, payload, timeout, backend, local, env)
            if errors:
                for rank in range(world_size):
                    self._replace(rank)  # a failed task may leave a worker in any state
            set_up_failed = _connection_set_up_failures(errors)
            if not set_up_failed or attempt == INIT_RETRIES:
                break
            # Rarely, gloo's connection set-up between local processes fails ("Connection closed
            # by peer"), at init or in a new_group: that is the machine, not the test, so run it again.
            print(f"run_world: group set-up failed on ranks {set_up_failed}; retrying", file=sys.stderr)
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise WorldError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
        return [results[r] for r in range(world_size)]

    def _run_once(
        self,
        world_size: int,
        payload: bytes,
        timeout: float,
        backend: str,
        local: int,
        env: Optional[Mapping[str, Optional[str]]],
    ) -> tuple[dict, dict]:
        self._ensure(world_size)
        self._task_counter += 1
        store_path = os.path.join(self._tmpdir, f"store-{self._task_counter}")
        for rank in range(world_size):
            task_env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % local),
                "LOCAL_WORLD_SIZE": str(local),
                "GROUP_RANK": str(rank // local),
                "GROUP_WORLD_SIZE": str(world_size // local),
                **(env or {}),
            }
            task = {
                "rank": rank,
                "world_size": world_size,
                "backend": backend,
                "timeout": timeout,
                "store_path": store_path,
                "env": task_env,
                "sys_path": list(sys.path),
                "payload": payload,
                "stacks_path": self._stacks_path(rank),
                "stacks_at": time.time() + STACKS_AT_FRACTION * timeout,
            }
            self._workers[rank].conn.send_bytes(pickle.dumps(task))
        try:
            results, errors = self._collect(world_size, timeout)
            for rank, body in errors.items():
                if body.startswith((_TIMED_OUT, _KILLED_AFTER_FAILURE)):
                    errors[rank] = body + _stacks_of(self._stacks_path(rank))
            return results, errors
        finally:
            for path in [store_path] + [self._stacks_path(rank) for rank in range(world_size)]:
                try:
                    os.remove(path)
                except OSError:
                    pass

    def _stacks_path(self, rank: int) -> str:
        """Where the worker of ``rank`` writes its threads' stacks when its task nears its timeout."""
        return os.path.join(self._tmpdir, f"stacks-{self._task_counter}-{rank}")

    def _collect(self, world_size: int, timeout: float) -> tuple[dict, dict]:
        conns = {self._workers[r].conn: r for r in range(world_size)}
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error = 0.0
        while conns:
            limit = deadline if not errors else min(deadline, first_error + FAILURE_GRACE_S)
            ready = wait(list(conns), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = conns.pop(conn)
                try:
                    status, _, body = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    process = self._workers[rank].process
                    process.join(timeout=5)  # the exit code is known once the process is reaped
                    code = process.exitcode
                    status, body = "error", f"worker process died (exit code {code})\n"
                if status == "ok":
                    results[rank] = pickle.loads(body)
                else:
                    if status == "init-error":
                        body = _INIT_ERROR + body
                    if not errors:
                        first_error = time.monotonic()
                    errors[rank] = body
        for rank in conns.values():
            late = f"{_TIMED_OUT} {timeout:.0f} s timeout"
            why = _KILLED_AFTER_FAILURE if len(errors) else late
            errors[rank] = f"{why}; worker killed\n"
        return results, errors

    def shutdown_workers(self) -> None:
        """Kill every worker (the pool starts new ones when it is used again)."""
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def shutdown(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []
        shutil.rmtree(self._tmpdir, ignore_errors=True)


_POOL: Optional[WorkerPool] = None


def worker_pool() -> WorkerPool:
    """The process-wide pool (created on first use, shut down at exit)."""
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool()
        atexit.register(shutdown_workers)
    return _POOL


def shutdown_workers() -> None:
    """Stop all harness workers (idempotent)."""
    global _POOL
    if _POOL is not None:
        _POOL.shutdown()
        _POOL = None


def _called_from_unguarded_main_code(depth: int) -> bool:
    """True when the caller ``depth`` frames up is the main script's top-level code outside an
    ``if __name__ == "__main__":`` block (spawned workers import the script and would run it again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return False  # python -c, an interactive session, a notebook: nothing is re-imported
    frame = sys._getframe(depth + 1)
    # the script's own top-level frame, from which run_world (or a function that calls it) was called
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return False
    try:
        with open(path) as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if node.lineno <= frame.f_lineno <= (node.end_lineno or node.lineno):
            return not (isinstance(node, ast.If) and "__name__" in ast.unparse(node.test))
    return False


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    local_world_size: Optional[int] = None,
    env: Optional[Mapping[str, Optional[str]]] = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return the per-rank results.

    Each rank runs in a worker process with the default process group initialized (``backend``,
    default gloo) and torchrun's environment variables set (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK, ...; ``local_world_size`` simulates several nodes on one machine). ``env`` adds or
    (with None) removes variables for this task only. ``fn`` must be a module-level function; results
    must be picklable.

    Raises ``WorldError`` naming every failed rank with its traceback, or the ranks that did not
    finish within ``timeout`` seconds (those workers are killed). Raises ``RuntimeError`` (one line)
    when called from a script without an ``if __name__ == "__main__":`` guard.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # This process is a spawned worker importing the user's main module, which calls run_world
        # at import time: starting processes from here would fail with a page of bootstrapping
        # errors on every worker. Leave quietly with a code the parent recognizes.
        os._exit(NO_MAIN_GUARD_EXIT)
    if _called_from_unguarded_main_code(1):
        raise RuntimeError(NO_MAIN_GUARD_MESSAGE)  # before starting workers that would fail anyway
    return worker_pool().run(
        fn,
        world_size,
        args,
        kwargs,
        timeout=timeout,
        backend=backend,
        local_world_size=local_world_size,
        env=env,
    )

"""What the ranks of a sweep row wait on: per rank, wall vs CPU time and the time blocked in collectives.

``PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.step_waits --rows 21 41`` (rows of
:mod:`benchmarks.vs_torchrec_sweep`, 1-based; both libraries, alternated, same forced plan, weights and
batches as the sweep). Without torchrec here it re-runs under ``$SHARDKIT_TORCHREC_PYTHON``, like the
sweep. For each row, library and rank (the round of ``--steps`` steps with the least wall time, of
``--rounds``), per step in ms:

- ``wall``: the step's wall time; ``main_cpu``: the main thread's CPU time (``time.thread_time``: user
  + system, page faults included); ``proc_cpu``: the whole process's (gloo's threads too, where a
  CPU all-to-all copies the bytes and the kernel moves them through loopback TCP);
- ``colls`` / ``MB``: all-to-alls started (and other collectives), bytes sent including each rank's own
  chunk; ``blocked``: main-thread wall time spent in ``Work.wait()`` (or a blocking collective) minus
  its CPU there, i.e. waiting for the transfer or the peer; ``waits``: ``MB:ms`` of each collective of
  a step in order, its bytes sent and its blocked ms averaged over the round's steps;
- ``rest = wall - main_cpu - blocked``: time the main thread was runnable but not running (other load
  on the machine) or blocked outside collectives.

How: ``ProcessGroup.all_to_all_single`` (shardkit calls the group's method directly) and
``torch.distributed``'s other collective functions are wrapped (torch's ``all_to_all_single``, which
torchrec calls, ends in the group's method), for this script's processes only,
so that their works record the time spent in ``wait()``. With the shared-memory exchange on (the
default; ``SHARDKIT_SHM_EXCHANGE=0`` turns it off) shardkit's all-to-alls go through shared memory,
not the group's method, and are not counted (0 collectives).
``--transport`` also times, on the same two
ranks, gloo's ``all_to_all_single`` against a ``copy_`` of the same bytes (what a same-host
shared-memory exchange would at least cost) at the row's pooled-output size.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.common import write_results
from benchmarks.vs_torchrec import _batches, _full_tables, handled_without_peers, prepare
from benchmarks.vs_torchrec_sweep import grid, label

LIBS = ("torchrec", "shardkit")
_STATS: Dict[str, Any] = {}


def _reset() -> None:
    _STATS.update(colls=0, bytes=0, wall=0.0, cpu=0.0, waits=[])


class _TimedWork(dist.Work):
    """A collective's work whose ``wait()`` adds its wall and thread-CPU time to ``_STATS``."""

    def __init__(self, work: dist.Work, nbytes: int) -> None:
        super().__init__()  # a dist.Work: torchrec checks isinstance before waiting
        self._work, self._bytes = work, nbytes

    def wait(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        done = self._work.wait(*args, **kwargs)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        _STATS["wall"] += wall
        _STATS["cpu"] += cpu
        _STATS["waits"].append((self._bytes, wall - cpu))
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()


def _blocking(fn, nbytes: int, *args, **kwargs):
    _STATS["colls"] += 1
    _STATS["bytes"] += nbytes
    if kwargs.get("async_op"):
        return _TimedWork(fn(*args, **kwargs), nbytes)
    wall, cpu = time.perf_counter(), time.thread_time()
    done = fn(*args, **kwargs)
    _STATS["wall"] += time.perf_counter() - wall
    _STATS["cpu"] += time.thread_time() - cpu
    return done


def _counted(fn):
    def timed_collective(*args, **kwargs):
        return _blocking(fn, 0, *args, **kwargs)

    return timed_collective


_ORIGINALS: Dict[Any, Dict[str, Any]] = {}
_OTHERS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")


def install_timers() -> None:
    """Wrap the collectives both libraries start, in this process until :func:`uninstall_timers`."""
    if _ORIGINALS:
        _reset()
        return
    method = dist.ProcessGroup.all_to_all_single
    # the class's own entry (pybind's instancemethod) is what goes back: the attribute read above is
    # a plain builtin that a group would no longer be bound to (its calls would lose ``self``)
    _ORIGINALS[dist.ProcessGroup] = {"all_to_all_single": vars(dist.ProcessGroup)["all_to_all_single"]}
    _ORIGINALS[dist] = {name: getattr(dist, name) for name in _OTHERS}

    def group_all_to_all(group, output, input, output_splits, input_splits, opts):
        nbytes = input.numel() * input.element_size()
        _STATS["colls"] += 1
        _STATS["bytes"] += nbytes
        return _TimedWork(method(group, output, input, output_splits, input_splits, opts), nbytes)

    dist.ProcessGroup.all_to_all_single = group_all_to_all
    # torch's all_to_all_single ends in the group's method (wrapped above, its sync wait included); the
    # others do not: counted, their bytes not
    for name in _OTHERS:
        setattr(dist, name, _counted(getattr(dist, name)))
    _reset()


def uninstall_timers() -> None:
    """Put the collectives back as they were."""
    for owner, originals in _ORIGINALS.items():
        for name, original in originals.items():
            setattr(owner, name, original)
    _ORIGINALS.clear()
    _reset()


def summarize(wall: float, main_cpu: float, proc_cpu: float, steps: int) -> Dict[str, Any]:
    """One round's per-step figures (ms) from its totals (s) and ``_STATS``."""
    blocked = _STATS["wall"] - _STATS["cpu"]
    waits = _STATS["waits"]
    per_step = len(waits) // max(1, steps)
    # the i-th all-to-all of a step, averaged over the round's steps
    mean = [
        (waits[i][0], sum(w for _, w in waits[i::per_step]) / len(waits[i::per_step]))
        for i in range(per_step)
    ]
    return {
        "wall": 1e3 * wall / steps,
        "main_cpu": 1e3 * main_cpu / steps,
        "proc_cpu": 1e3 * proc_cpu / steps,
        "colls": _STATS["colls"] / steps,
        "MB": _STATS["bytes"] / steps / 1e6,
        "blocked": 1e3 * blocked / steps,
        "rest": 1e3 * (wall - main_cpu - blocked) / steps,
        "waits": [(b / 1e6, 1e3 * w) for b, w in mean],
    }


def transport(nbytes: int, repeats: int = 7) -> Dict[str, float]:
    """Best-of ms of gloo's all_to_all_single of ``nbytes`` per peer (2 ranks), and of a copy_ of them."""
    n = max(1, nbytes // 4)
    send, recv = torch.randn(2 * n), torch.empty(2 * n)
    best = {"gloo_a2a_ms": float("inf"), "copy_ms": float("inf")}
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.all_to_all_single(recv, send)
        best["gloo_a2a_ms"] = min(best["gloo_a2a_ms"], 1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        recv.copy_(send)
        best["copy_ms"] = min(best["copy_ms"], 1e3 * (time.perf_counter() - t))
    return best


def waits_worker(config: Dict[str, Any], steps: int, rounds: int, with_transport: bool) -> List[Any]:
    """Both libraries' steps on this rank, alternated; every rank's best round per library."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    install_timers()  # the worker processes are shut down after each row
    raw = _batches(config, dist.get_rank())
    tables = _full_tables(config)
    step_of = {lib: prepare(lib, config["kind"], config, tables, raw)[0] for lib in LIBS}
    del tables
    best: Dict[str, Dict[str, Any]] = {}
    for r in range(rounds):
        for lib in LIBS if r % 2 == 0 else LIBS[::-1]:
            for i in range(2):
                step_of[lib](i)
            dist.barrier()
            _reset()
            wall, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
            for i in range(steps):
                step_of[lib](i)
            got = summarize(
                time.perf_counter() - wall, time.thread_time() - cpu, time.process_time() - proc, steps
            )
            if lib not in best or got["wall"] < best[lib]["wall"]:
                best[lib] = got
    if with_transport:
        pooled = 4 * config["batch"] * config["tables"] * config["dim"] // dist.get_world_size()
        best["transport"] = {"bytes_per_peer": pooled, **transport(pooled)}
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, best)
    return gathered


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[21], help="sweep rows (1-based)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per library (alternated)")
    parser.add_argument("--transport", action="store_true", help="also gloo all-to-all vs copy_")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    parsed = parser.parse_args(argv)
    if parsed.steps < 1 or parsed.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {parsed.steps} and {parsed.rounds}")
    configs = grid()
    bad = [n for n in parsed.rows if not 1 <= n <= len(configs)]
    if bad:
        parser.error(f"--rows: no sweep row {bad} (rows are 1..{len(configs)})")
    if handled_without_peers("step_waits", argv, parsed.out):
        return
    from benchmarks.step_waits import waits_worker as worker  # workers unpickle it by module name
    from shardkit.testing import run_world, shutdown_workers

    rows = []
    for n in parsed.rows:
        config = configs[n - 1]
        try:
            ranks = run_world(worker, 2, config, parsed.steps, parsed.rounds, parsed.transport, timeout=900)[
                0
            ]
        finally:
            shutdown_workers()
        for lib in LIBS:
            for rank, per_rank in enumerate(ranks):
                got = per_rank[lib]
                waits = " ".join(f"{mb:.2f}:{ms:.1f}" for mb, ms in got.pop("waits"))
                rows.append(
                    {"row": n, "name": label(config), "lib": lib, "rank": rank, **got, "waits": waits}
                )
        if parsed.transport:
            for rank, per_rank in enumerate(ranks):
                rows.append(
                    {
                        "row": n,
                        "name": label(config),
                        "lib": "transport",
                        "rank": rank,
                        **per_rank["transport"],
                    }
                )
        sys.stdout.flush()
    write_results("step_waits", vars(parsed), rows, parsed.out)


if __name__ == "__main__":
    main()

"""Where a sweep row's training step spends rank 0's time, op by op, in shardkit and torchrec side by side.

``PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.step_profile --rows 26 31`` (rows of
:mod:`benchmarks.vs_torchrec_sweep`, 1-based; both libraries on the sweep's forced plan, weights and
batches; without torchrec here it re-runs under ``$SHARDKIT_TORCHREC_PYTHON``, like the sweep). Per row,
the two libraries' steps alternate for ``--rounds`` rounds of ``--steps`` steps under
``torch.profiler`` (CPU, every rank; shapes recorded); the printed table is one rank's (``--rank``):
for each op (or phase: ``phase:*`` are ``record_function`` ranges around the step's parts, inclusive)
its self time per step in ms and calls per step in each library, the ops sorted by the larger of the
two, then the profiled step's main-thread CPU ms. The profiler's times are wall time on the op's thread
(a loaded machine inflates them alike in both libraries, since the rounds alternate); the profiler adds
a few us per op, so a step with many small ops reads slower than it runs.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.common import write_results
from benchmarks.vs_torchrec import _batches, _full_tables, handled_without_peers, prepare
from benchmarks.vs_torchrec_sweep import grid, label

LIBS = ("torchrec", "shardkit")


def _phased_step(lib: str, kind: str, config: Dict[str, Any], tables, raw):
    """``prepare``'s step with a ``record_function`` range around each part (same work)."""
    step, _ = prepare(lib, kind, config, tables, raw)
    model, optimizer = _closure_objects(step)
    from torch.autograd.profiler import record_function

    features = _closure_value(step, "features")

    def phased(i: int) -> None:
        with record_function("phase:zero_grad"):
            optimizer.zero_grad()
        with record_function("phase:forward"):
            out = model(features[i % len(features)])
        with record_function("phase:wait"):
            out = out.wait() if hasattr(out, "wait") else out
        with record_function("phase:loss"):
            loss = out.values().pow(2).mean()
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer_step"):
            optimizer.step()

    return phased


def _closure_value(fn, name: str):
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def _closure_objects(fn):
    return _closure_value(fn, "model"), _closure_value(fn, "optimizer")


def profile_worker(config: Dict[str, Any], steps: int, rounds: int, shapes: bool = False) -> List[Any]:
    """Every rank's per-op self ms per step and calls per step, per library (all profiled rounds)."""
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    raw = _batches(config, dist.get_rank())
    tables = _full_tables(config)
    step_of = {lib: _phased_step(lib, config["kind"], config, tables, raw) for lib in LIBS}
    del tables
    for lib in LIBS:
        for i in range(2):
            step_of[lib](i)
    ops: Dict[str, Dict[str, List[float]]] = {lib: collections.defaultdict(lambda: [0.0, 0]) for lib in LIBS}
    cpu = {lib: 0.0 for lib in LIBS}
    for r in range(rounds):
        for lib in LIBS if r % 2 == 0 else LIBS[::-1]:
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                start = time.thread_time()
                for i in range(steps):
                    step_of[lib](i)
                cpu[lib] += time.thread_time() - start
            for event in prof.key_averages(group_by_input_shape=shapes):
                name = f"{event.key} {event.input_shapes}" if shapes and event.input_shapes else event.key
                entry = ops[lib][name]
                total = event.cpu_time_total if event.key.startswith("phase:") else event.self_cpu_time_total
                entry[0] += total / 1e3
                entry[1] += event.count
    n = steps * rounds
    result = {
        lib: {
            "cpu_ms": 1e3 * cpu[lib] / n,
            "ops": {k: (v[0] / n, v[1] / n) for k, v in ops[lib].items()},
        }
        for lib in LIBS
    }
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def perf_worker(
    config: Dict[str, Any], steps: int, rank: int, out_dir: str, event: str = "cpu-clock"
) -> List[Any]:
    """Each library's ``steps`` steps with ``perf record`` attached to rank ``rank`` (no torch.profiler):
    ``out_dir/perf-<lib>.data``; every rank's main-thread CPU ms per step."""
    import signal
    import subprocess

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    raw = _batches(config, dist.get_rank())
    tables = _full_tables(config)
    step_of = {lib: prepare(lib, config["kind"], config, tables, raw)[0] for lib in LIBS}
    del tables
    cpu = {}
    for lib in LIBS:
        for i in range(2):
            step_of[lib](i)
        recorder = None
        if dist.get_rank() == rank:
            target = os.path.join(out_dir, f"perf-{lib}.data")
            recorder = subprocess.Popen(
                ["perf", "record", "-q", "-e", event, *(["-F", "2000"] if event == "cpu-clock" else [])]
                + ["-g", "-p", str(os.getpid()), "-o", target],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)  # perf attaches
        dist.barrier()
        start = time.thread_time()
        for i in range(steps):
            step_of[lib](i)
        cpu[lib] = 1e3 * (time.thread_time() - start) / steps
        if recorder is not None:
            recorder.send_signal(signal.SIGINT)
            recorder.wait()
        dist.barrier()
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, cpu)
    return gathered


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[31], help="sweep rows (1-based)")
    parser.add_argument("--steps", type=int, default=4, help="profiled steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per library (alternated)")
    parser.add_argument("--rank", type=int, default=0, choices=(0, 1), help="the rank whose ops are printed")
    parser.add_argument("--top", type=int, default=30, help="ops printed per row")
    parser.add_argument("--shapes", action="store_true", help="one entry per op and input shapes")
    parser.add_argument(
        "--perf",
        metavar="DIR",
        help="instead: perf record rank --rank's steps (DIR/row<n>/perf-<lib>.data)",
    )
    parser.add_argument("--perf-event", default="cpu-clock", help="perf's event (e.g. page-faults)")
    parser.add_argument(
        "--dp-kernel",
        choices=["fused", "dense"],
        default="fused",
        help="shardkit's kernel in data_parallel rows (fused: the sweep's default)",
    )
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    parsed = parser.parse_args(argv)
    configs = grid()
    for config in configs:
        if config["kind"] == "data_parallel":  # the kernel the sweep runs (vs_torchrec's own default: dense)
            config["dp_kernel"] = parsed.dp_kernel
    if any(not 1 <= n <= len(configs) for n in parsed.rows):
        parser.error(f"--rows: sweep rows are 1..{len(configs)}")
    if handled_without_peers("step_profile", argv, parsed.out):
        return
    from benchmarks.step_profile import perf_worker, profile_worker  # workers unpickle them by module name
    from shardkit.testing import run_world, shutdown_workers

    if parsed.perf:
        for n in parsed.rows:
            row_dir = os.path.abspath(os.path.join(parsed.perf, f"row{n}"))
            os.makedirs(row_dir, exist_ok=True)
            try:
                cpu = run_world(
                    perf_worker,
                    2,
                    configs[n - 1],
                    parsed.steps * parsed.rounds,
                    parsed.rank,
                    row_dir,
                    parsed.perf_event,
                    timeout=900,
                )[0]
            finally:
                shutdown_workers()
            print(
                f"row {n}: main-thread CPU ms per step (under perf, rank {parsed.rank}): {cpu[parsed.rank]}"
            )
        return

    rows = []
    for n in parsed.rows:
        config = configs[n - 1]
        load = os.getloadavg()[0]
        try:
            ranks = run_world(
                profile_worker, 2, config, parsed.steps, parsed.rounds, parsed.shapes, timeout=900
            )[0]
        finally:
            shutdown_workers()
        got = ranks[parsed.rank]
        names = set(got["torchrec"]["ops"]) | set(got["shardkit"]["ops"])

        def ms(lib: str, name: str, got=got) -> tuple:
            return got[lib]["ops"].get(name, (0.0, 0.0))

        ordered = sorted(names, key=lambda k: -max(ms("torchrec", k)[0], ms("shardkit", k)[0]))
        print(
            f"row {n} {label(config)}, rank {parsed.rank}, load {load:.1f}: main-thread CPU ms per "
            f"profiled step: shardkit {got['shardkit']['cpu_ms']:.2f}, "
            f"torchrec {got['torchrec']['cpu_ms']:.2f}"
        )
        for name in ordered[: parsed.top]:
            (s_ms, s_calls), (t_ms, t_calls) = ms("shardkit", name), ms("torchrec", name)
            rows.append(
                {
                    "row": n,
                    "op": name[:110],
                    "shardkit_ms": round(s_ms, 3),
                    "shardkit_calls": round(s_calls, 1),
                    "torchrec_ms": round(t_ms, 3),
                    "torchrec_calls": round(t_calls, 1),
                }
            )
    write_results("step_profile", vars(parsed), rows, parsed.out)


if __name__ == "__main__":
    main()

"""The transport of one-host CPU ranks: gloo's all-to-all vs the shared-memory exchange, per size.

``PYTHONPATH=src:. python -m benchmarks.shm_transport`` (2 ranks). For each size per peer, best-of and
median ms of one all-to-all through gloo (the group's method, as shardkit calls it) and through
``SHARDKIT_SHM_EXCHANGE``'s exchange (whichever version the sources on the path have: run it with
another checkout's ``src`` first on the path to compare versions), alternated call by call in one
process, with a ``copy_`` of the same bytes as the physical floor; and, where the exchange has one,
its all-reduce (a DDP bucket's size) against gloo's. Also the process CPU time per call (gloo's
threads included), because wall time on a shared machine is noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

SIZES = [64, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]


def _time(fn, repeats: int) -> Dict[str, float]:
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {
        "best": 1e3 * min(walls),
        "median": 1e3 * statistics.median(walls),
        "cpu": 1e3 * statistics.median(cpus),
    }


def worker(sizes: List[int], repeats: int, reduce_bytes: int) -> List[Dict[str, Any]]:
    from shardkit.distributed import shm_exchange
    from shardkit.distributed.direct_collectives import all_to_all_single

    torch.set_num_threads(1)
    world, group = dist.get_world_size(), dist.group.WORLD
    rows = []
    for nbytes in sizes:
        send = torch.randint(0, 255, (world * nbytes,), dtype=torch.uint8)
        recv = torch.empty_like(send)
        splits = [nbytes] * world

        def gloo(recv=recv, send=send, splits=splits):
            all_to_all_single(recv, send, splits, splits, group, async_op=False)

        def shm(recv=recv, send=send, splits=splits):
            shm_exchange.set_shm_exchange(True)
            try:
                all_to_all_single(recv, send, splits, splits, group, async_op=False)
            finally:
                shm_exchange.set_shm_exchange(False)

        def copy(recv=recv, send=send):
            recv.copy_(send)

        for fn in (gloo, shm):  # warm: connections, files
            fn()
        got: Dict[str, List[Dict[str, float]]] = {"gloo": [], "shm": [], "copy": []}
        for r in range(repeats):  # alternated, one call each
            for name, fn in (("gloo", gloo), ("shm", shm), ("copy", copy))[:: 1 if r % 2 == 0 else -1]:
                got[name].append(_time(fn, 1))
        row: Dict[str, Any] = {"name": f"a2a {nbytes} B/peer", "bytes_per_peer": nbytes}
        for name, timings in got.items():
            row[f"{name}_ms"] = min(t["best"] for t in timings)
            row[f"{name}_med_ms"] = statistics.median(t["best"] for t in timings)
            row[f"{name}_cpu_ms"] = statistics.median(t["cpu"] for t in timings)
        row["gloo/shm_med"] = row["gloo_med_ms"] / max(row["shm_med_ms"], 1e-9)
        rows.append(row)
    shm_exchange.set_shm_exchange(True)
    exchange = shm_exchange.exchange_for(group)
    shm_exchange.set_shm_exchange(False)
    if reduce_bytes and exchange is not None and hasattr(exchange, "all_reduce_sum"):
        grad = torch.randn(reduce_bytes // 4)
        got = {"gloo": [], "shm": []}
        for r in range(repeats):
            for name in ("gloo", "shm")[:: 1 if r % 2 == 0 else -1]:
                if name == "gloo":
                    got[name].append(_time(lambda: dist.all_reduce(grad, group=group), 1))
                else:
                    got[name].append(_time(lambda: exchange.all_reduce_sum(grad).wait(), 1))
        row = {"name": f"all_reduce {reduce_bytes} B", "bytes_per_peer": reduce_bytes}
        for name, timings in got.items():
            row[f"{name}_ms"] = min(t["best"] for t in timings)
            row[f"{name}_med_ms"] = statistics.median(t["best"] for t in timings)
            row[f"{name}_cpu_ms"] = statistics.median(t["cpu"] for t in timings)
        row["gloo/shm_med"] = row["gloo_med_ms"] / max(row["shm_med_ms"], 1e-9)
        rows.append(row)
    shm_exchange.close_all()
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=SIZES, help="bytes per peer")
    parser.add_argument("--repeats", type=int, default=41, help="calls per size and transport")
    parser.add_argument("--reduce-bytes", type=int, default=100_000, help="all-reduce size (0: none)")
    parser.add_argument("--quick", action="store_true", help="two small sizes, 5 repeats")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    parsed = parser.parse_args(argv)
    if parsed.quick:
        parsed.sizes, parsed.repeats = [64, 64 << 10], 5
    if parsed.repeats < 1 or any(s < 1 for s in parsed.sizes):
        parser.error("--repeats and --sizes must be >= 1")
    from benchmarks.common import write_results
    from benchmarks.shm_transport import worker as run  # the workers unpickle it by module name
    from shardkit.testing import run_world, shutdown_workers

    try:
        rows = run_world(run, 2, parsed.sizes, parsed.repeats, parsed.reduce_bytes, timeout=900)[0]
    finally:
        shutdown_workers()
    write_results("shm_transport", vars(parsed), rows, parsed.out)


if __name__ == "__main__":
    main()

"""Host syncs, ops and host time per training step of a CUDA ``fused_uvm_caching`` table, by bookkeeping path.

Run on a CUDA machine: ``python -m benchmarks.offload_gpu_syncs [--quick]``. The same table, ids and
step as ``benchmarks.offload_gpu`` (zero-copy copies, the prefetch order), the cache's bookkeeping on
the host (``SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING=0``) and on the device (kernels/offload/device_slots.py),
the latter also with validation off (``SHARDKIT_VALIDATE=0``). Per row, after ``--warmup`` steps:

- ``syncs/step``: over ``--steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")``, the
  synchronizing calls torch reports (device-to-host copies, ``nonzero``, ``item``, ...), ``where``
  they come from; with ``--device cpu``, the calls that would sync on a GPU
  (``shardkit.testing.dispatch_counts``);
- ``host_ms/step``: the time the host takes to issue a step (no final synchronize), ``wall_ms/step``
  with it;
- ``ops/step`` / ``kernels/step``: the aten ops dispatched in a step (``kernels``: those that are not
  views, each a launch on a GPU), and ``acquire_kernels`` / ``release_kernels``: those inside the
  cache's ``acquire_ids`` / ``release`` (a step makes one of each), counted over ``--steps`` more steps
  (the counting slows the host down: not in the timed steps).

``--device cpu`` runs the same rows on CPU tensors (the device bookkeeping forced on a CPU cache, as the
tests run it): the op and sync counts of that path without a GPU, and a check that this script works.
Without CUDA and without ``--device cpu`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
import warnings
from typing import List, Optional

import torch

from benchmarks.common import write_results
from benchmarks.offload_gpu import _lookup, _Runner, _sync
from benchmarks.offload_steady import zipf_sampler
from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.testing.dispatch_counts import DispatchCounts

ROWS = (("host", True), ("device", True), ("device", False))  # (bookkeeping, validation)


def _counted(runner: _Runner, steps: int) -> dict:
    """Ops and kernels a step, and inside the cache's acquire_ids / release, over ``steps`` steps."""
    cache = runner.lookup.cache
    inside = {"acquire_ids": 0, "release": 0}
    with DispatchCounts() as counts:

        def wrap(name):
            method = getattr(cache, name)

            def counted(*args, **kwargs):
                before = counts.kernels
                try:
                    return method(*args, **kwargs)
                finally:
                    inside[name] += counts.kernels - before

            return counted

        for name in inside:
            setattr(cache, name, wrap(name))
        try:
            runner.steps(steps)
        finally:
            for name in inside:
                delattr(cache, name)  # the class's methods again
    return {
        "ops/step": round(counts.ops / steps, 1),
        "kernels/step": round(counts.kernels / steps, 1),
        "acquire_kernels": round(inside["acquire_ids"] / steps, 1),
        "release_kernels": round(inside["release"] / steps, 1),
        "cpu_syncs/step": round(counts.syncs / steps, 2),
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--pooling", type=int, default=32)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--load-factor", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: the same rows on CPU tensors (counts only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.dim, args.batch, args.pooling, args.warmup = 20_000, 32, 256, 8, 4
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("offload_gpu_syncs: no CUDA device; nothing to measure (--device cpu counts on CPU)")
        return
    cuda = device.type == "cuda"
    sample = zipf_sampler(args.rows, args.zipf, 0)
    ids_per_step = args.batch * args.pooling
    offsets = torch.arange(0, ids_per_step + 1, args.pooling).to(device)
    batches = [(sample(ids_per_step).to(device), offsets) for _ in range(32)]
    tmp = tempfile.mkdtemp(prefix="shardkit-offload-syncs-")
    rows = []
    validation = validation_enabled()
    for bookkeeping, validate in ROWS:
        set_validation(validate)
        try:
            rows.append(_row(args, device, batches, tmp, bookkeeping, validate))
        finally:
            set_validation(validation)
        if cuda:
            torch.cuda.empty_cache()
    config = dict(vars(args), device_name=torch.cuda.get_device_name(0) if cuda else "cpu")
    config.pop("out")
    write_results("offload_gpu_syncs", config, rows, args.out)


def _row(args, device, batches, tmp, bookkeeping: str, validate: bool) -> dict:
    cuda = device.type == "cuda"
    lookup = _lookup("caching", args.rows, args.dim, device, args.load_factor, "zero-copy", tmp, bookkeeping)
    if not cuda and bookkeeping == "device":  # a CPU cache keeps the host path unless forced
        old = lookup.cache
        lookup.cache = RowCache(old.backing, old.capacity, old.algorithm, bookkeeping="device")
    runner = _Runner(bookkeeping, lookup, True, batches, device)
    runner.steps(args.warmup)
    where: collections.Counter = collections.Counter()
    host_s = wall_s = 0.0
    for _ in range(args.steps):
        _sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            began = time.perf_counter()
            try:
                runner.steps(1)
            finally:
                issued = time.perf_counter()
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            _sync(device)
            ended = time.perf_counter()
        host_s += issued - began
        wall_s += ended - began
        for w in caught:
            if "synchroniz" in str(w.message):
                where[f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}"] += 1
    counted = _counted(runner, args.steps)
    row = {
        "row": f"{bookkeeping} bookkeeping" + ("" if validate else ", SHARDKIT_VALIDATE=0"),
        "syncs/step": round(sum(where.values()) / args.steps, 2) if cuda else counted["cpu_syncs/step"],
        "host_ms/step": round(host_s / args.steps * 1e3, 3),
        "wall_ms/step": round(wall_s / args.steps * 1e3, 3),
    }
    counted.pop("cpu_syncs/step")
    row.update(counted)
    row["where"] = "; ".join(f"{k} x{v / args.steps:g}" for k, v in where.most_common(8))
    return row


if __name__ == "__main__":
    main()

"""Host syncs and host time per training step of a CUDA ``fused_uvm_caching`` table, by bookkeeping path.

Run on a CUDA machine: ``python -m benchmarks.offload_gpu_syncs [--quick]``. The same table, ids and
step as ``benchmarks.offload_gpu`` (zero-copy copies, the prefetch order), the cache's bookkeeping on
the host (``SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING=0``) and on the device (kernels/offload/device_slots.py).
After ``--warmup`` steps, each of ``--steps`` steps runs under ``torch.cuda.set_sync_debug_mode("warn")``
and counts the synchronizing calls torch reports (device-to-host copies, ``nonzero``, ``item``, ...);
``host_ms/step``: the time the host takes to issue a step (no final synchronize), ``wall_ms/step`` with
it. Without CUDA it says so and exits 0.
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
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no syncs to count)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.dim, args.batch, args.pooling, args.warmup = 20_000, 32, 256, 8, 4
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("offload_gpu_syncs: no CUDA device; nothing to measure")
        return
    cuda = device.type == "cuda"
    sample = zipf_sampler(args.rows, args.zipf, 0)
    ids_per_step = args.batch * args.pooling
    offsets = torch.arange(0, ids_per_step + 1, args.pooling).to(device)
    batches = [(sample(ids_per_step).to(device), offsets) for _ in range(32)]
    tmp = tempfile.mkdtemp(prefix="shardkit-offload-syncs-")
    rows = []
    for bookkeeping in ("host", "device"):
        lf = args.load_factor
        lookup = _lookup("caching", args.rows, args.dim, device, lf, "zero-copy", tmp, bookkeeping)
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
        syncs = sum(where.values()) / args.steps
        rows.append(
            {
                "row": f"{bookkeeping} bookkeeping",
                "syncs/step": round(syncs, 2),
                "host_ms/step": round(host_s / args.steps * 1e3, 3),
                "wall_ms/step": round(wall_s / args.steps * 1e3, 3),
                "where": "; ".join(f"{k} x{v / args.steps:g}" for k, v in where.most_common(8)),
            }
        )
        del runner, lookup
        if cuda:
            torch.cuda.empty_cache()
    config = dict(vars(args), device_name=torch.cuda.get_device_name(0) if cuda else "cpu")
    config.pop("out")
    write_results("offload_gpu_syncs", config, rows, args.out)


if __name__ == "__main__":
    main()

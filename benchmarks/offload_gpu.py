"""Offloaded tables on a GPU: ``fused_uvm_caching`` (a cache in device memory over pinned host memory)
against the same table in device memory (``fused``), with the cache's copies on a side stream and on the
compute stream.

Run from the repository root on a CUDA machine: ``python -m benchmarks.offload_gpu [--quick]``
(without CUDA it runs the same rows on the CPU, a file-backed cache: a check that the script works).

One table (``--rows`` x ``--dim`` fp32, row-wise Adagrad fused into the backward), Zipf ids (exponent
``--zipf``, hot rows spread by a permutation), ``--batch`` bags of ``--pooling`` ids a step. Rows, each a
training step (forward, ``sum`` loss, backward with the fused update) timed over ``--steps`` steps after
``--warmup`` steps (the cache driven to its steady state by the warm-up), in ``--rounds`` alternating
rounds (the median round per row):

- ``fused``: the table in device memory;
- ``caching lf=X <order> <copies>``: ``fused_uvm_caching`` at load factor X; ``order`` ``plain``: each
  forward acquires its own rows (misses copied in before its kernel); ``prefetch``: the order of
  ``PrefetchTrainPipelineSparseDist`` (forward i, prefetch of batch i+1, backward i): batch i+1's misses
  are copied while batch i's backward runs; ``copies``: ``zero-copy`` (the default: on a side stream,
  the GPU gathering and scattering rows of the pinned host memory itself), ``staged`` (on a side
  stream, rows gathered on the host into pinned buffers and copied, ``SHARDKIT_OFFLOAD_UVA=0``) or
  ``compute stream`` (``SHARDKIT_OFFLOAD_COPY_STREAM=0``: staged copies queued on the caller's stream);
  ``bookkeeping``: ``device`` (the slot maps, pins, stamps and victims as torch ops on the GPU,
  ``kernels/offload/device_slots.py``; zero-copy only) or ``host`` (``SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING=0``:
  native C++ on the host); ``--copies`` / ``--bookkeeping`` choose which rows run;
- ``vs_fused``: in-memory step time / this row's (1.0 = as fast as in device memory), measured in the
  same rounds; ``hit_rate`` and ``miss_MB/step`` from the cache's counters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

from benchmarks.common import write_results
from benchmarks.offload_steady import zipf_sampler

# how a CUDA cache moves rows: the environment while it is built (kernels/offload/device_copies.py)
COPIES = {
    "zero-copy": {"SHARDKIT_OFFLOAD_COPY_STREAM": "1", "SHARDKIT_OFFLOAD_UVA": "1"},
    "staged": {"SHARDKIT_OFFLOAD_COPY_STREAM": "1", "SHARDKIT_OFFLOAD_UVA": "0"},
    "compute stream": {"SHARDKIT_OFFLOAD_COPY_STREAM": "0"},
}


def _lookup(
    kind: str,
    rows: int,
    dim: int,
    device: torch.device,
    load_factor: float,
    copies: str,
    tmp,
    bookkeeping: str = "host",
):
    from shardkit.kernels.offload import OffloadSpec
    from shardkit.modules import EmbeddingBagConfig, FusedOptimizerConfig, OptimType
    from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
    from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup

    config = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.01)
    shards = [ShardSpec(EmbeddingBagConfig(rows, dim, name="t", feature_names=["f"]))]
    if kind == "fused":
        return GroupedEmbeddingLookup(shards, True, device, config)
    environment = dict(COPIES[copies])
    environment["SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING"] = "1" if bookkeeping == "device" else "0"
    saved = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    try:
        spec = OffloadSpec("caching", load_factor, prefetch=True, directory=tmp)
        lookup = OffloadedEmbeddingLookup(shards, True, device, config, spec)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    lookup.background_prefetch = False  # the same order on every device (CUDA prefetches inline)
    if device.type == "cuda":
        moves = lookup.cache._copies
        kind_built = (
            "compute stream" if moves is None else ("zero-copy" if moves.views is not None else "staged")
        )
        assert kind_built == copies, f"asked for {copies} copies, the cache has {kind_built}"
        assert lookup.cache.bookkeeping == bookkeeping, lookup.cache.bookkeeping_reason
    return lookup


class _Runner:
    """A lookup trained on a stream of batches, in the plain or the prefetch order."""

    def __init__(self, name: str, lookup, prefetch: bool, batches: List[tuple], device: torch.device):
        self.name, self.lookup, self.prefetch, self.batches = name, lookup, prefetch, batches
        self.device = device
        self.position = 0
        self.loss_weight = torch.ones(lookup.embedding_dim, device=device)

    def steps(self, count: int) -> None:
        bags = [self.batches[0][1].numel() - 1]
        for _ in range(count):
            ids, offsets = self.batches[self.position % len(self.batches)]
            self.position += 1
            out = self.lookup(ids, offsets, bags)
            if self.prefetch:
                following = self.batches[self.position % len(self.batches)]
                self.lookup.prefetch(following[0], following[1], bags)
            out.mul(self.loss_weight).sum().backward()

    def timed(self, count: int) -> float:
        _sync(self.device)
        began = time.perf_counter()
        self.steps(count)
        _sync(self.device)
        return (time.perf_counter() - began) / count


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> List[Dict[str, Any]]:
    device = torch.device(args.device)
    sample = zipf_sampler(args.rows, args.zipf, args.seed)
    ids_per_step = args.batch * args.pooling
    offsets = torch.arange(0, ids_per_step + 1, args.pooling).to(device)
    batches = [(sample(ids_per_step).to(device), offsets) for _ in range(args.batches)]
    tmp = tempfile.mkdtemp(prefix="shardkit-offload-gpu-")
    runners = [
        _Runner("fused", _lookup("fused", args.rows, args.dim, device, 0, "", tmp), False, batches, device)
    ]
    for load_factor in args.load_factors:
        for prefetch in (False, True):
            for copies in args.copies:
                for bookkeeping in args.bookkeeping:
                    if device.type == "cuda" and bookkeeping == "device" and copies != "zero-copy":
                        continue  # the device bookkeeping needs the zero-copy views
                    if device.type != "cuda" and bookkeeping == "device":
                        continue  # a CPU cache keeps the host bookkeeping
                    order = "prefetch" if prefetch else "plain"
                    lookup = _lookup(
                        "caching", args.rows, args.dim, device, load_factor, copies, tmp, bookkeeping
                    )
                    name = f"caching lf={load_factor} {order} {copies} {bookkeeping} bookkeeping"
                    runners.append(_Runner(name, lookup, prefetch, batches, device))
    for runner in runners:  # warm: kernels compiled, caches at their steady state
        runner.steps(args.warmup)
        if getattr(runner.lookup, "cache", None) is not None:
            runner.lookup.reset_cache_stats()
    times: Dict[str, List[float]] = {r.name: [] for r in runners}
    for round_index in range(args.rounds):
        order = runners[round_index % len(runners) :] + runners[: round_index % len(runners)]
        for runner in order:
            times[runner.name].append(runner.timed(args.steps))
    fused_s = statistics.median(times["fused"])
    rows = []
    for runner in runners:
        step_s = statistics.median(times[runner.name])
        row = {"row": runner.name, "ms/step": round(step_s * 1e3, 3), "vs_fused": round(fused_s / step_s, 3)}
        cache = getattr(runner.lookup, "cache", None)
        if cache is not None:
            stats = runner.lookup.cache_stats()["t"]
            steps = args.rounds * args.steps
            row["hit_rate"] = round(stats["hits"] / max(stats["lookups"], 1), 4)
            row["miss_MB/step"] = round(stats["bytes_read"] / steps / 1e6, 2)
            row["write_MB/step"] = round(stats["bytes_written"] / steps / 1e6, 2)
        rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8192, help="bags per step")
    parser.add_argument("--pooling", type=int, default=32, help="ids per bag")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--load-factors", type=float, nargs="+", default=[0.05, 0.2])
    parser.add_argument("--batches", type=int, default=64, help="distinct batches, cycled")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copies", nargs="+", choices=list(COPIES), default=list(COPIES))
    parser.add_argument("--bookkeeping", nargs="+", choices=["host", "device"], default=["host", "device"])
    parser.add_argument("--quick", action="store_true", help="small sizes: runs in seconds")
    parser.add_argument("--out", default=None, help="directory for offload_gpu.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.dim, args.batch, args.pooling = 20_000, 32, 256, 8
        args.load_factors, args.warmup, args.steps, args.rounds = [0.2], 4, 3, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("offload_gpu: --device cuda, but torch sees no CUDA device")
    rows = run(args)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["device_name"] = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    write_results("offload_gpu", config, rows, args.out)


if __name__ == "__main__":
    main()

"""Training-step throughput of a sharded EmbeddingBagCollection, per sharding type, on CPU ranks (gloo).

Run from the repository root: ``python -m benchmarks.sharded_ebc [--world 2 --tables 8 --rows 1e5]``.

Each sharding type shards every table the same way (data-parallel, table-wise round robin over the
ranks, row-wise, column-wise over all ranks, table-row-wise and table-column-wise on node 0) and
times a training step on each rank: forward, backward with the fused SGD update (data-parallel: dense
gradients, an all-reduce and SGD, as DDP would), on a batch of ``--batch`` samples per rank with
``--pooling`` ids per bag. The same run times the unsharded module on the global batch
(``world x batch`` samples) in one process; ``speedup_vs_unsharded`` is that step time over the sharded
one. The ranks share this machine's cores, so the ratio says what sharding costs or gains on one
host, not across hosts. Every sharded step runs twice: with the native C++ kernels (when they build
here; ``ms_per_step``) and with the pure-torch path (``torch_path_ms_per_step``); ``native_speedup`` is
their ratio. The unsharded baseline uses the default (native when available).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.common import median_seconds, write_results
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.validation import set_validation
from shardkit.kernels import kernel_backend, native_ops
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from shardkit.sparse import KeyedJaggedTensor

LR = 0.01
SHARDING_TYPES = [
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
]


def _module(tables: int, rows: int, dim: int) -> EmbeddingBagCollection:
    configs = [EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(tables)]
    return EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig("SGD", lr=LR))


def _batch(tables: int, rows: int, batch: int, pooling: int, seed: int) -> KeyedJaggedTensor:
    """Bags of uniform random ids, lengths uniform in [0, 2 * pooling] (mean ``pooling``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * pooling + 1, (tables * batch,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor([f"f{i}" for i in range(tables)], values, lengths=lengths)


def _generator(kind: str, index: int, world: int):
    if kind == "data_parallel":
        # the DENSE kernel, as measured in docs/performance.md (a fused collection's default is FUSED
        # since issue 23: the fused optimizer on the all-reduced gradient)
        return data_parallel(compute_kernel="dense")
    if kind == "table_wise":
        return table_wise(rank=index % world)
    if kind == "row_wise":
        return row_wise()
    if kind == "column_wise":
        return column_wise(ranks=list(range(world)))
    if kind == "table_row_wise":
        return table_row_wise(host_index=0)
    return table_column_wise(host_index=0)


def step_worker(
    kind: str, tables: int, rows: int, dim: int, batch: int, pooling: int, repeats: int, backend: str = "auto"
) -> float:
    """Median seconds of one training step of the ``kind``-sharded module on this rank, with the kernel
    ``backend`` ("native", "torch" or "auto")."""
    with kernel_backend(None if backend == "auto" else backend):
        return _step_seconds(kind, tables, rows, dim, batch, pooling, repeats)


def _step_seconds(
    kind: str, tables: int, rows: int, dim: int, batch: int, pooling: int, repeats: int
) -> float:
    seconds = median_seconds(training_step(kind, tables, rows, dim, batch, pooling), repeats=repeats)
    # every rank's time counts: the step ends when the slowest rank's does
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, seconds)
    return max(times)


def training_step(
    kind: str, tables: int, rows: int, dim: int, batch: int, pooling: int
) -> Callable[[], None]:
    """This rank's training step of the ``kind``-sharded module (1 thread, validation off)."""
    torch.set_num_threads(1)
    set_validation(False)
    world, rank = dist.get_world_size(), dist.get_rank()
    module = _module(tables, rows, dim)
    generators = {f"t{i}": _generator(kind, i, world) for i in range(tables)}
    plan = construct_module_sharding_plan(module, generators, world_size=world)
    sharded = EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(None))
    features = _batch(tables, rows, batch, pooling, seed=rank)
    dense = [p for p in sharded.parameters() if p.requires_grad]

    def step() -> None:
        sharded(features).values().sum().backward()
        for param in dense:  # the data-parallel tables: what DDP + SGD would do
            if param.grad is not None:
                dist.all_reduce(param.grad)
                with torch.no_grad():
                    param.add_(param.grad, alpha=-LR / world)
                param.grad = None

    return step


def unsharded_step(tables: int, rows: int, dim: int, batch: int, pooling: int, repeats: int) -> float:
    torch.set_num_threads(1)
    set_validation(False)
    module = _module(tables, rows, dim)
    features = _batch(tables, rows, batch, pooling, seed=0)
    return median_seconds(lambda: module(features).values().sum().backward(), repeats=repeats)


def main(argv: Optional[List[str]] = None) -> None:
    # the workers unpickle functions by module name, which must not be __main__
    from benchmarks.sharded_ebc import step_worker as worker
    from shardkit.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=float, default=1e5)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="samples per rank")
    parser.add_argument("--pooling", type=int, default=20, help="mean ids per bag")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--types", nargs="+", default=SHARDING_TYPES, choices=SHARDING_TYPES)
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    rows = int(args.rows)
    sizes = (args.tables, rows, args.dim)
    global_batch = args.world * args.batch
    baseline = unsharded_step(*sizes, global_batch, args.pooling, args.repeats)
    results: List[Dict[str, Any]] = [
        {
            "name": f"unsharded, 1 process, batch {global_batch}",
            "ms_per_step": baseline * 1e3,
            "samples_per_s": global_batch / baseline,
            "speedup_vs_unsharded": 1.0,
        }
    ]
    backends = ["native", "torch"] if native_ops() is not None else ["torch"]
    for kind in args.types:
        seconds = {
            backend: run_world(
                worker, args.world, kind, *sizes, args.batch, args.pooling, args.repeats, backend, timeout=600
            )[0]
            for backend in backends
        }
        fastest = seconds[backends[0]]
        results.append(
            {
                "name": f"{kind}, {args.world} ranks x batch {args.batch}",
                "ms_per_step": fastest * 1e3,
                "samples_per_s": global_batch / fastest,
                "speedup_vs_unsharded": baseline / fastest,
                "torch_path_ms_per_step": seconds["torch"] * 1e3,
                "native_speedup": seconds["torch"] / fastest,
            }
        )
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config.update(dtype="fp32", optimizer="fused SGD", backend="gloo", validation=False)
    write_results("sharded_ebc", config, results, args.out)


if __name__ == "__main__":
    main()

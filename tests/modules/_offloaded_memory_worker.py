"""Run by test_offloaded_memory.py in a fresh process: train an offloaded table far larger than a memory
budget and print, as one JSON line, the process's peak resident memory beyond its baseline.

Usage: ``python _offloaded_memory_worker.py KERNEL ROWS DIM BAGS POOLING STEPS OFFLOAD_DIR``.

The module is built on the meta device and sharded by a plan (world of one): the table is never
allocated in RAM, only in its backing file. The baseline is taken after the imports and one step of a
tiny in-memory table (native kernels loaded, autograd warmed), with the peak reset there
(``/proc/self/clear_refs``); the peak is ``VmHWM`` (anonymous and file-backed pages together).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing.process_memory import memory_mib, reset_peak


def sharded_ebc(kernel: str, rows: int, dim: int, offload_dir: str, device: str):
    fused = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.01)
    config = EmbeddingBagConfig(rows, dim, name="big", feature_names=["f"])
    ebc = EmbeddingBagCollection([config], device=torch.device(device), fused_optimizer=fused)
    plan = construct_module_sharding_plan(ebc, {"big": table_wise(rank=0)}, 1, 1)
    if kernel != "fused":
        from shardkit.sharding.cache_params import CacheParams

        cache = CacheParams(load_factor=0.05, algorithm="lru", offload_dir=offload_dir)
        plan = {k: dataclasses.replace(v, compute_kernel=kernel, cache_params=cache) for k, v in plan.items()}
    return EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_local(1, 0))


def step(module, rows: int, bags: int, pooling: int, gen: torch.Generator) -> None:
    ids = torch.randint(0, rows, (bags * pooling,), generator=gen)
    kjt = KeyedJaggedTensor(["f"], ids, lengths=torch.full((bags,), pooling))
    module(kjt).wait().values().sum().backward()


def main(argv) -> None:
    kernel, rows, dim, bags, pooling, steps, offload_dir = argv
    rows, dim, bags, pooling, steps = map(int, (rows, dim, bags, pooling, steps))
    gen = torch.Generator().manual_seed(0)
    warm = sharded_ebc("fused", 1000, dim, offload_dir, "cpu")
    step(warm, 1000, bags, pooling, gen)
    del warm
    peak_reset = reset_peak()
    baseline = memory_mib()
    module = sharded_ebc(kernel, rows, dim, offload_dir, "meta")
    built = memory_mib()
    for _ in range(steps):
        step(module, rows, bags, pooling, gen)
    end = memory_mib()
    groups = [g for lk in module.lookups for g in lk.lookups]
    trained = 0  # rows whose optimizer state the steps changed (read after the measurement)
    for g in groups:
        g.sync_storage()
        trained += sum(int(t.count_nonzero()) for n, t in g.store.tensors.items() if n.startswith("state."))
    print(
        json.dumps(
            {
                "peak_reset": peak_reset,
                "baseline": baseline,
                "built": built,
                "end": end,
                "file_bytes": sum(g.store.nbytes for g in groups),
                "stats": module.cache_stats()["big"],
                "trained_rows": trained,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])

"""quant_uvm / quant_uvm_caching: quantized inference tables in a backing file answer bitwise like ``quant``.

The quantized collection of tests/sharding/test_quant_embeddingbag.py (INT8 / INT4 / INT2 / FP16 / BF16 /
FP32 tables, table-, row- and column-wise) sharded once with the in-memory ``quant`` kernel and once with
each offloading kernel (a cache of one row per shard: every batch evicts), at worlds 1-3: the outputs
are equal, the rows come from the backing files (the counters say so), and the caches never write back.
Also with the device bookkeeping on CPU tensors, and (``cuda``-marked) ``quant_uvm_caching`` on a GPU,
where the cache and its bookkeeping are in device memory by default, against ``quant`` on the GPU.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.quant import QuantEmbeddingBagCollection
from shardkit.quant.offloaded_quant_lookup import OffloadedQuantEmbeddingLookup
from shardkit.sharding.cache_params import CacheParams
from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case
from tests.sharding import test_quant_embeddingbag as quant


def _worker(kernel: str, bookkeeping: str = "host") -> bool:
    rank, world_size, _ = case.world()
    env = ShardingEnv.from_process_group(None)
    sharder = QuantEmbeddingBagCollectionSharder()
    reference = QuantEmbeddingBagCollection.from_float(quant._trained(True))
    plan = quant.plan_of(reference, world_size)
    cache = CacheParams(load_factor=0.01, algorithm="lru")
    offloaded_plan = {
        n: dataclasses.replace(ps, compute_kernel=kernel, cache_params=cache) for n, ps in plan.items()
    }
    in_memory = sharder.shard(copy.deepcopy(reference), plan, env)
    offloaded = sharder.shard(copy.deepcopy(reference), offloaded_plan, env)
    groups = [g for lk in offloaded.lookups for g in lk.lookups]
    assert groups and all(isinstance(g, OffloadedQuantEmbeddingLookup) for g in groups)
    if bookkeeping == "device":  # the CUDA tier's device bookkeeping, run as torch ops on CPU tensors
        for g in groups:
            old = g.cache
            g.cache = RowCache(old.backing, old.capacity, old.algorithm, bookkeeping="device")
    for step in range(3):
        _, local_kjt, _ = case.global_and_local(step, rank, world_size, quant.FEATURES, True)
        assert torch.equal(offloaded(local_kjt).values(), in_memory(local_kjt).values()), step
    stats = offloaded.cache_stats()
    assert stats and all(s["rows_read"] > 0 and s["bytes_written"] == 0 for s in stats.values()), stats
    assert any(s["evictions"] > 0 for s in stats.values()) or kernel == "quant_uvm", stats
    return True


@pytest.mark.parametrize("kernel", ["quant_uvm_caching", "quant_uvm"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_offloaded_quantized_equals_in_memory(world_size, kernel):
    assert all(run_world(_worker, world_size, kernel))


def test_offloaded_quantized_with_device_bookkeeping_equals_in_memory():
    """The cache of each shard keeping its bookkeeping as the CUDA tier does (kernels/offload/
    device_slots.py; the default of a quantized table's cache on a GPU), on CPU tensors."""
    assert all(run_world(_worker, 1, "quant_uvm_caching", "device"))


def _cuda_worker(algorithm: str) -> bool:
    """``quant_uvm_caching`` on the GPU (pinned host backing, the cache and its bookkeeping in device
    memory: the default there) answers bitwise as the in-memory ``quant`` kernel on the GPU."""
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    env = ShardingEnv.from_process_group(None)
    sharder = QuantEmbeddingBagCollectionSharder()
    reference = QuantEmbeddingBagCollection.from_float(quant._trained(True))
    plan = construct_module_sharding_plan(reference, quant._generators(1), 1, 1, device_type="cuda")
    cache = CacheParams(load_factor=0.01, algorithm=algorithm)
    offloaded_plan = {
        n: dataclasses.replace(ps, compute_kernel="quant_uvm_caching", cache_params=cache)
        for n, ps in plan.items()
    }
    in_memory = sharder.shard(copy.deepcopy(reference), plan, env, device=device)
    offloaded = sharder.shard(copy.deepcopy(reference), offloaded_plan, env, device=device)
    groups = [g for lk in offloaded.lookups for g in lk.lookups]
    assert groups and all(isinstance(g, OffloadedQuantEmbeddingLookup) for g in groups)
    for g in groups:
        assert g.cache.bookkeeping == "device", g.cache.bookkeeping_reason
        assert g.cache.slot_of_row.is_cuda and g.cache.tensors["weight"].is_cuda
        assert all(t.device.type == "cpu" and t.is_pinned() for t in g.cache.backing.values())
    for step in range(4):
        _, local_kjt, _ = case.global_and_local(step, 0, 1, quant.FEATURES, True)
        kjt = local_kjt.to(device)
        got, want = offloaded(kjt).values(), in_memory(kjt).values()
        assert got.is_cuda and torch.equal(got, want), step
    stats = offloaded.cache_stats()
    assert stats and all(s["rows_read"] > 0 and s["bytes_written"] == 0 for s in stats.values()), stats
    assert any(s["evictions"] > 0 for s in stats.values()), stats
    return True


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (tools/device_offload_check.sh)"
)
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_offloaded_quantized_on_cuda_equals_in_memory(algorithm):
    assert all(run_world(_cuda_worker, 1, algorithm, backend="nccl"))

"""Offloaded tables (``fused_uvm``, ``fused_uvm_caching``) train bitwise like in-memory ``fused`` ones.

Every sharding type but data-parallel, pooled and sequence, the four fused optimizers, both cache
algorithms and load factors from one row (every step evicts, and the cache grows past its capacity for
the batch's working set) to the whole table, at world sizes 1-4: the outputs equal the unsharded
module's on the global batch, and after the steps every shard's weights and optimizer state are
*equal* (not close) to those of the same plan with the in-memory ``fused`` kernel.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels import kernel_backend, native_enabled_by_env
from shardkit.kernels.native_build import native_ops
from shardkit.kernels.offload.backing_store import RESIDENT_MAP_ENV, resident_map_allowance
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    OptimType,
)
from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup
from shardkit.sharding.cache_params import CacheParams
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)


def _cache(kind: str, load_factor: float, algorithm: str):
    return CacheParams(load_factor=load_factor, algorithm=algorithm, prefetch_pipeline=False)


def _offloaded_plan(plan, kernel: str, load_factor: float, algorithm: str):
    return {
        name: ps
        if ps.sharding_type == "data_parallel"
        else dataclasses.replace(
            ps, compute_kernel=kernel, cache_params=_cache(kernel, load_factor, algorithm)
        )
        for name, ps in plan.items()
    }


def _local(value):
    """This rank's part of a state value: a tensor, or the list of its local shards' tensors."""
    if hasattr(value, "local_shards"):
        return [shard.tensor.clone() for shard in value.local_shards()]
    if hasattr(value, "to_local"):
        return [value.to_local().clone()]
    return [value.clone()] if isinstance(value, torch.Tensor) else value


def _state(sharded) -> dict:
    """Every local shard's weights and fused optimizer state, as copies."""
    out = {key: [w.clone()] for key, w in sharded.local_shards().items()}
    for table, state in sharded.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[(table, name)] = _local(value)
    return out


def _outputs(module, kjt, pooled: bool):
    out = module(kjt)
    return out.values() if pooled else {k: jt.values() for k, jt in out.items()}


def _train(reference, in_memory, offloaded, features, pooled: bool, exact_reference: bool) -> None:
    """Steps of the three modules in lockstep: the offloaded module's outputs *equal* the in-memory
    sharded module's, and (``exact_reference``) are close to the unsharded module's on the global batch.
    Row-wise Adagrad of a column-sharded table averages the squared gradient over the shard's columns
    (as torchrec does), so it has no unsharded reference beyond the first step."""
    rank, world_size, _ = case.world()
    for step in range(case.STEPS):
        global_kjt, local_kjt, batch = case.global_and_local(step, rank, world_size, features, False)
        mine = case.my_rows(rank, batch)
        expected = _outputs(reference, global_kjt, pooled)
        want, got = _outputs(in_memory, local_kjt, pooled), _outputs(offloaded, local_kjt, pooled)
        gen = torch.Generator().manual_seed(step)
        if pooled:
            grad = torch.randn(expected.shape, generator=gen)
            assert torch.equal(got, want), f"step {step}"
            if exact_reference:
                torch.testing.assert_close(got, expected[mine].detach(), **TOL)
            (expected * grad).sum().div(world_size).backward()
            (want * grad[mine]).sum().backward()
            (got * grad[mine]).sum().backward()
            continue
        loss, local_in, local_off = 0, 0, 0
        for key in expected:
            grad = torch.randn(expected[key].shape, generator=gen)
            offsets = global_kjt[key].offsets()
            lo, hi = int(offsets[mine.start]), int(offsets[mine.stop])
            assert torch.equal(got[key], want[key]), f"step {step} feature {key}"
            if exact_reference:
                torch.testing.assert_close(got[key], expected[key][lo:hi].detach(), **TOL)
            loss = loss + (expected[key] * grad).sum()
            local_in = local_in + (want[key] * grad[lo:hi]).sum()
            local_off = local_off + (got[key] * grad[lo:hi]).sum()
        loss.div(world_size).backward()
        local_in.backward()
        local_off.backward()


def _modules(pooled: bool, optimizer: OptimType):
    torch.manual_seed(0)
    fused = FusedOptimizerConfig(optimizer, lr=case.LR)
    if pooled:
        tables = [
            EmbeddingBagConfig(rows, dim, name=name, feature_names=feats, pooling=pooling)
            for name, rows, dim, feats, pooling in case.TABLES
            if name != "t_dp"
        ]
        return EmbeddingBagCollection(tables, fused_optimizer=fused), EmbeddingBagCollectionSharder()
    tables = [
        EmbeddingConfig(rows, 4, name=name, feature_names=feats)
        for name, rows, _, feats, _ in case.TABLES
        if name not in ("t_dp", "t_twcw")
    ]
    return EmbeddingCollection(tables, fused_optimizer=fused), EmbeddingCollectionSharder()


def _check(pooled: bool, optimizer: OptimType, kernel: str, load_factor: float, algorithm: str) -> None:
    rank, world_size, local_size = case.world()
    reference, sharder = _modules(pooled, optimizer)
    generators = case.plan_generators(world_size, local_size, with_dp=False)
    generators = {k: v for k, v in generators.items() if k in {t.name for t in reference._tables}}
    plan = construct_module_sharding_plan(reference, generators, local_size, world_size)
    env = ShardingEnv.from_process_group(None)
    in_memory = sharder.shard(copy.deepcopy(reference), plan, env)
    offloaded = sharder.shard(
        copy.deepcopy(reference), _offloaded_plan(plan, kernel, load_factor, algorithm), env
    )
    groups = [g for lk in offloaded.lookups for g in lk.lookups]
    assert groups and all(isinstance(g, OffloadedEmbeddingLookup) for g in groups)
    assert all((g.cache is None) == (kernel == "fused_uvm") for g in groups)
    # $SHARDKIT_OFFLOAD_RESIDENT_MAP set (these files are small): every store keeps its mapping and the
    # cache moves rows through it instead of preadv / pwritev; unset: the positioned I/O
    resident = resident_map_allowance() > 0
    assert all(g.store.resident == resident for g in groups)
    assert all((g.cache._row_io is None) == resident for g in groups if g.cache is not None)
    features = [(f, rows) for t in reference._tables for f in t.feature_names for rows in [t.num_embeddings]]
    _train(reference, in_memory, offloaded, features, pooled, optimizer is not OptimType.ROWWISE_ADAGRAD)
    want, got = _state(in_memory), _state(offloaded)
    assert want.keys() == got.keys()
    for key in want:
        if isinstance(want[key], list):
            assert len(got[key]) == len(want[key]) and all(map(torch.equal, got[key], want[key])), key
        else:
            assert got[key] == want[key], key
    for g in groups:
        assert os.path.exists(g.store.path)


def _worker(cases, backend: str, resident_map: str = "") -> bool:
    os.environ[RESIDENT_MAP_ENV] = resident_map
    if backend == "native":  # the default on CPU: make sure it is the one that ran
        assert native_ops() is not None, "the native kernels did not build here"
        for args in cases:
            _check(*args)
        return True
    with kernel_backend("torch"):
        for args in cases:
            _check(*args)
    return True


CASES = [
    (True, OptimType.SGD, "fused_uvm_caching", 0.01, "lru"),
    (True, OptimType.ROWWISE_ADAGRAD, "fused_uvm_caching", 0.5, "lfu"),
    (True, OptimType.ADAM, "fused_uvm", 1.0, "lru"),
    (True, OptimType.ADAGRAD, "fused_uvm_caching", 1.0, "lru"),
    (False, OptimType.ADAGRAD, "fused_uvm_caching", 0.01, "lfu"),
    (False, OptimType.SGD, "fused_uvm", 1.0, "lru"),
]


@pytest.mark.skipif(
    not native_enabled_by_env(), reason="SHARDKIT_NATIVE=0: the native kernels are switched off"
)
@pytest.mark.parametrize("world_size, local_size", [(1, None), (2, None), (3, None), (4, 2)])
def test_offloaded_equals_in_memory_fused(world_size, local_size):
    assert all(run_world(_worker, world_size, CASES, "native", local_world_size=local_size))


def test_offloaded_equals_in_memory_fused_pure_torch_kernels():
    assert all(run_world(_worker, 2, CASES, "torch"))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_offloaded_with_resident_mapping_equals_in_memory_fused(backend):
    """The backing files kept mapped ($SHARDKIT_OFFLOAD_RESIDENT_MAP): rows move by copies through the
    mapping instead of preadv / pwritev; the results stay bitwise those of ``fused``."""
    if backend == "native" and not native_enabled_by_env():
        pytest.skip("SHARDKIT_NATIVE=0: the native kernels are switched off")
    assert all(run_world(_worker, 2, CASES, backend, "1G"))

"""Offloaded tables under the train pipelines: the prefetch pipeline loads batch i+1's rows during step i.

DistributedModelParallel at world 2 with table-wise, row-wise and column-wise tables, once in memory
(``fused``) and once offloaded (``fused_uvm_caching``, a cache of a few rows, so every step evicts). Both
run the same batches (random sizes, zero included) through the same pipeline type in lockstep: every
step's output and, at the end, every shard's weights and optimizer state are *equal*. With
``prefetch_pipeline`` set and PrefetchTrainPipelineSparseDist, no forward loads a row itself (all its
misses were loaded by the prefetch a step earlier, under eviction pressure, with the batch in flight
pinned), on the background prefetch thread at worlds 1 and 2 (the backward of batch i updating its
cached rows while the thread fills other slots); without it, the forwards load their misses.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch

from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel
from shardkit.modules import OptimType
from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup
from shardkit.pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
from shardkit.sharding.cache_params import CacheParams
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.sharding.types import ShardingPlan
from shardkit.testing import run_world
from shardkit.testing.dispatch_counts import DispatchCounts
from tests.pipeline import test_zero_sample_pipeline as base

STEPS = 24


def _dmp(reference, kernel: str, prefetch: bool, world_size: int):
    generators = {
        "tw0": table_wise(rank=0),
        "tw2": table_wise(rank=world_size - 1),
        "rw": row_wise(),
        "cw": column_wise(ranks=[0, world_size - 1]),
    }
    tables = set(generators)
    generators["dp"] = data_parallel()
    plan = construct_module_sharding_plan(reference, generators, world_size, world_size)
    cache = CacheParams(load_factor=0.1, algorithm="lru", prefetch_pipeline=prefetch)
    for name in tables:
        if kernel != "fused":
            plan[name] = dataclasses.replace(plan[name], compute_kernel=kernel, cache_params=cache)
    return DistributedModelParallel(base._Model(copy.deepcopy(reference)), plan=ShardingPlan({"ebc": plan}))


def _pipeline(dmp, pipeline_type):
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=base.LR)
    return pipeline_type(dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)]), "cpu")


def _count_forward_misses(dmp) -> list:
    """Wrap each offloaded lookup's acquisitions: cell[0] counts those of a non-empty batch made on the
    main thread (a forward loading its rows itself: a miss counter cannot tell, the next batch's
    prefetch loading rows in the background during the forward), cell[1] those made on the
    background prefetch thread; cell[2] counts evicted slots that were pinned (a row of a batch in
    flight: must stay 0); cell[3] the calls reading tensor values (a host sync on a GPU) while a
    forward takes its prefetch over."""
    cell = [0, 0, 0, 0]
    for module in dmp.modules():
        if isinstance(module, OffloadedEmbeddingLookup):
            acquire, evict = module._acquire_rows, module.cache._evict

            def evicting(victims, _evict=evict, _cache=module.cache):
                cell[2] += int((_cache._pins.index_select(0, victims) > 0).sum())
                return _evict(victims)

            module.cache._evict = evicting

            def acquired(ids, *args, _acquire=acquire):
                background = threading.current_thread().name.startswith("shardkit-offload-prefetch")
                cell[1] += background
                cell[0] += not background and ids.numel() > 0
                return _acquire(ids, *args)

            def take(*args, _take=module._take_prefetched):
                with DispatchCounts() as counts:
                    out = _take(*args)
                cell[3] += counts.syncs
                return out

            module._acquire_rows = acquired
            module._take_prefetched = take
    return cell


def _worker(prefetch: bool) -> list:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reference = base._ebc()
    pipeline_type = PrefetchTrainPipelineSparseDist if prefetch else TrainPipelineSparseDist
    in_memory = _dmp(reference, "fused", prefetch, world_size)
    offloaded = _dmp(reference, "fused_uvm_caching", prefetch, world_size)
    forward_misses = _count_forward_misses(offloaded)
    pipelines = [_pipeline(in_memory, pipeline_type), _pipeline(offloaded, pipeline_type)]
    data = [base._Data(rank, world_size, STEPS), base._Data(rank, world_size, STEPS)]
    for step in range(STEPS):
        want, got = (p.progress(d) for p, d in zip(pipelines, data))
        assert torch.equal(got, want), f"step {step}"
    for p, d in zip(pipelines, data):
        with pytest.raises(StopIteration):
            p.progress(d)
    want, got = in_memory.module.ebc, offloaded.module.ebc
    for key, weight in want.local_shards().items():
        assert torch.equal(got.local_shards()[key], weight), key
    stats = got.cache_stats()
    assert stats and all(s["misses"] > 0 and s["evictions"] > 0 for s in stats.values()), stats
    return forward_misses


@pytest.mark.parametrize("prefetch, world_size", [(True, 1), (True, 2), (False, 2)])
def test_offloaded_pipeline_equals_in_memory(prefetch, world_size):
    counts = run_world(_worker, world_size, prefetch, timeout=300)
    assert all(pinned == 0 for _, _, pinned, _ in counts), counts
    if prefetch:
        # every batch's rows acquired by its prefetch, on the background thread (asynchronous prefetch)
        assert [in_forward for in_forward, _, _, _ in counts] == [0] * world_size
        assert all(background > 0 for _, background, _, _ in counts), counts
        # each group's prefetch matched to its forward by the tensors' identity, not their values
        assert all(value_reads == 0 for *_, value_reads in counts), counts
    else:
        assert all(in_forward > 0 and background == 0 for in_forward, background, _, _ in counts), counts


def test_optimizer_state_equal_after_prefetch_pipeline():
    assert all(run_world(_state_worker, 2, timeout=300))


def _state_worker() -> bool:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # row-wise Adagrad: the optimizer state must travel with its rows through evictions
    reference = _with_optimizer(base._ebc(), OptimType.ROWWISE_ADAGRAD)
    dmps = [_dmp(reference, k, True, world_size) for k in ("fused", "fused_uvm_caching")]
    pipelines = [_pipeline(d, PrefetchTrainPipelineSparseDist) for d in dmps]
    data = [base._Data(rank, world_size, 12), base._Data(rank, world_size, 12)]
    for _ in range(12):
        want, got = (p.progress(d) for p, d in zip(pipelines, data))
        assert torch.equal(got, want)
    want, got = (d.module.ebc.fused_optimizer.state_dict()["state"] for d in dmps)
    for table, state in want.items():
        for name, value in state.items():
            other = got[table][name]
            if isinstance(value, torch.Tensor):
                a = value.to_local() if hasattr(value, "to_local") else value
                b = other.to_local() if hasattr(other, "to_local") else other
                if hasattr(a, "local_shards"):
                    a, b = [s.tensor for s in a.local_shards()], [s.tensor for s in b.local_shards()]
                    assert all(map(torch.equal, a, b)), (table, name)
                else:
                    assert torch.equal(a, b), (table, name)
            else:
                assert value == other, (table, name)
    return True


def _with_optimizer(reference, optimizer: OptimType):
    from shardkit.modules import EmbeddingBagCollection, FusedOptimizerConfig

    torch.manual_seed(0)
    return EmbeddingBagCollection(
        reference.embedding_bag_configs(), fused_optimizer=FusedOptimizerConfig(optimizer, lr=base.LR)
    )


def _failing_worker() -> str:
    """Train at world 1; make the first cache load on the prefetch thread after step k fail, where batch
    k+1 has samples: step k still returns, step k+1 raises that error, and the other steps ran."""
    reference = base._ebc()
    offloaded = _dmp(reference, "fused_uvm_caching", True, 1)
    pipeline = _pipeline(offloaded, PrefetchTrainPipelineSparseDist)
    data = base._Data(0, 1, STEPS)
    k = next(step for step in range(2, STEPS - 1) if base._sizes(step + 1, 1)[0] > 0)
    armed = [False]
    lookups = [m for m in offloaded.modules() if isinstance(m, OffloadedEmbeddingLookup)]
    for module in lookups:

        def failing(rows, slots, _load=module.cache._load):
            if armed[0] and threading.current_thread().name.startswith("shardkit-offload-prefetch"):
                armed[0] = False
                raise OSError(5, "injected read failure")
            return _load(rows, slots)

        module.cache._load = failing
    for _ in range(k):
        pipeline.progress(data)
    for module in lookups:  # batch k's prefetch (asked for during step k - 1) must not be the one failing
        module.wait_for_prefetch()
    armed[0] = True
    pipeline.progress(data)  # step k: batch k+1's prefetch fails in the background
    with pytest.raises(OSError, match="injected read failure"):
        pipeline.progress(data)  # step k+1: its forward raises the worker's error
    return "raised at the next step"


def test_an_exception_in_the_prefetch_thread_is_raised_by_the_next_step():
    assert run_world(_failing_worker, 1, timeout=300) == ["raised at the next step"]

"""benchmarks/offload_steady.py: the benchmark's fast warming leaves an offloaded table's cache in the
state training steps leave it in, and stops when the hit rate has converged (issue 24, item 10)."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from benchmarks.offload_steady import cache_step, warm_to_steady, zipf_sampler


def _table(tmp_path, rows: int, load_factor: float):
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
    from shardkit.sharding.cache_params import CacheParams
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan, table_wise

    fused = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.01)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(rows, 8, name="t", feature_names=["f"])],
        device=torch.device("meta"),
        fused_optimizer=fused,
    )
    plan = construct_module_sharding_plan(ebc, {"t": table_wise(rank=0)}, 1, 1)
    cache = CacheParams(load_factor=load_factor, algorithm="lru", offload_dir=str(tmp_path))
    plan = {
        k: dataclasses.replace(v, compute_kernel="fused_uvm_caching", cache_params=cache)
        for k, v in plan.items()
    }
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_local(1, 0))
    return sharded, sharded.lookups[0].lookups[0].cache


def _state(cache):
    resident = cache.row_of_slot >= 0
    rows = cache.row_of_slot[resident]
    order = rows.argsort()
    dirty = cache._dirty[resident][order]
    counters = cache.counters.as_dict()
    return rows[order].tolist(), dirty.tolist(), counters


def test_cache_step_is_what_a_training_step_does_to_the_cache(tmp_path):
    from shardkit.sparse import KeyedJaggedTensor

    rows, bags, pooling = 3000, 64, 8
    trained, trained_cache = _table(tmp_path, rows, 0.05)
    driven, driven_cache = _table(tmp_path, rows, 0.05)
    sample = zipf_sampler(rows, 1.05, 0, stream=1)
    lengths = torch.full((bags,), pooling)
    for _ in range(30):  # well past the 150-row cache filling: evictions of dirty rows every step
        ids = sample(bags * pooling)
        trained(KeyedJaggedTensor(["f"], ids, lengths=lengths)).wait().values().sum().backward()
        cache_step(driven_cache, ids)
    assert trained_cache.counters.evictions > 0 and trained_cache.counters.rows_written > 0
    assert _state(driven_cache) == _state(trained_cache)


def test_warm_to_steady_stops_when_the_hit_rate_is_flat_or_at_the_cap(tmp_path):
    rows = 5000
    _, cache = _table(tmp_path, rows, 0.1)
    sample = zipf_sampler(rows, 1.05, 0, stream=1)
    args = argparse.Namespace(warm_window=4, warm_tolerance=0.01, warm_cap=4096)
    done = warm_to_steady(cache, sample, 256, args)
    assert done["warm_converged"] and done["cache_full"]
    assert done["warm_batches"] < 4096 and abs(done["warm_hit_rate"] - cache.counters.hit_rate) < 0.2
    # a window of 4 batches, then 8, 16, ...: a whole number of windows
    assert (done["warm_batches"] // 4 + 1) & (done["warm_batches"] // 4) == 0
    _, fresh = _table(tmp_path, rows, 0.1)
    capped = warm_to_steady(
        fresh, sample, 256, argparse.Namespace(warm_window=4, warm_tolerance=0.0, warm_cap=20)
    )
    assert capped["warm_batches"] == 20 and not capped["warm_converged"]


def test_streams_share_the_hot_rows_and_differ_in_draws():
    a, b = zipf_sampler(1000, 1.05, 0, stream=0), zipf_sampler(1000, 1.05, 0, stream=1)
    x, y = a(20000), b(20000)
    assert not torch.equal(x[:100], y[:100])
    top = lambda ids: set(torch.bincount(ids, minlength=1000).topk(5).indices.tolist())  # noqa: E731
    assert top(x) == top(y)  # the same permutation: the same hot rows


def test_a_whole_table_cache_is_prefilled_then_confirmed(tmp_path):
    rows = 2000
    _, cache = _table(tmp_path, rows, 1.0)
    sample = zipf_sampler(rows, 1.05, 0, stream=1)
    done = warm_to_steady(
        cache, sample, 256, argparse.Namespace(warm_window=4, warm_tolerance=0.01, warm_cap=64)
    )
    assert done["prefilled"] and done["cache_full"] and done["warm_converged"]
    assert done["warm_hit_rate"] == 1.0 and done["warm_batches"] == 4 + 8
    assert bool(cache._dirty.all()) and int((cache.row_of_slot >= 0).sum()) == rows

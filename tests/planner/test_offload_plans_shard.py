"""A planned offloading plan is what the storage builds: the planner chooses a load factor from the
table's miss-ratio curve for a memory budget, the real EmbeddingBagCollection sharder shards by the plan,
and the offloaded lookup's cache holds the rows the report says (the table itself only in the backing
file), with the unsharded module's outputs.

The real sharder offers the offloading kernels; on CPU the planner considers them only where the
constraints name them. The sharder's ``fused_params`` cache keys reach the storage too.
"""

from __future__ import annotations

import torch

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup
from shardkit.planner import (
    EmbeddingShardingPlanner,
    HeuristicalStorageReservation,
    ParameterConstraints,
    Topology,
)
from shardkit.planner.cache_sizing import candidate_load_factors
from shardkit.sharding import embeddingbag
from shardkit.sharding.cache_params import CacheParams, CacheStatistics, cache_rows
from shardkit.sharding.types import ShardingEnv
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

ROWS, DIM, BATCH = 400, 16, 8
CACHING = "fused_uvm_caching"


def _ids(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.05
    return torch.multinomial(weights, n, replacement=True, generator=gen)


def _plan_and_shard(tmp_dir: str):
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="big", feature_names=["f"]),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=DIM, name="small", feature_names=["g"]),
    ]
    fused = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.1)
    ebc = EmbeddingBagCollection(configs, fused_optimizer=fused)
    stats = CacheStatistics.from_ids([_ids(64, s) for s in range(20)], ROWS)
    candidates = candidate_load_factors(stats, ROWS)
    # RAM for every candidate cache but the largest: the planner must pick the next one down
    row_bytes = DIM * 4 + 4
    budget_rows = round(candidates[-1] * ROWS) - 1
    constraints = {
        "big": ParameterConstraints(
            sharding_types=["table_wise"],
            compute_kernels=[CACHING],
            cache_params=CacheParams(stats=stats, offload_dir=tmp_dir),
        ),
        "small": ParameterConstraints(sharding_types=["table_wise"]),
    }
    buffers = 8 * BATCH + 2 * BATCH * DIM * 4  # big's step: ids in, pooled output and its gradient out
    small = 10 * DIM * 4 + 10 * 4 + 8 * BATCH + 2 * BATCH * DIM * 4
    topology = Topology(
        world_size=1, compute_device="cpu", ddr_cap=buffers + small + budget_rows * row_bytes + 8
    )
    planner = EmbeddingShardingPlanner(
        topology,
        batch_size=BATCH,
        constraints=constraints,
        storage_reservation=HeuristicalStorageReservation(percentage=0.0),
    )
    sharder = embeddingbag.EmbeddingBagCollectionSharder()
    plan = planner.collective_plan(ebc, [sharder]).plan[""]
    report = {t["table"]: t for t in planner.last_report.tables}
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(None))
    groups = [g for lk in sharded.lookups for g in lk.lookups if isinstance(g, OffloadedEmbeddingLookup)]
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 4, (2 * BATCH,), generator=gen)
    ids = torch.cat(
        [_ids(int(lengths[:BATCH].sum()), 99), torch.randint(0, 10, (int(lengths[BATCH:].sum()),))]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(["f", "g"], ids, lengths)
    with torch.no_grad():
        equal = torch.allclose(sharded(kjt).values(), ebc(kjt).values(), atol=1e-6)
    return {
        "candidates": candidates,
        "kernel": plan["big"].compute_kernel,
        "load_factor": plan["big"].cache_params.load_factor,
        "offload_dir": plan["big"].cache_params.offload_dir,
        "small_cache_params": plan["small"].cache_params,
        "report_cache_rows": report["big"]["cache"]["cache_rows"],
        "capacities": [g.cache.capacity for g in groups],
        "paths": [g.store.path for g in groups],
        "equal": equal,
    }


def test_the_planned_cache_is_the_cache_the_storage_builds(tmp_path):
    (out,) = run_world(_plan_and_shard, 1, str(tmp_path), timeout=120)
    candidates = out["candidates"]
    assert out["kernel"] == CACHING and out["small_cache_params"] is None
    assert out["load_factor"] == candidates[-2]  # the largest candidate whose cache fits the RAM
    assert out["offload_dir"] == str(tmp_path)
    rows = cache_rows(ROWS, candidates[-2])
    assert out["report_cache_rows"] == rows and out["capacities"] == [rows]
    assert len(out["paths"]) == 1 and out["paths"][0].startswith(str(tmp_path))
    assert out["equal"]


def _fused_params_worker(tmp_dir: str):
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan, table_wise

    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="big", feature_names=["f"])]
    ebc = EmbeddingBagCollection(configs)
    fused_params = {
        "optimizer": OptimType.ADAGRAD,
        "learning_rate": 0.1,
        "cache_load_factor": 0.25,
        "cache_algorithm": "lfu",
        "offload_dir": tmp_dir,
    }
    sharder = embeddingbag.EmbeddingBagCollectionSharder(fused_params=fused_params)
    plan = construct_module_sharding_plan(
        ebc, {"big": table_wise(rank=0, compute_kernel=CACHING)}, sharder, 1, 1
    )
    assert plan["big"].cache_params is None  # the plan names no cache options: fused_params' apply
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(None))
    (group,) = [g for lk in sharded.lookups for g in lk.lookups]
    return group.cache.capacity, group.cache.algorithm, group.store.path, plan["big"].cache_params


def test_fused_params_cache_keys_reach_the_cache(tmp_path):
    (out,) = run_world(_fused_params_worker, 1, str(tmp_path), timeout=120)
    capacity, algorithm, path, untouched = out
    assert capacity == cache_rows(ROWS, 0.25) and algorithm == "lfu"
    assert path.startswith(str(tmp_path)) and untouched is None  # the caller's plan was not modified


def test_bad_fused_params_cache_keys_fail_at_the_sharder():
    import pytest

    with pytest.raises(ValueError, match="cache_load_factor"):
        embeddingbag.EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "SGD", "cache_load_factor": 2.0}
        )

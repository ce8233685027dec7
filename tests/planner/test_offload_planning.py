"""The planner and the offloading kernels (issue 24 item 6): storage in the fast and slow tiers, the
miss rate in the cost model, load factors chosen from the miss-ratio curve, cache params in the plan.

Table as in test_estimators: 100 rows x 10 fp32 columns, batch 10 per rank, pooling factor 2, 2 ranks
(i = 20 ids per rank, I = 40 over the world); here with row-wise Adagrad (4 bytes of state per row).
"""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import EmbeddingBagConfig, OptimType
from shardkit.planner import (
    CostModel,
    EmbeddingEnumerator,
    EmbeddingPerfEstimator,
    EmbeddingShardingPlanner,
    EmbeddingStorageEstimator,
    ParameterConstraints,
    PlannerError,
    Topology,
)
from shardkit.planner.cache_sizing import candidate_load_factors
from shardkit.sharding.cache_params import CacheAlgorithm, CacheParams, SampledCacheStatistics
from tests.planner._sharder import DENSE, FUSED, ebc_sharder, meta_ebc

UVM, CACHING = "fused_uvm", "fused_uvm_caching"
MODEL = CostModel(
    hbm_lookup_bw=1e9,
    ddr_lookup_bw=1e9,
    uvm_lookup_bw=1e8,
    intra_node_bw=1e8,
    cross_node_bw=1e7,
    bwd_compute_factor=2.0,
    lookup_overhead_s=0.0,
    cache_hit_rate=0.5,
    disk_lookup_bw=1e7,
)
TABLE = EmbeddingBagConfig(num_embeddings=100, embedding_dim=10, name="t", feature_names=["f"])
WEIGHTS, STATE = 100 * 10 * 4, 100 * 4
BUFFERS = 40 * 8 + 2 * 20 * 10 * 4  # ids in, output and its gradient out (table-wise)
READ = 3 * 40 * 10 * 4  # forward + backward bytes of rows per step


def _options(topology, sharder=None, optimizer=OptimType.ROWWISE_ADAGRAD, **constraints):
    enumerator = EmbeddingEnumerator(
        topology,
        batch_size=10,
        constraints={"t": ParameterConstraints(pooling_factors=[2.0], **constraints)},
        optimizer=optimizer,
    )
    sharder = sharder or ebc_sharder(kernels=[FUSED, DENSE, UVM, CACHING])
    ((table, found),) = enumerator.tables(meta_ebc([TABLE]), [sharder])
    options = enumerator.enumerate(table, found)
    EmbeddingStorageEstimator().estimate(options, topology)
    EmbeddingPerfEstimator().estimate(options, topology)
    return options


def _table_wise(options, kernel):
    found = [o for o in options if o.sharding_type == "table_wise" and o.compute_kernel == kernel]
    assert len(found) == 1, found
    return found[0]


def _cpu(**kwargs):
    return Topology(world_size=2, compute_device="cpu", cost_model=MODEL, **kwargs)


def _cuda():
    return Topology(world_size=2, compute_device="cuda", cost_model=MODEL)


@pytest.mark.parametrize("keep_narrow", ["1", "0", "auto"])
def test_cpu_caching_keeps_only_the_cache_in_memory_and_the_table_on_disk(monkeypatch, keep_narrow):
    monkeypatch.setenv("SHARDKIT_OFFLOAD_KEEP_NARROW_STATE", keep_narrow)
    cache = CacheParams(load_factor=0.25)
    options = _options(_cpu(), compute_kernels=[FUSED, UVM, CACHING], cache_params=cache)
    fused, uvm, caching = (_table_wise(options, k) for k in (FUSED, UVM, CACHING))
    assert (fused.hbm.tolist(), fused.ddr.tolist(), fused.disk.tolist()) == (
        [0.0],
        [WEIGHTS + STATE + BUFFERS],
        [0.0],
    )
    # fused_uvm: nothing but the step's buffers in RAM
    assert uvm.ddr.tolist() == pytest.approx([BUFFERS])
    assert uvm.disk.tolist() == pytest.approx([WEIGHTS + STATE])
    # fused_uvm_caching: the cache of a quarter of the rows, with their optimizer state, and row-wise
    # Adagrad's state of every row kept mapped where forced ("1"; auto: its 400 bytes are more than 1/8
    # of the cache's 25 x 44: not kept, narrow_state.keep_narrow_state), and the cache's bookkeeping: a
    # dense slot map (4 bytes a row: no larger than the hashed one) and 29 bytes a slot (slot_map.py)
    kept = STATE if keep_narrow == "1" else 0
    book = 4 * 100 + 25 * 29
    assert caching.ddr.tolist() == pytest.approx([BUFFERS + 0.25 * (WEIGHTS + STATE) + kept + book])
    assert caching.disk.tolist() == pytest.approx([WEIGHTS + STATE])
    assert caching.hbm.tolist() == [0.0]
    assert caching.cache_params == CacheParams(load_factor=0.25)


def test_cuda_caching_keeps_the_cache_in_hbm_and_the_table_in_ddr():
    options = _options(_cuda(), cache_params=CacheParams(load_factor=0.5))
    uvm, caching = _table_wise(options, UVM), _table_wise(options, CACHING)
    assert (uvm.hbm.tolist(), uvm.ddr.tolist()) == (
        pytest.approx([BUFFERS]),
        pytest.approx([WEIGHTS + STATE]),
    )
    assert caching.hbm.tolist() == pytest.approx([BUFFERS + 0.5 * (WEIGHTS + STATE)])
    assert caching.ddr.tolist() == pytest.approx([WEIGHTS + STATE])
    assert caching.disk.tolist() == [0.0]


def test_cache_precision_sizes_the_cached_values():
    options = _options(_cuda(), cache_params=CacheParams(load_factor=0.5, precision="FP16"))
    caching = _table_wise(options, CACHING)
    assert caching.hbm.tolist() == pytest.approx([BUFFERS + 0.5 * (100 * 10 * 2 + STATE)])


def test_cost_model_uses_the_miss_rate_of_the_statistics():
    g = torch.Generator().manual_seed(0)
    stats = SampledCacheStatistics(torch.randint(0, 30, (400,), generator=g), 100)
    options = _options(
        _cpu(), compute_kernels=[CACHING], cache_params=CacheParams(load_factor=0.2, stats=stats)
    )
    caching = _table_wise(options, CACHING)
    hit = 1.0 - stats.expected_miss_rate(0.2)
    assert 0.0 < hit < 1.0
    assert (caching.hit_rate, caching.hit_rate_source) == (pytest.approx(hit), "statistics")
    assert caching.compute.tolist() == pytest.approx([READ * (hit / 1e9 + (1 - hit) / 1e7)])
    # without statistics: the cost model's constant hit rate
    plain = _table_wise(_options(_cpu(), compute_kernels=[CACHING]), CACHING)
    assert (plain.hit_rate, plain.hit_rate_source) == (0.5, "cost model")
    assert plain.compute.tolist() == pytest.approx([READ * (0.5 / 1e9 + 0.5 / 1e7)])
    uvm = _table_wise(_options(_cpu(), compute_kernels=[UVM]), UVM)
    assert uvm.compute.tolist() == pytest.approx([READ / 1e7]) and uvm.hit_rate == 0.0


def test_cpu_offers_offloading_kernels_only_when_the_constraints_name_them():
    kernels = {o.compute_kernel for o in _options(_cpu())}
    assert kernels == {FUSED}  # DENSE is not offered to a fused module unless named either
    named = {o.compute_kernel for o in _options(_cpu(), compute_kernels=[FUSED, CACHING])}
    assert named == {FUSED, CACHING}
    # on CUDA, as before: whatever the sharder offers
    assert {o.compute_kernel for o in _options(_cuda())} == {FUSED, UVM, CACHING}


def test_a_named_kernel_the_sharder_does_not_offer_is_an_error_saying_so():
    with pytest.raises(PlannerError, match="this one offers \\['fused', 'dense'\\]"):
        _options(_cpu(), sharder=ebc_sharder(), compute_kernels=[CACHING])


def test_load_factor_from_fused_params_and_constraints_win():
    sharder = ebc_sharder(kernels=[FUSED, CACHING])
    sharder.fused_params = {"cache_load_factor": 0.3, "cache_algorithm": "lfu"}
    caching = _table_wise(_options(_cpu(), sharder=sharder, compute_kernels=[CACHING]), CACHING)
    assert caching.cache_params == CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.3)
    explicit = CacheParams(load_factor=0.1)
    caching = _table_wise(
        _options(_cpu(), sharder=sharder, compute_kernels=[CACHING], cache_params=explicit), CACHING
    )
    assert caching.cache_params == CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.1)


def test_statistics_without_a_load_factor_give_one_option_per_candidate():
    g = torch.Generator().manual_seed(1)
    stats = SampledCacheStatistics(torch.randint(0, 40, (500,), generator=g), 100)
    options = _options(_cpu(), compute_kernels=[CACHING], cache_params=CacheParams(stats=stats))
    table_wise = [o for o in options if o.sharding_type == "table_wise"]
    assert [o.cache_params.load_factor for o in table_wise] == candidate_load_factors(stats, 100)
    assert len(table_wise) > 2


def _planner(topology, **constraints):
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=10,
        constraints={"t": ParameterConstraints(pooling_factors=[2.0], **constraints)},
        optimizer=OptimType.ROWWISE_ADAGRAD,
    )


def test_the_plan_carries_the_cache_params_of_offloaded_tables_only():
    other = EmbeddingBagConfig(num_embeddings=50, embedding_dim=10, name="u", feature_names=["g"])
    planner = _planner(
        _cpu(), compute_kernels=[CACHING], cache_params=CacheParams(load_factor=0.1, prefetch_pipeline=True)
    )
    plan = planner.plan(meta_ebc([TABLE, other]), [ebc_sharder(kernels=[FUSED, CACHING])]).plan[""]
    assert plan["t"].compute_kernel == CACHING
    assert plan["t"].cache_params == CacheParams(load_factor=0.1, prefetch_pipeline=True)
    assert plan["u"].compute_kernel == FUSED and plan["u"].cache_params is None
    (row,) = [t for t in planner.last_report.tables if t["table"] == "t"]
    cache = row["cache"]
    # 10 rows whole or 2 x 5 rows row-wise: cache_rows' rule on each shard
    assert cache["load_factor"] == 0.1 and cache["cache_rows"] == 10
    assert cache["cache_bytes"] == pytest.approx(10 * (10 * 4 + 4))
    assert (cache["expected_hit_rate"], cache["hit_rate_source"], cache["slow_tier"]) == (
        0.5,
        "cost model",
        "disk",
    )
    assert cache["slow_tier_bytes"] == pytest.approx(WEIGHTS + STATE)


def test_the_planner_chooses_the_largest_cache_that_fits_the_memory():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 100, (2000,), generator=g)  # uniform: every row of cache pays
    stats = SampledCacheStatistics(ids, 100)
    candidates = candidate_load_factors(stats, 100)
    sharder = ebc_sharder(types=["table_wise"], kernels=[FUSED, CACHING])

    def chosen(ddr_cap):
        planner = _planner(
            _cpu(ddr_cap=ddr_cap), compute_kernels=[CACHING], cache_params=CacheParams(stats=stats)
        )
        planner.storage_reservation.percentage = 0.0
        return planner.plan(meta_ebc([TABLE]), [sharder]).plan[""]["t"].cache_params.load_factor

    assert chosen(10**6) == candidates[-1]  # room for any cache: the one with the fewest misses
    # room for the buffers and a cache just short of the best candidate's: the next one down
    rows = round(candidates[-1] * 100) - 1
    assert rows >= round(candidates[-2] * 100)
    # (+ STATE: row-wise Adagrad's state of every row, kept mapped in memory: within 1/8 of the cache;
    # + the bookkeeping: a dense slot map, 4 bytes a table row, and 29 bytes a slot)
    book = 4 * 100 + rows * 29
    assert chosen(BUFFERS + STATE + rows * (10 * 4 + 4) + book + 1) == candidates[-2]  # + 1: float rounding
    # the estimated time falls with the cache: the planner prefers the larger cache for speed
    assert stats.expected_miss_rate(candidates[-1]) < stats.expected_miss_rate(candidates[-2])


def test_a_disk_too_small_for_the_table_is_a_planner_error_naming_it():
    planner = _planner(_cpu(disk_cap=1000), compute_kernels=[UVM])
    with pytest.raises(
        PlannerError,
        match=r"(?s)needs .* disk 4\.3 KiB;.* disk 1000 B free.*offload disk 8\.6 KiB needed of 2\.0 KiB",
    ):
        planner.plan(meta_ebc([TABLE]), [ebc_sharder(kernels=[FUSED, UVM])])
    with pytest.raises(ValueError, match="disk_cap"):
        Topology(world_size=1, compute_device="cpu", disk_cap=-1)


def test_cpu_caching_of_a_large_table_counts_a_hashed_slot_map_of_the_cache_rows(monkeypatch):
    """A table far larger than its cache: the slot map is hashed (O(cache rows)) and Adagrad's narrow
    state is not kept mapped (auto): the estimate grows with the cache's rows, not 4 + 4 bytes a table row."""
    monkeypatch.delenv("SHARDKIT_OFFLOAD_KEEP_NARROW_STATE", raising=False)
    monkeypatch.delenv("SHARDKIT_OFFLOAD_SLOT_MAP", raising=False)
    cache = CacheParams(load_factor=0.01)
    options = _options(_cpu(), compute_kernels=[UVM, CACHING], cache_params=cache)
    uvm, caching = _table_wise(options, UVM), _table_wise(options, CACHING)
    rows = 100  # the table's; the cache holds 1 row: its values, state, slot arrays and hashed map
    expected = float(uvm.ddr[0]) + 0.01 * rows * (10 * 4 + 4) + 0.01 * rows * (29 + 48)
    assert caching.ddr.tolist() == pytest.approx([expected])
    monkeypatch.setenv("SHARDKIT_OFFLOAD_SLOT_MAP", "dense")  # the switch is followed by the estimate
    options = _options(_cpu(), compute_kernels=[UVM, CACHING], cache_params=cache)
    dense = _table_wise(options, CACHING)
    assert dense.ddr.tolist() == pytest.approx([expected - 0.01 * rows * 48 + 4 * rows])

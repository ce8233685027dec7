"""The cost model by hand: storage and time of each sharding type on a small table, and the inputs.

Table: 100 rows x 10 fp32 columns, one feature, batch 10 per rank, pooling factor 2; 2 ranks on one
CPU node; lookups at 1 GB/s, collectives at 0.1 GB/s, backward = 2 x forward, no fixed overhead.
So per step: b = 10 bags and i = 20 ids per rank, B = 20 and I = 40 over the world.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import EmbeddingBagConfig, EmbeddingConfig
from shardkit.planner import (
    CostModel,
    EmbeddingEnumerator,
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
    ParameterConstraints,
    PlannerError,
    Topology,
)
from shardkit.planner.estimators import (
    CACHE_LOAD_FACTOR,
    distinct_rows,
    rank_footprint_bytes,
    replica_exchange,
    replica_groups,
)
from shardkit.planner.types import TableInfo
from tests.planner._sharder import ebc_sharder, ec_sharder, meta_ebc, meta_ec

MODEL = CostModel(
    hbm_lookup_bw=1e9,
    ddr_lookup_bw=1e9,
    uvm_lookup_bw=1e8,
    intra_node_bw=1e8,
    cross_node_bw=1e7,
    bwd_compute_factor=2.0,
    lookup_overhead_s=0.0,
    cache_hit_rate=0.5,
)
TABLE = EmbeddingBagConfig(num_embeddings=100, embedding_dim=10, name="t", feature_names=["f"])


def _options(topology, module=None, sharder=None, **constraints):
    # every kernel by name: a module with a fused optimizer gets DENSE options only when asked for them
    constraints.setdefault("compute_kernels", list((sharder or ebc_sharder()).compute_kernels("", "cpu")))
    enumerator = EmbeddingEnumerator(
        topology, batch_size=10, constraints={"t": ParameterConstraints(pooling_factors=[2.0], **constraints)}
    )
    ((table, found),) = enumerator.tables(module or meta_ebc([TABLE]), [sharder or ebc_sharder()])
    options = enumerator.enumerate(table, found)
    EmbeddingStorageEstimator().estimate(options, topology)
    EmbeddingPerfEstimator().estimate(options, topology)
    return {(o.sharding_type, o.compute_kernel): o for o in options}


def _cpu(world=2, local=None):
    return Topology(world_size=world, compute_device="cpu", local_world_size=local, cost_model=MODEL)


def test_table_wise():
    o = _options(_cpu())[("table_wise", "fused")]
    assert o.compute.tolist() == pytest.approx([3 * 40 * 10 * 4 / 1e9])
    assert o.comm.tolist() == pytest.approx([(40 * 8 + 2 * 20 * 10 * 4) / 1e8])
    assert o.ddr.tolist() == pytest.approx([100 * 10 * 4 + 40 * 8 + 2 * 20 * 10 * 4])
    assert o.hbm.tolist() == [0.0]


def test_row_wise_splits_ids_and_reduce_scatters():
    o = _options(_cpu())[("row_wise", "fused")]
    assert o.sizes.tolist() == [[50, 10], [50, 10]]
    assert o.compute.tolist() == pytest.approx([3 * 20 * 10 * 4 / 1e9] * 2)
    assert o.comm.tolist() == pytest.approx([20 * 8 / 1e8 + 2 * 20 * 10 * 4 * 0.5 / 1e8] * 2)


# one rank's 20 uniform ids over 100 rows touch 100 x (1 - 0.99^20) distinct rows
TOUCHED = 100 * (1 - 0.99**20)


def test_a_fused_replica_gathers_the_touched_rows_not_the_table():
    o = _options(_cpu())[("data_parallel", "fused")]
    assert o.compute.tolist() == pytest.approx([3 * 20 * 10 * 4 / 1e9] * 2)
    # the other rank's touched rows and fp32 gradients: (10 + 2) 4-byte words each, not a table all-reduce
    assert o.comm.tolist() == pytest.approx([4 * TOUCHED * 12 / 1e8] * 2)


def test_a_dense_replica_all_reduces_its_gradient():
    o = _options(_cpu())[("data_parallel", "dense")]
    assert o.comm.tolist() == pytest.approx([2 * 0.5 * 4000 / 1e8] * 2)


def test_distinct_rows():
    assert distinct_rows(100, 20) == pytest.approx(TOUCHED)
    assert distinct_rows(100, 0) == 0.0 and distinct_rows(0, 5) == 0.0 and distinct_rows(1, 7) == 1.0
    assert distinct_rows(10**6, 1) == pytest.approx(1.0)
    counts = [distinct_rows(1000, ids) for ids in (1, 10, 100, 1000, 10_000, 100_000)]
    assert counts == sorted(counts) and counts[-1] == pytest.approx(1000.0)
    assert all(c <= min(1000, ids) + 1e-9 for c, ids in zip(counts, (1, 10, 100, 1000, 10_000, 100_000)))
    # against a sample: 5000 uniform ids over 4000 rows
    gen = torch.Generator().manual_seed(0)
    seen = [torch.randint(0, 4000, (5000,), generator=gen).unique().numel() for _ in range(20)]
    assert sum(seen) / len(seen) == pytest.approx(distinct_rows(4000, 5000), rel=0.01)


def _replica_table(rows: int, cols: int, ids: float) -> TableInfo:
    return TableInfo("", "t", rows, cols, 4, True, bags=ids, ids=ids)


def test_replica_exchange_follows_rows_of_all_ranks_choice():
    # few rows touched: gather them (world x touched rows applied, the other ranks' words received)
    table = _replica_table(100_000, 16, 50)
    touched = distinct_rows(100_000, 50)
    applied, received, dense = replica_exchange(table, 4)
    assert not dense and applied == pytest.approx(4 * touched)
    assert received == pytest.approx(4 * 3 * touched * 18)
    # most rows touched: the dense all-reduce of rows x (cols + 1) fp32, the global batch's distinct rows
    table = _replica_table(64, 16, 500)
    applied, received, dense = replica_exchange(table, 4)
    assert dense and received == pytest.approx(4 * 2 * 3 / 4 * 64 * 17)
    assert applied == pytest.approx(distinct_rows(64, 2000))
    # one rank: nothing exchanged
    assert replica_exchange(_replica_table(100, 8, 20), 1) == (pytest.approx(TOUCHED), 0.0, False)
    # the same rule as the exchange itself: gather while world x max touched x (dim + 2) < rows x (dim + 1)
    for rows, ids, world in ((1000, 30, 2), (1000, 300, 4), (200, 100, 2), (5000, 4000, 4)):
        touched = distinct_rows(rows, ids)
        assert replica_exchange(_replica_table(rows, 8, ids), world)[2] == (world * touched * 10 >= rows * 9)


def test_a_fused_replica_pays_per_row_and_value_it_applies():
    dp = ("data_parallel", "fused")
    base = _options(_cpu())[dp]
    model = MODEL.replace(replica_row_s=1e-6, replica_value_s=1e-7)
    got = _options(Topology(world_size=2, compute_device="cpu", cost_model=model))[dp]
    # every rank applies both ranks' touched rows: 2 x TOUCHED rows of 10 values
    extra = 2 * TOUCHED * (1e-6 + 10 * 1e-7)
    assert got.compute.tolist() == pytest.approx([c + extra for c in base.compute.tolist()])
    assert got.comm.tolist() == pytest.approx(base.comm.tolist())
    # more ranks: more rows applied on each (the global batch grows)
    four = _options(Topology(world_size=4, compute_device="cpu", cost_model=model))[dp]
    assert four.compute[0].item() - base.compute[0].item() == pytest.approx(4 * TOUCHED * (1e-6 + 10 * 1e-7))
    # the dense replica runs no such update
    dense = ("data_parallel", "dense")
    with_update = _options(Topology(world_size=2, compute_device="cpu", cost_model=model))[dense]
    assert with_update.compute.tolist() == pytest.approx(_options(_cpu())[dense].compute.tolist())


def test_a_replica_cost_grows_with_the_batch():
    model = MODEL.replace(replica_row_s=1e-6, replica_value_s=1e-8, id_miss_s=1e-7, lookup_cache_bytes=1000.0)
    table = EmbeddingBagConfig(num_embeddings=100_000, embedding_dim=10, name="t", feature_names=["f"])
    times = []
    for pooling in (1.0, 4.0, 16.0, 64.0):
        enumerator = EmbeddingEnumerator(
            Topology(world_size=2, compute_device="cpu", cost_model=model),
            batch_size=10,
            constraints={"t": ParameterConstraints(pooling_factors=[pooling], compute_kernels=["fused"])},
        )
        ((info, found),) = enumerator.tables(meta_ebc([table]), [ebc_sharder()])
        options = [o for o in enumerator.enumerate(info, found) if o.sharding_type == "data_parallel"]
        EmbeddingPerfEstimator().estimate(options, enumerator.topology)
        times.append(options[0].compute[0].item() + options[0].comm[0].item())
    assert times == sorted(times) and times[-1] > 10 * times[0]


def test_dense_kernel_adds_gradient_memory_and_update_time():
    options = _options(_cpu())
    fused, dense = options[("table_wise", "fused")], options[("table_wise", "dense")]
    assert float(dense.ddr[0] - fused.ddr[0]) == pytest.approx(4000)
    assert float(dense.compute[0] - fused.compute[0]) == pytest.approx(3 * 4000 / 1e9)


def test_column_wise_needs_two_min_partitions():
    wide = EmbeddingBagConfig(num_embeddings=100, embedding_dim=64, name="t", feature_names=["f"])
    topology = _cpu(world=4)
    options = _options(topology, module=meta_ebc([wide]), min_partition=16)
    assert options[("column_wise", "fused")].sizes.tolist() == [[100, 16]] * 4
    assert ("column_wise", "fused") not in _options(topology, module=meta_ebc([wide]), min_partition=40)


def test_table_row_wise_reduces_within_the_node_first():
    o = _options(_cpu(world=4, local=2))[("table_row_wise", "fused")]
    out = 4 * 10 * 10 * 4  # B = 40 bags x 10 columns x 4 bytes
    ids = 80 * 50 / 100
    expected = ids * 8 / 1e7 + 2 * (out * 0.5 / 1e8 + out / 2 / 1e7)  # input dist crosses nodes
    assert o.comm.tolist() == pytest.approx([expected] * 2)


def test_sequence_tables_send_one_row_per_id():
    seq = EmbeddingConfig(num_embeddings=100, embedding_dim=10, name="t", feature_names=["f"])
    o = _options(_cpu(), module=meta_ec([seq]), sharder=ec_sharder())[("table_wise", "fused")]
    assert o.comm.tolist() == pytest.approx([(40 * 8 + 2 * 40 * 10 * 4) / 1e8])


def test_gpu_kernels_place_weights():
    topology = Topology(world_size=2, compute_device="cuda", cost_model=MODEL)
    kernels = ["fused", "fused_uvm", "fused_uvm_caching"]
    options = _options(topology, sharder=ebc_sharder(kernels=kernels))
    buffers = 40 * 8 + 2 * 20 * 10 * 4
    fused, uvm, caching = (options[("table_wise", k)] for k in kernels)
    assert (float(fused.hbm[0]), float(fused.ddr[0])) == pytest.approx((4000 + buffers, 0))
    assert (float(uvm.hbm[0]), float(uvm.ddr[0])) == pytest.approx((buffers, 4000))
    assert (float(caching.hbm[0]), float(caching.ddr[0])) == pytest.approx(
        (buffers + CACHE_LOAD_FACTOR * 4000, 4000)
    )
    read = 3 * 40 * 10 * 4
    assert float(uvm.compute[0]) == pytest.approx(read / 1e8)
    assert float(caching.compute[0]) == pytest.approx(read * (0.5 / 1e9 + 0.5 / 1e8))


def test_per_feature_figures_must_match_the_features():
    enumerator = EmbeddingEnumerator(
        _cpu(), constraints={"t": ParameterConstraints(pooling_factors=[1.0, 2.0])}
    )
    with pytest.raises(ValueError, match="2 pooling factors for 1 features"):
        enumerator.tables(meta_ebc([TABLE]), [ebc_sharder()])


def test_no_allowed_option_is_a_planner_error():
    with pytest.raises(PlannerError, match="'t' has no sharding option"):
        _options(_cpu(), sharding_types=["table_row_wise"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"world_size": 4, "local_world_size": 3}, "does not divide"),
        ({"world_size": 2, "compute_device": "tpu"}, "unknown compute_device"),
        ({"world_size": 2, "ddr_cap": -1}, "negative memory"),
    ],
)
def test_topology_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_topology_bandwidth_overrides_the_cost_model():
    t = Topology(world_size=4, compute_device="cpu", local_world_size=2, cost_model=MODEL, cross_node_bw=5.0)
    assert t.cost_model.cross_node_bw == 5.0 and t.cost_model.intra_node_bw == MODEL.intra_node_bw
    assert t.collective_bw == 5.0 and t.num_nodes == 2 and list(t.host_ranks(1)) == [2, 3]


def test_cost_model_validation():
    with pytest.raises(ValueError, match="hbm_lookup_bw must be positive"):
        MODEL.replace(hbm_lookup_bw=0.0)
    with pytest.raises(ValueError, match="cache_hit_rate"):
        MODEL.replace(cache_hit_rate=1.5)


def test_weighted_ids_carry_their_weights():
    o = _options(_cpu(), module=meta_ebc([TABLE], is_weighted=True))[("table_wise", "fused")]
    assert o.comm.tolist() == pytest.approx([(40 * 12 + 2 * 20 * 10 * 4) / 1e8])


# the cache-miss term: 100 x 10 fp32 = 4000 weight bytes; table-wise sees I = 40 ids per step
MISS = MODEL.replace(id_miss_s=1e-6, lookup_cache_bytes=1000.0)


def test_cost_model_miss_rate():
    assert MISS.miss_rate(4000.0) == pytest.approx(0.75)
    assert MISS.miss_rate(1000.0) == 0.0 and MISS.miss_rate(10.0) == 0.0 and MISS.miss_rate(0.0) == 0.0
    with pytest.raises(ValueError, match="id_miss_s"):
        MODEL.replace(id_miss_s=-1e-9)
    with pytest.raises(ValueError, match="lookup_cache_bytes"):
        MODEL.replace(lookup_cache_bytes=0.0)


def test_ids_that_miss_the_cache_pay_the_memory_latency():
    base = _options(_cpu())
    topology = Topology(world_size=2, compute_device="cpu", cost_model=MISS)
    got = _options(topology)
    tw = ("table_wise", "fused")
    # 40 ids x 1 us x (1 - 1000 / 4000)
    assert got[tw].compute.tolist() == pytest.approx([base[tw].compute.item() + 40 * 1e-6 * 0.75])
    # row-wise: each shard 50 x 10 x 4 = 2000 bytes, 20 ids each, miss 1 - 1000 / 2000
    rw = ("row_wise", "fused")
    assert got[rw].compute.tolist() == pytest.approx([c + 20 * 1e-6 * 0.5 for c in base[rw].compute.tolist()])
    # a replica: its own 20 ids looked up and both ranks' touched rows updated, over the whole table
    dp = ("data_parallel", "fused")
    assert got[dp].compute.tolist() == pytest.approx(
        [c + (20 + 2 * TOUCHED) * 1e-6 * 0.75 for c in base[dp].compute.tolist()]
    )
    assert got[tw].comm.tolist() == base[tw].comm.tolist()  # a compute cost only


def test_the_miss_term_grows_with_the_table_and_vanishes_in_the_cache():
    def table_wise_compute(rows: int, cache: float) -> float:
        table = EmbeddingBagConfig(num_embeddings=rows, embedding_dim=10, name="t", feature_names=["f"])
        model = MODEL.replace(id_miss_s=1e-6, lookup_cache_bytes=cache)
        topology = Topology(world_size=2, compute_device="cpu", cost_model=model)
        return _options(topology, module=meta_ebc([table]))[("table_wise", "fused")].compute.item()

    no_miss = 3 * 40 * 10 * 4 / 1e9  # the bytes term alone: the ids do not depend on the rows
    assert table_wise_compute(100, cache=4000.0) == pytest.approx(no_miss)  # fits the cache exactly
    times = [table_wise_compute(rows, cache=4000.0) for rows in (100, 200, 1000, 10_000, 100_000)]
    assert times == sorted(times) and times[-1] > times[1] > times[0]
    assert times[-1] < no_miss + 40 * 1e-6  # at most every id misses
    # a larger cache never costs more
    assert table_wise_compute(10_000, cache=40_000.0) < table_wise_compute(10_000, cache=4000.0)


def test_a_shard_among_others_misses_as_its_ranks_share_of_all_tables():
    # four tables of 4000 bytes on 2 ranks: a rank's share is 8000 bytes, more than any one shard
    tables = [
        EmbeddingBagConfig(num_embeddings=100, embedding_dim=10, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(4)
    ]
    topology = Topology(world_size=2, compute_device="cpu", cost_model=MISS)
    enumerator = EmbeddingEnumerator(topology, batch_size=10, constraints=None)
    found = enumerator.tables(meta_ebc(tables), [ebc_sharder()])
    options = [o for table, sharder in found for o in enumerator.enumerate(table, sharder)]
    assert rank_footprint_bytes(options, 2) == 4 * 4000 / 2  # each table once, whatever its options
    # a replica is whole on every rank: a table whose only options are data-parallel counts whole
    replicas = [o for o in options if o.sharding_type == "data_parallel"]
    assert rank_footprint_bytes(replicas, 2) == 4 * 4000
    t0_replicated = [o for o in options if o.table.fqn != "t0" or o.sharding_type == "data_parallel"]
    assert rank_footprint_bytes(t0_replicated, 2) == 4000 + 3 * 4000 / 2
    EmbeddingStorageEstimator().estimate(options, topology)
    EmbeddingPerfEstimator().estimate(options, topology)
    with_misses = {id(o): o.compute.clone() for o in options}
    EmbeddingPerfEstimator().estimate(options, Topology(world_size=2, compute_device="cpu", cost_model=MODEL))
    missed = {
        (o.table.fqn, o.sharding_type, o.compute_kernel): with_misses[id(o)] - o.compute for o in options
    }
    # table-wise (a 4000-byte shard) and row-wise (two of 2000 bytes) alike at 1 - 1000 / 8000, one id a
    # bag: 20 ids a table, 10 a row-wise shard (a table alone: 0.75 and 0.5, the tests above)
    assert missed[("t0", "table_wise", "fused")].tolist() == pytest.approx([20 * 1e-6 * 0.875])
    assert missed[("t0", "row_wise", "fused")].tolist() == pytest.approx([10 * 1e-6 * 0.875] * 2)


def test_offloading_kernels_are_not_charged_the_miss_term():
    topology = Topology(world_size=2, compute_device="cuda", cost_model=MISS)
    kernels = ["fused", "fused_uvm_caching"]
    got = _options(topology, sharder=ebc_sharder(kernels=kernels))
    base = _options(
        Topology(world_size=2, compute_device="cuda", cost_model=MODEL), sharder=ebc_sharder(kernels=kernels)
    )
    key = ("table_wise", "fused_uvm_caching")
    assert got[key].compute.tolist() == pytest.approx(base[key].compute.tolist())
    assert got[("table_wise", "fused")].compute.item() > base[("table_wise", "fused")].compute.item()


def test_a_fused_replica_pays_whole_table_passes_only_when_it_all_reduces_the_dense_gradient():
    dp = ("data_parallel", "fused")
    model = MODEL.replace(replica_grad_passes=5.0)
    # 40 of 100 rows touched per step: the touched rows are gathered, no table-sized buffer
    base = _options(_cpu())[dp]
    got = _options(Topology(world_size=2, compute_device="cpu", cost_model=model))[dp]
    assert got.compute.tolist() == pytest.approx(base.compute.tolist())
    # a 10-row table: most rows touched, the dense gradient all-reduced: 5 passes over 400 bytes at 1 GB/s
    small = meta_ebc([EmbeddingBagConfig(num_embeddings=10, embedding_dim=10, name="t", feature_names=["f"])])
    base = _options(_cpu(), module=small)[dp]
    got = _options(Topology(world_size=2, compute_device="cpu", cost_model=model), module=small)[dp]
    assert got.compute.tolist() == pytest.approx([c + 5 * 400 / 1e9 for c in base.compute.tolist()])
    assert base.comm.tolist() == pytest.approx([2 * 0.5 * 10 * 11 * 4 / 1e8] * 2)


def test_a_dense_replica_pays_the_passes_too_and_its_optimizer_on_top():
    key = ("data_parallel", "dense")
    base = _options(_cpu())[key]
    model = MODEL.replace(replica_grad_passes=5.0)
    got = _options(Topology(world_size=2, compute_device="cpu", cost_model=model))[key]
    assert base.compute.tolist() == pytest.approx([3 * 20 * 10 * 4 / 1e9 + 3 * 4000 / 1e9] * 2)
    assert got.compute.tolist() == pytest.approx([c + 5 * 4000 / 1e9 for c in base.compute.tolist()])


def test_replica_groups_are_the_fused_replicas_widths_and_the_plan_pays_each():
    tables = [
        EmbeddingBagConfig(num_embeddings=100, embedding_dim=d, name=f"t{i}", feature_names=[f"f{i}"])
        for i, d in enumerate((8, 8, 16, 32))
    ]
    topology = Topology(world_size=2, compute_device="cpu", cost_model=MODEL)
    enumerator = EmbeddingEnumerator(topology, batch_size=10)
    options = {}
    for table, found in enumerator.tables(meta_ebc(tables), [ebc_sharder()]):
        for o in enumerator.enumerate(table, found):
            options[(table.name, o.sharding_type, o.compute_kernel)] = o
    fused = [options[(f"t{i}", "data_parallel", "fused")] for i in range(4)]
    assert replica_groups(fused) == 3  # widths 8, 16, 32
    assert replica_groups(fused[:2]) == 1
    # table-wise tables and DENSE replicas run no replica exchange
    assert replica_groups([options[("t0", "table_wise", "fused")]]) == 0
    model = MODEL.replace(step_overhead_s=1e-3, replica_group_s=2e-3)
    assert model.plan_overhead(["data_parallel"] * 4, replica_groups(fused)) == pytest.approx(1e-3 + 3 * 2e-3)
    assert model.plan_overhead(["table_wise"]) == pytest.approx(1e-3)


def test_every_output_value_a_shard_writes_costs_local_time_not_only_the_share_sent():
    base = _options(_cpu())
    model = MODEL.replace(output_value_s=1e-9)
    got = _options(Topology(world_size=2, compute_device="cpu", cost_model=model))
    tw, rw, dp = ("table_wise", "fused"), ("row_wise", "fused"), ("data_parallel", "fused")
    # table-wise: the B = 20 bags x 10 columns it pools for both ranks
    assert got[tw].compute.tolist() == pytest.approx([base[tw].compute.item() + 20 * 10 * 1e-9])
    # row-wise: each shard writes partial sums for all 20 bags, though half of them stay on its rank
    # (the reduce-scatter's wire bytes, in comm, are (W-1)/W of them)
    assert got[rw].compute.tolist() == pytest.approx([c + 20 * 10 * 1e-9 for c in base[rw].compute.tolist()])
    # a replica pools its own rank's b = 10 bags only
    assert got[dp].compute.tolist() == pytest.approx([c + 10 * 10 * 1e-9 for c in base[dp].compute.tolist()])
    for key in (tw, rw, dp):
        assert got[key].comm.tolist() == base[key].comm.tolist()  # a compute cost only
    with pytest.raises(ValueError, match="output_value_s"):
        MODEL.replace(output_value_s=-1e-9)


def test_a_missed_row_wider_than_the_latency_costs_its_bytes():
    # rows of 10 fp32 columns are 40 bytes; each of 40 ids misses with probability 1 - 1000 / 4000
    def miss_time(key, latency_bytes):
        model = MISS.replace(miss_latency_bytes=latency_bytes)
        got = _options(Topology(world_size=2, compute_device="cpu", cost_model=model))[key]
        return got.compute.sum().item() - base[key].compute.sum().item()

    base = _options(_cpu())
    tw, rw = ("table_wise", "fused"), ("row_wise", "fused")
    assert miss_time(tw, float("inf")) == pytest.approx(40 * 1e-6 * 0.75)  # per id, as before
    assert miss_time(tw, 40.0) == pytest.approx(40 * 1e-6 * 0.75)  # a row in one latency
    assert miss_time(tw, 10.0) == pytest.approx(4 * 40 * 1e-6 * 0.75)  # its bytes take 4 latencies
    # row-wise: 2 shards of 50 rows (miss 1 - 1000 / 2000), 20 ids each, rows as wide as the table's
    assert miss_time(rw, 10.0) == pytest.approx(4 * 2 * 20 * 1e-6 * 0.5)
    assert MISS.miss_cost(80.0) == MISS.id_miss_s  # inf: per id whatever the width
    assert MISS.replace(miss_latency_bytes=40.0).miss_cost(80.0) == pytest.approx(2 * MISS.id_miss_s)
    with pytest.raises(ValueError, match="miss_latency_bytes"):
        MODEL.replace(miss_latency_bytes=0.0)

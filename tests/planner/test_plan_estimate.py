"""EmbeddingShardingPlanner.estimate: the cost model's figures for a given plan, and the fixed
per-step costs (step, sharding group, shard) that make a plan mixing sharding types cost more."""

from __future__ import annotations

import pytest

from shardkit.modules import EmbeddingBagConfig
from shardkit.planner import CostModel, EmbeddingShardingPlanner, ParameterConstraints, Topology
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
from shardkit.sharding.types import ShardingPlan
from tests.planner._sharder import ebc_sharder, meta_ebc, random_tables

# what calibrate() measured on a 2-core machine with 2 gloo ranks (shared, loaded), rounded: the group
# and step costs are milliseconds, far above the bandwidth terms of small tables
MEASURED_LIKE = CostModel.default("cpu").replace(
    step_overhead_s=0.5e-3,
    group_overhead_s={"table_wise": 5e-3, "row_wise": 4e-3, "column_wise": 5e-3, "data_parallel": 2e-3},
    shard_overhead_s={
        "table_wise": 0.1e-3,
        "row_wise": 0.1e-3,
        "column_wise": 0.3e-3,
        "data_parallel": 0.3e-3,
    },
)


def _tables(n: int = 6, rows: int = 1000, dim: int = 16):
    return [EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(n)]


def _planner(cost_model: CostModel, world: int = 2, **kwargs) -> EmbeddingShardingPlanner:
    return EmbeddingShardingPlanner(
        Topology(world_size=world, compute_device="cpu", cost_model=cost_model), batch_size=64, **kwargs
    )


def _plan(ebc, generators, world: int = 2) -> ShardingPlan:
    return ShardingPlan(
        {"": construct_module_sharding_plan(ebc, generators, world_size=world, local_size=world)}
    )


def test_estimate_of_the_planners_own_plan_is_its_report():
    ebc = meta_ebc(random_tables(12, seed=3, max_rows=10**5))
    for cost_model in (CostModel.default("cpu"), MEASURED_LIKE):
        planner = _planner(cost_model, world=4)
        plan = planner.plan(ebc, [ebc_sharder()])
        report = planner.estimate(ebc, [ebc_sharder()], plan)
        assert report.max_time_s == pytest.approx(planner.last_report.max_time_s, rel=1e-12)
        assert [r["time_s"] for r in report.ranks] == pytest.approx(
            [r["time_s"] for r in planner.last_report.ranks]
        )


def test_mixing_sharding_types_pays_each_types_group():
    """Measured (benchmarks/plan_quality.py, demo tables, 2 ranks): one data-parallel table beside
    table-wise ones made the step ~2x slower than all table-wise; the bytes-only model ranked the mixed
    plan faster. With group overheads the mixed plan costs the data-parallel group on top."""
    ebc = meta_ebc(_tables())
    uniform = _plan(ebc, {f"t{i}": table_wise(rank=i % 2) for i in range(6)})
    mixed = _plan(ebc, {**{f"t{i}": table_wise(rank=i % 2) for i in range(5)}, "t5": data_parallel("fused")})
    planner = _planner(MEASURED_LIKE)
    t_uniform = planner.estimate(ebc, [ebc_sharder()], uniform).max_time_s
    t_mixed = planner.estimate(ebc, [ebc_sharder()], mixed).max_time_s
    assert t_mixed > t_uniform + 1.5e-3  # the data-parallel group's 2 ms, less one table-wise shard
    assert t_uniform == pytest.approx(
        0.5e-3 + 5e-3 + 3 * 0.1e-3 + _bytes_terms(planner, ebc, uniform), rel=1e-9
    )


def _bytes_terms(planner, ebc, plan) -> float:
    """The slowest rank's time without the fixed costs (the same plan under a model without them)."""
    bare = planner.topology.cost_model.replace(
        step_overhead_s=0.0, group_overhead_s={}, shard_overhead_s={}, lookup_overhead_s=0.0
    )
    return _planner(bare).estimate(ebc, [ebc_sharder()], plan).max_time_s


def test_the_planner_keeps_to_one_type_when_groups_are_costly():
    """Uniform costs per table but a 5 ms group each: the planner's plan uses one sharding type."""
    ebc = meta_ebc(_tables(8))
    planner = _planner(MEASURED_LIKE)
    plan = planner.plan(ebc, [ebc_sharder()])
    assert len({ps.sharding_type for ps in plan.plan[""].values()}) == 1


def test_known_large_difference_is_ordered():
    """Four 200000 x 128 tables at 1024 bags of 20 ids per rank (benchmarks/plan_quality.py's
    few_large set: replicated, measured 8-14x slower than table-wise on the idle 2-core machine):
    every replica applies every rank's ~19000 touched rows per table. Far slower than table-wise under
    the default constants. (It used to say: a 1M-row table's 512 MB gradient all-reduce per step; the
    fused replica now gathers the touched rows only, and at a batch of 64 replicating is cheap.)"""
    ebc = meta_ebc(_tables(4, rows=200_000, dim=128))
    tw = _plan(ebc, {f"t{i}": table_wise(rank=i % 2) for i in range(4)})
    dp = _plan(ebc, {f"t{i}": data_parallel("fused") for i in range(4)})
    constraints = {f"t{i}": ParameterConstraints(pooling_factors=[20.0]) for i in range(4)}
    planner = EmbeddingShardingPlanner(
        Topology(world_size=2, compute_device="cpu", cost_model=CostModel.default("cpu")),
        batch_size=1024,
        constraints=constraints,
    )
    t_dp = planner.estimate(ebc, [ebc_sharder()], dp).max_time_s
    t_tw = planner.estimate(ebc, [ebc_sharder()], tw).max_time_s
    assert t_dp > 3 * t_tw
    # at a batch of 64 bags of one id the replicas touch 128 rows per table: no longer far slower
    small_batch = _planner(CostModel.default("cpu"))
    assert (
        small_batch.estimate(ebc, [ebc_sharder()], dp).max_time_s
        < 3 * small_batch.estimate(ebc, [ebc_sharder()], tw).max_time_s
    )


def test_estimate_names_a_table_the_plan_leaves_out():
    ebc = meta_ebc(_tables(3))
    plan = _plan(ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=1)})
    with pytest.raises(KeyError, match="t2"):
        _planner(CostModel.default("cpu")).estimate(ebc, [ebc_sharder()], plan)


def test_negative_fixed_costs_are_refused():
    with pytest.raises(ValueError, match="group_overhead_s.*row_wise"):
        CostModel.default("cpu").replace(group_overhead_s={"row_wise": -1e-3})
    with pytest.raises(ValueError, match="step_overhead_s"):
        CostModel.default("cpu").replace(step_overhead_s=-1.0)


def test_constraints_forcing_one_type_and_estimate_agree():
    """A uniform plan made by the planner under constraints is estimated at the planner's own figure."""
    ebc = meta_ebc(_tables(5))
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(5)}
    planner = _planner(MEASURED_LIKE, constraints=constraints)
    plan = planner.plan(ebc, [ebc_sharder()])
    free = _planner(MEASURED_LIKE)
    assert free.estimate(ebc, [ebc_sharder()], plan).max_time_s == pytest.approx(
        planner.last_report.max_time_s
    )


def test_the_planner_proposes_uniform_plans():
    """Per table, data-parallel is cheapest for the tiny tables and table-wise for the large ones, but
    the data-parallel group costs 20 ms per step: all table-wise is faster, and the planner, which
    proposes every table in one type too, finds it (per-table choices and refinement alone did not)."""
    model = CostModel.default("cpu").replace(
        group_overhead_s={"table_wise": 0.5e-3, "data_parallel": 20e-3},
        shard_overhead_s={"table_wise": 1e-3, "data_parallel": 0.05e-3},
    )
    tables = _tables(4, rows=1_000_000, dim=64) + [
        EmbeddingBagConfig(10, 8, name=f"s{i}", feature_names=[f"g{i}"]) for i in range(4)
    ]
    ebc = meta_ebc(tables)
    types = ParameterConstraints(sharding_types=["table_wise", "data_parallel"])
    planner = _planner(model, constraints={t.name: types for t in tables})
    plan = planner.plan(ebc, [ebc_sharder()])
    assert {ps.sharding_type for ps in plan.plan[""].values()} == {"table_wise"}
    uniform = _plan(ebc, {t.name: table_wise(rank=i % 2) for i, t in enumerate(tables)})
    assert planner.last_report.max_time_s <= planner.estimate(ebc, [ebc_sharder()], uniform).max_time_s


@pytest.mark.parametrize("world", [2, 4])
def test_default_cpu_constants_keep_the_demos_tables_to_one_type(world):
    """With no fixed costs, the default CPU planner gave the demo's 8 tables a data-parallel table
    beside table-wise ones (and a column-wise one at 4 ranks): measured 1.4-2.3x slower than all
    table-wise (benchmarks/plan_quality.py, docs/planner/plan_quality.md). The CPU defaults charge each
    type's group."""
    from shardkit.cli.demo_dlrm import demo_tables

    specs = demo_tables(8)
    ebc = meta_ebc([EmbeddingBagConfig(t.rows, t.dim, name=t.name, feature_names=[t.name]) for t in specs])
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling]) for t in specs}
    topology = Topology(world_size=world, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology, batch_size=256, constraints=constraints)  # the demo's
    plan = planner.plan(ebc, [ebc_sharder()])
    assert len({ps.sharding_type for ps in plan.plan[""].values()}) == 1, str(planner.last_report)


def _pinned(widths, ranks, group_s: float, free=(), rows=None, pooling=None, bag_s: float = 0.0):
    """Planner (table-wise only; table ``i`` of ``rows[i]`` (default 1000) x ``widths[i]`` at
    ``pooling[i]`` ids per bag (default 1) on rank ``ranks[i]`` unless in ``free``) with
    ``lookup_group_s`` = ``group_s`` and ``lookup_group_bag_s`` = ``bag_s``, its plan and the module,
    on 2 CPU ranks."""
    rows = rows or [1000] * len(widths)
    pooling = pooling or [1.0] * len(widths)
    tables = [
        EmbeddingBagConfig(rows[i], d, name=f"t{i}", feature_names=[f"f{i}"]) for i, d in enumerate(widths)
    ]
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=["table_wise"],
            ranks=None if i in free else [ranks[i]],
            pooling_factors=[pooling[i]],
        )
        for i, t in enumerate(tables)
    }
    model = MEASURED_LIKE.replace(lookup_group_s=group_s, lookup_group_bag_s=bag_s)
    planner = _planner(model, world=2, constraints=constraints)
    ebc = meta_ebc(tables)
    plan = planner.plan(ebc, [ebc_sharder()])
    return planner, plan, ebc


def test_a_rank_pays_each_lookup_group_it_holds_once():
    """Measured (many_small's 48 table-wise tables on 2 ranks, alternating rounds, shared machine,
    loaded): widths 8 / 16 / 32 in turn took 1.7 and 2.5 ms a step more than the same tables all
    16 wide (two runs, 10.1 / 8.4 and 7.0 / 4.5 ms), where the model, per shard and per byte, said
    0.05 ms. A rank's shards of one width share a lookup; each more width is a kernel call more."""
    ranks = [0, 1, 0, 1, 0, 1]
    for widths, groups in (((8, 16, 32, 8, 16, 32), 3), ((16,) * 6, 1), ((8, 8, 16, 16, 8, 8), 2)):
        planner0, plan, ebc = _pinned(widths, ranks, 0.0)
        planner1, _, _ = _pinned(widths, ranks, 1e-3)
        assert [r["time_s"] for r in planner1.last_report.ranks] == pytest.approx(
            [r["time_s"] + groups * 1e-3 for r in planner0.last_report.ranks], rel=1e-9
        )
        # the estimate of a given plan counts them alike
        report = planner1.estimate(ebc, [ebc_sharder()], plan)
        assert report.max_time_s == pytest.approx(planner1.last_report.max_time_s, rel=1e-12)


def test_a_lookup_group_costs_more_the_more_bags_its_rank_serves():
    """``lookup_group_bag_s``: each group is a kernel call forward and backward over every bag the rank
    serves (table-wise: the global batch, the planner's batch per rank x 2 ranks). Measured on 2 ranks
    (8 table-wise tables of 4 widths against one width): an extra group cost 0.21-0.28 ms at 32 bags a
    rank, 0.53-0.66 ms at 1024."""
    ranks = [0, 1, 0, 1, 0, 1]
    bags = 2 * 64  # _planner's batch per rank x 2 ranks
    for widths, groups in (((8, 16, 32, 8, 16, 32), 3), ((16,) * 6, 1)):
        planner0, plan, ebc = _pinned(widths, ranks, 0.0)
        planner1, _, _ = _pinned(widths, ranks, 0.0, bag_s=1e-6)
        assert [r["time_s"] for r in planner1.last_report.ranks] == pytest.approx(
            [r["time_s"] + groups * bags * 1e-6 for r in planner0.last_report.ranks], rel=1e-9
        )
        report = planner1.estimate(ebc, [ebc_sharder()], plan)
        assert report.max_time_s == pytest.approx(planner1.last_report.max_time_s, rel=1e-12)


def test_a_free_shard_goes_where_its_lookup_group_is_when_groups_cost_enough():
    # t1 (8 wide, the largest: placed first) on rank 1, t0 (16 wide) on rank 0; t2 (16 wide, the
    # smallest: placed last) free: rank 1 is less loaded, but rank 0 already holds a 16-wide group
    widths, ranks = (16, 8, 16), [0, 1, None]

    def rank_of_t2(group_s: float) -> int:
        _, plan, _ = _pinned(
            widths, ranks, group_s, free=(2,), rows=[1000, 4000, 1000], pooling=[4.0, 4.0, 1.0]
        )
        return plan.plan[""]["t2"].ranks[0]

    assert rank_of_t2(0.0) == 1
    assert rank_of_t2(1e-2) == 0


def test_column_blocks_of_one_width_on_one_rank_are_one_lookup_group():
    # a 64-column table in 4 blocks of 16, all allowed on rank 0 only: one group there, not four
    table = EmbeddingBagConfig(1000, 64, name="t0", feature_names=["f0"])
    times = []
    for group_s in (0.0, 1e-3):
        constraints = {
            "t0": ParameterConstraints(sharding_types=["column_wise"], ranks=[0], min_partition=16)
        }
        planner = _planner(MEASURED_LIKE.replace(lookup_group_s=group_s), world=4, constraints=constraints)
        plan = planner.plan(meta_ebc([table]), [ebc_sharder()])
        assert plan.plan[""]["t0"].ranks == [0, 0, 0, 0]
        times.append([r["time_s"] for r in planner.last_report.ranks])
    assert times[1] == pytest.approx([times[0][0] + 1e-3] + times[0][1:], rel=1e-9)


def test_a_replica_group_on_the_dense_way_pays_its_fixed_cost_once_and_only_then():
    """``replica_dense_s``: a group of FUSED replicas whose backward all-reduces its dense gradient
    (most of its rows touched) pays it once per step, in place of the sparse way's ``replica_group_s``
    (it gathers no rows); the way is the group's (its tables' rows and
    touched rows summed, as the library's exchange decides on the group's stacked table), so a small,
    fully touched table in a group with a large one of its width takes the sparse way and pays nothing."""
    from shardkit.planner.estimators import dense_replica_groups

    # 64 rows at 64 bags x 20 ids a rank: every row touched (dense alone); 100000 rows: few touched
    shapes = {"small16": (64, 16), "big16": (100_000, 16), "small32": (64, 32)}
    configs = [EmbeddingBagConfig(r, d, name=n, feature_names=[n]) for n, (r, d) in shapes.items()]
    ebc = meta_ebc(configs)
    constraints = {n: ParameterConstraints(pooling_factors=[20.0]) for n in shapes}
    fused = {n: data_parallel(compute_kernel="fused") for n in shapes}
    base = MEASURED_LIKE.replace(replica_group_s=1e-3, replica_dense_s=0.0)
    charged = base.replace(replica_dense_s=0.7e-3)

    def estimate(names, model):
        sub = meta_ebc([c for c in configs if c.name in names])
        plan = _plan(sub, {n: fused[n] for n in names})
        planner = _planner(model, constraints={n: constraints[n] for n in names})
        report = planner.estimate(sub, [ebc_sharder()], plan)
        return report.max_time_s

    for names, dense in ((["small16"], 1), (["small16", "big16"], 0), (["small16", "big16", "small32"], 1)):
        assert estimate(names, charged) - estimate(names, base) == pytest.approx(dense * 0.7e-3), names
    # the dense way's group pays replica_dense_s instead of the sparse way's replica_group_s
    swapped = base.replace(replica_group_s=0.0, replica_dense_s=1e-3)
    assert estimate(["small16", "big16", "small32"], swapped) == pytest.approx(
        estimate(["small16", "big16", "small32"], base)
    )
    # the count itself, from the planner's options of the plan
    planner = _planner(base, constraints=constraints)
    from shardkit.planner.plan_estimate import plan_options

    tables = [t for t, _ in planner.enumerator.tables(ebc, [ebc_sharder()])]
    options = {o.table.name: o for o in plan_options(tables, _plan(ebc, fused), planner.topology)}
    assert dense_replica_groups([options["small16"], options["small32"]], 2) == 2
    assert dense_replica_groups([options["small16"], options["big16"]], 2) == 0
    assert dense_replica_groups([options["small16"]], 1) == 0  # one rank exchanges nothing
    # two groups, one of them dense: one replica_group_s (1 ms) and one replica_dense_s (0 here)
    assert base.plan_overhead(["data_parallel"], 2, 1) == pytest.approx(
        base.step_overhead_s + base.group_overhead_s["data_parallel"] + 1e-3
    )
    assert charged.plan_overhead(["data_parallel"], 2, 1) - base.plan_overhead(["data_parallel"], 2, 1) == (
        pytest.approx(0.7e-3)
    )


def test_data_parallel_tables_of_interleaved_widths_pay_the_permutation_once_per_module():
    """``replica_permute_s``: a module's data-parallel tables are looked up one (width, dtype) group at
    a time, groups in order of first appearance; widths 16, 32, 16 make the sharded module permute
    every batch into group order and the output columns back, widths 16, 16, 32 do not. Measured on 2
    ranks (12 data-parallel tables of 3 widths, 256 bags, a new batch object a step): interleaved 4.05
    ms against 3.69 in group order."""
    from shardkit.planner.estimators import permuted_replica_modules
    from shardkit.planner.plan_estimate import plan_options

    fused = data_parallel(compute_kernel="fused")
    base = MEASURED_LIKE.replace(replica_permute_s=0.0)
    charged = base.replace(replica_permute_s=0.4e-3)
    for widths, permuted in (((16, 32, 16), 1), ((16, 16, 32), 0), ((32, 16, 16), 0), ((16,), 0)):
        configs = [
            EmbeddingBagConfig(1000, d, name=f"t{i}", feature_names=[f"f{i}"]) for i, d in enumerate(widths)
        ]
        ebc = meta_ebc(configs)
        plan = _plan(ebc, {c.name: fused for c in configs})
        times = [_planner(m).estimate(ebc, [ebc_sharder()], plan).max_time_s for m in (base, charged)]
        assert times[1] - times[0] == pytest.approx(permuted * 0.4e-3), widths
        planner = _planner(base)
        tables = [t for t, _ in planner.enumerator.tables(ebc, [ebc_sharder()])]
        options = plan_options(tables, plan, planner.topology)
        assert permuted_replica_modules(options) == permuted
        # the count does not depend on the order the options come in (a proposal's order)
        assert permuted_replica_modules(options[::-1]) == permuted
        # the planner's own partition charges it alike
        only_dp = {
            c.name: ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["fused"])
            for c in configs
        }
        planner = _planner(charged, constraints=only_dp)
        planned = planner.plan(ebc, [ebc_sharder()])
        assert planner.last_report.max_time_s == pytest.approx(
            planner.estimate(ebc, [ebc_sharder()], planned).max_time_s, rel=1e-12
        )
        without = _planner(base, constraints=only_dp)
        without.plan(ebc, [ebc_sharder()])
        assert planner.last_report.max_time_s - without.last_report.max_time_s == pytest.approx(
            permuted * 0.4e-3
        )

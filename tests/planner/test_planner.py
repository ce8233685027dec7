"""EmbeddingShardingPlanner on one process: valid plans, constraints, memory, balance, explanations."""

from __future__ import annotations

import json

import pytest
from torch import nn

from shardkit.modules import EmbeddingBagConfig, EmbeddingConfig, OptimType
from shardkit.planner import (
    GIB,
    EmbeddingShardingPlanner,
    HeuristicalStorageReservation,
    ParameterConstraints,
    PlannerError,
    Topology,
)
from shardkit.sharding.sharding_plan import grid_shard
from shardkit.sharding.types import ShardingPlan, ShardingType
from tests.planner._sharder import DENSE, FUSED, ebc_sharder, ec_sharder, meta_ebc, meta_ec, random_tables

TW, RW, CW, DP = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)
TWRW, TWCW = ShardingType.TABLE_ROW_WISE.value, ShardingType.TABLE_COLUMN_WISE.value
GRID = ShardingType.GRID_SHARD.value


def _planner(world=4, local=None, device="cpu", **kwargs) -> EmbeddingShardingPlanner:
    topology = kwargs.pop("topology", None) or Topology(
        world_size=world, compute_device=device, local_world_size=local
    )
    return EmbeddingShardingPlanner(topology, **kwargs)


def _check_plan(plan: ShardingPlan, module_tables, world: int) -> None:
    """Every table of every module planned exactly once, with metadata that tiles it."""
    assert set(plan.plan) == set(module_tables)
    for path, tables in module_tables.items():
        module_plan = plan.plan[path]
        assert list(module_plan) == [t.name for t in tables]
        for t in tables:
            module_plan[t.name].check(t.name, (t.num_embeddings, t.embedding_dim), world)


@pytest.mark.parametrize("world, local", [(1, 1), (3, 3), (8, 8), (8, 4)])
def test_every_table_planned_once_with_valid_shards(world, local):
    tables = random_tables(40, seed=world)
    plan = _planner(world, local).plan(meta_ebc(tables), [ebc_sharder()])
    _check_plan(plan, {"": tables}, world)


def test_nested_modules_are_found_by_sharder_type():
    bag_tables = random_tables(3, seed=1, max_rows=1000)
    seq_tables = [EmbeddingConfig(num_embeddings=50, embedding_dim=8, name="s", feature_names=["q"])]
    model = nn.ModuleDict(
        {
            "dense": nn.Linear(8, 8),
            "sparse": nn.ModuleDict({"bags": meta_ebc(bag_tables)}),
            "seq": meta_ec(seq_tables),
        }
    )
    planner = _planner(2)
    plan = planner.plan(model, [ebc_sharder(), ec_sharder()])
    _check_plan(plan, {"sparse.bags": bag_tables, "seq": seq_tables}, 2)
    assert "seq.s" in str(planner.last_report)
    # without the EmbeddingCollection sharder, that module is left alone
    assert set(_planner(2).plan(model, [ebc_sharder()]).plan) == {"sparse.bags"}


def test_no_shardable_module_is_an_error():
    with pytest.raises(PlannerError, match="no sharder handles"):
        _planner(2).plan(nn.Linear(2, 2), [ebc_sharder()])


def test_constraints_on_types_kernels_and_ranks_are_respected():
    tables = random_tables(30, seed=3)
    constraints = {
        "t0": ParameterConstraints(sharding_types=[RW]),
        "t1": ParameterConstraints(sharding_types=[TW], ranks=[2]),
        "t2": ParameterConstraints(sharding_types=[TW, CW], ranks=[1, 3]),
        "t3": ParameterConstraints(compute_kernels=[DENSE]),
        "t4": ParameterConstraints(sharding_types=[DP]),
    }
    plan = _planner(4, constraints=constraints).plan(meta_ebc(tables), [ebc_sharder()]).plan[""]
    assert plan["t0"].sharding_type == RW
    assert plan["t1"].sharding_type == TW and plan["t1"].ranks == [2]
    assert set(plan["t2"].ranks) <= {1, 3}
    assert plan["t3"].compute_kernel == DENSE
    assert plan["t4"].sharding_type == DP
    # the sharder's own limits apply too
    only = _planner(4).plan(meta_ebc(tables), [ebc_sharder(types=[TW], kernels=[FUSED])]).plan[""]
    assert {(ps.sharding_type, ps.compute_kernel) for ps in only.values()} == {(TW, FUSED)}


def test_min_partition_sets_the_column_shards():
    tables = [EmbeddingBagConfig(num_embeddings=1000, embedding_dim=128, name="w", feature_names=["f"])]
    constraints = {"w": ParameterConstraints(sharding_types=[CW], min_partition=32)}
    ps = _planner(8, constraints=constraints).plan(meta_ebc(tables), [ebc_sharder()]).plan[""]["w"]
    assert [s.shard_sizes[1] for s in ps.sharding_spec.shards] == [32, 32, 32, 32]
    narrow = {"w": ParameterConstraints(sharding_types=[CW], min_partition=100)}
    with pytest.raises(PlannerError, match="'w' has no sharding option"):
        _planner(8, constraints=narrow).plan(meta_ebc(tables), [ebc_sharder()])


def test_node_types_need_several_nodes():
    tables = random_tables(10, seed=4)
    one_node = _planner(4, 4).plan(meta_ebc(tables), [ebc_sharder()]).plan[""]
    assert not {ps.sharding_type for ps in one_node.values()} & {TWRW, TWCW}
    constraints = {
        "t0": ParameterConstraints(sharding_types=[TWRW]),
        "t1": ParameterConstraints(sharding_types=[TWCW]),
    }
    tables[1] = EmbeddingBagConfig(num_embeddings=100, embedding_dim=64, name="t1", feature_names=["f1"])
    two_nodes = _planner(4, 2, constraints=constraints).plan(meta_ebc(tables), [ebc_sharder()]).plan[""]
    for name in ("t0", "t1"):
        ranks = two_nodes[name].ranks
        assert ranks in ([0, 1], [2, 3]), (name, ranks)


def test_grid_shard_only_where_the_constraints_name_it():
    tables = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=64, name="g", feature_names=["f"])]
    unconstrained = _planner(4, 2).plan(meta_ebc(tables), [ebc_sharder()]).plan[""]["g"]
    assert unconstrained.sharding_type != GRID
    constraints = {"g": ParameterConstraints(sharding_types=[GRID], min_partition=16)}
    ps = _planner(4, 2, constraints=constraints).plan(meta_ebc(tables), [ebc_sharder()]).plan[""]["g"]
    # one column block per node, its rows over the node's ranks: grid_shard(host_indexes=[0, 1])'s plan
    expected = grid_shard(host_indexes=[0, 1])("g", (10, 64), 2, 4, "cpu")
    assert ps.sharding_type == GRID and ps.ranks == expected.ranks == [0, 1, 2, 3]
    assert ps.sharding_spec.shards == expected.sharding_spec.shards
    one_node = {"g": ParameterConstraints(sharding_types=[GRID])}
    with pytest.raises(PlannerError, match="GRID_SHARD need more than one node"):
        _planner(4, 4, constraints=one_node).plan(meta_ebc(tables), [ebc_sharder()])


def test_plans_fit_the_memory_and_big_tables_get_split():
    # 4 ranks of 1 GiB DDR; a 1.5 GiB table fits no rank whole, so it must be split
    big = EmbeddingBagConfig(num_embeddings=3 * 2**20, embedding_dim=128, name="big", feature_names=["f"])
    tables = [big] + random_tables(20, seed=5, max_rows=10**4)
    topology = Topology(world_size=4, compute_device="cpu", ddr_cap=GIB)
    planner = _planner(topology=topology)
    plan = planner.plan(meta_ebc(tables), [ebc_sharder()]).plan[""]
    assert plan["big"].sharding_type in (RW, CW)
    report = planner.last_report
    for rank in report.ranks:
        assert rank["ddr_bytes"] <= GIB * (1 - 0.15)
        assert rank["ddr_free_bytes"] >= 0


def test_gpu_memory_uses_hbm_and_uvm_goes_to_ddr():
    tables = random_tables(6, seed=6, max_rows=10**4)
    planner = _planner(
        2, device="cuda", constraints={"t0": ParameterConstraints(compute_kernels=["fused_uvm"])}
    )
    planner.plan(meta_ebc(tables), [ebc_sharder(kernels=[FUSED, "fused_uvm"])])
    rows = {t["table"]: t for t in planner.last_report.tables}
    assert rows["t0"]["ddr_bytes"] > 0 and rows["t1"]["ddr_bytes"] == 0 and rows["t1"]["hbm_bytes"] > 0


def test_infeasible_memory_names_the_tables_and_bytes():
    tables = [
        EmbeddingBagConfig(num_embeddings=2**20, embedding_dim=256, name="huge", feature_names=["a"]),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=8, name="tiny", feature_names=["b"]),
    ]
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=100 * 2**20)
    with pytest.raises(PlannerError) as info:
        _planner(topology=topology).plan(meta_ebc(tables), [ebc_sharder()])
    message = str(info.value)
    assert "'huge'" in message and "'tiny'" not in message
    assert "MiB" in message and "DDR" in message
    assert info.value.tables == ["huge"]


def test_dense_part_too_big_for_the_reservation():
    model = nn.ModuleDict({"mlp": nn.Linear(1024, 1024), "ebc": meta_ebc(random_tables(2, seed=7))})
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=4 * 2**20)
    with pytest.raises(PlannerError, match="dense part of the model needs 16.0 MiB"):
        _planner(topology=topology).plan(model, [ebc_sharder()])
    roomy = HeuristicalStorageReservation(percentage=0.0, dense_factor=0.0)
    _planner(topology=topology, storage_reservation=roomy).plan(model, [ebc_sharder()])


def test_optimizer_state_counts_toward_memory():
    tables = random_tables(4, seed=8, max_rows=10**4)
    sharder = [ebc_sharder(types=[TW], kernels=[FUSED])]
    sgd, adam = _planner(2, optimizer=OptimType.SGD), _planner(2, optimizer=OptimType.ADAM)
    sgd.plan(meta_ebc(tables), sharder)
    adam.plan(meta_ebc(tables), sharder)
    used = lambda p: sum(r["ddr_bytes"] for r in p.last_report.ranks)  # noqa: E731
    weights = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    assert used(adam) - used(sgd) == pytest.approx(2 * weights)


@pytest.mark.parametrize("world", [8, 16])
def test_imbalance_is_small_on_random_tables(world):
    planner = _planner(world, 8, device="cuda")
    planner.plan(meta_ebc(random_tables(300, seed=world)), [ebc_sharder()])
    assert planner.last_report.imbalance < 1.1


def test_balances_better_than_round_robin_table_wise():
    tables = random_tables(50, seed=9)
    best = _planner(4)
    best.plan(meta_ebc(tables), [ebc_sharder()])
    naive = _planner(
        4,
        constraints={
            t.name: ParameterConstraints(sharding_types=[TW], ranks=[i % 4]) for i, t in enumerate(tables)
        },
    )
    naive.plan(meta_ebc(tables), [ebc_sharder()])
    assert best.last_report.max_time_s < naive.last_report.max_time_s


def test_printed_plan_and_dict():
    tables = random_tables(5, seed=10, max_rows=1000)
    planner = _planner(3)
    plan = planner.plan(meta_ebc(tables), [ebc_sharder()])
    report = planner.last_report
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "tables:" and "sharding" in lines[1] and "max shard ms" in lines[1]
    for t in tables:
        row = next(line for line in lines if line.startswith(t.name + " "))
        assert plan.plan[""][t.name].sharding_type in row
    assert "ranks:" in lines and sum(1 for line in lines if line[:2] in ("0 ", "1 ", "2 ")) == 3
    assert "imbalance" in lines[-1]
    data = json.loads(report.to_json())
    assert [t["table"] for t in data["tables"]] == [t.name for t in tables]
    assert len(data["ranks"]) == 3 and data["imbalance"] >= 1.0
    assert data["cost_model"]["ddr_lookup_bw"] > 0
    assert data["max_time_s"] == pytest.approx(max(r["time_s"] for r in data["ranks"]))


def test_planning_is_deterministic():
    tables = random_tables(60, seed=11)
    first = _planner(8, 4).plan(meta_ebc(tables), [ebc_sharder()])
    second = _planner(8, 4).plan(meta_ebc(tables), [ebc_sharder()])
    assert str(first) == str(second)
    assert all(first.plan[""][n] == second.plan[""][n] for n in first.plan[""])


def test_constraint_ranks_outside_the_world():
    constraints = {"t0": ParameterConstraints(ranks=[0, 4])}
    with pytest.raises(ValueError, match=r"'t0': constraint ranks \[4\] are outside a world of 4"):
        _planner(4, constraints=constraints).plan(meta_ebc(random_tables(2, seed=0)), [ebc_sharder()])


def test_without_a_fused_optimizer_only_other_kernels_are_planned():
    tables = random_tables(10, seed=12)
    plan = _planner(2).plan(meta_ebc(tables, fused=False), [ebc_sharder()]).plan[""]
    assert {ps.compute_kernel for ps in plan.values()} == {DENSE}
    with pytest.raises(PlannerError, match="FUSED kernels need a module built with a fused_optimizer"):
        _planner(2).plan(meta_ebc(tables, fused=False), [ebc_sharder(kernels=[FUSED])])

"""collective_plan and calibrate on several ranks: every rank ends with the same plan and constants.

Each rank builds the planner with a rank-dependent batch size, so a rank that planned on its own
would get a different plan: equality proves the plan came from rank 0.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardkit.distributed.collective_utils import RemoteInvocationError
from shardkit.modules import EmbeddingBagConfig
from shardkit.planner import CostModel, EmbeddingShardingPlanner, PlannerError, Topology, calibrate
from shardkit.testing import run_world
from tests.planner._sharder import ebc_sharder, meta_ebc, random_tables

SMALL_LOOKUP = {"rows": 4096, "dim": 16, "batch": 64, "pooling": 4}


def _collective_plan_and_calibration(world: int):
    rank = dist.get_rank()
    topology = Topology(
        world_size=world, compute_device="cpu", local_world_size=2 if world % 2 == 0 else None
    )
    planner = EmbeddingShardingPlanner(topology, batch_size=64 * (rank + 1))
    plan = planner.collective_plan(meta_ebc(random_tables(30, seed=0)), [ebc_sharder()])
    own = EmbeddingShardingPlanner(topology, batch_size=64 * (rank + 1))
    own.plan(meta_ebc(random_tables(30, seed=0)), [ebc_sharder()])
    # the bandwidths only: the timed steps (seconds on 3 ranks sharing 2 cores) and their agreement
    # are tests/planner/test_calibration_steps.py's
    cost_model = calibrate("cpu", measure_steps=False, **SMALL_LOOKUP)
    return str(plan), planner.last_report.to_json(), own.last_report.max_time_s, cost_model


@pytest.mark.parametrize("world", [2, 3])
def test_collective_plan_and_calibration_agree_on_every_rank(world):
    results = run_world(_collective_plan_and_calibration, world, world, timeout=90)
    plans, reports, own_times, models = zip(*results)
    assert all(p == plans[0] for p in plans)
    assert all(r == reports[0] for r in reports)
    # planning alone, the ranks would have disagreed (their batch sizes differ)
    assert len(set(own_times)) == world
    assert all(m == models[0] for m in models)
    # one node (the harness's ranks): the measured all-to-all bandwidth replaced the intra-node default
    default = CostModel.default("cpu")
    assert models[0].intra_node_bw != default.intra_node_bw
    assert models[0].cross_node_bw == default.cross_node_bw
    assert models[0].ddr_lookup_bw != default.ddr_lookup_bw


def _collective_infeasible():
    huge = [EmbeddingBagConfig(num_embeddings=2**22, embedding_dim=256, name="huge", feature_names=["f"])]
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=2**20)
    try:
        EmbeddingShardingPlanner(topology).collective_plan(meta_ebc(huge), [ebc_sharder()])
    except (PlannerError, RemoteInvocationError) as err:
        return type(err).__name__, "'huge'" in str(err)
    return None


def test_collective_plan_error_reaches_every_rank():
    assert run_world(_collective_infeasible, 2, timeout=60) == [
        ("PlannerError", True),
        ("RemoteInvocationError", True),
    ]


def _collective_plan_with_a_16_rank_topology():
    tables = [EmbeddingBagConfig(num_embeddings=100, embedding_dim=8, name="t", feature_names=["f"])]
    topology = Topology(world_size=16, compute_device="cpu")
    try:
        EmbeddingShardingPlanner(topology).collective_plan(meta_ebc(tables), [ebc_sharder()])
    except (ValueError, RemoteInvocationError) as err:
        return type(err).__name__, str(err)
    return None


def test_collective_plan_checks_the_topology_against_the_process_group():
    results = run_world(_collective_plan_with_a_16_rank_topology, 2, timeout=60)
    assert [kind for kind, _ in results] == ["ValueError", "RemoteInvocationError"]
    for _, message in results:
        assert "topology has world_size 16" in message and "process group has 2 ranks" in message


def test_collective_plan_without_torch_distributed_is_a_one_rank_group():
    tables = [EmbeddingBagConfig(num_embeddings=100, embedding_dim=8, name="t", feature_names=["f"])]
    with pytest.raises(ValueError, match="world_size 4 but the process group has 1 ranks"):
        EmbeddingShardingPlanner(Topology(world_size=4, compute_device="cpu")).collective_plan(
            meta_ebc(tables), [ebc_sharder()]
        )
    plan = EmbeddingShardingPlanner(Topology(world_size=1, compute_device="cpu")).collective_plan(
        meta_ebc(tables), [ebc_sharder()]
    )
    assert "t" in plan.plan[""]

"""DistributedModelParallel trains a DLRM exactly as the unsharded model trains on the global batches.

One ``run_world`` per world size checks the planner's plan and a forced plan of every sharding type
(all tables of that type), plus a mixed plan: losses step by step and every weight after the steps.
The other checks (structure, state dict, copy, meta init, optimizer combination) run on 2 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.model_parallel import (
    CombinedOptimizer,
    DataParallelWrapper,
    DistributedModelParallel,
    get_module,
    get_unwrapped_module,
    sharded_model_copy,
)
from shardkit.modules import OptimType
from shardkit.sharding.embeddingbag import ShardedEmbeddingBagCollection
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from shardkit.sharding.types import ShardingPlan
from shardkit.testing import run_world
from tests.model_parallel import _dlrm as d

STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-6)


def forced_plans(world_size: int, local_size: int):
    """Plan name -> per-table generators (None: let DistributedModelParallel plan)."""
    names = [name for name, *_ in d.TABLES]
    hosts = world_size // local_size
    every = {
        "table_wise": lambda i: table_wise(rank=i % world_size),
        "row_wise": lambda i: row_wise(),
        "column_wise": lambda i: column_wise(ranks=[(i + k) % world_size for k in range(2)]),
        "data_parallel": lambda i: data_parallel(),
        "table_row_wise": lambda i: table_row_wise(host_index=i % hosts),
        "table_column_wise": lambda i: table_column_wise(host_index=i % hosts),
    }
    plans = {"planner": None}
    plans.update({kind: {n: make(i) for i, n in enumerate(names)} for kind, make in every.items()})
    kinds = list(every.values())
    plans["mixed"] = {n: kinds[i % len(kinds)](i) for i, n in enumerate(names)}
    return plans


def combined_optimizer(dmp: DistributedModelParallel) -> CombinedOptimizer:
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=d.LR)
    return CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])


def train_dmp(dmp: DistributedModelParallel, steps: int, optimizer=None, first_step: int = 0) -> list:
    """Train on this rank's batches ``first_step ..``; the mean loss over ranks of each step."""
    rank = dmp._env.rank
    optimizer = optimizer or combined_optimizer(dmp)
    losses = []
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        loss, _ = dmp(d.rank_batch(step, rank))
        loss.backward()
        optimizer.step()
        losses.append(d.mean_over_ranks(loss.item()))
    return losses


def shard(model, generators, world_size, local_size) -> DistributedModelParallel:
    plan = None
    if generators is not None:
        plan = ShardingPlan(
            {"ebc": construct_module_sharding_plan(model.ebc, generators, local_size, world_size)}
        )
    return DistributedModelParallel(model, plan=plan)


def _equivalence_worker(world_size: int, local_size: int) -> list:
    checked = []
    for name, generators in forced_plans(world_size, local_size).items():
        reference = d.make_model()
        dmp = shard(copy.deepcopy(reference), generators, world_size, local_size)
        assert isinstance(dmp.module.ebc, ShardedEmbeddingBagCollection)
        assert dmp.plan.get_plan_for_module("ebc") is not None
        losses = train_dmp(dmp, STEPS)
        expected = d.train_reference(reference, STEPS, world_size)
        assert losses == pytest.approx(expected, rel=1e-5), name
        d.assert_same_weights(dmp.module, reference, TOL)
        checked.append(name)
    return checked


@pytest.mark.parametrize("world_size, local_size", [(2, 2), (4, 2)])
def test_trains_like_the_unsharded_model_with_every_plan(world_size, local_size):
    results = run_world(_equivalence_worker, world_size, world_size, local_size, local_world_size=local_size)
    assert all(r == list(forced_plans(world_size, local_size)) for r in results)


def _structure_worker() -> bool:
    rank = ShardingEnv.from_process_group(None).rank
    dmp = shard(d.make_model(), forced_plans(2, 2)["table_wise"], 2, 2)
    # wrappers: DMP -> DDP -> bare model; names do not depend on them
    assert isinstance(dmp._dmp_wrapped_module, DistributedDataParallel)
    assert get_module(dmp) is dmp._dmp_wrapped_module
    assert get_unwrapped_module(dmp) is dmp.module is dmp._dmp_wrapped_module.module
    bare = dict(dmp.bare_named_parameters())
    assert set(bare) == {n for n, _ in dmp.module.named_parameters()}
    assert "dense_arch.0.weight" in bare and not any(n.startswith("_dmp") for n in bare)
    assert all(not k.startswith(("_dmp", "module.")) for k in dmp.state_dict())
    # DDP ignores the table shards; it owns the dense layers
    ignored = set(dmp._dmp_wrapped_module.parameters_to_ignore)
    assert any(n.startswith("ebc.") for n in ignored) and not any(n.startswith("dense") for n in ignored)
    # the fused optimizer is reachable, keyed by module path, and combines with a dense one
    fused = dmp.fused_optimizer
    assert [k for k, _ in fused.optimizers] == ["ebc"]
    combined = CombinedOptimizer([("fused", fused), ("dense", torch.optim.SGD(bare.values(), lr=d.LR))])
    state = combined.state_dict()
    assert set(state) == {"fused", "dense"} and set(state["fused"]) == {"ebc"}
    combined.load_state_dict(state)
    with pytest.raises(KeyError, match="missing"):
        combined.load_state_dict({"fused": state["fused"]})

    # state_dict round trip into a second model with different weights
    train_dmp(dmp, 2)
    other = shard(d.make_model(seed=5), forced_plans(2, 2)["table_wise"], 2, 2)
    other.load_state_dict(dmp.state_dict())
    batch = d.rank_batch(7, rank)
    with torch.no_grad():
        torch.testing.assert_close(other(batch)[1], dmp(batch)[1])

    # copy: independent tensors, same outputs
    copied = dmp.copy(torch.device("cpu"))
    assert isinstance(copied, DistributedModelParallel)
    assert copied.module.dense_arch[0].weight.data_ptr() != dmp.module.dense_arch[0].weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(copied(batch)[1], dmp(batch)[1])
    with sharded_model_copy("cpu"):
        deep = copy.deepcopy(dmp)
    with torch.no_grad():
        torch.testing.assert_close(deep(batch)[1], dmp(batch)[1])
    assert deep.module.dense_arch[0].weight.data_ptr() != dmp.module.dense_arch[0].weight.data_ptr()
    return True


def test_structure_state_dict_copy_and_optimizers():
    assert all(run_world(_structure_worker, 2))


class _NoDataParallel(DataParallelWrapper):
    def wrap(self, dmp, env, device) -> None:
        dmp.wrapped_by_custom = True


def _meta_worker() -> bool:
    env = ShardingEnv.from_process_group(None)
    model = d.DLRM(device=torch.device("meta"))
    dmp = DistributedModelParallel(model, plan=None)
    assert not any(p.is_meta for p in dmp.parameters())
    # the replicas agree after DDP's broadcast at wrapping, though each rank initialized its own
    weight = dmp.module.over_arch[0].weight.detach().clone()
    gathered = [torch.empty_like(weight) for _ in range(env.world_size)]
    torch.distributed.all_gather(gathered, weight)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    loss, _ = dmp(d.rank_batch(0, env.rank))
    assert torch.isfinite(loss)

    custom = DistributedModelParallel(d.make_model(), data_parallel_wrapper=_NoDataParallel())
    assert custom.wrapped_by_custom and not isinstance(custom._dmp_wrapped_module, DistributedDataParallel)
    lazy = DistributedModelParallel(d.make_model(), init_data_parallel=False)
    assert not isinstance(lazy._dmp_wrapped_module, DistributedDataParallel)
    lazy.init_data_parallel()
    lazy.init_data_parallel()
    assert isinstance(lazy._dmp_wrapped_module, DistributedDataParallel)
    assert isinstance(lazy._dmp_wrapped_module.module, d.DLRM)

    # ranks that disagree on the plan fail together, before any training collective
    diverging = {n: table_wise(rank=env.rank) for n, *_ in d.TABLES}
    with pytest.raises(ValueError, match="disagree"):
        shard(d.make_model(), diverging, env.world_size, env.world_size)
    return True


def test_meta_init_planner_default_and_custom_wrapper():
    assert all(run_world(_meta_worker, 2))


def _adagrad_worker() -> bool:
    """A fused Adagrad on sharded tables (no replicated table: its update would be the dense SGD)."""
    world_size = torch.distributed.get_world_size()
    reference = d.make_model(optimizer=OptimType.ADAGRAD)
    generators = {
        n: (row_wise() if i % 2 else table_wise(rank=i % world_size)) for i, (n, *_) in enumerate(d.TABLES)
    }
    dmp = shard(copy.deepcopy(reference), generators, world_size, world_size)
    losses = train_dmp(dmp, STEPS)
    assert losses == pytest.approx(d.train_reference(reference, STEPS, world_size), rel=1e-5)
    d.assert_same_weights(dmp.module, reference, TOL)

    # resuming from the model's and the combined optimizer's state dicts continues the same run
    optimizer = combined_optimizer(dmp)
    train_dmp(dmp, 1, optimizer, first_step=STEPS)
    resumed = shard(d.make_model(seed=3, optimizer=OptimType.ADAGRAD), generators, world_size, world_size)
    resumed.load_state_dict(dmp.state_dict())
    resumed_optimizer = combined_optimizer(resumed)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    assert train_dmp(resumed, 1, resumed_optimizer, first_step=STEPS + 1) == train_dmp(
        dmp, 1, optimizer, first_step=STEPS + 1
    )
    for key, weight in dmp.module.ebc.local_shards().items():
        torch.testing.assert_close(resumed.module.ebc.local_shards()[key], weight, msg=str(key))
    return True


def test_fused_adagrad_tables():
    assert all(run_world(_adagrad_worker, 2))

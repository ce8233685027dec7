"""ShardedEmbeddingBagCollection equals the unsharded EmbeddingBagCollection on the global batch.

One ``run_world`` per world size checks every sharding type at once (one table per type), weighted and
unweighted, SGD, Adagrad and Adam (the data-parallel table with the fused optimizer
too; with the DENSE kernel under SGD): forward values, the gradients of the
input's per-id weights (weighted), and every shard's weights after fused optimizer steps. Bad plans
and inputs must fail on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
from shardkit.sharding.sharding_spec import EnumerableShardingSpec, ShardMetadata
from shardkit.sharding.types import EmbeddingComputeKernel, ParameterSharding, ShardingType
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)


def _module(optimizer: OptimType, weighted: bool, with_dp: bool) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=feats, pooling=pooling)
        for name, rows, dim, feats, pooling in case.TABLES
        if with_dp or name != "t_dp"
    ]
    return EmbeddingBagCollection(
        tables, is_weighted=weighted, fused_optimizer=FusedOptimizerConfig(optimizer, lr=case.LR)
    )


def _check_exact(optimizer: OptimType, weighted: bool, dense_dp: bool = False) -> None:
    """Every sharding type, the data-parallel table with the module's fused optimizer (issue 23: it
    used to be left to the dense optimizer), or ``dense_dp`` with the DENSE kernel asked for by name
    (its update then is the plain SGD of average_dense_gradients_, so SGD only)."""
    rank, world_size, local_size = case.world()
    with_dp = True
    reference = _module(optimizer, weighted, with_dp)
    generators = case.plan_generators(world_size, local_size, with_dp)
    if dense_dp:
        generators["t_dp"] = data_parallel(compute_kernel=EmbeddingComputeKernel.DENSE.value)
    plan = construct_module_sharding_plan(reference, generators, local_size, world_size)
    assert plan["t_dp"].compute_kernel == ("dense" if dense_dp else "fused")
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    assert isinstance(sharded, ShardedEmbeddingBagCollection)
    sharded_names = set(sharded.sharded_parameter_names())
    replicated = {name for name, _ in sharded.named_parameters()} - sharded_names
    # the dense data-parallel table's buffer is the data-parallel wrapper's; a fused one syncs itself
    assert len(replicated) == (1 if dense_dp else 0)
    features = [(f, rows) for t, rows, _, feats, _ in case.TABLES if with_dp or t != "t_dp" for f in feats]
    case.train_and_compare(reference, sharded, features, weighted, TOL)
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)


def _check_variable_batch() -> None:
    """Variable batch per feature (table-wise, column-wise, row-wise, data-parallel tables)."""
    rank, world_size, local_size = case.world()
    reference = _module(OptimType.SGD, False, True)
    generators = case.plan_generators(world_size, local_size, True)
    generators["t_twrw"] = table_wise(rank=0)
    generators["t_twcw"] = generators["t_cw"]
    generators["t_rw_small"] = table_wise(rank=world_size - 1)  # row-wise needs a block on every rank
    # row-wise MEAN with a variable batch is refused (tested below); these two go table-wise here
    generators["t_rw_mean"] = table_wise(rank=0)
    generators["t_twrw_mean"] = table_wise(rank=world_size - 1)
    plan = construct_module_sharding_plan(reference, generators, local_size, world_size)
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    features = [(f, rows) for _, rows, _, feats, _ in case.TABLES for f in feats]
    for step in range(case.STEPS):
        global_kjt, local_kjt, batch = case.variable_batch(step, rank, world_size, features)
        expected = reference(global_kjt)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().div(world_size).backward()
        out = sharded(local_kjt)
        mine = case.my_rows(rank, batch)
        torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **TOL)
        (out.values() * grad[mine]).sum().backward()
        case.average_dense_gradients_(sharded, world_size)
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)


def _exactness_worker() -> bool:
    for optimizer in (OptimType.SGD, OptimType.ADAGRAD):
        for weighted in (False, True):
            _check_exact(optimizer, weighted)
    _check_exact(OptimType.ADAM, False)  # lazy Adam's step count: every shard steps once per step
    _check_exact(OptimType.SGD, True, dense_dp=True)
    _check_variable_batch()
    return True


@pytest.mark.parametrize("world_size, local_size", [(1, None), (2, None), (3, None), (4, 2)])
def test_every_sharding_type_matches_unsharded(world_size, local_size):
    assert all(run_world(_exactness_worker, world_size, local_world_size=local_size))


def _bad_input_worker() -> bool:
    rank, world_size, local_size = case.world()
    env = ShardingEnv.from_process_group(None)
    module = _module(OptimType.SGD, weighted=False, with_dp=True)
    generators = case.plan_generators(world_size, local_size, True)
    sharder = EmbeddingBagCollectionSharder()

    def plan():
        return construct_module_sharding_plan(module, generators, local_size, world_size)

    unknown = plan()
    unknown["no_such_table"] = unknown["t_tw"]
    case.raises_value_error(lambda: sharder.shard(module, unknown, env), "no_such_table")

    # only rank 0's plan is bad: every rank must still raise, naming rank 0
    bad_rank = plan()
    if rank == 0:
        bad_rank["t_tw"] = table_wise(rank=world_size)("t_tw", (11, 4), local_size, world_size, "cpu")
    case.raises_value_error(lambda: sharder.shard(module, bad_rank, env), "rank 0", "t_tw")

    short = plan()
    short["t_rw"] = ParameterSharding(
        ShardingType.ROW_WISE,
        EmbeddingComputeKernel.FUSED,
        sharding_spec=EnumerableShardingSpec([ShardMetadata([0, 0], [5, 4], "rank:0/cpu")]),
    )
    case.raises_value_error(lambda: sharder.shard(module, short, env), "t_rw", "cover")

    diverging = plan()
    diverging["t_tw"] = table_wise(rank=rank)("t_tw", (11, 4), local_size, world_size, "cpu")
    case.raises_value_error(lambda: sharder.shard(module, diverging, env), "disagree")

    sharded = sharder.shard(module, plan(), env)
    features = [(f, rows) for _, rows, _, feats, _ in case.TABLES for f in feats]
    _, kjt, _ = case.global_and_local(0, rank, world_size, features, weighted=False)
    if rank == world_size - 1:  # one rank lacks a feature
        missing = sharded_input_without(kjt, "f_rw")
        case.raises_value_error(lambda: sharded(missing), f"rank {rank}", "f_rw")
    else:
        case.raises_value_error(lambda: sharded(kjt), f"rank {world_size - 1}", "f_rw")
    if rank == 0:  # an id past the end of t_tw2 (5 rows), on one rank
        values = kjt.values().clone()
        start = kjt.offset_per_key()[kjt.keys().index("f_tw2")]
        values[start] = 5
        kjt = KeyedJaggedTensor(kjt.keys(), values, lengths=kjt.lengths())
    case.raises_value_error(lambda: sharded(kjt), "rank 0", "f_tw2", "out of range")
    return True


def sharded_input_without(kjt: KeyedJaggedTensor, key: str) -> KeyedJaggedTensor:
    return kjt.permute([i for i, k in enumerate(kjt.keys()) if k != key])


def test_bad_plans_and_inputs_fail_on_every_rank():
    assert all(run_world(_bad_input_worker, 3))

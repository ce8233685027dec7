"""State of the sharded modules: dcp checkpoints, full tables, unsharded state dicts.

One module holds every sharding type (one table per type, ``_sharded_case``). A checkpoint saved with
``torch.distributed.checkpoint`` (tables and fused optimizer state) loads into a freshly initialized
module with nothing lost: its shards equal the saved ones and the next training step gives the same
outputs and weights. Full tables equal the unsharded module's after training; an unsharded module's
state dict loads into a sharded one and gives its outputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    FusedOptimizerConfig,
    OptimType,
    PositionWeightedModule,
)
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)
FEATURES = [(f, rows) for _, rows, _, feats, _ in case.TABLES for f in feats]
# DP tables use the dense kernel; they are left out of the sequence module to keep it small
SEQUENCE_FEATURES = [(f, rows) for t, rows, _, feats, _ in case.TABLES if t != "t_dp" for f in feats]


def _ebc(seed: int, optimizer: OptimType) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=feats, pooling=pooling)
        for name, rows, dim, feats, pooling in case.TABLES
    ]
    return EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(optimizer, lr=case.LR))


def _ec(seed: int) -> EmbeddingCollection:
    torch.manual_seed(seed)
    tables = [
        EmbeddingConfig(rows, dim, name=name, feature_names=feats)
        for name, rows, dim, feats, _ in case.TABLES
        if name != "t_dp"
    ]
    return EmbeddingCollection(tables, fused_optimizer=FusedOptimizerConfig(OptimType.ADAM, lr=case.LR))


def _shard(module, sharder):
    """``module`` sharded by the case's plan (one sharding type per table)."""
    _, world_size, local_size = case.world()
    tables = getattr(module, "embedding_bag_collection", module)
    with_dp = any(k.endswith(".t_dp.weight") for k in tables.state_dict())
    plan = construct_module_sharding_plan(
        tables, case.plan_generators(world_size, local_size, with_dp), local_size, world_size
    )
    return sharder.shard(module, plan, ShardingEnv.from_process_group(None))


def _values(out) -> torch.Tensor:
    """A pooled KeyedTensor's values, or a sequence output's rows flattened, as one tensor."""
    values = out.values()  # waits for the LazyAwaitable
    if isinstance(values, torch.Tensor):
        return values
    return torch.cat([jt.values().reshape(-1) for jt in values])


def _train_step(sharded, step: int, features) -> torch.Tensor:
    """One forward / backward (fused update; SGD on the data-parallel replicas) on this rank's batch."""
    rank, world_size, _ = case.world()
    _, local_kjt, _ = case.global_and_local(step, rank, world_size, features, weighted=False)
    out = _values(sharded(local_kjt))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step))
    (out * grad).sum().backward()
    case.average_dense_gradients_(sharded, world_size)
    return out.detach()


def _shards_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _round_trip(path: str, name: str, make, sharder, features) -> None:
    trained = _shard(make(0), sharder)
    for step in range(2):
        _train_step(trained, step, features)
    saved = {"model": trained.state_dict(), "optim": trained.fused_optimizer.state_dict()}
    dcp.save(saved, checkpoint_id=path)

    fresh = _shard(make(1), sharder)  # same configs and plan, other initial weights
    assert not _shards_equal(trained.local_shards(), fresh.local_shards()) or not trained.local_shards()
    state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    fresh.fused_optimizer.load_state_dict(state["optim"])
    assert _shards_equal(trained.local_shards(), fresh.local_shards()), name
    # the optimizer state came back too: one more step keeps both modules equal
    assert torch.equal(_train_step(trained, 2, features), _train_step(fresh, 2, features)), name
    assert _shards_equal(trained.local_shards(), fresh.local_shards()), name


def _checkpoint_worker(path: str) -> bool:
    # row-wise Adagrad: per-row state, one column of it per column block; Adam: per-element state
    ebc = lambda seed: _ebc(seed, OptimType.ROWWISE_ADAGRAD)  # noqa: E731
    _round_trip(f"{path}/ebc", "ebc", ebc, EmbeddingBagCollectionSharder(), FEATURES)
    _round_trip(f"{path}/ec", "ec", _ec, EmbeddingCollectionSharder(), SEQUENCE_FEATURES)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_checkpoint_round_trip_every_sharding_type(world_size, tmp_path):
    assert all(run_world(_checkpoint_worker, world_size, str(tmp_path)))


def _full_tables_worker() -> bool:
    rank, world_size, _ = case.world()
    reference = _ebc(0, OptimType.SGD)
    sharded = _shard(copy.deepcopy(reference), EmbeddingBagCollectionSharder())
    assert list(sharded.state_dict()) == list(reference.state_dict())
    for step in range(case.STEPS):
        global_kjt, local_kjt, batch = case.global_and_local(step, rank, world_size, FEATURES, False)
        expected = reference(global_kjt)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().div(world_size).backward()
        (sharded(local_kjt).values() * grad[case.my_rows(rank, batch)]).sum().backward()
        case.average_dense_gradients_(sharded, world_size)
    for name, *_ in case.TABLES:
        torch.testing.assert_close(sharded.full_table(name), reference.table_weight(name).detach(), **TOL)
        on_last = sharded.full_table(name, dst=world_size - 1)
        assert (on_last is None) == (rank != world_size - 1)

    # an unsharded module's state dict (full tensors) loads into the sharded module
    other = _ebc(3, OptimType.SGD)
    other_state = other.state_dict()
    sharded.load_state_dict(other_state)
    assert list(other_state) == list(other.state_dict())  # the caller's dict is left as it was
    global_kjt, local_kjt, batch = case.global_and_local(5, rank, world_size, FEATURES, False)
    torch.testing.assert_close(
        sharded(local_kjt).values(), other(global_kjt).values()[case.my_rows(rank, batch)].detach(), **TOL
    )
    # and one full table alone
    full = torch.arange(13 * 4, dtype=torch.float32).view(13, 4)
    sharded.load_full_table("t_rw", full)
    assert torch.equal(sharded.full_table("t_rw"), full)
    with pytest.raises(KeyError, match="no_such_table"):
        sharded.full_table("no_such_table")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*embedding_bags\.t_cw\.weight"):
        sharded.load_state_dict({k: v for k, v in other_state.items() if "t_cw" not in k})
    wrong = dict(other_state, **{"embedding_bags.t_tw.weight": torch.zeros(3, 4)})
    with pytest.raises(RuntimeError, match="'t_tw'.*shape"):
        sharded.load_state_dict(wrong)

    # the position-weighted module: the unsharded module's keys, and its state dict loads
    fp_reference = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(
            reference.embedding_bag_configs(),
            is_weighted=True,
            fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=case.LR),
        ),
        {"f_rw": PositionWeightedModule(4), "f_cw1": PositionWeightedModule(4)},
    )
    fp_sharded = _shard(copy.deepcopy(fp_reference), FeatureProcessedEmbeddingBagCollectionSharder())
    with torch.no_grad():
        fp_reference._feature_processors["f_rw"].position_weight.copy_(torch.linspace(0.5, 1.5, 4))
    fp_state = fp_reference.state_dict()
    assert sorted(fp_sharded.state_dict()) == sorted(fp_state)
    fp_sharded.load_state_dict(fp_state)
    global_kjt, local_kjt, batch = case.global_and_local(6, rank, world_size, FEATURES, True)
    torch.testing.assert_close(
        fp_sharded(local_kjt).values(),
        fp_reference(global_kjt).values()[case.my_rows(rank, batch)].detach(),
        **TOL,
    )
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_tables_and_unsharded_state_dicts(world_size):
    assert all(run_world(_full_tables_worker, world_size))

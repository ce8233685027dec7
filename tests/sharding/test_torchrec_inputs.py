"""Sharded collections take the inputs torchrec's do: a KJT carrying features they do not use (one KJT
feeds several modules) gives the unsharded module's result; a feature of several tables, which only
the unsharded modules support, fails at sharding time with the fix in the message."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    OptimType,
)
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

KEYS = ["unused", "f1", "f0"]  # "unused" is no table's feature
ROWS = 9


def _kjt(rank: int) -> KeyedJaggedTensor:
    """Rank ``rank``'s 2 samples: per key lengths [1, 2], ids from a rank-seeded generator."""
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.tensor([1, 2] * len(KEYS))
    return KeyedJaggedTensor.from_lengths_sync(
        KEYS, torch.randint(0, ROWS, (3 * len(KEYS),), generator=gen), lengths
    )


def _global_kjt(world: int) -> KeyedJaggedTensor:
    parts = [_kjt(r) for r in range(world)]
    values = torch.cat([p[k].values() for k in KEYS for p in parts])
    lengths = torch.cat([p[k].lengths() for k in KEYS for p in parts])
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths)


def _modules():
    fused = FusedOptimizerConfig(OptimType.SGD, lr=0.1)
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(ROWS, 4, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(2)],
        fused_optimizer=fused,
    )
    ec = EmbeddingCollection(
        [EmbeddingConfig(ROWS, 4, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(2)],
        fused_optimizer=fused,
    )
    return ebc, ec


def _check_unused_features_are_ignored() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = ShardingEnv.from_process_group(None)
    ebc, ec = _modules()
    gens = {"t0": table_wise(rank=world - 1), "t1": row_wise()}
    global_kjt, local_kjt = _global_kjt(world), _kjt(rank)
    for module, sharder in ((ebc, EmbeddingBagCollectionSharder()), (ec, EmbeddingCollectionSharder())):
        plan = construct_module_sharding_plan(module, gens, world, world)
        sharded = sharder.shard(copy.deepcopy(module), plan, env)
        out, expected = sharded(local_kjt), module(global_kjt)
        if isinstance(module, EmbeddingBagCollection):
            out = out.wait() if hasattr(out, "wait") else out
            assert out.keys() == ["f0", "f1"]
            torch.testing.assert_close(out.values(), expected.values()[2 * rank : 2 * rank + 2].detach())
        else:
            assert list(out) == ["f0", "f1"]
            for name in out:
                torch.testing.assert_close(
                    out[name].values(), expected[name].values()[3 * rank : 3 * rank + 3].detach()
                )


def test_sharded_collections_ignore_features_no_table_looks_up():
    run_world(_check_unused_features_are_ignored, 2)


def test_sharding_a_feature_of_several_tables_says_how_to_fix_it():
    tables = [EmbeddingBagConfig(ROWS, 4, name=f"t{i}", feature_names=["f"]) for i in range(2)]
    module = EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=0.1))
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0), "t1": table_wise(rank=0)}, 1, 1)
    with pytest.raises(ValueError, match=r"\{'f': \['t0', 't1'\]\} cannot be sharded yet; give each table"):
        EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv(1, 0, None))

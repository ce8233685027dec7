"""Sharded collections take the inputs torchrec's do: a KJT carrying features they do not use (one KJT
feeds several modules), and a feature that several tables look up (outputs ``feature@table``), give the
unsharded module's result."""

from __future__ import annotations

import copy

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
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
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
    """t0 looks up f0, t1 f1, t2 f0 again (outputs f0@t0, f1, f0@t2); t2 is narrower."""
    fused = FusedOptimizerConfig(OptimType.SGD, lr=0.1)
    torch.manual_seed(0)
    specs = [("t0", 4, "f0"), ("t1", 4, "f1"), ("t2", 3, "f0")]
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(ROWS, d, name=t, feature_names=[f]) for t, d, f in specs], fused_optimizer=fused
    )
    ec = EmbeddingCollection(
        [EmbeddingConfig(ROWS, d, name=t, feature_names=[f]) for t, d, f in specs], fused_optimizer=fused
    )
    return ebc, ec


NAMES = ["f0@t0", "f1", "f0@t2"]


def _check_torchrec_inputs() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = ShardingEnv.from_process_group(None)
    ebc, ec = _modules()
    gens = {"t0": table_wise(rank=world - 1), "t1": row_wise(), "t2": column_wise(ranks=[0, world - 1])}
    global_kjt, local_kjt = _global_kjt(world), _kjt(rank)
    for module, sharder in ((ebc, EmbeddingBagCollectionSharder()), (ec, EmbeddingCollectionSharder())):
        plan = construct_module_sharding_plan(module, gens, world_size=world)
        sharded = sharder.shard(copy.deepcopy(module), plan, env)
        out, expected = sharded(local_kjt), module(global_kjt)
        if isinstance(module, EmbeddingBagCollection):
            assert out.keys() == expected.keys() == NAMES
            torch.testing.assert_close(out.values(), expected.values()[2 * rank : 2 * rank + 2].detach())
            # one fused SGD step: each table of the shared feature gets its own gradient
            (out.values() * torch.arange(11.0)).sum().backward()
            (expected.values() * torch.arange(11.0)).sum().div(world).backward()
            for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
                torch.testing.assert_close(weight, module.table_weight(name)[r0:r1, c0:c1].detach())
        else:
            assert list(out) == list(expected) == NAMES
            for name in NAMES:
                mine = expected[name].values()[3 * rank : 3 * rank + 3].detach()
                torch.testing.assert_close(out[name].values(), mine)
                assert torch.equal(out[name].lengths(), local_kjt[name.split("@")[0]].lengths())


def test_sharded_collections_take_torchrec_inputs():
    """Features no table looks up are ignored; a feature of several tables gives one output per table."""
    run_world(_check_torchrec_inputs, 2)

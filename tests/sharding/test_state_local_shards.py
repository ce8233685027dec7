"""torchrec's ``value.local_shards()`` on a sharded module's state-dict values.

torchrec programs read a rank's rows of a sharded table as ``sd[key].local_shards()`` (each shard's
``tensor`` and ``metadata.shard_offsets`` / ``shard_sizes``). shardkit's values are ShardedTensors or,
for replicated tables and even row- / column-wise splits, DTensors (docs/sharded_state.md): both answer
it. Each shard is checked against the unsharded table by plain indexing with its own metadata, and
the shards of all ranks together must tile each table exactly once.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.testing import run_world

# name -> (rows, dim); "tiny" has fewer rows than 3 ranks: an empty row block on the last rank
TABLES = {"rw": (12, 4), "cw": (6, 8), "tw": (5, 3), "dp": (7, 2), "tiny": (2, 4)}


def _local_shards_of_every_table():
    world = dist.get_world_size()
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(rows, dim, name=name, feature_names=[f"f_{name}"])
            for name, (rows, dim) in TABLES.items()
        ]
    )
    full = {
        f"embedding_bags.{name}.weight": ebc.embedding_bags[name].weight.detach().clone() for name in TABLES
    }
    generators = {
        "rw": row_wise(),
        "cw": column_wise(ranks=list(range(world))),
        "tw": table_wise(rank=world - 1),
        "dp": data_parallel(),
        "tiny": row_wise(),
    }
    plan = construct_module_sharding_plan(ebc, generators, world, world)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_process_group(None))
    state = sharded.state_dict()
    pieces = {}
    for value_dict in (state, copy.deepcopy(state)):  # a deep copy keeps the access
        for key, value in value_dict.items():
            assert isinstance(value, (DTensor, ShardedTensor)), key
            pieces[key] = []
            for shard in value.local_shards():
                md = shard.metadata
                index = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))
                assert torch.equal(shard.tensor, full[key][index]), (key, md)
                assert md.placement.rank() == dist.get_rank(), (key, md)
                pieces[key].append((list(md.shard_offsets), list(md.shard_sizes)))
    # writes through a shard reach the module's table (the shard is the local tensor, not a copy)
    rw = state["embedding_bags.rw.weight"].local_shards()[0]
    with torch.no_grad():
        rw.tensor.add_(1.0)
    after = sharded.state_dict()["embedding_bags.rw.weight"].local_shards()[0].tensor
    assert torch.equal(
        after, full["embedding_bags.rw.weight"][rw.metadata.shard_offsets[0] :][: after.shape[0]] + 1
    )
    return {key: isinstance(state[key], DTensor) for key in state}, pieces


@pytest.mark.parametrize("world", [2, 3])
def test_local_shards_of_dtensor_and_sharded_tensor_values(world):
    results = run_world(_local_shards_of_every_table, world)
    is_dtensor = results[0][0]
    # both kinds of value are covered: the even row split and the replicated table are DTensors
    assert is_dtensor["embedding_bags.rw.weight"] and is_dtensor["embedding_bags.dp.weight"]
    assert not is_dtensor["embedding_bags.tw.weight"]
    for name, (rows, dim) in TABLES.items():
        key = f"embedding_bags.{name}.weight"
        per_rank = [pieces[key] for _, pieces in results]
        if name == "dp":  # every rank holds the whole table
            assert all(p == [([0, 0], [rows, dim])] for p in per_rank), per_rank
            continue
        covered = torch.zeros(rows, dim, dtype=torch.int64)
        for rank_pieces in per_rank:
            for (r0, c0), (nr, nc) in rank_pieces:
                covered[r0 : r0 + nr, c0 : c0 + nc] += 1
        assert torch.equal(covered, torch.ones_like(covered)), (key, per_rank)

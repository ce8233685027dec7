"""Table-wise routing: which keys each rank receives, the input permutation, the output layout, and the
output all-to-all that puts the columns in the module's order.

Exactness against the unsharded modules: test_sharded_embedding_bag_collection.py and
test_sharded_embedding_collection.py.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding import embeddingbag
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, table_wise
from shardkit.sharding.table_wise import TwPooledEmbeddingSharding
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case


def test_features_are_permuted_into_rank_order():
    configs = [
        EmbeddingBagConfig(4, 2, name="x", feature_names=["x1", "x2"]),
        EmbeddingBagConfig(4, 3, name="y", feature_names=["y1"]),
        EmbeddingBagConfig(4, 2, name="z", feature_names=["z1"]),
    ]
    ranks = {"x": 1, "y": 0, "z": 1}
    tables = [
        sharded_table(c, table_wise(ranks[c.name])(c.name, (4, c.embedding_dim), 2, 2, "cpu"), 2)
        for c in configs
    ]
    sharding = TwPooledEmbeddingSharding(tables, ShardingEnv.from_local(2, 0), True)
    assert sharding.feature_names() == ["x1", "x2", "y1", "z1"]
    assert sharding._splits == [1, 3]
    assert sharding._permute == [2, 0, 1, 3]
    assert sharding.output_layout() == [("y1", 0, 3), ("x1", 0, 2), ("x2", 0, 2), ("z1", 0, 2)]
    assert sharding.received_features() == ["y1"]


def _placed_worker(layout: str) -> int:
    """One table-/column-wise sharding whose output columns need reordering: trained bitwise equal to
    the unsharded module; returns how many times the separate column permutation ran."""
    tables = {
        # round-robin tables of one width: one strided run per rank
        "round_robin": [("a", 9, 4, 0), ("b", 7, 4, 1), ("c", 5, 4, 0), ("d", 8, 4, 1)],
        # mixed widths, irregular order: several runs per rank
        "mixed": [("a", 9, 3, 1), ("b", 7, 5, 0), ("c", 5, 2, 1), ("d", 8, 4, 0), ("e", 6, 3, 1)],
    }[layout]
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(r, d, name=n, feature_names=[f"f_{n}"]) for n, r, d, _ in tables]
    reference = EmbeddingBagCollection(
        configs, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=case.LR)
    )
    plan = construct_module_sharding_plan(
        reference, {n: table_wise(rank=rank) for n, _, _, rank in tables}, 2, 2
    )
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    calls = []
    real = embeddingbag._PermuteColumnRuns.apply

    def counting(*args):
        calls.append(1)
        return real(*args)

    with mock.patch.object(embeddingbag._PermuteColumnRuns, "apply", counting):
        features = [(f"f_{n}", r) for n, r, _, _ in tables]
        case.train_and_compare(reference, sharded, features, False, dict(rtol=0, atol=0))
    return len(calls)


@pytest.mark.parametrize("layout", ["round_robin", "mixed"])
def test_all_to_all_places_the_columns(layout):
    # the output dist's all-to-all writes the received columns in the module's order: no separate
    # permutation copy (forward) and its backward copy
    assert run_world(_placed_worker, 2, layout) == [0, 0]

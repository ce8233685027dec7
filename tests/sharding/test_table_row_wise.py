"""Table-row-wise placement checks (exactness with 2 nodes of 2 ranks: the sharded-module tests) and
the one-node output dist."""

from __future__ import annotations

import copy
import importlib
from unittest import mock

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    OptimType,
    PoolingType,
)
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_row_wise
from shardkit.sharding.table_row_wise import TwRwPooledEmbeddingSharding
from shardkit.sharding.types import ShardingType
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

# the module (``shardkit.sharding.table_row_wise`` as an attribute is the plan helper of that name)
twrw = importlib.import_module("shardkit.sharding.table_row_wise")


def test_blocks_on_two_nodes_are_rejected():
    # without torch.distributed every rank is its own node, so blocks on ranks 0 and 1 span two nodes
    config = EmbeddingBagConfig(6, 2, name="t", feature_names=["f"])
    sharding = row_wise()("t", (6, 2), 1, 2, "cpu")
    sharding.sharding_type = ShardingType.TABLE_ROW_WISE.value
    table = sharded_table(config, sharding, 2)
    with pytest.raises(ValueError, match="one node"):
        TwRwPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 0), True)


def _one_node_worker() -> int:
    """TWRW tables (SUM and MEAN) on one node of 2 ranks: trained equal to the unsharded module;
    returns how many cross-node all-to-alls the output dist built."""
    torch.manual_seed(0)
    tables = [("a", 10, 4, PoolingType.SUM), ("b", 7, 3, PoolingType.MEAN)]
    configs = [EmbeddingBagConfig(r, d, name=n, feature_names=[f"f_{n}"], pooling=p) for n, r, d, p in tables]
    reference = EmbeddingBagCollection(
        configs, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=case.LR)
    )
    plan = construct_module_sharding_plan(
        reference, {n: table_row_wise(host_index=0) for n, *_ in tables}, 2, 2
    )
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    built = []
    real = twrw.PooledEmbeddingsAllToAll

    def counting(*args, **kwargs):
        built.append(args)
        return real(*args, **kwargs)

    with mock.patch.object(twrw, "PooledEmbeddingsAllToAll", counting):
        features = [(f"f_{n}", r) for n, r, *_ in tables]
        # row blocks sum a bag in two parts: equal to rounding, as in the sharded-module tests
        case.train_and_compare(reference, sharded, features, False, dict(rtol=1e-5, atol=1e-6))
    return len(built)


def test_one_node_output_dist_has_no_cross_node_all_to_all():
    # with one node the reduce-scatter gives each rank its samples already: an all-to-all over a
    # group of one rank would only copy the pooled output (and its gradient)
    assert run_world(_one_node_worker, 2, local_world_size=2) == [0, 0]

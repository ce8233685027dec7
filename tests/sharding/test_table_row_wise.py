"""Table-row-wise placement checks (exactness with 2 nodes of 2 ranks: the sharded-module tests)."""

from __future__ import annotations

import pytest

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagConfig
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.sharding_plan import row_wise
from shardkit.sharding.table_row_wise import TwRwPooledEmbeddingSharding
from shardkit.sharding.types import ShardingType


def test_blocks_on_two_nodes_are_rejected():
    # without torch.distributed every rank is its own node, so blocks on ranks 0 and 1 span two nodes
    config = EmbeddingBagConfig(6, 2, name="t", feature_names=["f"])
    sharding = row_wise()("t", (6, 2), 1, 2, "cpu")
    sharding.sharding_type = ShardingType.TABLE_ROW_WISE.value
    table = sharded_table(config, sharding, 2)
    with pytest.raises(ValueError, match="one node"):
        TwRwPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 0), True)

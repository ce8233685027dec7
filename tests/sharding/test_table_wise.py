"""Table-wise routing: which keys each rank receives, the input permutation, the output layout.

Exactness against the unsharded modules: test_sharded_embedding_bag_collection.py and
test_sharded_embedding_collection.py.
"""

from __future__ import annotations

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagConfig
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.sharding_plan import table_wise
from shardkit.sharding.table_wise import TwPooledEmbeddingSharding


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

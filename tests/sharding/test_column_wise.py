"""Column-wise routing: a feature goes to every block of its table; blocks are reassembled in order.

Exactness against the unsharded modules (uneven blocks, two blocks on one rank):
test_sharded_embedding_bag_collection.py and test_sharded_embedding_collection.py.
"""

from __future__ import annotations

import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagConfig
from shardkit.sharding.column_wise import CwPooledEmbeddingSharding
from shardkit.sharding.embedding_sharding import sharded_table, split_sequence_rows
from shardkit.sharding.embeddingbag import column_permutation
from shardkit.sharding.sharding_plan import column_wise


def _sharding() -> CwPooledEmbeddingSharding:
    config = EmbeddingBagConfig(4, 5, name="c", feature_names=["f", "g"])
    table = sharded_table(config, column_wise([1, 0, 1])("c", (4, 5), 2, 2, "cpu"), 2)  # widths 2, 2, 1
    return CwPooledEmbeddingSharding([table], ShardingEnv.from_local(2, 0), True)


def test_each_block_receives_every_feature_of_its_table():
    sharding = _sharding()
    assert sharding._splits == [2, 4]
    assert sharding._permute == [0, 1, 0, 1, 0, 1]
    # rank 1 holds blocks [0, 2) and [4, 5), grouped by width (2 first)
    assert sharding.output_layout() == [
        ("f", 2, 4),
        ("g", 2, 4),
        ("f", 0, 2),
        ("g", 0, 2),
        ("f", 4, 5),
        ("g", 4, 5),
    ]


def test_blocks_are_put_back_in_column_order():
    layout = _sharding().output_layout()
    index = column_permutation(layout, ["f", "g"], {"f": 5, "g": 5})
    labels = [f"{f}{c}" for f, c0, c1 in layout for c in range(c0, c1)]  # the concatenated outputs
    assert [labels[i] for i in index] == [f"{f}{c}" for f in "fg" for c in range(5)]


def test_sequence_blocks_side_by_side():
    rows = torch.arange(12.0).view(3, 4)  # three keys' rows, padded to width 4
    keys = [("f", 2, 5), ("g", 0, 4), ("f", 0, 2)]
    out = split_sequence_rows(rows, [1, 1, 1], keys, {"f": 5, "g": 4})
    assert out["f"].tolist() == [[8.0, 9.0, 0.0, 1.0, 2.0]]
    assert out["g"].tolist() == [[4.0, 5.0, 6.0, 7.0]]

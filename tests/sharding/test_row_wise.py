"""Row-wise block bucketization (single process: the routing needs no communication).

The exactness of row-wise sharding against the unsharded modules is checked in
test_sharded_embedding_bag_collection.py / test_sharded_embedding_collection.py.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagConfig
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.row_wise import RwPooledEmbeddingSharding
from shardkit.sharding.sharding_plan import row_wise
from shardkit.sharding.sharding_spec import EnumerableShardingSpec, ShardMetadata
from shardkit.sparse import KeyedJaggedTensor


def _sharding(rank: int = 0) -> RwPooledEmbeddingSharding:
    t = EmbeddingBagConfig(10, 2, name="t", feature_names=["a"])
    u = EmbeddingBagConfig(5, 2, name="u", feature_names=["b"])
    tables = [
        sharded_table(t, row_wise(([4, 0, 6], "cpu"))("t", (10, 2), 3, 3, "cpu"), 3),  # empty block on rank 1
        sharded_table(u, row_wise()("u", (5, 2), 3, 3, "cpu"), 3),  # array_split: 2, 2, 1
    ]
    return RwPooledEmbeddingSharding(tables, ShardingEnv.from_local(3, rank), True, weighted=True)


def test_ids_go_to_the_block_holding_their_row_in_bag_order():
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([0, 5, 3, 9, 4, 0]),
        torch.tensor([0.0, 5.0, 3.0, 9.0, 4.0, 0.5]),
        lengths=torch.tensor([3, 1, 2, 0]),
    )
    send, order = _sharding().bucketize(kjt)
    # rank 0: a [0, 4), b [0, 2); rank 1: b [2, 4) (its block of t is empty); rank 2: a [4, 10), b [4, 5)
    assert send.keys() == ["a@0", "b@0", "b@1", "a@2", "b@2"]
    assert send.lengths().tolist() == [2, 0, 1, 0, 0, 0, 1, 1, 1, 0]
    assert send.values().tolist() == [0, 3, 0, 5, 9, 4]
    assert send.weights().tolist() == [0.0, 3.0, 0.5, 5.0, 9.0, 4.0]
    assert kjt.values().index_select(0, order).tolist() == send.values().tolist()
    assert send.stride() == 2


def test_bucketize_without_order_sends_the_same_kjt():
    # a pooled unweighted lookup needs no order (the kernel then does not write it); with weights the
    # order is still computed, since it permutes them
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([0, 5, 3, 9, 4, 0]), lengths=torch.tensor([3, 1, 2, 0]))
    send, order = _sharding().bucketize(kjt)
    bare, none = _sharding().bucketize(kjt, need_order=False)
    assert none is None and order is not None
    assert bare.keys() == send.keys() and torch.equal(bare.lengths(), send.lengths())
    assert torch.equal(bare.values(), send.values())
    weighted = KeyedJaggedTensor(
        ["a", "b"], torch.tensor([7, 1]), torch.tensor([0.5, 2.0]), lengths=torch.tensor([2, 0, 0, 0])
    )
    _, kept = _sharding().bucketize(weighted, need_order=False)
    assert kept is not None


def test_bucketized_kjt_carries_its_per_key_totals_and_a_private_key_list():
    # built without re-validation, with its per-key totals from its lengths' row sums (no second
    # sync in the all-to-all's send plan); they must be those a validating constructor finds
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([0, 5, 3, 9, 4, 0]), lengths=torch.tensor([3, 1, 2, 0]))
    sharding = _sharding()
    send, _ = sharding.bucketize(kjt, need_order=False)
    assert send.length_per_key_or_none() == [2, 1, 0, 2, 1]
    checked = KeyedJaggedTensor(send.keys(), send.values(), lengths=send.lengths(), stride=send.stride())
    assert send.length_per_key() == checked.length_per_key()
    send.keys().append("x")  # the caller's list, not the sharding's plan
    again, _ = sharding.bucketize(kjt, need_order=False)
    assert again.keys() == ["a@0", "b@0", "b@1", "a@2", "b@2"]
    empty = KeyedJaggedTensor(["a", "b"], torch.tensor([], dtype=torch.int64), lengths=torch.tensor([0, 0]))
    assert sharding.bucketize(empty, need_order=False)[0].length_per_key() == [0] * 5


def test_splits_and_output_layout_do_not_depend_on_the_rank():
    layouts = [_sharding(r).output_layout() for r in range(3)]
    assert layouts[0] == layouts[1] == layouts[2] == [("a", 0, 2), ("b", 0, 2)]
    assert [len(_sharding(r)._local_shards) for r in range(3)] == [2, 1, 2]


def test_variable_batch_needs_a_block_on_every_rank():
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2]),
        torch.ones(2),
        lengths=torch.tensor([1, 1]),
        stride_per_key_per_rank=[[1], [1]],
        inverse_indices=(["a", "b"], torch.zeros(2, 1, dtype=torch.int64)),
    )
    with pytest.raises(ValueError, match="non-empty block of every table"):
        _sharding().input_dist(None, kjt)


def test_two_blocks_of_a_table_on_one_rank_are_rejected():
    config = EmbeddingBagConfig(6, 2, name="t", feature_names=["a"])
    sharding = row_wise()("t", (6, 2), 2, 2, "cpu")
    sharding.sharding_spec = EnumerableShardingSpec(
        [ShardMetadata([0, 0], [3, 2], "rank:1/cpu"), ShardMetadata([3, 0], [3, 2], "rank:1/cpu")]
    )
    sharding.ranks = [1, 1]
    with pytest.raises(ValueError, match="two row_wise blocks"):
        sharded_table(config, sharding, 2)

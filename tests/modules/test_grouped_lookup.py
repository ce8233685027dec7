"""The grouped lookup over shard specs (row and column ranges of tables) against per-table lookups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.modules import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    GroupedEmbeddingLookup,
    PoolingType,
    ShardSpec,
)

BIG = EmbeddingBagConfig(num_embeddings=20, embedding_dim=6, name="big", feature_names=["x", "y"])
MEAN = EmbeddingBagConfig(
    num_embeddings=8, embedding_dim=3, name="mean", feature_names=["z"], pooling=PoolingType.MEAN
)


def _flat(ids_per_feature, lengths_per_feature):
    ids = torch.tensor([i for ids in ids_per_feature for i in ids])
    lengths = torch.tensor([n for lengths in lengths_per_feature for n in lengths])
    return ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def test_row_and_column_shards_share_a_buffer():
    full = torch.randn(20, 6)
    # rows 10..20 of `big`, columns 3..6, next to the whole of `mean`: both 3 columns wide
    shards = [ShardSpec(BIG, row_start=10, col_start=3), ShardSpec(MEAN)]
    lookup = GroupedEmbeddingLookup(shards, pooled=True)
    assert lookup.feature_names == ["x", "y", "z"]
    assert lookup.weight.shape == (18, 3)
    mean_table = torch.randn(8, 3)
    with torch.no_grad():
        lookup.shard_rows(0).copy_(full[10:, 3:])
        lookup.shard_rows(1).copy_(mean_table)
    # B = 2: x bags [10, 19] [], y bags [12] [12, 15], z bags [0, 7, 7] [1]
    ids, offsets = _flat([[10, 19], [12, 12, 15], [0, 7, 7, 1]], [[2, 0], [1, 2], [3, 1]])
    out = lookup(ids, offsets, [2, 2, 2])
    expected = torch.cat(
        [
            F.embedding_bag(
                torch.tensor([10, 19, 12, 12, 15]),
                full[:, 3:],
                torch.tensor([0, 2, 2, 3, 5]),
                mode="sum",
                include_last_offset=True,
            ),
            F.embedding_bag(
                torch.tensor([0, 7, 7, 1]),
                mean_table,
                torch.tensor([0, 3, 4]),
                mode="mean",
                include_last_offset=True,
            ),
        ]
    )
    torch.testing.assert_close(out, expected)


def test_ids_outside_the_shard_rows_are_rejected_naming_feature_and_table():
    lookup = GroupedEmbeddingLookup([ShardSpec(BIG, row_start=10)], pooled=True)
    ids, offsets = _flat([[10], [3]], [[1], [1]])
    with pytest.raises(IndexError, match=r"id 3 of feature 'y' .* table 'big' \(valid ids \[10, 20\)\)"):
        lookup(ids, offsets, [1, 1])


def test_validation_switch_skips_the_check():
    # both row halves of `big` in one buffer: features x, y (rows 0..10), then x, y (rows 10..20)
    lookup = GroupedEmbeddingLookup([ShardSpec(BIG, row_end=10), ShardSpec(BIG, row_start=10)], pooled=False)
    ids, offsets = _flat([[], [], [3], []], [[0], [0], [1], [0]])  # id 3 sent to the second half
    with pytest.raises(IndexError, match="valid ids \\[10, 20\\)"):
        lookup(ids, offsets, [1, 1, 1, 1])
    previous = validation_enabled()
    set_validation(False)
    try:
        # unchecked, the id lands on buffer row 3 - 10 + 10 = 3: another shard's row, silently
        torch.testing.assert_close(lookup(ids, offsets, [1, 1, 1, 1]), lookup.weight.detach()[[3]])
    finally:
        set_validation(previous)


def test_sequence_lookup_returns_one_row_per_id():
    table = EmbeddingConfig(num_embeddings=5, embedding_dim=2, name="s", feature_names=["a", "b"])
    lookup = GroupedEmbeddingLookup([ShardSpec(table, row_start=2)], pooled=False)
    ids, offsets = _flat([[2, 4], [3]], [[2, 0], [0, 1]])
    torch.testing.assert_close(lookup(ids, offsets, [2, 2]), lookup.weight.detach()[[0, 2, 1]])
    with pytest.raises(ValueError, match="pooled"):
        lookup(ids, offsets, [2, 2], torch.ones(3))


def test_group_and_shard_spec_errors():
    with pytest.raises(ValueError, match="one width and dtype"):
        GroupedEmbeddingLookup([ShardSpec(BIG), ShardSpec(MEAN)], pooled=True)
    with pytest.raises(ValueError, match="do not fit table 'big'"):
        ShardSpec(BIG, row_start=5, row_end=25)
    with pytest.raises(ValueError, match="do not fit"):
        ShardSpec(BIG, col_start=6)
    lookup = GroupedEmbeddingLookup([ShardSpec(BIG)], pooled=True)
    ids, offsets = _flat([[1], [2]], [[1], [1]])
    with pytest.raises(ValueError, match="bag counts for 2 features"):
        lookup(ids, offsets, [2])
    with pytest.raises(ValueError, match="offsets must be"):
        lookup(ids, offsets, [1, 2])
    with pytest.raises(ValueError, match="weights"):
        lookup(ids, offsets, [1, 1], torch.ones(3))


def test_empty_features_between_and_after_others_keep_ids_on_their_tables():
    small = EmbeddingBagConfig(num_embeddings=4, embedding_dim=6, name="small", feature_names=["s", "u"])
    lookup = GroupedEmbeddingLookup([ShardSpec(BIG), ShardSpec(small)], pooled=True)
    # features x (empty), y, s (empty), u; then the same with u empty at the end
    ids, offsets = _flat([[], [19, 0], [], [3, 3]], [[0], [2], [0], [2]])
    out = lookup(ids, offsets, [1, 1, 1, 1])
    weight = lookup.weight.detach()
    torch.testing.assert_close(out[1], weight[19] + weight[0])
    torch.testing.assert_close(out[3], 2 * weight[20 + 3])
    assert torch.count_nonzero(out[[0, 2]]) == 0
    ids, offsets = _flat([[5], [], [2], []], [[1], [0], [1], [0]])
    torch.testing.assert_close(lookup(ids, offsets, [1, 1, 1, 1])[[0, 2]], weight[[5, 22]])
    with pytest.raises(IndexError, match="id 4 of feature 'u' .*table 'small'"):
        lookup(*_flat([[], [], [], [4]], [[0], [0], [0], [1]]), [1, 1, 1, 1])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_grouped_lookup_equals_one_lookup_per_shard(data):
    """Random row shards of random tables in one group, random bags (empty features included)."""
    num_shards = data.draw(st.integers(1, 4), label="shards")
    shards, tables = [], []
    for i in range(num_shards):
        rows = data.draw(st.integers(1, 6), label="rows")
        start = data.draw(st.integers(0, rows - 1), label="row_start")
        features = [f"s{i}f{j}" for j in range(data.draw(st.integers(1, 2), label="features"))]
        pooling = data.draw(st.sampled_from([PoolingType.SUM, PoolingType.MEAN]), label="pooling")
        table = EmbeddingBagConfig(
            num_embeddings=rows, embedding_dim=3, name=f"t{i}", feature_names=features, pooling=pooling
        )
        shards.append(ShardSpec(table, row_start=start))
        tables.append(table)
    lookup = GroupedEmbeddingLookup(shards, pooled=True)
    batch = data.draw(st.integers(0, 3), label="batch")
    ids_per_feature, lengths_per_feature, expected = [], [], []
    for i, shard in enumerate(shards):
        for _ in shard.config.feature_names:
            lengths = data.draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch), label="lengths")
            ids = data.draw(
                st.lists(
                    st.integers(shard.row_start, shard.row_end - 1),
                    min_size=sum(lengths),
                    max_size=sum(lengths),
                ),
                label="ids",
            )
            ids_per_feature.append(ids)
            lengths_per_feature.append(lengths)
            table_rows = torch.zeros(shard.row_end, 3)
            table_rows[shard.row_start :] = lookup.shard_rows(i).detach()
            offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()])
            mode = "sum" if shard.config.pooling is PoolingType.SUM else "mean"
            expected.append(
                F.embedding_bag(
                    torch.tensor(ids, dtype=torch.long),
                    table_rows,
                    offsets,
                    mode=mode,
                    include_last_offset=True,
                )
            )
    ids, offsets = _flat(ids_per_feature, lengths_per_feature)
    out = lookup(ids.long(), offsets, [batch] * len(ids_per_feature))
    torch.testing.assert_close(out, torch.cat(expected))

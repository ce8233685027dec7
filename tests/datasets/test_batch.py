"""``Batch`` moves all three fields; ``concat_batches`` keeps the samples of the parts in order."""

import torch

from shardkit.datasets import Batch, SyntheticClicks, TableSpec, concat_batches


def test_to_moves_every_field_and_global_batch_is_the_ranks_in_order():
    data = SyntheticClicks([TableSpec("a", 50, 4, 2.0), TableSpec("b", 9, 4)], batch_size=3, dense_in=2)
    parts = [data.batch(0, rank) for rank in range(2)]
    whole = concat_batches(parts)
    assert torch.equal(whole.labels, torch.cat([p.labels for p in parts]))
    for key in ("a", "b"):
        bags = [bag.tolist() for bag in whole.sparse_features[key].to_dense()]
        assert bags == [bag.tolist() for p in parts for bag in p.sparse_features[key].to_dense()]
    moved = whole.to(torch.device("meta"))
    assert isinstance(moved, Batch)
    fields = (moved.dense_features, moved.labels, moved.sparse_features.values())
    assert {t.device.type for t in fields} == {"meta"}

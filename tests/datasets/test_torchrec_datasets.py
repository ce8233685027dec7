"""torchrec's ``RandomRecDataset`` and Criteo layout, by their documented behaviour."""

import pytest
import torch

from shardkit.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, criteo_kaggle, default_row_mapper
from shardkit.datasets.random import RandomRecDataset


def test_random_rec_dataset_shapes_ranges_and_caching():
    data = RandomRecDataset(
        keys=["a", "b"],
        batch_size=4,
        hash_sizes=[5, 50],
        ids_per_features=[1, 3],
        num_dense=6,
        manual_seed=0,
        num_batches=12,
        num_generated_batches=10,
    )
    batches = list(data)
    assert len(batches) == 12 and batches[10] is batches[0]  # 10 cached batches, cycled
    batch = batches[0]
    assert batch.dense_features.shape == (4, 6) and set(batch.labels.tolist()) <= {0, 1}
    kjt = batch.sparse_features
    assert kjt.keys() == ["a", "b"] and kjt.stride() == 4
    assert max(kjt["a"].lengths().tolist()) <= 1 and max(kjt["b"].lengths().tolist()) <= 3
    fixed = next(iter(RandomRecDataset(["x"], 8, ids_per_feature=2, manual_seed=0)))
    assert fixed.sparse_features.lengths().tolist() == [2] * 8  # min ids default to ids_per_feature
    assert all(0 <= v < 5 for v in kjt["a"].values().tolist())
    assert all(0 <= v < 50 for v in kjt["b"].values().tolist())
    again = next(
        iter(
            RandomRecDataset(
                ["a", "b"], 4, hash_sizes=[5, 50], ids_per_features=[1, 3], num_dense=6, manual_seed=0
            )
        )
    )
    assert torch.equal(again.sparse_features.values(), kjt.values())  # the seed fixes the batches
    ranged = next(iter(RandomRecDataset(["x"], 64, ids_per_feature=3, min_ids_per_feature=0, manual_seed=1)))
    assert set(ranged.sparse_features.lengths().tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="1 hash_sizes for 2 keys"):
        RandomRecDataset(["a", "b"], 4, hash_sizes=[5])


def test_criteo_rows(tmp_path):
    assert DEFAULT_INT_NAMES[0] == "int_0" and DEFAULT_CAT_NAMES[-1] == "cat_25"
    fields = ["1", "5", "", *["7"] * 11, "68fd1e64", "", *["a"] * 24]
    path = tmp_path / "train.txt"
    path.write_text("\t".join(fields) + "\n")
    (row,) = list(criteo_kaggle(str(path)))
    assert row["label"] == 1 and row["int_0"] == 5 and row["int_1"] == 0  # empty integer -> 0
    assert row["cat_0"] == "68fd1e64" and row["cat_1"] == ""
    assert default_row_mapper(fields[1:])["cat_25"] == "a" and "label" not in default_row_mapper(fields[1:])

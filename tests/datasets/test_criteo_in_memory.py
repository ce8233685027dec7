"""``InMemoryBinaryCriteoIterDataPipe`` over three small days and several "ranks" (rank / world_size
arguments, no process group). Row ``i`` of day ``d`` has id ``100 * d + i``: dense ``id + column / 100``,
sparse ``id * 1000 + column``, label ``id % 2``, so every batch can be checked against its source rows."""

import pytest
import torch
from torch.utils.data import DataLoader

from shardkit.datasets.criteo import DEFAULT_CAT_NAMES, InMemoryBinaryCriteoIterDataPipe
from shardkit.datasets.npy import save_npy
from shardkit.datasets.utils import Batch

SIZES = [11, 6, 13]
# torchrec 1.8 on the same files: per rank, (len(pipe), the row ids of each batch)
EXPECTED = {
    ("train", 4, 2, False): [
        (4, [[0, 1, 2, 3], [8, 9, 10, 100], [105, 200, 201, 202], [207, 208, 209]]),
        (4, [[4, 5, 6, 7], [101, 102, 103, 104], [203, 204, 205, 206], [210, 211, 212]]),
    ],
    ("train", 4, 2, True): [
        (3, [[0, 1, 2, 3], [8, 9, 10, 100], [105, 200, 201, 202]]),
        (3, [[4, 5, 6, 7], [101, 102, 103, 104], [203, 204, 205, 206]]),
    ],
    ("train", 7, 3, False): [
        (2, [[0, 1, 2, 3, 4, 5, 6], [204, 205, 206]]),
        (2, [[7, 8, 9, 10, 100, 101, 102], [207, 208, 209]]),
        (2, [[103, 104, 105, 200, 201, 202, 203], [210, 211, 212]]),
    ],
    ("train", 7, 4, False): [  # 2 leftover rows for 4 ranks: the last full round absorbs them
        (1, [[0, 1, 2, 3, 4, 5, 6, 7]]),
        (1, [[8, 9, 10, 100, 101, 102, 103, 104]]),
        (1, [[105, 200, 201, 202, 203, 204, 205]]),
        (1, [[206, 207, 208, 209, 210, 211, 212]]),
    ],
    ("train", 31, 5, False): [
        (1, [[0, 1, 2, 3, 4, 5]]),
        (1, [[6, 7, 8, 9, 10, 100]]),
        (1, [[101, 102, 103, 104, 105, 200]]),
        (1, [[201, 202, 203, 204, 205, 206]]),
        (1, [[207, 208, 209, 210, 211, 212]]),
    ],
    ("val", 4, 2, False): [
        (3, [[0, 1, 2, 3], [102, 103, 104, 105], [204, 205, 206, 207, 208]]),
        (3, [[4, 5, 100, 101], [200, 201, 202, 203], [209, 210, 211, 212]]),
    ],
    ("test", 3, 2, True): [
        (4, [[6, 7, 8], [101, 102, 103], [201, 202, 203], [207, 208, 209]]),
        (4, [[9, 10, 100], [104, 105, 200], [204, 205, 206], [210, 211, 212]]),
    ],
}


@pytest.fixture
def paths(tmp_path):
    out = ([], [], [])
    for day, rows in enumerate(SIZES):
        ids = torch.arange(rows) + 100 * day
        arrays = (
            ids[:, None].float() + torch.arange(13) / 100,
            (ids[:, None] * 1000 + torch.arange(26)).int(),
            (ids % 2).int()[:, None],
        )
        for names, part, array in zip(out, ("dense", "sparse", "labels"), arrays):
            names.append(str(tmp_path / f"day_{day}_{part}.npy"))
            save_npy(names[-1], array)
    return out


def _ids(batch):
    return batch.dense_features[:, 0].round().long()


def _check_rows(batch, hashes=None):
    """The batch holds its source rows, dense / sparse / labels aligned, in torchrec's KJT layout."""
    ids, size = _ids(batch), len(batch.labels)
    assert isinstance(batch, Batch) and batch.dense_features.shape == (size, 13)
    assert torch.allclose(batch.dense_features, ids[:, None].float() + torch.arange(13) / 100)
    kjt = batch.sparse_features
    assert kjt.keys() == DEFAULT_CAT_NAMES and kjt.stride() == size
    assert kjt.lengths().dtype == torch.int32 and kjt.lengths().tolist() == [1] * (26 * size)
    sparse = ids[:, None] * 1000 + torch.arange(26)
    if hashes is not None:
        sparse = sparse % torch.tensor(hashes)
    assert kjt.values().dtype == torch.int32 and kjt.values().tolist() == sparse.t().reshape(-1).tolist()
    assert kjt["cat_3"].values().tolist() == sparse[:, 3].tolist()
    assert batch.labels.dtype == torch.int32 and batch.labels.tolist() == (ids % 2).tolist()


@pytest.mark.parametrize("config", list(EXPECTED), ids=str)
def test_batches_per_rank_are_torchrecs(paths, config):
    stage, batch_size, world_size, drop_last = config
    for rank, (length, batches) in enumerate(EXPECTED[config]):
        pipe = InMemoryBinaryCriteoIterDataPipe(
            stage, *paths, batch_size, rank, world_size, drop_last=drop_last
        )
        got = list(pipe)
        assert len(pipe) == length == len(got)
        assert [_ids(b).tolist() for b in got] == batches
        for batch in got:
            _check_rows(batch)


def test_hashes_and_mmap_give_the_same_batches(paths):
    hashes = [7 + i for i in range(26)]
    plain = list(InMemoryBinaryCriteoIterDataPipe("train", *paths, 4, 1, 2, hashes=hashes))
    mapped = list(InMemoryBinaryCriteoIterDataPipe("train", *paths, 4, 1, 2, hashes=hashes, mmap_mode=True))
    assert len(plain) == len(mapped) == 4
    for a, b in zip(plain, mapped):
        _check_rows(a, hashes)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert [_ids(b).tolist() for b in list(DataLoader(mapped, batch_size=None))] == [
        _ids(b).tolist() for b in plain
    ]


def test_shuffled_batches_are_seeded_permutations_of_the_same_rows(paths):
    def run(seed):
        pipe = InMemoryBinaryCriteoIterDataPipe(
            "train", *paths, 7, 0, 2, shuffle_batches=True, shuffle_training_set_random_seed=seed
        )
        return [_ids(b).tolist() for b in pipe], list(pipe)

    first, batches = run(0)
    plain = [_ids(b).tolist() for b in InMemoryBinaryCriteoIterDataPipe("train", *paths, 7, 0, 2)]
    assert first == run(0)[0] and first != run(1)[0] and first != plain
    assert [sorted(ids) for ids in first] == plain
    for batch in batches:
        _check_rows(batch)


def test_shuffled_training_set_splits_all_rows_between_ranks(paths):
    ranks = [
        InMemoryBinaryCriteoIterDataPipe("train", *paths, 4, r, 2, shuffle_training_set=True)
        for r in range(2)
    ]
    ids = [[i for b in pipe for i in _ids(b).tolist()] for pipe in ranks]
    assert [len(i) for i in ids] == [15, 15] and [len(p) for p in ranks] == [4, 4]
    everything = [100 * d + i for d, rows in enumerate(SIZES) for i in range(rows)]
    assert sorted(ids[0] + ids[1]) == everything and ids[0] + ids[1] != everything
    again = InMemoryBinaryCriteoIterDataPipe("train", *paths, 4, 0, 2, shuffle_training_set=True)
    assert [i for b in again for i in _ids(b).tolist()] == ids[0]


def test_bad_arguments_say_what_is_wrong(paths, tmp_path):
    dense, sparse, labels = paths
    with pytest.raises(ValueError, match="stage 'eval' is not one of"):
        InMemoryBinaryCriteoIterDataPipe("eval", dense, sparse, labels, 4, 0, 1)
    with pytest.raises(ValueError, match="3 dense, 2 sparse and 3 labels paths"):
        InMemoryBinaryCriteoIterDataPipe("train", dense, sparse[:2], labels, 4, 0, 1)
    with pytest.raises(ValueError, match="got batch_size=4, rank=2, world_size=2"):
        InMemoryBinaryCriteoIterDataPipe("train", dense, sparse, labels, 4, 2, 2)
    with pytest.raises(ValueError, match="3 hashes, need one per categorical feature"):
        InMemoryBinaryCriteoIterDataPipe("train", dense, sparse, labels, 4, 0, 1, hashes=[1, 2, 3])
    with pytest.raises(
        ValueError, match=r"day_1_sparse.npy.*have shapes \[\(11, 13\), \(6, 26\), \(11, 1\)\]"
    ):
        InMemoryBinaryCriteoIterDataPipe("train", dense[:1], sparse[1:2], labels[:1], 4, 0, 1)

"""``BinaryCriteoUtils``: TSV -> ``.npy``, row ranges, contiguous ids, shuffling; expected values are
torchrec 1.8's on the same inputs."""

import pytest
import torch

from shardkit.datasets.criteo import BinaryCriteoUtils as Utils
from shardkit.datasets.npy import load_npy, save_npy

ROWS = [
    ["1", "5", "", "-2", *["1"] * 10, "68fd1e64", "", *["a"] * 24],
    ["", "", "3", "7", *["0"] * 10, "", "ff", *["10"] * 24],
    ["0", "300", "2", "", *[""] * 10, *["0"] * 26],
]
# torchrec 1.8's tsv_to_npys of ROWS: the first three columns of dense and sparse, and the labels
DENSE = [
    [2.1972246, 1.3862944, 0.6931472],
    [1.3862944, 1.9459102, 2.3978953],
    [5.7170277, 1.7917595, 1.3862944],
]
SPARSE = [[1761418852, 0, 10], [0, 255, 16], [0, 0, 0]]


def _tsv(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return str(path)


def _convert(tmp_path, source, **kw):
    out = [str(tmp_path / f"{part}.npy") for part in ("dense", "sparse", "labels")]
    Utils.tsv_to_npys(source, *out, **kw)
    return [load_npy(path) for path in out]


def test_tsv_to_npys_matches_torchrec(tmp_path):
    dense, sparse, labels = _convert(tmp_path, _tsv(tmp_path, "day_0", ROWS))
    assert (dense.dtype, sparse.dtype, labels.dtype) == (torch.float32, torch.int64, torch.int32)
    assert (dense.shape, sparse.shape, labels.shape) == ((3, 13), (3, 26), (3, 1))
    # numpy's and torch's float32 log may round differently in the last bit
    torch.testing.assert_close(dense[:, :3], torch.tensor(DENSE), rtol=2e-7, atol=0)
    assert sparse[:, :3].tolist() == SPARSE and labels.tolist() == [[1], [0], [0]]
    test_set = _tsv(tmp_path, "test.txt", [row[1:] for row in ROWS])
    dense_t, sparse_t, labels_t = _convert(tmp_path, test_set, dataset_name="criteo_kaggle")
    assert torch.equal(dense_t, dense) and torch.equal(sparse_t, sparse) and labels_t.tolist() == [[-1]] * 3


def test_tsv_to_npys_files_are_numpy_files(tmp_path):
    np = pytest.importorskip("numpy", reason="numpy is needed to read the files with numpy.load")
    out = [str(tmp_path / f"{part}.npy") for part in ("dense", "sparse", "labels")]
    Utils.tsv_to_npys(_tsv(tmp_path, "day_0", ROWS), *out)
    assert np.load(out[1])[:, :3].tolist() == SPARSE and np.load(out[2]).dtype == np.int32


def test_malformed_tsv_lines_name_file_line_and_column(tmp_path):
    short = _tsv(tmp_path, "day_3", [ROWS[0], ROWS[1][1:]])
    with pytest.raises(ValueError, match=r"day_3, line 2: 39 tab-separated fields, expected 40"):
        _convert(tmp_path, short)
    bad_hex = _tsv(tmp_path, "day_4", [ROWS[0][:16] + ["zz"] + ROWS[0][17:]])
    with pytest.raises(ValueError, match=r"day_4, line 1: column cat_2 is 'zz', not a hexadecimal id"):
        _convert(tmp_path, bad_hex)
    bad_int = _tsv(tmp_path, "day_5", [ROWS[0][:2] + ["1.5"] + ROWS[0][3:]])
    with pytest.raises(ValueError, match=r"day_5, line 1: column int_1 is '1.5', not an integer"):
        _convert(tmp_path, bad_int)
    with pytest.raises(ValueError, match=r"empty.tsv: no lines to convert"):
        _convert(tmp_path, _tsv(tmp_path, "empty.tsv", []))


def test_shape_and_row_ranges_of_npy_files(tmp_path):
    path = str(tmp_path / "a.npy")
    save_npy(path, torch.arange(40, dtype=torch.int32).reshape(10, 4))
    assert Utils.get_shape_from_npy(path) == (10, 4)
    for mmap_mode in (False, True):
        rows = Utils.load_npy_range(path, 3, 4, mmap_mode=mmap_mode)
        assert rows.dtype == torch.int32 and rows.tolist() == torch.arange(12, 28).reshape(4, 4).tolist()
    with pytest.raises(ValueError, match=r"a.npy: start_row 10 is outside the file's rows 0..9"):
        Utils.load_npy_range(path, 10, 1)
    with pytest.raises(ValueError, match=r"a.npy: rows 6..10 \(num_rows=5\) go past the file's 10 rows"):
        Utils.load_npy_range(path, 6, 5)
    save_npy(path, torch.arange(4))
    with pytest.raises(ValueError, match=r"a.npy: cannot load a row range of an array of shape \(4,\)"):
        Utils.load_npy_range(path, 0, 1)


# torchrec 1.8's get_file_row_ranges_and_remainder(lengths, rank, world_size, start_row, last_row)
ROW_RANGES = [
    (([3, 4, 5], 0, 2, 0, None), ({0: (0, 2), 1: (0, 2)}, 0)),
    (([3, 4, 5], 1, 2, 0, None), ({1: (3, 3), 2: (0, 4)}, 0)),
    (([10, 1, 0, 7], 0, 3, 2, None), ({0: (2, 7)}, 1)),
    (([10, 1, 0, 7], 1, 3, 2, None), ({0: (8, 9), 1: (0, 0), 2: (0, -1), 3: (0, 1)}, 1)),
    (([10, 1, 0, 7], 2, 3, 2, None), ({3: (2, 6)}, 1)),
    (([3, 4, 5], 3, 4, 1, 5), ({1: (2, 2)}, 1)),
    (([2, 2], 2, 3, 0, None), ({1: (1, 1)}, 1)),
    (([5], 0, 4, 1, 5), ({0: (1, 2)}, 1)),
]


@pytest.mark.parametrize("args, expected", ROW_RANGES)
def test_file_row_ranges_are_torchrecs(args, expected):
    assert Utils.get_file_row_ranges_and_remainder(*args) == expected


def test_sparse_to_contiguous_numbers_ids_by_first_appearance(tmp_path):
    days = [str(tmp_path / f"day_{d}_sparse.npy") for d in range(2)]
    save_npy(days[0], torch.tensor([[3, 6, 7], [7, 9, 3], [3, 6, 8]], dtype=torch.int32))
    save_npy(days[1], torch.tensor([[7, 9, 3], [5, 6, 7]], dtype=torch.int32))
    expected = {  # torchrec 1.8, per frequency threshold
        1: [[[2, 2, 2], [3, 3, 3], [2, 2, 4]], [[3, 3, 3], [4, 2, 2]]],
        2: [[[2, 2, 2], [3, 3, 3], [2, 2, 1]], [[3, 3, 3], [1, 2, 2]]],
        3: [[[1, 2, 1], [1, 1, 1], [1, 2, 1]], [[1, 1, 1], [1, 2, 1]]],
    }
    for threshold, arrays in expected.items():
        Utils.sparse_to_contiguous(days, str(tmp_path), frequency_threshold=threshold, columns=3)
        out = [load_npy(tmp_path / f"day_{d}_sparse_contig_freq.npy") for d in range(2)]
        assert [a.tolist() for a in out] == arrays and out[0].dtype == torch.int32
    with pytest.raises(ValueError, match="share base names"):
        Utils.sparse_to_contiguous([days[0], days[0]], str(tmp_path))


def _days(folder, rows_per_day):
    for day, rows in rows_per_day.items():
        ids = torch.arange(rows) + 100 * day
        save_npy(folder / f"day_{day}_dense.npy", ids[:, None].float() + torch.zeros(rows, 2))
        save_npy(folder / f"day_{day}_sparse.npy", ids[:, None] * 10 + torch.arange(3))
        save_npy(folder / f"day_{day}_labels.npy", (ids % 2).int()[:, None])


def test_shuffle_permutes_rows_across_days_and_keeps_the_last_day(tmp_path):
    rows_per_day = {0: 4, 1: 5, 2: 3}
    _days(tmp_path, rows_per_day)
    runs = {}
    for seed in (0, 0, 1):
        out = tmp_path / f"out{len(runs)}"
        out.mkdir()
        Utils.shuffle(
            str(tmp_path), str(tmp_path), str(out), rows_per_day, str(out), 3, 2, 3, random_seed=seed
        )
        runs[len(runs)] = out
    parts = {
        p: [load_npy(runs[0] / f"day_{d}_{p}.npy") for d in range(3)] for p in ("dense", "sparse", "labels")
    }
    ids = torch.cat(parts["dense"][:2])[:, 0].long()
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 100, 101, 102, 103, 104]  # days 0-1 mixed
    assert ids.tolist() != [0, 1, 2, 3, 100, 101, 102, 103, 104]
    assert [len(parts["dense"][d]) for d in range(3)] == [4, 5, 3]  # rows_per_day kept
    sparse, labels = torch.cat(parts["sparse"][:2]), torch.cat(parts["labels"][:2])
    assert sparse.dtype == labels.dtype == torch.int32
    assert torch.equal(sparse, ids[:, None] * 10 + torch.arange(3)) and torch.equal(labels[:, 0], ids % 2)
    assert torch.equal(parts["dense"][2], load_npy(tmp_path / "day_2_dense.npy"))  # copied as it was
    same = load_npy(runs[1] / "day_0_dense.npy")
    assert torch.equal(same, parts["dense"][0]) and not torch.equal(
        load_npy(runs[2] / "day_0_dense.npy"), same
    )
    full = load_npy(runs[0] / "full.npy")  # unshuffled, float32 [dense | sparse | label]
    assert (
        full.dtype == torch.float32
        and full.shape == (9, 6)
        and full[4].tolist() == [100, 100, 1000, 1001, 1002, 0]
    )
    with pytest.raises(ValueError, match=r"day_1_dense.npy: shape \(5, 2\), expected \(6, 2\)"):
        Utils.shuffle(str(tmp_path), str(tmp_path), str(runs[0]), {0: 4, 1: 6, 2: 3}, None, 3, 2, 3)

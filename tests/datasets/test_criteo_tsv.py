"""torchrec's Criteo TSV readers (``criteo_kaggle``, ``criteo_terabyte``, ``CriteoIterDataPipe``)."""

import pytest
import torch.utils.data.datapipes as dp
from torch.utils.data import IterDataPipe

import shardkit.datasets.criteo_tsv as criteo_tsv
from shardkit.datasets.criteo import (
    COLUMN_TYPE_CASTERS,
    DEFAULT_COLUMN_NAMES,
    FREQUENCY_THRESHOLD,
    TOTAL_TRAINING_SAMPLES,
    CriteoIterDataPipe,
    criteo_kaggle,
    criteo_terabyte,
)

LINE = ["1", "5", "", "x", *["7"] * 10, "68fd1e64", "", *["a"] * 24]  # an empty and a non-number int


def _tsv(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return str(path)


def test_constants_are_torchrecs():
    assert FREQUENCY_THRESHOLD == 3 and TOTAL_TRAINING_SAMPLES == 4195197692
    assert len(COLUMN_TYPE_CASTERS) == len(DEFAULT_COLUMN_NAMES) == 40


def test_kaggle_rows_cast_ints_and_keep_hex_strings(tmp_path):
    path = _tsv(tmp_path, "train.txt", [LINE, LINE[1:]])
    full, no_label = list(criteo_kaggle(path))
    assert full["label"] == 1 and (full["int_0"], full["int_1"], full["int_2"]) == (5, 0, 0)
    assert full["cat_0"] == "68fd1e64" and full["cat_1"] == "" and full["cat_25"] == "a"
    assert "label" not in no_label and no_label == {k: v for k, v in full.items() if k != "label"}
    assert isinstance(criteo_kaggle(path), IterDataPipe)
    assert [len(b) for b in dp.iter.Batcher(criteo_kaggle(path), 1)] == [1, 1]


def test_terabyte_reads_the_files_in_order_and_splits_across_workers(tmp_path, monkeypatch):
    days = [_tsv(tmp_path, f"day_{d}", [[str(d), str(i)] for i in range(2)]) for d in range(3)]
    rows = list(criteo_terabyte(days, row_mapper=None))
    assert rows == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"], ["2", "0"], ["2", "1"]]

    class Worker:
        id, num_workers = 1, 2

    monkeypatch.setattr(criteo_tsv, "get_worker_info", lambda: Worker)
    assert list(CriteoIterDataPipe(days, row_mapper=None)) == [["1", "0"], ["1", "1"]]  # files 1, 3, ...


def test_a_malformed_line_names_the_file_and_line(tmp_path):
    path = _tsv(tmp_path, "day_1", [LINE, LINE + ["extra"]])
    with pytest.raises(ValueError, match=r"day_1, line 2: 41 fields, a Criteo line has at most 40"):
        list(criteo_terabyte([path]))

    def needs_three(fields):
        return fields[2]

    short = _tsv(tmp_path, "short", [["1", "2", "3"], ["1"]])
    with pytest.raises(IndexError, match=r"short, line 2: list index out of range"):
        list(CriteoIterDataPipe([short], row_mapper=needs_three))

"""torchrec's data-pipe utilities (``torchrec.datasets.utils``): Limit, LoadFiles, ReadLinesFromCSV,
ParallelReadConcat, safe_cast; expected values checked against torchrec 1.8 on the same inputs."""

import subprocess
import sys
import textwrap

import pytest
import torch.utils.data.datapipes as dp
from torch.utils.data import DataLoader

import shardkit.datasets.pipes as pipes
from shardkit.datasets.datapipe import HAS_DATAPIPES, IterDataPipe
from shardkit.datasets.utils import (
    Limit,
    LoadFiles,
    ParallelReadConcat,
    ReadLinesFromCSV,
    _default_dp_selector,
    safe_cast,
)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_limit_stops_after_n_items_and_chains_like_a_datapipe():
    assert [list(Limit(range(7), n)) for n in (0, 1, 3, 7, 9)] == [[], [0], [0, 1, 2], list(range(7))] + [
        list(range(7))
    ]
    assert HAS_DATAPIPES and isinstance(Limit(range(3), 1), IterDataPipe)
    pipe = dp.iter.IterableWrapper(range(10)).limit(5).batch(2)  # torch's functional chaining
    assert list(pipe) == [[0, 1], [2, 3], [4]]
    assert list(dp.iter.Batcher(Limit(range(10), 3), 2)) == [[0, 1], [2]]


def test_load_files_opens_each_path_in_its_mode(tmp_path):
    a, b = _write(tmp_path, "a.csv", "x,y\n1,2\n"), _write(tmp_path, "b.csv", "3,4\n")
    opened = list(LoadFiles([a, b], mode="b"))
    assert [path for path, _ in opened] == [a, b] and opened[0][1].read() == b"x,y\n1,2\n"
    for _, stream in opened:
        stream.close()
    assert len(LoadFiles([a, b], length=2)) == 2
    with pytest.raises(TypeError, match="length unknown"):  # torchrec: NotImplementedError
        len(LoadFiles([a]))
    with pytest.raises(ValueError, match="invalid mode 'w'"):
        LoadFiles([a], mode="w")
    with pytest.raises(TypeError, match="expected a path \\(str\\), got int"):
        list(LoadFiles([3]))
    with pytest.raises(ValueError, match="path_manager_key='manifold'.*local paths"):
        LoadFiles([a], path_manager_key="manifold")


def test_read_lines_from_csv_reads_every_file_and_skips_headers(tmp_path):
    a, b = _write(tmp_path, "a.csv", "x,y\n1,2\n"), _write(tmp_path, "b.csv", "h\n3,,4\n")
    assert list(ReadLinesFromCSV(LoadFiles([a, b], mode="r"))) == [
        ["x", "y"],
        ["1", "2"],
        ["h"],
        ["3", "", "4"],
    ]
    assert list(ReadLinesFromCSV(LoadFiles([a, b], mode="t"), skip_first_line=True)) == [
        ["1", "2"],
        ["3", "", "4"],
    ]
    tsv = _write(tmp_path, "c.tsv", "1\t\t2\n")
    assert list(ReadLinesFromCSV(LoadFiles([tsv], mode="r"), delimiter="\t")) == [["1", "", "2"]]


class _Worker:
    def __init__(self, id, num_workers):
        self.id, self.num_workers = id, num_workers


# torchrec 1.8's _default_dp_selector on range(n) pipes, per worker
SELECTED = {
    (1, 1): [[0]],
    (5, 2): [[0, 1, 2], [3, 4]],
    (5, 3): [[0, 1], [2, 3], [4]],
    (7, 4): [[0, 1], [2, 3], [4, 5], [6]],
    (8, 3): [[0, 1, 2], [3, 4, 5], [6, 7]],
    (4, 4): [[0], [1], [2], [3]],
}


def test_parallel_read_concat_gives_each_worker_a_contiguous_share(monkeypatch):
    assert list(ParallelReadConcat(range(2), ["a"], range(5, 7))) == [0, 1, "a", 5, 6]
    for (count, workers), expected in SELECTED.items():
        shares = []
        for worker in range(workers):
            info = _Worker(worker, workers)
            monkeypatch.setattr(pipes, "get_worker_info", lambda info=info: info)
            shares.append(list(_default_dp_selector(list(range(count)))))
        assert shares == expected, (count, workers)
    monkeypatch.setattr(pipes, "get_worker_info", lambda: _Worker(0, 3))
    with pytest.raises(ValueError, match="3 DataLoader workers for only 2 datapipes"):
        list(ParallelReadConcat(range(2), range(2)))
    last = ParallelReadConcat(range(3), range(3), dp_selector=lambda pipes: pipes[-1:])
    monkeypatch.undo()
    assert list(DataLoader(last, batch_size=None)) == [0, 1, 2]


def test_safe_cast_falls_back_on_value_errors_only():
    assert [safe_cast("12", int, 0), safe_cast("", int, -1), safe_cast("1.5", int, 7)] == [12, -1, 7]
    assert safe_cast("x", float, 2.5) == 2.5 and safe_cast(3, str, "") == "3"
    with pytest.raises(TypeError):
        safe_cast(None, int, 0)


def test_without_torch_datapipes_the_pipes_are_iterable_datasets(tmp_path):
    """If a later torch drops ``IterDataPipe``, the pipes still iterate, chain and feed a DataLoader."""
    path = _write(tmp_path, "a.csv", "1,2\n3,4\n5,6\n")
    script = textwrap.dedent(
        f"""
        import torch.utils.data as data
        del data.IterDataPipe
        from shardkit.datasets.datapipe import HAS_DATAPIPES
        from shardkit.datasets.utils import Limit, LoadFiles, ReadLinesFromCSV, idx_split_train_val
        assert not HAS_DATAPIPES
        pipe = Limit(ReadLinesFromCSV(LoadFiles([{path!r}], mode="r")), 2)
        assert isinstance(pipe, data.IterableDataset)
        assert list(data.DataLoader(pipe, batch_size=None)) == [["1", "2"], ["3", "4"]]
        train, val = idx_split_train_val(range(10), 0.5, 1)
        assert (list(train), list(val)) == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
        assert len(LoadFiles([{path!r}], length=1)) == 1
        print("fallback ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "fallback ok" in done.stdout, done.stderr

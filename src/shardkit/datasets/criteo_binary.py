"""``BinaryCriteoUtils``: torchrec's preprocessing of the Criteo TSV files into ``.npy`` arrays.

The files are numpy's ``.npy`` format (read and written by ``shardkit.datasets.npy`` with torch alone),
so they are interchangeable with torchrec's: per day, ``*_dense.npy`` (float32 ``[N, 13]``, the log of
the shifted integer features), ``*_sparse.npy`` (int64 ``[N, 26]`` hashes, int32 after ``shuffle``) and
``*_labels.npy`` (int32 ``[N, 1]``).
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch

from shardkit.datasets.criteo_tsv import (
    CAT_FEATURE_COUNT,
    DAYS,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    FREQUENCY_THRESHOLD,
    INT_FEATURE_COUNT,
    CriteoIterDataPipe,
)
from shardkit.datasets.npy import load_npy, read_npy_header, read_tensor, save_npy
from shardkit.datasets.pipes import PATH_MANAGER_KEY, check_path_manager_key


def _tsv_row_parser(with_label: bool):
    """A row mapper: ``(dense ints [13], sparse ints [26], label)``; empty fields are 0, categorical
    fields hex. A row of the wrong length or with a non-number raises ValueError naming the column."""
    columns = [("label", 10)] if with_label else []
    columns += [(name, 10) for name in DEFAULT_INT_NAMES] + [(name, 16) for name in DEFAULT_CAT_NAMES]
    first = len(columns) - INT_FEATURE_COUNT - CAT_FEATURE_COUNT

    def parse(row: List[str]) -> Tuple[List[int], List[int], int]:
        if len(row) != len(columns):
            raise ValueError(f"{len(row)} tab-separated fields, expected {len(columns)}")
        values = []
        for (name, base), field in zip(columns, row):
            try:
                values.append(int(field or "0", base))
            except ValueError:
                kind = "a hexadecimal id" if base == 16 else "an integer"
                raise ValueError(f"column {name} is {field!r}, not {kind}") from None
        label = values[0] if with_label else -1  # Kaggle's test set has no labels
        return values[first : first + INT_FEATURE_COUNT], values[first + INT_FEATURE_COUNT :], label

    return parse


class BinaryCriteoUtils:
    """Preprocess, save, load and split the Criteo data set in binary (``.npy``) form, as torchrec's.
    Arrays come back as torch tensors (torchrec: numpy arrays)."""

    @staticmethod
    def tsv_to_npys(
        in_file: str,
        out_dense_file: str,
        out_sparse_file: str,
        out_labels_file: str,
        dataset_name: str = "criteo_1tb",
        path_manager_key: str = PATH_MANAGER_KEY,
    ) -> None:
        """Convert one TSV file into three ``.npy`` files: dense float32 ``[N, 13]`` (``log(x - min + 2)``
        with ``min`` the smallest integer feature of the file; empty fields are 0), sparse int64
        ``[N, 26]`` (the hex hashes; empty fields 0) and labels int32 ``[N, 1]``. For
        ``dataset_name="criteo_kaggle"`` and a path containing ``"test"`` the lines have no label and
        the labels are -1. A malformed line raises ValueError naming the file, line and column."""
        check_path_manager_key(path_manager_key)
        with_label = not (dataset_name == "criteo_kaggle" and "test" in in_file)
        dense, sparse, labels = [], [], []
        for row_dense, row_sparse, label in CriteoIterDataPipe(
            [in_file], row_mapper=_tsv_row_parser(with_label)
        ):
            dense.append(row_dense)
            sparse.append(row_sparse)
            labels.append(label)
        if not dense:
            raise ValueError(f"{in_file}: no lines to convert")
        dense_ints = torch.tensor(dense, dtype=torch.int64)
        del dense
        # the log is costly at training time, so it is stored; the shift makes every value >= 2
        dense_log = (dense_ints - (dense_ints.min() - 2)).to(torch.float32).log_()
        save_npy(out_dense_file, dense_log)
        save_npy(out_sparse_file, torch.tensor(sparse, dtype=torch.int64))
        save_npy(out_labels_file, torch.tensor(labels, dtype=torch.int32).reshape(-1, 1))

    @staticmethod
    def get_shape_from_npy(path: str, path_manager_key: str = PATH_MANAGER_KEY) -> Tuple[int, ...]:
        """The shape of the array in the ``.npy`` file ``path``, read from its header alone."""
        check_path_manager_key(path_manager_key)
        with open(path, "rb") as stream:
            return read_npy_header(stream, path)[0]

    @staticmethod
    def get_file_row_ranges_and_remainder(
        lengths: List[int], rank: int, world_size: int, start_row: int = 0, last_row: Optional[int] = None
    ) -> Tuple[Dict[int, Tuple[int, int]], int]:
        """Rank ``rank``'s share of the rows ``start_row..last_row`` (default: to the end) of files of
        ``lengths`` rows read back to back: ``({file index: (first row, last row) in that file,
        inclusive}, total rows % world_size)``. Ranks get contiguous blocks of equal size, the first
        ``remainder`` ranks one row more."""
        total = sum(lengths) - start_row if last_row is None else last_row - start_row + 1
        base, remainder = divmod(total, world_size)
        first = start_row + rank * base + min(rank, remainder)
        last = first + base + (rank < remainder) - 1
        ranges, file_first = {}, 0
        for index, length in enumerate(lengths):
            file_last = file_first + length - 1
            if first <= file_last and last >= file_first:
                ranges[index] = (max(first, file_first) - file_first, min(last, file_last) - file_first)
            file_first = file_last + 1
        return ranges, remainder

    @staticmethod
    def load_npy_range(
        fname: str,
        start_row: int,
        num_rows: int,
        path_manager_key: str = PATH_MANAGER_KEY,
        mmap_mode: bool = False,
    ) -> torch.Tensor:
        """Rows ``start_row .. start_row + num_rows - 1`` of the 2-D array in ``fname``, ``[num_rows,
        columns]`` of the file's dtype, reading only those rows (``mmap_mode``: a view of the mapped
        file). ValueError for a file that is not 2-D or rows out of range."""
        check_path_manager_key(path_manager_key)
        with open(fname, "rb") as stream:
            shape, dtype = read_npy_header(stream, fname)
            if len(shape) != 2:
                raise ValueError(f"{fname}: cannot load a row range of an array of shape {shape} (not 2-D)")
            total_rows, row_size = shape
            if not 0 <= start_row < total_rows:
                raise ValueError(
                    f"{fname}: start_row {start_row} is outside the file's rows 0..{total_rows - 1}"
                )
            if start_row + num_rows > total_rows:
                raise ValueError(
                    f"{fname}: rows {start_row}..{start_row + num_rows - 1} (num_rows={num_rows}) go past "
                    f"the file's {total_rows} rows"
                )
            if not mmap_mode:
                stream.seek(start_row * row_size * dtype.itemsize, os.SEEK_CUR)
                return read_tensor(stream, dtype, num_rows * row_size, fname).reshape(num_rows, row_size)
        return load_npy(fname, mmap_mode=True)[start_row : start_row + num_rows]

    @staticmethod
    def sparse_to_contiguous(
        in_files: List[str],
        output_dir: str,
        frequency_threshold: int = FREQUENCY_THRESHOLD,
        columns: int = CAT_FEATURE_COUNT,
        path_manager_key: str = PATH_MANAGER_KEY,
        output_file_suffix: str = "_contig_freq.npy",
    ) -> None:
        """Renumber the ids of each column of the sparse files ``in_files`` (read together, so equal ids
        in different files get equal numbers) as 2, 3, ... in order of first appearance; ids seen fewer
        than ``frequency_threshold`` times in all files become 1 (no threshold when it is <= 1). Writes
        ``output_dir/<name>{output_file_suffix}`` per file (``name``: its base name up to the first
        dot), same shape and dtype."""
        check_path_manager_key(path_manager_key)
        names = [os.path.basename(f).split(".")[0] for f in in_files]
        if len(set(names)) != len(names):
            raise ValueError(f"sparse_to_contiguous: input files {in_files} share base names {names}")
        arrays = [load_npy(f) for f in in_files]
        sizes = [len(a) for a in arrays]
        for col in range(columns):
            ids = torch.cat([a[:, col].to(torch.int64) for a in arrays])
            unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            positions = torch.arange(len(ids))
            first_seen = torch.full_like(unique, len(ids)).scatter_reduce_(0, inverse, positions, "amin")
            keep = (
                counts >= frequency_threshold
                if frequency_threshold > 1
                else torch.ones_like(counts, dtype=torch.bool)
            )
            kept = keep.nonzero().squeeze(1)
            kept = kept[first_seen[kept].argsort()]
            numbers = torch.ones_like(unique)
            numbers[kept] = torch.arange(2, 2 + len(kept))
            for array, part in zip(arrays, numbers[inverse].split(sizes)):
                array[:, col] = part.to(array.dtype)
        for name, array in zip(names, arrays):
            save_npy(os.path.join(output_dir, name + output_file_suffix), array)

    @staticmethod
    def shuffle(
        input_dir_labels_and_dense: str,
        input_dir_sparse: str,
        output_dir_shuffled: str,
        rows_per_day: Dict[int, int],
        output_dir_full_set: Optional[str] = None,
        days: int = DAYS,
        int_columns: int = INT_FEATURE_COUNT,
        sparse_columns: int = CAT_FEATURE_COUNT,
        path_manager_key: str = PATH_MANAGER_KEY,
        random_seed: int = 0,
    ) -> None:
        """Shuffle the rows of days ``0 .. days - 2`` (``day_{d}_dense.npy`` / ``_labels.npy`` in
        ``input_dir_labels_and_dense``, ``day_{d}_sparse.npy`` in ``input_dir_sparse``) across days, and
        write them back with ``rows_per_day[d]`` rows per day to ``output_dir_shuffled`` (dense float32,
        sparse and labels int32); the last day is copied unshuffled (validation and test). With
        ``output_dir_full_set``, ``full.npy`` gets the unshuffled rows as float32 ``[N, dense | sparse |
        label]``. The permutation is ``torch.randperm`` under ``random_seed`` (torchrec: numpy's)."""
        check_path_manager_key(path_manager_key)
        folders = {
            "dense": input_dir_labels_and_dense,
            "sparse": input_dir_sparse,
            "labels": input_dir_labels_and_dense,
        }
        widths = {"dense": int_columns, "sparse": sparse_columns, "labels": 1}
        days_rows = [rows_per_day[day] for day in range(days - 1)]
        whole = {}
        for part, folder in folders.items():
            arrays = [load_npy(os.path.join(folder, f"day_{day}_{part}.npy")) for day in range(days - 1)]
            for day, array in enumerate(arrays):
                if tuple(array.shape) != (days_rows[day], widths[part]):
                    raise ValueError(
                        f"{os.path.join(folder, f'day_{day}_{part}.npy')}: shape {tuple(array.shape)}, "
                        f"expected ({days_rows[day]}, {widths[part]}) from rows_per_day and the column counts"
                    )
            whole[part] = torch.cat(arrays)
        if output_dir_full_set is not None:
            full = torch.cat([whole[part].float() for part in ("dense", "sparse", "labels")], dim=1)
            save_npy(os.path.join(output_dir_full_set, "full.npy"), full)
            del full
        order = torch.randperm(sum(days_rows), generator=torch.Generator().manual_seed(random_seed))
        dtypes = {"dense": torch.float32, "sparse": torch.int32, "labels": torch.int32}
        for part, array in whole.items():
            for day, rows in enumerate(array[order].to(dtypes[part]).split(days_rows)):
                save_npy(os.path.join(output_dir_shuffled, f"day_{day}_{part}.npy"), rows)
        for part, folder in folders.items():
            name = f"day_{days - 1}_{part}.npy"
            shutil.copyfile(os.path.join(folder, name), os.path.join(output_dir_shuffled, name))


__all__ = ["BinaryCriteoUtils"]

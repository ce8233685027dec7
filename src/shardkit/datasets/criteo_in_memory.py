"""``InMemoryBinaryCriteoIterDataPipe``: batches of the binary (``.npy``) Criteo files, held in memory.

The files' rows, read back to back, are cut into consecutive global batches of ``batch_size`` rows;
rank ``r`` of ``world_size`` yields the global batches ``r, r + world_size, ...``, so every rank
yields the same number of batches. When the rows do not fill a whole round of ``world_size`` batches
and ``drop_last`` is false, the last round spreads the leftover rows over the ranks (sizes differ by at
most one row; when there are fewer leftover rows than ranks, the last full round absorbs them and its
batches exceed ``batch_size`` by at most one). That is torchrec 1.8's batching, row for row.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch
from torch.utils.data import IterableDataset

from shardkit.datasets.criteo_tsv import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES
from shardkit.datasets.npy import load_npy
from shardkit.datasets.pipes import PATH_MANAGER_KEY, check_path_manager_key
from shardkit.datasets.utils import Batch
from shardkit.sparse import KeyedJaggedTensor

_STAGES = ("train", "val", "test")


def _batch_sizes(total_rows: int, batch_size: int, world_size: int, drop_last: bool) -> List[int]:
    """The sizes of the global batches, in order (torchrec's rule, see the module docstring)."""
    full = total_rows // batch_size // world_size * world_size
    last = [0] * world_size
    leftover = total_rows % (world_size * batch_size)
    if not drop_last and leftover > 0:
        if leftover < world_size:
            full -= world_size  # the last full round takes the few leftover rows
            last = [batch_size] * world_size
        else:
            last = [leftover // world_size] * world_size
        for rank in range(leftover % world_size):
            last[rank] += 1
    if full < 0:  # fewer rows than ranks: no batch at all
        return []
    return [batch_size] * full + (last if last[0] > 0 else [])


class InMemoryBinaryCriteoIterDataPipe(IterableDataset):
    """Batches (``shardkit.datasets.utils.Batch``) of the Criteo ``.npy`` files for rank ``rank``.

    Args (torchrec's):
        stage: ``"train"``, ``"val"`` (the first half, rounded up, of the first file's rows) or
            ``"test"`` (its second half); other files are read whole.
        dense_paths, sparse_paths, labels_paths: the files of each day, in order (float32 ``[N, 13]``,
            int ``[N, 26]``, int32 ``[N, 1]``, as ``BinaryCriteoUtils.tsv_to_npys`` writes them).
        batch_size, rank, world_size, drop_last: see the module docstring.
        shuffle_batches: permute the rows inside each batch (a torch generator seeded with
            ``shuffle_training_set_random_seed``; torchrec draws from numpy's global generator).
        shuffle_training_set: for ``stage="train"``, permute all rows once (seeded), give rank ``r``
            the ``r``-th contiguous block of the permutation and yield all of that block's batches.
        mmap_mode: map the files instead of reading them (rows are read when a batch needs them).
        hashes: 26 table sizes; each categorical id becomes ``id % hashes[feature]``.

    A batch of ``B`` rows holds ``dense_features`` ``[B, 13]`` (the dense file's dtype),
    ``sparse_features`` a KJT of the 26 keys ``cat_0..cat_25`` with one id per sample (values
    feature-major, the sparse file's dtype; lengths int32 ones) and ``labels`` ``[B]``. ``len()`` is the
    number of batches this rank yields.
    """

    def __init__(
        self,
        stage: str,
        dense_paths: List[str],
        sparse_paths: List[str],
        labels_paths: List[str],
        batch_size: int,
        rank: int,
        world_size: int,
        drop_last: Optional[bool] = False,
        shuffle_batches: bool = False,
        shuffle_training_set: bool = False,
        shuffle_training_set_random_seed: int = 0,
        mmap_mode: bool = False,
        hashes: Optional[List[int]] = None,
        path_manager_key: str = PATH_MANAGER_KEY,
    ) -> None:
        super().__init__()
        _check_arguments(stage, dense_paths, sparse_paths, labels_paths, batch_size, rank, world_size, hashes)
        check_path_manager_key(path_manager_key)
        self.stage, self.batch_size, self.rank, self.world_size = stage, batch_size, rank, world_size
        self.dense_paths, self.sparse_paths, self.labels_paths = dense_paths, sparse_paths, labels_paths
        self.drop_last, self.shuffle_batches, self.mmap_mode = bool(drop_last), shuffle_batches, mmap_mode
        self.shuffle_training_set = shuffle_training_set
        self.hashes = None if hashes is None else torch.tensor(hashes).reshape(1, CAT_FEATURE_COUNT)
        self._generator = torch.Generator().manual_seed(shuffle_training_set_random_seed)
        self.dense_arrs, self.sparse_arrs, self.labels_arrs = (
            [load_npy(path, mmap_mode=mmap_mode) for path in paths]
            for paths in (dense_paths, sparse_paths, labels_paths)
        )
        _check_rows(
            [self.dense_arrs, self.sparse_arrs, self.labels_arrs], [dense_paths, sparse_paths, labels_paths]
        )
        if stage != "train":
            half = (len(self.dense_arrs[0]) + 1) // 2
            part = slice(None, half) if stage == "val" else slice(half, None)
            for arrays in (self.dense_arrs, self.sparse_arrs, self.labels_arrs):
                arrays[0] = arrays[0][part]
        elif shuffle_training_set:
            self._keep_shuffled_block()
            self.rank, self.world_size = 0, 1
        if self.hashes is not None and not mmap_mode:
            for sparse in self.sparse_arrs:
                sparse.remainder_(self.hashes.to(sparse.dtype))
        self.num_rows_per_file = [len(a) for a in self.dense_arrs]
        self._sizes = _batch_sizes(sum(self.num_rows_per_file), batch_size, self.world_size, self.drop_last)

    def _keep_shuffled_block(self) -> None:
        """Keep this rank's block of a seeded permutation of all rows (row ``g`` moves to position
        ``perm[g]``; rank ``r`` holds positions of its contiguous block, in order)."""
        total = sum(len(a) for a in self.dense_arrs)
        permutation = torch.randperm(total, generator=self._generator)
        base, extra = divmod(total, self.world_size)
        first = self.rank * base + min(self.rank, extra)
        rows = permutation.argsort()[first : first + base + (self.rank < extra)]
        for arrays in (self.dense_arrs, self.sparse_arrs, self.labels_arrs):
            arrays[:] = [torch.cat(arrays)[rows]]

    def __iter__(self) -> Iterator[Batch]:
        offsets = [0]
        for rows in self.num_rows_per_file:
            offsets.append(offsets[-1] + rows)
        start = 0
        for index, size in enumerate(self._sizes):
            if index % self.world_size == self.rank:
                yield self._batch(
                    *(
                        self._rows(arrays, offsets, start, start + size)
                        for arrays in (self.dense_arrs, self.sparse_arrs, self.labels_arrs)
                    )
                )
            start += size

    @staticmethod
    def _rows(arrays: List[torch.Tensor], offsets: List[int], start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop-1`` of the files read back to back."""
        parts = [
            array[max(start - first, 0) : stop - first]
            for array, first, end in zip(arrays, offsets, offsets[1:])
            if start < end and stop > first
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _batch(self, dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor) -> Batch:
        if self.shuffle_batches:
            order = torch.randperm(len(dense), generator=self._generator)
            dense, sparse, labels = dense[order], sparse[order], labels[order]
        if self.hashes is not None and self.mmap_mode:
            sparse = sparse.remainder(self.hashes.to(sparse.dtype))
        size = len(dense)
        kjt = KeyedJaggedTensor(
            keys=DEFAULT_CAT_NAMES,
            values=sparse.t().reshape(-1),
            lengths=torch.ones(CAT_FEATURE_COUNT * size, dtype=torch.int32),
            stride=size,
            length_per_key=[size] * CAT_FEATURE_COUNT,
            offset_per_key=[size * i for i in range(CAT_FEATURE_COUNT + 1)],
            validate=False,  # built here: one id per sample and key
        )
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels.reshape(-1))

    def __len__(self) -> int:
        return len(self._sizes[self.rank :: self.world_size])


def _check_arguments(
    stage: str,
    dense_paths: List[str],
    sparse_paths: List[str],
    labels_paths: List[str],
    batch_size: int,
    rank: int,
    world_size: int,
    hashes: Optional[List[int]],
) -> None:
    if stage not in _STAGES:
        raise ValueError(f"InMemoryBinaryCriteoIterDataPipe: stage {stage!r} is not one of {_STAGES}")
    counts = [len(dense_paths), len(sparse_paths), len(labels_paths)]
    if len(set(counts)) != 1 or counts[0] == 0:
        raise ValueError(
            f"InMemoryBinaryCriteoIterDataPipe: {counts[0]} dense, {counts[1]} sparse and {counts[2]} "
            "labels paths; give the same number (at least one) of each, one per day"
        )
    if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(
            f"InMemoryBinaryCriteoIterDataPipe: need batch_size > 0 and 0 <= rank < world_size, got "
            f"batch_size={batch_size}, rank={rank}, world_size={world_size}"
        )
    if hashes is not None and len(hashes) != CAT_FEATURE_COUNT:
        raise ValueError(
            f"InMemoryBinaryCriteoIterDataPipe: {len(hashes)} hashes, need one per categorical feature "
            f"({CAT_FEATURE_COUNT})"
        )


def _check_rows(arrays: List[List[torch.Tensor]], paths: List[List[str]]) -> None:
    """Each day's dense, sparse and labels arrays are 2-D with the same number of rows."""
    for day_arrays, day_paths in zip(zip(*arrays), zip(*paths)):
        shapes = [tuple(a.shape) for a in day_arrays]
        if any(len(s) != 2 for s in shapes) or len({s[0] for s in shapes}) != 1:
            raise ValueError(
                "InMemoryBinaryCriteoIterDataPipe: the dense, sparse and labels files of a day must be 2-D "
                f"with the same number of rows; {day_paths} have shapes {shapes}"
            )


__all__ = ["InMemoryBinaryCriteoIterDataPipe"]

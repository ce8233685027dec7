"""``torchrec.datasets.utils``: the ``Batch`` type, ``safe_cast``, and (re-exported from their own
modules) the data-pipe utilities and train / validation splits."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence, TypeVar

import torch

from shardkit.datasets.pipes import (
    PATH_MANAGER_KEY,
    Limit,
    LoadFiles,
    ParallelReadConcat,
    ReadLinesFromCSV,
    _default_dp_selector,
)
from shardkit.datasets.splits import (
    _IdxFilter,
    _RandFilter,
    idx_split_train_val,
    rand_split_train_val,
    train_filter,
    val_filter,
)
from shardkit.sparse import KeyedJaggedTensor

T = TypeVar("T")


@dataclasses.dataclass
class Batch:
    """Dense features ``[B, D]`` (float), sparse features (a KJT of batch ``B``), labels ``[B]``."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense_features.pin_memory(), self.sparse_features.pin_memory(), self.labels.pin_memory()
        )


def concat_batches(parts: Sequence[Batch]) -> Batch:
    """The samples of ``parts`` in order, as one batch (a step's global batch from the ranks' batches)."""
    keys = parts[0].sparse_features.keys()
    lengths, values = [], []
    for key in keys:
        for part in parts:
            jagged = part.sparse_features[key]
            lengths.append(jagged.lengths())
            values.append(jagged.values())
    kjt = KeyedJaggedTensor(keys, torch.cat(values), lengths=torch.cat(lengths))
    return Batch(torch.cat([p.dense_features for p in parts]), kjt, torch.cat([p.labels for p in parts]))


def safe_cast(val: T, dest_type: Callable[[T], T], default: T) -> T:
    """``dest_type(val)``, or ``default`` when that raises ValueError (``safe_cast("", int, 0) == 0``);
    other errors (a TypeError for ``None``) propagate, as torchrec's."""
    try:
        return dest_type(val)
    except ValueError:
        return default


__all__ = [
    "PATH_MANAGER_KEY",
    "Batch",
    "Limit",
    "LoadFiles",
    "ParallelReadConcat",
    "ReadLinesFromCSV",
    "_IdxFilter",
    "_RandFilter",
    "_default_dp_selector",
    "concat_batches",
    "idx_split_train_val",
    "rand_split_train_val",
    "safe_cast",
    "train_filter",
    "val_filter",
]

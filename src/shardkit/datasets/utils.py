"""``Batch``: one training step's input, as ``torchrec.datasets.utils.Batch``."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from shardkit.sparse import KeyedJaggedTensor


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

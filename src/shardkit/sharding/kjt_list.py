"""KJTList: the per-rank (or per-sharding) KeyedJaggedTensors of one input, as one object."""

from __future__ import annotations

from typing import Iterator, List

import torch

from shardkit.sparse import KeyedJaggedTensor


class KJTList:
    """A list of KeyedJaggedTensors (indexable, iterable, sized) that can record a CUDA stream."""

    def __init__(self, features: List[KeyedJaggedTensor]) -> None:
        self.features = list(features)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> KeyedJaggedTensor:
        return self.features[index]

    def __iter__(self) -> Iterator[KeyedJaggedTensor]:
        return iter(self.features)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor of every KJT as used by ``stream``."""
        for feature in self.features:
            feature.record_stream(stream)

    def __repr__(self) -> str:
        return f"KJTList({self.features!r})"


__all__ = ["KJTList"]

"""KJTList: the per-rank (or per-sharding) KeyedJaggedTensors of one input, as one object; ListOfKJTList:
one KJTList per rank (inference's table-wise input dist)."""

from __future__ import annotations

from typing import Iterator, List

import torch

from shardkit.distributed.multistreamable import Multistreamable
from shardkit.sparse import KeyedJaggedTensor


class KJTList(Multistreamable):
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


class ListOfKJTList(Multistreamable):
    """A list of ``KJTList`` (indexable, iterable, sized) that can record a CUDA stream."""

    def __init__(self, features: List[KJTList]) -> None:
        self.features_list = list(features)

    def __len__(self) -> int:
        return len(self.features_list)

    def __getitem__(self, index: int) -> KJTList:
        return self.features_list[index]

    def __iter__(self) -> Iterator[KJTList]:
        return iter(self.features_list)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for features in self.features_list:
            features.record_stream(stream)

    def __repr__(self) -> str:
        return f"ListOfKJTList({self.features_list!r})"


__all__ = ["KJTList", "ListOfKJTList"]

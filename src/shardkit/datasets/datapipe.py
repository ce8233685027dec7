"""The base class of shardkit's data pipes: torch's ``IterDataPipe`` where torch has it.

torchrec builds its readers on ``torch.utils.data.IterDataPipe``, so torchrec scripts chain them with
torch's pipes (``dp.iter.Batcher(pipe, 100)``, ``pipe.batch(100).collate()``). torch 2.1 to 2.13 ship
it; torchdata removed its own DataPipes in 0.10 and PyTorch said it would revisit the ones in torch, so
if a later torch drops them the pipes fall back to ``IterableDataset``: they still iterate, feed a
``DataLoader`` and chain through their constructors (``Limit(ReadLinesFromCSV(...), 10)``).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch.utils import data as _data

IterDataPipe = getattr(_data, "IterDataPipe", _data.IterableDataset)
HAS_DATAPIPES = IterDataPipe is not _data.IterableDataset

C = TypeVar("C", bound=type)


def functional_datapipe(name: str) -> Callable[[C], C]:
    """Register a pipe class as ``IterDataPipe.<name>(...)`` (torch's decorator), unless the name is
    taken already: torchrec registers ``limit`` too, and importing both must not fail."""

    def register(cls: C) -> C:
        if HAS_DATAPIPES and name not in IterDataPipe.functions:
            return _data.functional_datapipe(name)(cls)
        return cls

    return register


__all__ = ["HAS_DATAPIPES", "IterDataPipe", "functional_datapipe"]

"""Merging per-device embeddings in one process (single-host inference over several devices).

When one process drives several devices, each device's lookup result is gathered onto one device by
plain copies; no process group is involved. Each forward returns a ``LazyNoWait``: an ``Awaitable``
that also acts as its result when passed to torch functions. Copies and sums are differentiable.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from shardkit.distributed.awaitable import LazyNoWait


def _check_count(owner: str, tensors: List[torch.Tensor], world_size: int) -> None:
    if len(tensors) != world_size:
        raise ValueError(f"{owner}: got {len(tensors)} tensors for a world of {world_size} devices")


class EmbeddingsAllToOne(nn.Module):
    """Concatenates one embedding tensor per device on ``device`` along ``cat_dim``.

    ``cat_dim`` is 1 for pooled embeddings (``[B, D_r]`` -> ``[B, sum D_r]``) and 0 for sequence
    embeddings (``[N_r, D]`` -> ``[sum N_r, D]``).
    """

    def __init__(self, device: torch.device, world_size: int, cat_dim: int) -> None:
        super().__init__()
        self._device = torch.device(device)
        self._world_size = world_size
        self._cat_dim = cat_dim

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> LazyNoWait[torch.Tensor]:
        _check_count("EmbeddingsAllToOne", tensors, self._world_size)
        return LazyNoWait(torch.cat([t.to(self._device) for t in tensors], dim=self._cat_dim))


class EmbeddingsAllToOneReduce(nn.Module):
    """Sums one pooled embedding tensor per device (all ``[B, D]``) on ``device``."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        super().__init__()
        self._device = torch.device(device)
        self._world_size = world_size

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> LazyNoWait[torch.Tensor]:
        _check_count("EmbeddingsAllToOneReduce", tensors, self._world_size)
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(f"EmbeddingsAllToOneReduce: tensors have different shapes {sorted(shapes)}")
        return LazyNoWait(torch.stack([t.to(self._device) for t in tensors]).sum(dim=0))


class SeqEmbeddingsAllToOne(nn.Module):
    """Moves one sequence embedding tensor per device to ``device``, keeping them separate (a list)."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        super().__init__()
        self._device = torch.device(device)
        self._world_size = world_size

    def set_device(self, device_str: str) -> None:
        self._device = torch.device(device_str)

    def forward(self, tensors: List[torch.Tensor]) -> LazyNoWait[List[torch.Tensor]]:
        _check_count("SeqEmbeddingsAllToOne", tensors, self._world_size)
        return LazyNoWait([t.to(self._device) for t in tensors])


__all__ = ["EmbeddingsAllToOne", "EmbeddingsAllToOneReduce", "SeqEmbeddingsAllToOne"]

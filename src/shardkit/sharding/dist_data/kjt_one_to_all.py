"""KJTOneToAll: split a KeyedJaggedTensor's features over the devices one process drives (inference)."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from shardkit.sharding.kjt_list import KJTList
from shardkit.sparse import KeyedJaggedTensor


class KJTOneToAll(nn.Module):
    """Splits the keys into ``splits`` consecutive groups and copies group ``r`` to device ``r``.

    Args:
        splits: ``world_size`` ints summing to the number of keys (checked at forward).
        world_size: number of devices.
        device: their type: ``cuda`` puts group ``r`` on ``cuda:r``; ``cpu`` and ``meta`` keep every
            group on that device. Default: CPU.

    ``forward(kjt)`` -> ``KJTList`` of ``world_size`` KJTs (views when no copy is needed). No process
    group is involved.
    """

    def __init__(self, splits: List[int], world_size: int, device: Optional[torch.device] = None) -> None:
        super().__init__()
        if len(splits) != world_size:
            raise ValueError(
                f"KJTOneToAll: splits {list(splits)} has {len(splits)} entries for {world_size} devices"
            )
        self._splits = [int(s) for s in splits]
        self._world_size = world_size
        self._device_type = torch.device(device).type if device is not None else "cpu"

    def _device_of(self, rank: int) -> torch.device:
        if self._device_type in ("cpu", "meta"):
            return torch.device(self._device_type)
        return torch.device(self._device_type, rank)

    def forward(self, kjt: KeyedJaggedTensor) -> KJTList:
        parts = kjt.split(self._splits)
        return KJTList(
            [
                part
                if part.device() == self._device_of(rank)
                else part.to(self._device_of(rank), non_blocking=True)
                for rank, part in enumerate(parts)
            ]
        )


__all__ = ["KJTOneToAll"]

"""A DTensor state-dict value that also answers torchrec's ``value.local_shards()``.

torchrec's sharded tables have ``ShardedTensor`` state-dict values, and torchrec programs read a rank's
rows with ``value.local_shards()`` (each a ``Shard(tensor, metadata)`` carrying the shard's global
offsets). shardkit gives a replicated table and an even row- or column-wise split as a ``DTensor``
(docs/sharded_state.md), which has no such method; ``StateDTensor`` is that DTensor with the method
added, and a plain DTensor in every other respect (dcp saves and loads it, ops on it return DTensors).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List

from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TorchShard
from torch.distributed.tensor import DTensor, Replicate, Shard


class StateDTensor(DTensor):
    """``DTensor`` on a 1-D mesh (``Replicate()`` or ``Shard(dim)``) plus ``local_shards()``."""

    def local_shards(self) -> List[TorchShard]:
        """This rank's piece as ShardedTensor's ``local_shards()`` gives it: one ``Shard`` whose
        ``tensor`` is the local tensor (no copy) and whose ``metadata`` has its global offsets and sizes
        (a rank whose piece is empty gets it with size 0 along the split dim, as the plan has it)."""
        local = self.to_local()
        (placement,) = self.placements
        (coordinate,) = self.device_mesh.get_coordinate()
        offsets = [0] * local.dim()
        if isinstance(placement, Shard):
            # DTensor's Shard(dim) follows torch.chunk: ceil(n / world) rows per rank, the last ones
            # fewer or none
            n = self.shape[placement.dim]
            block = -(-n // self.device_mesh.size())
            offsets[placement.dim] = min(coordinate * block, n)
        elif not isinstance(placement, Replicate):
            raise TypeError(f"local_shards(): placement {placement} is not Replicate() or Shard(dim)")
        rank = self.device_mesh.mesh[coordinate].item()
        metadata = TorchShardMetadata(offsets, list(local.shape), f"rank:{rank}/{local.device}")
        return [TorchShard(local, metadata)]

    def __deepcopy__(self, memo: Dict[int, Any]) -> StateDTensor:
        # torch's default deepcopy of a tensor subclass needs clone() to return the subclass; ops on a
        # DTensor return a plain DTensor
        local = copy.deepcopy(self._local_tensor, memo)
        return StateDTensor(local, self._spec, requires_grad=self.requires_grad)


def with_local_shards(value: DTensor) -> StateDTensor:
    """``value`` (from ``DTensor.from_local``) as a ``StateDTensor`` over the same local tensor."""
    return StateDTensor(value._local_tensor, value._spec, requires_grad=value.requires_grad)

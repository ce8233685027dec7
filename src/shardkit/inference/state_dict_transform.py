"""A sharded state dict gathered onto one rank, or moved to another device (torchrec's
``torchrec.inference.state_dict_transform``).

A sharded model's ``state_dict()`` holds, per table, a ``ShardedTensor`` or a ``DTensor`` (shardkit's
``StateDTensor`` included; docs/sharded_state.md) over this rank's pieces, and plain tensors for the
dense parameters. :func:`state_dict_gather` fills an unsharded model's state dict from it on rank 0,
one value at a time: rank 0 receives one rank's pieces at a time and writes them into the result, so
no rank holds more than one table beyond the result (rank 0) or its own shards (the others).
:func:`state_dict_to_device` moves every local piece to a device and keeps the values sharded.

Every rank calls both with the same keys; a rank whose keys, shapes or values disagree makes both
raise ``ValueError`` on every rank before any table is sent (never a hang).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._shard.sharded_tensor import Shard as TorchShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from shardkit.distributed.agreement import gather_objects, group_rank, group_size
from shardkit.sharding.state_dtensor import StateDTensor, with_local_shards

StateValue = Union[torch.Tensor, ShardedTensor, DTensor]
# (global offsets, sizes) of one local piece
Piece = Tuple[Tuple[int, ...], Tuple[int, ...]]


def _global_shape(value: StateValue) -> Tuple[int, ...]:
    # ShardedTensor.shape goes through a deprecated __torch_function__ (a FutureWarning)
    return tuple(value.metadata().size if isinstance(value, ShardedTensor) else value.shape)


def _local_pieces(value: StateValue) -> List[Tuple[Piece, torch.Tensor]]:
    """This rank's pieces of ``value`` with their global offsets (a plain tensor: the whole of it)."""
    if isinstance(value, ShardedTensor):
        return [
            ((tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)), s.tensor)
            for s in value.local_shards()
        ]
    if isinstance(value, DTensor):
        if any(isinstance(p, Partial) for p in value.placements):
            raise ValueError(f"a DTensor with a Partial placement {value.placements} has no pieces to gather")
        local = value.to_local()
        (chunk,) = value.__create_chunk_list__()  # dcp's view of where the local tensor sits
        return [((tuple(chunk.offsets), tuple(local.shape)), local)]
    return [(((0,) * value.dim(), tuple(value.shape)), value)]


def _describe(key: str, value: object) -> Tuple[Optional[str], Optional[Tuple[int, ...]], List[Piece]]:
    """(problem, global shape, local pieces) of one value, for the agreement between ranks."""
    if not isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor):
        return f"{key!r} is a {type(value).__name__}, not a tensor, ShardedTensor or DTensor", None, []
    try:
        return None, _global_shape(value), [piece for piece, _ in _local_pieces(value)]
    except ValueError as err:
        return f"{key!r}: {err}", None, []


def _comm_device(group: Optional[ProcessGroup]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slices(piece: Piece) -> Tuple[slice, ...]:
    offsets, sizes = piece
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


@torch.no_grad()
def state_dict_gather(
    src: Dict[str, Union[torch.Tensor, ShardedTensor, DTensor]],
    dst: Dict[str, torch.Tensor],
) -> None:
    """Fill ``dst`` (an unsharded model's state dict) on rank 0 with the values of ``src`` (a sharded
    model's state dict on this rank) for every key of ``dst``. A collective over the default group.

    Args:
        src: this rank's state dict: ``ShardedTensor`` / ``DTensor`` values (any placement but
            ``Partial``) and plain tensors (dense parameters, identical on every rank: rank 0's is used).
        dst: the destination on every rank (the same keys and shapes on every rank); only rank 0's
            tensors are written (copied with conversion to their dtype and device), as torchrec does.

    Raises ``ValueError`` on every rank, before anything is sent, naming the key and the rank when a
    key of ``dst`` is missing from ``src``, shapes differ, or ranks pass different keys.
    """
    group = None
    world, rank = group_size(group), group_rank(group)
    problems, mine = [], {}
    for key, target in dst.items():
        if key not in src:
            problems.append(f"{key!r} is in dst but not in src")
            continue
        problem, shape, pieces = _describe(key, src[key])
        if problem is None and shape != tuple(target.shape):
            problem = f"{key!r}: src has shape {list(shape)}, dst {list(target.shape)}"
        if problem is not None:
            problems.append(problem)
        mine[key] = pieces
    everyone = gather_objects((list(dst), problems, mine), group)
    errors = [f"rank {r}: {p}" for r, (_, probs, _) in enumerate(everyone) for p in probs]
    if any(keys != list(dst) for keys, _, _ in everyone):
        errors.append(f"ranks pass dst with different keys: {[sorted(keys) for keys, _, _ in everyone]}")
    if errors:
        raise ValueError("state_dict_gather: " + "; ".join(errors))
    device = _comm_device(group) if world > 1 else None
    for key, target in dst.items():
        value = src[key]
        if rank == 0:
            for piece, tensor in _local_pieces(value):
                target[_slices(piece)] = tensor.detach().reshape(piece[1])
        if not isinstance(value, (ShardedTensor, DTensor)):
            continue  # a dense tensor: rank 0's own copy is the value
        if isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements):
            continue  # every rank holds all of it
        # one sending rank at a time: rank 0 holds at most one piece beyond the result
        for sender in range(1, world):
            for piece in everyone[sender][2][key]:
                if 0 in piece[1]:
                    continue
                if rank == sender:
                    tensor = dict(_local_pieces(value))[piece]
                    dist.send(tensor.detach().contiguous().to(device), dst=0)
                elif rank == 0:
                    buffer = torch.empty(piece[1], dtype=_dtype(value), device=device)
                    dist.recv(buffer, src=sender)
                    target[_slices(piece)] = buffer


def _dtype(value: StateValue) -> torch.dtype:
    if isinstance(value, ShardedTensor):
        return value.metadata().tensor_properties.dtype
    return value.dtype


def state_dict_all_gather_keys(
    state_dict: Dict[str, Union[torch.Tensor, ShardedTensor, DTensor]], pg: Optional[ProcessGroup]
) -> List[str]:
    """The union of every rank's keys, sorted (a collective over ``pg``)."""
    return sorted({key for keys in gather_objects(sorted(state_dict), pg) for key in keys})


def state_dict_to_device(
    state_dict: Dict[str, Union[torch.Tensor, ShardedTensor, DTensor]],
    pg: Optional[ProcessGroup],
    device: torch.device,
) -> Dict[str, Union[torch.Tensor, ShardedTensor, DTensor]]:
    """A copy of ``state_dict`` with every local piece on ``device``, still sharded the same way.

    ``ShardedTensor`` values keep their shards' offsets (placements now name ``device``), ``DTensor``
    values their placements on a mesh of ``pg``'s ranks for ``device``'s type (a ``StateDTensor``
    stays one), plain tensors move. A collective over ``pg`` (None: the default group): every rank
    must pass the same keys; ``ValueError`` on every rank naming the keys a rank lacks (torchrec fills
    them with empty ShardedTensors; every shardkit sharded module gives every rank every key).
    """
    device = torch.device(device)
    everyone = gather_objects(sorted(state_dict), pg)
    union = sorted({key for keys in everyone for key in keys})
    missing = [f"rank {r} lacks {sorted(set(union) - set(keys))}" for r, keys in enumerate(everyone)]
    missing = [m for m, keys in zip(missing, everyone) if set(keys) != set(union)]
    if missing:
        raise ValueError("state_dict_to_device: ranks pass different keys: " + "; ".join(missing))
    moved: Dict[str, Union[torch.Tensor, ShardedTensor, DTensor]] = {}
    for key in union:
        value = state_dict[key]
        if isinstance(value, ShardedTensor):
            moved[key] = _sharded_to(value, device)
        elif isinstance(value, DTensor):
            moved[key] = _dtensor_to(value, pg, device)
        elif isinstance(value, torch.Tensor):
            moved[key] = value.to(device)
        else:
            raise ValueError(f"state_dict_to_device: {key!r} is a {type(value).__name__}, not a tensor")
    return moved


def _sharded_to(value: ShardedTensor, device: torch.device) -> ShardedTensor:
    rank = dist.get_rank()

    def placed(md, mine: bool):
        where = f"rank:{md.placement.rank() if not mine else rank}/{_placement_device(device, mine)}"
        return type(md)(list(md.shard_offsets), list(md.shard_sizes), where)

    shards = [TorchShard(s.tensor.to(device), placed(s.metadata, True)) for s in value.local_shards()]
    metadata = value.metadata()
    everywhere = [placed(md, md.placement.rank() == rank) for md in metadata.shards_metadata]
    new_metadata = type(metadata)(everywhere, metadata.size, metadata.tensor_properties)
    # every rank knows the global metadata already: no all-gather (as sharded_state.to_state_value)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, new_metadata)


def _placement_device(device: torch.device, mine: bool = True) -> str:
    # a ShardedTensor names each shard's device; another rank's CUDA shard is on its own device index,
    # which this rank does not know: keep the type (cuda:0 for every rank is what torchrec writes too)
    if device.type == "cuda":
        index = device.index if mine and device.index is not None else 0
        return f"cuda:{index}"
    return device.type


def _dtensor_to(value: DTensor, pg: Optional[ProcessGroup], device: torch.device) -> DTensor:
    mesh = DeviceMesh.from_group(pg if pg is not None else dist.group.WORLD, device.type)
    moved = DTensor.from_local(
        value.to_local().to(device),
        mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )
    return with_local_shards(moved) if isinstance(value, StateDTensor) else moved


__all__ = ["state_dict_all_gather_keys", "state_dict_gather", "state_dict_to_device"]

"""State-dict values of sharded tables that ``torch.distributed.checkpoint`` (dcp) saves and loads.

A sharded module holds, on each rank, the local shards of each table (``ShardLayout.local_metadata``
order). :func:`to_state_value` wraps them, without copying, into one value per table:

- replicated (DATA_PARALLEL): a ``DTensor`` with ``Replicate()`` on a 1-D mesh of the world;
- one shard per rank, shard ``i`` on rank ``i``, cut along one dim exactly as DTensor cuts it
  (``torch.chunk`` sizes: ``ceil(n / world)`` per rank, the last ones smaller or empty): a ``DTensor``
  with ``Shard(dim)``; this covers even row- and column-wise splits over the whole world;
- anything else (table-wise, uneven ``array_split`` splits, several blocks per rank, a subset of the
  ranks): torch's ``ShardedTensor`` built from the local shards and the global metadata.

``DTensor.from_local`` cannot describe the last case even with an explicit shape: dcp derives each
rank's offsets from the placements (``torch.chunk`` sizes), not from the local tensor, so an uneven
``array_split`` shard would be saved at the wrong offsets. dcp saves ``ShardedTensor`` shards at their
own offsets, and it loads any saved layout into any other of the same global shape (it reads the
overlap of every saved chunk with every local one), so a checkpoint reshards across world sizes and
between the DTensor and ShardedTensor forms.

Because the values alias the local shards, ``dcp.load(module.state_dict(), ...)`` writes straight into
the module's tables. :func:`load_state_value` copies a value of the same layout (or a full tensor) into
local shards, for ``nn.Module.load_state_dict``. Only the default process group is supported: shard
placements name global ranks.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TorchShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardkit.kernels.offload.backing_store import store_of
from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sharding.state_dtensor import with_local_shards
from shardkit.sharding.state_layout import ShardLayout

StateValue = Union[DTensor, ShardedTensor]


def _world() -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sharded state values need torch.distributed to be initialized")
    return dist.get_rank(), dist.get_world_size()


def _chunk_sizes(n: int, world_size: int) -> List[int]:
    # DTensor's Shard(dim) follows torch.chunk; chunk returns fewer pieces when n is small, so pad
    # with empty ones (the ranks DTensor leaves empty).
    sizes = [len(c) for c in torch.arange(n).chunk(world_size)] if n > 0 else []
    return sizes + [0] * (world_size - len(sizes))


def dtensor_shard_dim(layout: ShardLayout, world_size: int) -> Optional[int]:
    """The dim along which ``layout`` is exactly DTensor's ``Shard(dim)`` on a 1-D world mesh, or None.

    That is: ``world_size`` shards, shard ``i`` on rank ``i``, the ``i``-th ``torch.chunk`` piece of
    dim ``dim``, whole along every other dim. A replicated layout has no shard dim (None).
    """
    shards = layout.shards
    if layout.replicated or len(shards) != world_size or [s.rank for s in shards] != list(range(world_size)):
        return None
    shape = layout.global_shape
    for dim in range(len(shape)):
        others_whole = all(
            s.shard_offsets[d] == 0 and s.shard_sizes[d] == shape[d]
            for s in shards
            for d in range(len(shape))
            if d != dim
        )
        if not others_whole:
            continue
        sizes = _chunk_sizes(shape[dim], world_size)
        offsets = [sum(sizes[:i]) for i in range(world_size)]
        # an empty shard's offset carries no data; the plan may put it anywhere
        if all(
            s.shard_sizes[dim] == size and (size == 0 or s.shard_offsets[dim] == off)
            for s, size, off in zip(shards, sizes, offsets)
        ):
            return dim
    return None


def _global_views(local_shards: Sequence[torch.Tensor], layout: ShardLayout) -> List[torch.Tensor]:
    # Detached views in the shards' global sizes: they share storage with the module's tensors, so
    # what dcp.load writes into them lands in the module.
    views = [t.detach() for t in local_shards]
    return [v.unsqueeze(-1) for v in views] if layout.per_block else views


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def to_state_value(
    local_shards: Sequence[torch.Tensor], layout: ShardLayout, dtype: Optional[torch.dtype] = None
) -> StateValue:
    """This rank's local shards of one table (or optimizer state) as a dcp-savable value, no copy.

    Args:
        local_shards: this rank's tensors, one per ``layout.local_metadata(rank)`` entry, in that
            order, each of ``layout.local_shape`` (any dtype, all the same); empty on a rank that
            holds no shard.
        layout: from ``table_layout`` / ``row_state_layout``.
        dtype: the tensor's dtype, used only on a rank without local shards (default: torch's
            default dtype); it does not affect what dcp saves.

    Returns a ``DTensor`` (replicated, or ``Shard(dim)`` when :func:`dtensor_shard_dim` finds one; a
    ``StateDTensor``, which also has ShardedTensor's ``local_shards()``) or a ``ShardedTensor``.
    Raises ``ValueError`` naming the table for wrong local shards or a layout that names ranks outside
    the world. No communication.
    """
    rank, world_size = _world()
    if layout.holding_ranks and layout.holding_ranks[-1] >= world_size:
        raise ValueError(
            f"table {layout.name!r}: layout places shards on ranks {layout.holding_ranks}, "
            f"the world has {world_size}"
        )
    if layout.replicated and len(layout.shards) != world_size:
        raise ValueError(
            f"table {layout.name!r}: replicated layout for {len(layout.shards)} ranks, "
            f"the world has {world_size}"
        )
    layout.check_local(local_shards, rank)
    views = _global_views(local_shards, layout)
    if layout.replicated:
        mesh = DeviceMesh.from_group(dist.group.WORLD, views[0].device.type)
        return with_local_shards(DTensor.from_local(views[0], mesh, [Replicate()], run_check=False))
    dim = dtensor_shard_dim(layout, world_size)
    if dim is not None:
        mesh = DeviceMesh.from_group(dist.group.WORLD, views[0].device.type)
        shape = torch.Size(layout.global_shape)
        value = DTensor.from_local(
            views[0], mesh, [Shard(dim)], run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )
        return with_local_shards(value)
    return _sharded_tensor(views, layout, rank, dtype)


def _sharded_tensor(
    views: List[torch.Tensor], layout: ShardLayout, rank: int, dtype: Optional[torch.dtype]
) -> ShardedTensor:
    local = list(zip(views, layout.local_metadata(rank)))
    for view, md in local:
        if view.device != torch.device(md.device):
            raise ValueError(
                f"table {layout.name!r}: the plan places shard {md.shard_offsets} on {md.device}, "
                f"the local tensor is on {view.device}"
            )
    properties = TensorProperties(dtype=views[0].dtype if views else (dtype or torch.get_default_dtype()))
    metadata = ShardedTensorMetadata(
        [_torch_md(s) for s in layout.shards],
        torch.Size(layout.global_shape),
        properties,
    )
    shards = [TorchShard(view, _torch_md(md)) for view, md in local]
    # The documented constructor (init_from_local_shards) all-gathers the metadata; every rank already
    # has it from the plan, so build without communication (torch's constructor for exactly this case).
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def _torch_md(md: ShardMetadata) -> TorchShardMetadata:
    return TorchShardMetadata(list(md.shard_offsets), list(md.shard_sizes), md.placement)


def _volume(md: ShardMetadata) -> int:
    volume = 1
    for size in md.shard_sizes:
        volume *= int(size)
    return volume


def _local_chunks(value: StateValue) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """(global offsets, tensor) of each local piece of a DTensor or ShardedTensor."""
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    chunks = value.__create_chunk_list__()  # dcp's own view of where the local tensor sits
    return [(tuple(chunks[0].offsets), value.to_local())]


def load_state_value(
    value: Union[StateValue, torch.Tensor], local_shards: Sequence[torch.Tensor], layout: ShardLayout
) -> None:
    """Copy ``value`` into this rank's ``local_shards`` (in place); for ``load_state_dict``.

    ``value`` is a DTensor / ShardedTensor whose local pieces together cover every non-empty local
    shard (e.g. one made by :func:`to_state_value` from the same layout, and filled by ``dcp.load``;
    the pieces may be cut differently, as an offloaded table's row chunks are), a replicated DTensor,
    or a plain tensor holding the whole table. Raises ``ValueError`` naming the table when the global
    shape differs or part of a shard is missing.
    """
    rank, _ = _world()
    # ShardedTensor.shape would go through its deprecated __torch_function__ (a FutureWarning)
    shape = tuple(value.metadata().size if isinstance(value, ShardedTensor) else value.shape)
    if shape != layout.global_shape:
        raise ValueError(
            f"table {layout.name!r}: state value has shape {list(shape)}, "
            f"the table's is {list(layout.global_shape)}"
        )
    if isinstance(value, DTensor) and all(isinstance(p, Replicate) for p in value.placements):
        value = value.to_local()
    if not isinstance(value, (DTensor, ShardedTensor)):
        load_full_table(value, local_shards, layout, rank)
        return
    layout.check_local(local_shards, rank)
    chunks = _local_chunks(value)
    with torch.no_grad():
        for view, md in zip(_global_views(local_shards, layout), layout.local_metadata(rank)):
            if _volume(md) == 0:
                continue
            copied, sources = _copy_overlaps(view, md, chunks)
            _drop_resident([view, *sources])
            if copied != _volume(md):
                raise ValueError(
                    f"table {layout.name!r}: the state value on rank {rank} does not cover the piece at "
                    f"offsets {md.shard_offsets} of sizes {md.shard_sizes} "
                    f"(it has {[(list(o), list(t.shape)) for o, t in chunks]}); "
                    f"load the checkpoint with dcp.load into this module's state_dict, or pass the full table"
                )


def _drop_resident(tensors: Sequence[torch.Tensor]) -> None:
    """Unmap from this process the pages of the backing files (an offloaded table's, or the scratch file
    a checkpoint load staged it in) that copying between ``tensors`` touched: a table larger than
    memory is loaded piece by piece with the resident set growing by about one piece."""
    for store in {id(s): s for s in map(store_of, tensors) if s is not None}.values():
        store.drop_resident()


def _copy_overlaps(view: torch.Tensor, md: ShardMetadata, chunks) -> Tuple[int, List[torch.Tensor]]:
    """Copy into ``view`` (shard ``md``) the part of each local chunk that overlaps it; the number of
    elements copied. The chunks of one value do not overlap each other, so ``view`` is covered when
    that number is its volume: a value cut differently from the layout (an offloaded table's row chunks,
    ``state_chunks``, against an in-memory table's shards, or back) loads as well as one cut alike.
    Also returns the chunks that overlapped."""
    copied, sources = 0, []
    for offsets, tensor in chunks:
        if tensor.dim() != view.dim():
            continue
        target, source, volume = [], [], 1
        for o, size, p, length in zip(md.shard_offsets, md.shard_sizes, offsets, tensor.shape):
            lo, hi = max(int(o), int(p)), min(int(o) + int(size), int(p) + int(length))
            if hi <= lo:
                volume = 0
                break
            target.append(slice(lo - int(o), hi - int(o)))
            source.append(slice(lo - int(p), hi - int(p)))
            volume *= hi - lo
        if volume:
            view[tuple(target)].copy_(tensor[tuple(source)])
            copied += volume
            sources.append(tensor)
    return copied, sources


def load_full_table(
    full: torch.Tensor, local_shards: Sequence[torch.Tensor], layout: ShardLayout, rank: Optional[int] = None
) -> None:
    """Copy this rank's slices of the unsharded ``full`` tensor into ``local_shards`` (in place).

    ``full`` has ``layout.global_shape`` (any device or dtype; copied with conversion). ``rank``
    defaults to this process's rank. No communication: every rank passes the same ``full``. Raises
    ``ValueError`` naming the table and the sizes for a wrong ``full`` or wrong local shards.
    """
    if rank is None:
        rank = _world()[0]
    if tuple(full.shape) != layout.global_shape:
        raise ValueError(
            f"table {layout.name!r}: the full tensor has shape {list(full.shape)}, "
            f"the table's is {list(layout.global_shape)}"
        )
    layout.check_local(local_shards, rank)
    with torch.no_grad():
        for target, md in zip(local_shards, layout.local_metadata(rank)):
            target.copy_(full[_slices(md)].reshape(target.shape))


def _slices(md: ShardMetadata) -> Tuple[slice, ...]:
    return tuple(slice(int(o), int(o) + int(s)) for o, s in zip(md.shard_offsets, md.shard_sizes))


def full_table(
    local_shards: Sequence[torch.Tensor], layout: ShardLayout, dst: Optional[int] = None
) -> Optional[torch.Tensor]:
    """The unsharded tensor of ``layout.global_shape``, assembled from every rank's local shards.

    A collective over the default group: every rank calls it with its own local shards. Returns the
    tensor on every rank (``dst=None``, an all-gather) or on rank ``dst`` only (a gather; None
    elsewhere), with the shards' dtype, on the shards' device. Raises the same ``ValueError`` on every
    rank when any rank's local shards do not match the layout or ranks disagree on the dtype, so a
    mistake on one rank does not leave the others waiting.
    """
    rank, world_size = _world()
    try:
        layout.check_local(local_shards, rank)
        problem = None
    except ValueError as err:
        problem = str(err)
    mine = (problem, str(local_shards[0].dtype) if local_shards else None, _device_type(local_shards))
    everyone: List[Tuple[Optional[str], Optional[str], Optional[str]]] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(everyone) if p is not None]
    dtypes = sorted({d for _, d, _ in everyone if d is not None})
    if not problems and len(dtypes) > 1:
        problems = [f"table {layout.name!r}: ranks hold shards of different dtypes {dtypes}"]
    if problems:
        raise ValueError("full_table: " + "; ".join(problems))
    if dst is not None and not 0 <= dst < world_size:
        raise ValueError(f"full_table: dst {dst} is outside a world of {world_size}")
    if layout.replicated:
        return local_shards[0].detach().clone() if dst in (None, rank) else None
    dtype = getattr(torch, dtypes[0].split(".")[-1]) if dtypes else torch.get_default_dtype()
    device = _comm_device(local_shards, [t for _, _, t in everyone if t is not None])
    return _gather(local_shards, layout, dst, rank, world_size, dtype, device)


def _device_type(local_shards: Sequence[torch.Tensor]) -> Optional[str]:
    return local_shards[0].device.type if local_shards else None


def _comm_device(local_shards: Sequence[torch.Tensor], device_types: List[str]) -> torch.device:
    # A rank without shards still takes part; it sends from the device its peers use.
    if local_shards:
        return local_shards[0].device
    kind = device_types[0] if device_types else "cpu"
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, getattr(torch, kind).current_device())


def _gather(
    local_shards: Sequence[torch.Tensor],
    layout: ShardLayout,
    dst: Optional[int],
    rank: int,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Optional[torch.Tensor]:
    # gloo's all_gather / gather need equal sizes: every rank sends its shards flattened into one
    # buffer padded to the largest rank's element count, which every rank knows from the layout.
    counts = [sum(_volume(md) for md in layout.local_metadata(r)) for r in range(world_size)]
    width = max(counts)
    send = torch.zeros(width, dtype=dtype, device=device)
    if local_shards:
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in local_shards])
        send[: flat.numel()] = flat
    received = [torch.empty_like(send) for _ in range(world_size)]
    if dst is None:
        dist.all_gather(received, send)
    else:
        dist.gather(send, received if rank == dst else None, dst=dst)
        if rank != dst:
            return None
    full = torch.empty(layout.global_shape, dtype=dtype, device=device)
    for r in range(world_size):
        start = 0
        for md in layout.local_metadata(r):
            size = _volume(md)
            full[_slices(md)] = received[r][start : start + size].reshape(md.shard_sizes)
            start += size
    return full


__all__ = [
    "StateValue",
    "dtensor_shard_dim",
    "full_table",
    "load_full_table",
    "load_state_value",
    "to_state_value",
]

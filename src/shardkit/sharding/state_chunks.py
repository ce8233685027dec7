"""The state of an offloaded table, cut into row chunks so that a checkpoint streams it.

An offloaded table (``fused_uvm`` / ``fused_uvm_caching``) may be larger than the memory of its rank, so
its state values must never make anything hold one of its shards whole in RAM:

- ``torch.distributed.checkpoint``'s reader loads every saved chunk with ``torch.load`` (a copy of the
  whole chunk in memory) before copying it into place, so a shard saved as one chunk would be read into
  RAM whole. Here each shard is cut along its rows into pieces of at most :data:`STATE_CHUNK_BYTES`
  (one ``ShardedTensor`` local shard each), so a save writes, and a load reads, one piece at a time.
- the writer clones a tensor whose storage is larger than the tensor (a row slice of a backing field)
  and keeps what it wrote until the file is complete: each piece is an *alias* of its rows of the backing
  file with a storage of its own (``BackingStore.alias``), written straight from the file.

The cut depends only on the plan (shard sizes, dtype), so every rank derives the same layout. A table
whose shards fit one piece keeps its plan layout unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence

import torch

from shardkit.kernels.offload.backing_store import store_of
from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sharding.state_layout import ShardLayout

# at most this many bytes per piece of an offloaded table's state value
STATE_CHUNK_BYTES = 16 << 20
# ... unless the table would then have more pieces than this (a checkpoint's metadata allows 65,536
# chunks per tensor): huge tables get larger pieces
MAX_PIECES = 32768


def _rows_per_piece(layout: ShardLayout, element_size: int) -> List[int]:
    """Rows per piece of each shard of ``layout`` (in ``layout.shards`` order)."""
    total_rows = sum(int(md.shard_sizes[0]) for md in layout.shards)
    floor = math.ceil(total_rows / MAX_PIECES) if total_rows else 1
    out = []
    for md in layout.shards:
        row_bytes = element_size * math.prod(int(s) for s in md.shard_sizes[1:])
        out.append(max(1, floor, STATE_CHUNK_BYTES // max(1, row_bytes)))
    return out


def chunked_layout(layout: ShardLayout, dtype: torch.dtype) -> ShardLayout:
    """``layout`` with every shard cut along dim 0 into pieces of at most :data:`STATE_CHUNK_BYTES`."""
    element_size = torch.empty((), dtype=dtype).element_size()
    shards = []
    for md, step in zip(layout.shards, _rows_per_piece(layout, element_size)):
        rows = int(md.shard_sizes[0])
        if rows <= step:
            shards.append(md)
            continue
        for start in range(0, rows, step):
            shards.append(
                ShardMetadata(
                    [int(md.shard_offsets[0]) + start, *md.shard_offsets[1:]],
                    [min(step, rows - start), *md.shard_sizes[1:]],
                    md.placement,
                )
            )
    return dataclasses.replace(layout, shards=tuple(shards))


def chunked_local(
    tensors: Sequence[torch.Tensor], layout: ShardLayout, rank: int, dtype: torch.dtype
) -> List[torch.Tensor]:
    """This rank's local tensors (in ``layout.local_metadata(rank)`` order) cut as
    :func:`chunked_layout` cuts their shards; pieces of a backing file are aliases with their own
    storage (no copy)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    steps = dict(zip(map(id, layout.shards), _rows_per_piece(layout, element_size)))
    out = []
    for tensor, md in zip(tensors, layout.local_metadata(rank)):
        step, rows = steps[id(md)], int(md.shard_sizes[0])
        pieces = [tensor] if rows <= step else [tensor[s : s + step] for s in range(0, rows, step)]
        for piece in pieces:
            store = store_of(piece)
            out.append(piece if store is None else store.alias(piece))
    return out


__all__ = ["MAX_PIECES", "STATE_CHUNK_BYTES", "chunked_layout", "chunked_local"]

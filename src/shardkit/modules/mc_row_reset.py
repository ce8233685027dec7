"""What an eviction does to a table: the evicted slots' rows are re-initialized and their fused
optimizer state is reset, wherever those rows live (a whole table or any shard of it).

Re-initialization is deterministic, so that a sharded module and its unsharded equivalent agree:
with ``init_fn`` in the table config, ``init_fn([n, cols] rows)`` (deterministic if ``init_fn`` is);
otherwise a uniform draw in ``[weight_init_min, weight_init_max]`` from a counter-based hash of
(table name, slot, column, iteration): the same value whichever rank holds the row.
"""

from __future__ import annotations

import zlib

import torch

from shardkit.modules.embedding_configs import BaseEmbeddingConfig
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 ``x`` in ``[0, 2**32)``; multipliers below 2**31 keep the
    products below 2**63 (no signed overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _MASK32
    return x ^ (x >> 16)


def reinit_values(
    config: BaseEmbeddingConfig, slots: torch.Tensor, col_start: int, col_end: int, iteration: int
) -> torch.Tensor:
    """Fresh ``[len(slots), col_end - col_start]`` rows (the table's dtype) for evicted ``slots``."""
    if config.init_fn is not None:
        rows = torch.empty(slots.numel(), config.embedding_dim, dtype=config.dtype, device=slots.device)
        config.init_weight_(rows)
        return rows[:, col_start:col_end]
    seed = zlib.crc32(config.name.encode()) ^ (iteration & _MASK32)
    row_key = _hash32(_hash32((slots & _MASK32) ^ seed) ^ ((slots >> 32) & _MASK32))  # [n]
    cols = torch.arange(col_start, col_end, device=slots.device)
    col_key = _hash32((cols * 0x9E3779B1) & _MASK32)  # [cols]
    unit = (_hash32(row_key.unsqueeze(1) ^ col_key.unsqueeze(0)).to(torch.float64) + 0.5) / 2.0**32
    low, high = config.get_weight_init_min(), config.get_weight_init_max()
    return (low + unit * (high - low)).to(config.dtype)


@torch.no_grad()
def reset_rows_(lookup: GroupedEmbeddingLookup, table: str, slots: torch.Tensor, iteration: int) -> None:
    """Re-initialize the rows of ``slots`` (global row ids of ``table``) that ``lookup`` holds, and zero
    their fused optimizer state (Adagrad sums to ``initial_accumulator_value``). Others are skipped."""
    lookup.sync_storage()  # an offloaded table's cache holds newer rows than its weight tensor
    slots = slots.to(lookup.weight.device)
    for index, shard in enumerate(lookup.shards):
        if shard.table_name != table:
            continue
        held = slots[(slots >= shard.row_start) & (slots < shard.row_end)]
        if held.numel() == 0:
            continue
        rows = held - shard.row_start + lookup.row_offsets[index]
        fresh = reinit_values(shard.config, held, shard.col_start, shard.col_end, iteration)
        lookup.weight.data[rows] = fresh
        if lookup.optimizer is not None:
            for name, state in lookup.optimizer.named_buffers(recurse=False):
                state[rows] = lookup.optimizer.config.initial_accumulator_value if name == "sum" else 0.0


__all__ = ["reinit_values", "reset_rows_"]

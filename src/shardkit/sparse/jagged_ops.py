"""Vectorized helpers over jagged layouts (values split into rows by lengths / offsets).

Shared by JaggedTensor and KeyedJaggedTensor. None of them synchronizes the host with the device
unless its docstring says so.
"""

from __future__ import annotations

from typing import Sequence

import torch


def host_list_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor of host-side ints on ``device`` without waiting for the device.

    ``torch.tensor(..., device=cuda)`` is a blocking copy that waits for the stream; a non-blocking copy
    from pageable memory is staged by the driver at once, so the host list may go away right after.
    """
    return torch.tensor(list(values), dtype=torch.long).to(device, non_blocking=True)


def complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets ``[n + 1]`` (starting at 0, same dtype) of lengths ``[n]``; no host sync."""
    offsets = lengths.new_zeros(lengths.numel() + 1)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """Lengths ``[n]`` of offsets ``[n + 1]``; no host sync."""
    return offsets[1:] - offsets[:-1]


def row_ids(lengths: torch.Tensor, num_values: int) -> torch.Tensor:
    """Row index (int64) of each of the ``num_values`` values; no host sync (output size is known)."""
    rows = torch.arange(lengths.numel(), device=lengths.device)
    return torch.repeat_interleave(rows, lengths, output_size=num_values)


def padded_dense(
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    length: int,
    padding_value: float,
) -> torch.Tensor:
    """Rows of a jagged ``values [N, *D]`` as ``[B, length, *D]``, truncated or padded; no host sync.

    Values past ``length`` in a row go to one spare slot that is dropped, so no boolean mask (which
    would need a sync to size its result) is used.
    """
    batch = lengths.numel()
    num_values = values.size(0)
    trailing = values.shape[1:]
    out = values.new_full((batch * length + 1, *trailing), padding_value)
    rows = row_ids(lengths, num_values)
    cols = torch.arange(num_values, device=values.device) - offsets[rows].long()
    spare = batch * length
    slots = torch.where(cols < length, rows * length + cols, torch.full_like(cols, spare))
    out.index_copy_(0, slots, values)
    return out[:spare].view(batch, length, *trailing)


def values_of_padded(dense: torch.Tensor, offsets: torch.Tensor, num_values: int) -> torch.Tensor:
    """The jagged values ``[num_values, *D]`` of padded rows ``dense [B, L, *D]`` cut by ``offsets
    [B + 1]`` (the inverse of :func:`padded_dense`); a value at a position ``>= L`` of its row is zero.
    No host sync (``num_values`` is ``offsets[-1]``, given by the caller); differentiable in ``dense``.
    """
    batch, length = dense.shape[0], dense.shape[1]
    trailing = dense.shape[2:]
    # one zero row after the dense rows: the source of every position past L (no mask, no sync)
    rows_and_zero = torch.cat([dense.reshape(batch * length, *trailing), dense.new_zeros(1, *trailing)])
    rows = row_ids(offsets[1:] - offsets[:-1], num_values)
    cols = torch.arange(num_values, device=dense.device) - offsets[rows].long()
    slots = torch.where(cols < length, rows * length + cols, batch * length)
    return rows_and_zero.index_select(0, slots)


def take_segments(tensor: torch.Tensor, sizes: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Cut ``tensor`` into consecutive segments of ``sizes`` and concatenate segments ``order``.

    One split (views, a single call rather than one Python slice per segment) and one copy kernel;
    a loop over segments (keys), never over elements.
    """
    if not order:
        return tensor[:0]
    parts = tensor.split_with_sizes(list(sizes))
    return torch.cat([parts[i] for i in order])

"""Reordering what an all-to-all delivers: from source-rank-major to feature-major ("recat").

After a KJT all-to-all, rank ``me`` holds, for each source rank ``s`` in order, its ``L`` local
features; segment ``s * L + i`` is feature ``i`` as sent by rank ``s``. The output wants each feature's
rows together: segment order ``[i + s * L for i in range(L) for s in feature_order]``.

``feature_order`` is ``range(W)`` with ``stagger=1``. With ``stagger=k`` (``k`` divides ``W``), ranks are
read as a ``[k, W / k]`` grid column by column: ``[x + (W // k) * y for x in range(W // k) for y in
range(k)]``, e.g. ``W=4, k=2 -> [0, 2, 1, 3]`` (used when ranks are numbered node-major but batches
are wanted interleaved).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from shardkit.kernels import native_for
from shardkit.sparse.jagged_ops import complete_cumsum, host_list_to_device


def feature_order(num_splits: int, stagger: int = 1) -> List[int]:
    """The order in which source ranks' rows follow each other within one feature (see module doc)."""
    per = num_splits // stagger
    return [x + per * y for x in range(per) for y in range(stagger)]


def get_recat(local_split: int, num_splits: int, stagger: int = 1) -> List[int]:
    """Segment order after the all-to-all: output segment ``k`` is received segment ``recat[k]``.

    ``local_split``: features this rank receives (L); ``num_splits``: ranks (W). ``get_recat(2, 4, 2)``
    is ``[0, 4, 2, 6, 1, 5, 3, 7]``.
    """
    order = feature_order(num_splits, stagger)
    return [i + j * local_split for i in range(local_split) for j in order]


def expand_recat(recat: Sequence[int], segment_sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """A segment order as an order of rows: ``[R]`` int64, output row ``r`` is input row ``result[r]``.

    ``segment_sizes[j]`` rows make received segment ``j`` (host ints, so no sync).
    """
    starts = [0, *accumulate(segment_sizes)]
    index = [row for j in recat for row in range(starts[j], starts[j + 1])]
    return host_list_to_device(index, device)


def jagged_segment_index(
    lengths: torch.Tensor, segment_rows: Sequence[int], recat: Sequence[int], num_values: int
) -> torch.Tensor:
    """Gather index ``[num_values]`` (int64) that reorders the *values* of jagged segments by ``recat``.

    ``lengths`` ``[R]`` are the row lengths of the received data; segment ``j`` is ``segment_rows[j]``
    consecutive rows. Output values are ``values[index]``. Computed on the device without a host
    sync: the segments' value counts come from the offsets, the output size is known.
    """
    device = lengths.device
    offsets = complete_cumsum(lengths.to(torch.int64))
    bounds = host_list_to_device([0, *accumulate(segment_rows)], device)
    starts = offsets[bounds[:-1]]
    sizes = offsets[bounds[1:]] - starts
    order = host_list_to_device(recat, device)
    new_sizes = sizes[order]
    new_starts = torch.cumsum(new_sizes, 0) - new_sizes
    # value p of output segment k sits at starts[order[k]] + (p - new_starts[k]) in the input
    shift = torch.repeat_interleave(starts[order] - new_starts, new_sizes, output_size=num_values)
    return shift + torch.arange(num_values, device=device)


# (segment rows, recat, device) -> their int64 tensors: a training step's input dist reorders the same
# segments every step (the batch sizes and the plan repeat), so the two small tensors are built once
# instead of twice a step; bounded (cleared when full) since a variable batch may bring new sizes
_SegmentKey = Tuple[Tuple[int, ...], Tuple[int, ...], torch.device]
_SEGMENT_TENSORS: Dict[_SegmentKey, Tuple[torch.Tensor, torch.Tensor]] = {}
SEGMENT_TENSORS_LIMIT = 64


def segment_tensors(
    segment_rows: Sequence[int], recat: Sequence[int], device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``segment_rows`` and ``recat`` as int64 tensors on ``device`` (``[S]`` each), kept between calls.

    The tensors are shared by every caller with the same arguments: read them, never write them.
    """
    key = (tuple(segment_rows), tuple(recat), device)
    found = _SEGMENT_TENSORS.get(key)
    if found is None:
        if len(_SEGMENT_TENSORS) >= SEGMENT_TENSORS_LIMIT:
            _SEGMENT_TENSORS.clear()
        found = _SEGMENT_TENSORS[key] = (
            host_list_to_device(segment_rows, device),
            host_list_to_device(recat, device),
        )
    return found


def permute_value_segments(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor],
    segment_rows: Sequence[int],
    recat: Sequence[int],
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``values`` (and ``weights``) ``[N]`` reordered by whole segments (see :func:`jagged_segment_index`).

    On CPU with the native kernels, one memcpy per segment; otherwise (and for weights that need a
    gradient) a gather through the index.
    """
    differentiable = weights is not None and weights.requires_grad and torch.is_grad_enabled()
    native = None if differentiable else native_for(values.device)
    if native is not None:
        rows_tensor, recat_tensor = segment_tensors(segment_rows, recat, lengths.device)
        return native.permute_segments(
            lengths.contiguous(),
            values.contiguous(),
            None if weights is None else weights.contiguous(),
            rows_tensor,
            recat_tensor,
        )
    index = jagged_segment_index(lengths, segment_rows, recat, values.numel())
    return values[index], None if weights is None else weights[index]


__all__ = [
    "expand_recat",
    "feature_order",
    "get_recat",
    "jagged_segment_index",
    "permute_value_segments",
    "segment_tensors",
]

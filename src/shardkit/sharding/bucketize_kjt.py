"""``bucketize_kjt_before_all2all``: a KeyedJaggedTensor's ids cut into row blocks (buckets), before the
KJT all-to-all of a row-wise sharding sends bucket ``b`` to rank ``b``.

Rule (fbgemm's ``block_bucketize_sparse_features``): with a block size ``bs`` for the feature and
``n`` buckets, id ``v < bs * n`` goes to bucket ``v // bs`` as local row ``v % bs``; a larger id goes to
bucket ``v % n`` as row ``v // n``. With ``block_bucketize_row_pos`` (uneven blocks: per feature, the
``n + 1`` first rows of the buckets), id ``v`` goes to the bucket whose rows contain it, as row
``v - first row``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from shardkit.sparse import KeyedJaggedTensor


def _buckets(
    values: torch.Tensor,
    feature: torch.Tensor,
    num_buckets: int,
    block_sizes: torch.Tensor,
    row_pos: Optional[List[torch.Tensor]],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(bucket, local row) of each id."""
    if row_pos is None:
        size = block_sizes.to(device=values.device, dtype=values.dtype)[feature]
        inside = values < size * num_buckets
        bucket = torch.where(inside, values // size.clamp(min=1), values % num_buckets)
        local = torch.where(inside, values % size.clamp(min=1), values // num_buckets)
        return bucket, local
    bucket = torch.empty_like(values)
    local = torch.empty_like(values)
    for f, starts in enumerate(row_pos):
        mask = feature == f
        starts = starts.to(device=values.device, dtype=values.dtype)
        ids = values[mask]
        b = (torch.searchsorted(starts, ids, right=True) - 1).clamp(0, num_buckets - 1)
        bucket[mask], local[mask] = b, ids - starts[b]
    return bucket, local


def bucketize_kjt_before_all2all(
    kjt: KeyedJaggedTensor,
    num_buckets: int,
    block_sizes: torch.Tensor,
    output_permute: bool = False,
    bucketize_pos: bool = False,
    block_bucketize_row_pos: Optional[List[torch.Tensor]] = None,
) -> Tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
    """``kjt``'s ids cut into ``num_buckets`` buckets (see the module docstring for the rule).

    Returns the bucketed KJT, keys ``kjt.keys() * num_buckets`` (bucket-major: bucket 0's keys, then
    bucket 1's, ...; a bag's ids keep their order), ids replaced by their local rows, weights carried
    along (with ``bucketize_pos``: each id's position in its bag instead, float32), and with
    ``output_permute`` the int64 ``[ids]`` position of each input id in the output (None otherwise).

    Args:
        block_sizes: ``[features]`` rows per bucket of each feature.
        block_bucketize_row_pos: per feature, ``[num_buckets + 1]`` bucket boundaries (uneven blocks).
    """
    keys = kjt.keys()
    if block_sizes.numel() != len(keys):
        raise ValueError(
            f"bucketize_kjt_before_all2all: {block_sizes.numel()} block sizes for {len(keys)} features {keys}"
        )
    if num_buckets < 1:
        raise ValueError(f"bucketize_kjt_before_all2all: num_buckets must be positive, got {num_buckets}")
    if block_bucketize_row_pos is not None and len(block_bucketize_row_pos) != len(keys):
        raise ValueError(
            f"bucketize_kjt_before_all2all: {len(block_bucketize_row_pos)} block_bucketize_row_pos for "
            f"{len(keys)} features"
        )
    values, lengths = kjt.values(), kjt.lengths().to(torch.int64)
    device = values.device
    segments = lengths.numel()
    segment = torch.repeat_interleave(torch.arange(segments, device=device), lengths)
    bags = torch.tensor(kjt.stride_per_key(), dtype=torch.int64, device=device)
    feature = torch.repeat_interleave(torch.arange(len(keys), device=device), bags)[segment]
    bucket, local = _buckets(values, feature, num_buckets, block_sizes, block_bucketize_row_pos)
    slot = bucket.to(torch.int64) * segments + segment  # output segment of each id
    order = torch.sort(slot, stable=True).indices
    new_lengths = torch.bincount(slot, minlength=num_buckets * segments).to(kjt.lengths().dtype)
    if bucketize_pos:
        starts = torch.cumsum(lengths, 0) - lengths
        weights = (torch.arange(values.numel(), device=device) - starts[segment]).to(torch.float32)[order]
    else:
        weights = None if kjt.weights_or_none() is None else kjt.weights()[order]
    variable = kjt.variable_stride_per_key()
    out = KeyedJaggedTensor(
        keys * num_buckets,
        local[order],
        weights,
        lengths=new_lengths,
        stride=None if variable else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() * num_buckets if variable else None,
    )
    permute = None
    if output_permute:
        permute = torch.empty_like(order)
        permute[order] = torch.arange(order.numel(), device=device)
    return out, permute


__all__ = ["bucketize_kjt_before_all2all"]

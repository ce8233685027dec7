"""Pooled embeddings with a variable batch size per feature: the flat layouts and the expansion.

With a variable batch per feature, feature ``f`` of rank ``r`` has ``b[f][r]`` bags, so a rank's lookup
yields one flat tensor of per-feature blocks (``ShardedGroupedLookup``: feature by feature, each
feature's bags in source-rank order). The variable-batch output dists want the blocks grouped by
destination rank; their results hold one ``[b[f][me] * width]`` block per feature, which the input's
``inverse_indices`` expand to the ``[B_me, width]`` rows of the unsharded module.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from shardkit.sparse.jagged_ops import take_segments


def feature_major_to_rank_major(
    flat: torch.Tensor, widths: Sequence[int], bags: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Blocks ``[f][r]`` (``bags[f][r] * widths[f]`` values each) -> blocks ``[r][f]``; one copy.

    flat: 1-D, features in order, each feature's source ranks in order. bags: ``[F][W]``.
    """
    if not bags:
        return flat
    world = len(bags[0])
    sizes = [bags[f][r] * widths[f] for f in range(len(widths)) for r in range(world)]
    order = [f * world + r for r in range(world) for f in range(len(widths))]
    return take_segments(flat, sizes, order)


def bags_per_rank_per_feature(bags: Sequence[Sequence[int]], world_size: int) -> List[List[int]]:
    """``[F][W]`` -> ``[W][F]`` (the variable-batch dists' ``batch_size_per_rank_per_feature``);
    ``W`` empty lists on a rank without features."""
    return [[bags[f][r] for f in range(len(bags))] for r in range(world_size)]


def expand_blocks(
    flat: torch.Tensor,
    widths: Sequence[int],
    batches: Sequence[int],
    inverse: torch.Tensor,
    features: Sequence[int],
) -> torch.Tensor:
    """Blocks ``[batches[k], widths[k]]`` of ``flat`` -> ``[B, sum widths]``.

    Block k's row of sample b is ``inverse[features[k], b]`` (``inverse`` the input's ``[F, B]``
    inverse indices); the gather's backward sums the gradients of samples sharing a bag.
    """
    blocks = flat.split([b * w for b, w in zip(batches, widths)])
    index = inverse.to(device=flat.device, dtype=torch.int64)
    rows = [
        block.view(b, w).index_select(0, index[f])
        for block, b, w, f in zip(blocks, batches, widths, features)
    ]
    return torch.cat(rows, dim=1) if len(rows) > 1 else rows[0]


__all__ = ["bags_per_rank_per_feature", "expand_blocks", "feature_major_to_rank_major"]

"""PermutePooledEmbeddings: reorder the feature blocks (columns) of pooled embeddings."""

from __future__ import annotations

from itertools import accumulate
from typing import List, Optional

import torch


class PermutePooledEmbeddings:
    """``[B, sum(embs_dims)]`` -> ``[B, sum(embs_dims[p] for p in permute)]``: output block ``i`` is input
    block ``permute[i]``.

    Used as a callback of an output dist to put features back in the unsharded module's order after
    an all-to-all delivered them grouped by rank. One ``index_select`` (differentiable: the backward
    scatters each block's gradient back). ``permute`` is usually a permutation; repeating or dropping
    blocks is allowed.

    Args:
        embs_dims: width of each input block (feature).
        permute: input block of each output block.
        device: where the column index is built (moved to the input's device when they differ).
    """

    def __init__(
        self, embs_dims: List[int], permute: List[int], device: Optional[torch.device] = None
    ) -> None:
        self._embs_dims = [int(d) for d in embs_dims]
        self._permute = [int(p) for p in permute]
        bad = [p for p in self._permute if not 0 <= p < len(self._embs_dims)]
        if bad:
            raise ValueError(
                f"PermutePooledEmbeddings: permute entries {bad} out of range for "
                f"{len(self._embs_dims)} blocks"
            )
        if any(d < 0 for d in self._embs_dims):
            raise ValueError(f"PermutePooledEmbeddings: negative block width in {self._embs_dims}")
        starts = [0, *accumulate(self._embs_dims)]
        columns = [c for p in self._permute for c in range(starts[p], starts[p + 1])]
        self._width = starts[-1]
        self._columns = torch.tensor(columns, dtype=torch.int64, device=device)

    def __call__(self, pooled_embs: torch.Tensor) -> torch.Tensor:
        if pooled_embs.dim() != 2 or pooled_embs.size(1) != self._width:
            raise ValueError(
                f"PermutePooledEmbeddings: input of shape {tuple(pooled_embs.shape)}, expected "
                f"[B, {self._width}] (sum of embs_dims {self._embs_dims})"
            )
        if self._columns.device != pooled_embs.device:
            self._columns = self._columns.to(pooled_embs.device)
        return pooled_embs.index_select(1, self._columns)


__all__ = ["PermutePooledEmbeddings"]

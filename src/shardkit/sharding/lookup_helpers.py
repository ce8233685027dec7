"""Small tensor helpers of torchrec's ``embedding_lookup`` that user-written lookups call.

(``CommOpGradientScaling``, the gradient scaling of that module, is in ``embedding_sharding``.)
"""

from __future__ import annotations

from typing import List

import torch


def fx_wrap_tensor_view2d(x: torch.Tensor, dim0: int, dim1: int) -> torch.Tensor:
    """``x.view(dim0, dim1)`` (torchrec keeps it out of fx tracing; here a plain call)."""
    return x.view(dim0, dim1)


def embeddings_cat_empty_rank_handle(
    embeddings: List[torch.Tensor], dummy_embs_tensor: torch.Tensor, dim: int = 0
) -> torch.Tensor:
    """``torch.cat(embeddings, dim)``, with ``dummy_embs_tensor`` when a rank has no embeddings at all
    (no table shard here) and the one tensor itself when there is one (no copy)."""
    if not embeddings:
        return dummy_embs_tensor
    if len(embeddings) == 1:
        return embeddings[0]
    return torch.cat(embeddings, dim=dim)


__all__ = ["embeddings_cat_empty_rank_handle", "fx_wrap_tensor_view2d"]

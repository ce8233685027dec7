"""``dp_all_reduce_sum``: the global count that normalizes the chunk losses across data-parallel ranks."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.collective_utils import all_reduce_sum_scalar


def dp_all_reduce_sum(local: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum a scalar count over the data-parallel ``group`` (None: the default group).

    Returns a fresh fp32 0-dim tensor on ``local``'s device, detached; ``local`` is not modified.
    Without an initialized torch.distributed (or with a group of one rank) it is a copy of
    ``local``. The chunk losses divide by this global number of valid chunks, so that the sum of the
    per-rank parts is the loss of the global batch (the convention the cross-entropy follows with
    its global token count). Collective: every rank of ``group`` must call it; a rank passing
    something that is not a scalar makes every rank raise ``ValueError``.
    """
    return all_reduce_sum_scalar(local, group)

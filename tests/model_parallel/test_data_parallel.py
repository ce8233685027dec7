"""The DDP wrapper of DistributedModelParallel on torch with and without DDP's ``forward_sync_buffers``
(torch >= 2.13; before it ``broadcast_buffers=False``, which also skips the init sync, so shardkit
broadcasts the replicated buffers itself): buffers start as rank 0's and are not re-synced in forward,
gradients are averaged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.model_parallel import DistributedModelParallel, data_parallel
from shardkit.sharding.types import ShardingPlan


class _WithBuffer(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 1)
        self.register_buffer("scale", torch.full((3,), float(rank + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.scale).sum()


def _wrapper_worker(has_forward_sync_buffers: bool) -> bool:
    data_parallel._HAS_FORWARD_SYNC_BUFFERS = has_forward_sync_buffers
    rank = dist.get_rank()
    dmp = DistributedModelParallel(_WithBuffer(rank), plan=ShardingPlan({}))  # dense only
    module = dmp.module
    torch.testing.assert_close(module.scale, torch.ones(3))  # rank 0's
    module.scale.fill_(rank + 5.0)  # rank-local from here on: not re-broadcast by forward
    x = torch.full((2, 3), float(rank))
    dmp(x).backward()
    torch.testing.assert_close(module.scale, torch.full((3,), rank + 5.0))
    # d/dw of sum(w . (x * scale)) over 2 rows: 2 * rank * (rank + 5), averaged over the ranks
    expected = sum(2 * r * (r + 5.0) for r in range(dist.get_world_size())) / dist.get_world_size()
    torch.testing.assert_close(module.linear.weight.grad, torch.full((1, 3), expected))
    return True


@pytest.mark.parametrize("has_forward_sync_buffers", [True, False], ids=["torch>=2.13", "older-torch"])
def test_buffers_synced_once_and_gradients_averaged(run_world, has_forward_sync_buffers):
    assert run_world(_wrapper_worker, 2, has_forward_sync_buffers) == [True, True]

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


def _dense_after_steps(shm: bool, precision, steps: int = 3) -> dict:
    """A DLRM's dense parameters after ``steps`` DMP steps, with the shared-memory exchange ``shm``."""
    from shardkit.distributed import shm_exchange
    from tests.model_parallel import _dlrm as d

    shm_exchange.set_shm_exchange(shm)
    try:
        dmp = d.row_wise_dmp(data_parallel.DefaultDataParallelWrapper(allreduce_comm_precision=precision))
        # DDP's registered hooks' states (shardkit's default sits in a CommHookSlot)
        hooks = [getattr(state, "state", state) for _, state in dmp._dmp_wrapped_module._comm_hooks]
        params = d.train_dense_sgd(dmp, steps)
        return {
            "dense": {n: p.detach().clone() for n, p in params.items()},
            "shm_hook_calls": [h.calls for h in hooks if isinstance(h, data_parallel.ShmAllReduceState)],
            "hooks": len(hooks),
        }
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gradient_all_reduce_goes_through_shared_memory_with_the_same_parameters(run_world, world_size):
    on = run_world(_dense_after_steps, world_size, True, None)
    off = run_world(_dense_after_steps, world_size, False, None)
    for a, b in zip(on, off):
        assert a["shm_hook_calls"] == [3] and b["hooks"] == 0  # one bucket per step, through the hook
        assert a["dense"].keys() == b["dense"].keys() and a["dense"]
        for name in a["dense"]:
            if world_size == 2:  # x / 2 + y / 2: one rounding whatever the order, bitwise gloo's
                assert torch.equal(a["dense"][name], b["dense"][name]), name
            else:  # gloo sums 3 ranks in its own order: fp32 reassociation
                torch.testing.assert_close(a["dense"][name], b["dense"][name], rtol=1e-5, atol=1e-6)
    # the same bits on every rank either way
    assert all(torch.equal(on[0]["dense"][n], r["dense"][n]) for r in on for n in on[0]["dense"])


def test_no_shared_memory_hook_over_a_callers_comm_hook(run_world):
    got = run_world(_dense_after_steps, 2, True, "fp16", 1)
    assert all(r["shm_hook_calls"] == [] and r["hooks"] == 1 for r in got)

"""DTensor logits sharded on the vocabulary: group and offsets come from the mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import (
    distributed_log_softmax,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_topk,
)
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, reference_cross_entropy, reference_logprobs

VOCAB = 13  # DTensor's chunk rule: 7 + 6 at 2 ranks, 5 + 5 + 3 at 3 ranks


def _check_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    X, t = randn((2, 5, VOCAB), 51), randint(VOCAB, (2, 5), 52)
    t[0, 1] = -100
    dx = distribute_tensor(X.clone(), mesh, [Shard(2)]).requires_grad_()
    out = vocab_parallel_cross_entropy(dx, t, reduction="mean", label_smoothing=0.1)
    ref_x = X.clone().requires_grad_()
    ref = reference_cross_entropy(ref_x, t, reduction="mean", label_smoothing=0.1)
    torch.testing.assert_close(out, ref.detach())
    out.backward()
    ref.backward()
    assert dx.grad.placements == dx.placements
    torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad)
    t_valid = t.clamp(min=0)
    torch.testing.assert_close(vocab_parallel_logprobs(dx, t_valid), reference_logprobs(X, t_valid))
    # the result is this rank's plain [..., V/tp] slice of the log-softmax
    own = torch.log_softmax(X, -1).narrow(-1, _start(), dx.to_local().size(-1))
    torch.testing.assert_close(distributed_log_softmax(dx), own)
    entropy = -(torch.softmax(X, -1) * torch.log_softmax(X, -1)).sum(-1)
    torch.testing.assert_close(vocab_parallel_entropy(dx), entropy)
    assert torch.equal(vocab_parallel_argmax(dx), X.argmax(-1))
    values, ids = vocab_parallel_topk(dx, 3)
    assert torch.equal(values, X.topk(3, -1).values) and torch.equal(X.gather(-1, ids), values)
    # the mesh already says the group and offsets
    with pytest.raises(ValueError, match="carries its own process group"):
        vocab_parallel_cross_entropy(dx, t, dist.group.WORLD)
    # only a vocabulary-sharded DTensor
    with pytest.raises(ValueError, match="sharded on its last"):
        vocab_parallel_cross_entropy(distribute_tensor(X.clone(), mesh, [Shard(0)]), t)
    return True


def _start():
    chunk = -(-VOCAB // dist.get_world_size())
    return min(dist.get_rank() * chunk, VOCAB)


@pytest.mark.parametrize("world_size", [2, 3])
def test_dtensor_input(world_size):
    assert all(run_world(_check_dtensor, world_size))

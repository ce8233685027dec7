"""Without torch.distributed (no group): every loss equals PyTorch's single-device function; gradcheck."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import gradcheck

from shardkit.losses import (
    CrossEntropyFunction,
    DistributedLogprob,
    TargetOutOfRangeError,
    TEParallelCrossEntropy,
    distributed_log_softmax,
    from_parallel_logits_to_logprobs,
    parallel_cross_entropy,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_logprobs,
    vocab_parallel_logprobs,
)
from tests.losses.reference import randint, randn

pytestmark = pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a default group")

V = 7


def test_equals_torch_without_a_group():
    X, t = randn((3, 4, V), 61, torch.float32), randint(V, (3, 4), 62)
    t[0, 0] = -100
    flat_ref = F.cross_entropy(X.reshape(-1, V), t.reshape(-1), reduction="none").view(3, 4)
    torch.testing.assert_close(vocab_parallel_cross_entropy(X, t), flat_ref)
    torch.testing.assert_close(parallel_cross_entropy(X, t), flat_ref)
    torch.testing.assert_close(CrossEntropyFunction.apply(X, t, 0.0, True, None, -100), flat_ref.sum() / 11)
    ref_smooth = F.cross_entropy(X.reshape(-1, V), t.reshape(-1), label_smoothing=0.3)
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(X, t, label_smoothing=0.3, reduction="mean"), ref_smooth
    )
    torch.testing.assert_close(
        TEParallelCrossEntropy(reduction="sum")(X, t),
        F.cross_entropy(X.reshape(-1, V), t.reshape(-1), reduction="sum"),
    )
    tv = t.clamp(min=0)
    ref_lp = torch.log_softmax(X, -1).gather(-1, tv[..., None]).squeeze(-1)
    torch.testing.assert_close(DistributedLogprob.apply(X, tv, 0, V, None), ref_lp)
    torch.testing.assert_close(vocab_parallel_logprobs(X, tv), ref_lp)
    next_token = torch.log_softmax(X[:, :-1], -1).gather(-1, tv[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(from_parallel_logits_to_logprobs(X, tv, 0, V, None), next_token)
    torch.testing.assert_close(distributed_log_softmax(X), torch.log_softmax(X, -1))
    # PyTorch raises on out-of-range targets, and so do we (with the ids named)
    with pytest.raises(TargetOutOfRangeError, match="id 9 at position"):
        vocab_parallel_cross_entropy(X, torch.full((3, 4), 9))


def test_non_contiguous_logits():
    X, t = randn((4, 3, V), 63), randint(V, (3, 4), 64)
    x = X.transpose(0, 1)  # [3, 4, V], not contiguous
    ref = F.cross_entropy(x.reshape(-1, V), t.reshape(-1), reduction="none").view(3, 4)
    torch.testing.assert_close(vocab_parallel_cross_entropy(x, t), ref)


def test_gradcheck_float64():
    X = randn((5, V), 65).requires_grad_()
    t = randint(V - 2, (5,), 66)
    t[1] = -100
    opts = dict(label_smoothing=0.2, z_loss=0.05, softcap=2.0, temperature=0.7, vocab_size=V - 2)
    for reduction in ("none", "mean"):
        assert gradcheck(lambda x, r=reduction: vocab_parallel_cross_entropy(x, t, reduction=r, **opts), (X,))
    tv = t.clamp(min=0)
    assert gradcheck(lambda x: vocab_parallel_logprobs(x, tv, temperature=1.5, softcap=3.0), (X,))
    assert gradcheck(lambda x: vocab_parallel_entropy(x, softcap=3.0, vocab_size=V - 1), (X,))
    assert gradcheck(lambda x: distributed_log_softmax(x), (X,))
    H, W = randn((5, 3), 67).requires_grad_(), randn((V, 3), 68).requires_grad_()
    assert gradcheck(
        lambda h, w: vocab_parallel_linear_cross_entropy(h, w, t, reduction="mean", chunk_size=2, **opts),
        (H, W),
    )
    assert gradcheck(lambda h, w: vocab_parallel_linear_logprobs(h, w, tv, chunk_size=2), (H, W))


# the losses' region functions: a backward that is a closed-form kernel cannot be differentiated
# again; asking for it must fail loudly, never give a silent zero or a wrong second derivative
DOUBLE_BACKWARD_CASES = {
    "cross_entropy": lambda x, t: vocab_parallel_cross_entropy(x, t, 0.1),
    "parallel_cross_entropy": lambda x, t: parallel_cross_entropy(x, t),
    "logprobs": lambda x, t: vocab_parallel_logprobs(x, t),
    "log_softmax": lambda x, t: distributed_log_softmax(x),
    "entropy": lambda x, t: vocab_parallel_entropy(x),
    "linear_cross_entropy": lambda x, t: vocab_parallel_linear_cross_entropy(
        x, torch.eye(V, dtype=x.dtype), t
    ),
}


@pytest.mark.parametrize("name", sorted(DOUBLE_BACKWARD_CASES))
def test_double_backward_fails_loudly(name):
    x = randn((3, V), 60).requires_grad_()
    t = randint(V, (3,), 61)
    out = DOUBLE_BACKWARD_CASES[name](x, t)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    # a gradient penalty: the gradient's dependence on x cannot be dropped without a word
    penalty = DOUBLE_BACKWARD_CASES[name](x, t).sum() + g.pow(2).sum()
    with pytest.raises(RuntimeError, match="closed-form kernel"):
        penalty.backward()
    # first order is unchanged by the marking
    (plain,) = torch.autograd.grad(DOUBLE_BACKWARD_CASES[name](x, t).sum(), x)
    torch.testing.assert_close(g.detach(), plain)

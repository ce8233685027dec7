"""The keyword spellings of NeMo RL's, Megatron's and NeMo Automodel's callers (issue 28)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import (
    ParallelCrossEntropy,
    from_parallel_logits_to_logprobs,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, vocab_slice

VOCAB = 12


def _check():
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    start, end = vocab_slice(VOCAB, world, rank)
    X = randn((2, 5, VOCAB), 21)
    target = randint(VOCAB, (2, 5), 22)
    G = randn((2, 4), 23)
    # NeMo RL: from_parallel_logits_to_logprobs(..., tp_group=...) is the group
    ref_x = X.clone().requires_grad_()
    ref = torch.log_softmax(ref_x[:, :-1], -1).gather(-1, target[:, 1:, None]).squeeze(-1)
    (ref * G).sum().backward()
    for spelling in ({"tp_group": group}, {"group": group}):
        x = X[..., start:end].clone().requires_grad_()
        out = from_parallel_logits_to_logprobs(
            x, target, vocab_start_index=start, vocab_end_index=end, **spelling
        )
        torch.testing.assert_close(out.double(), ref.detach())
        (out.double() * G).sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad[..., start:end])
    # NeMo RL's positional order: ..., tp_group, inference_only, cp_group, chunk_size, sampling_params
    positional = from_parallel_logits_to_logprobs(
        X[..., start:end], target, start, end, group, False, None, 3, None
    )
    torch.testing.assert_close(positional.double(), ref.detach())
    with pytest.raises(TypeError, match="not both"):
        from_parallel_logits_to_logprobs(X[..., start:end], target, start, end, group, tp_group=group)
    # NeMo RL: vocab_parallel_argmax(logits, tp_group=...) is the global argmax over the shards
    assert torch.equal(vocab_parallel_argmax(X[..., start:end], tp_group=group), X.argmax(-1))
    assert torch.equal(vocab_parallel_argmax(X[..., start:end], group), X.argmax(-1))
    # without a group (and no slice) it is NeMo RL's local argmax: no communication
    assert torch.equal(vocab_parallel_argmax(X[..., start:end]), X[..., start:end].argmax(-1))
    # Megatron: vocab_parallel_cross_entropy(vocab_parallel_logits=, target=, label_smoothing=)
    t = target.clone()
    t[0, 1] = -100
    ref_x = X.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(
        ref_x.reshape(-1, VOCAB), t.reshape(-1), label_smoothing=0.2, reduction="none"
    ).view(2, 5)
    G5 = randn((2, 5), 24)
    (ref * G5).sum().backward()
    for spelling in ({"vocab_parallel_logits": None}, {"logits": None}):
        x = X[..., start:end].clone().requires_grad_()
        name = next(iter(spelling))
        out = vocab_parallel_cross_entropy(
            **{name: x},
            target=t,
            label_smoothing=0.2,
            tp_group=group,
            vocab_start_index=start,
            vocab_end_index=end,
        )
        torch.testing.assert_close(out.double(), ref.detach())
        (out.double() * G5).sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad[..., start:end])
    with pytest.raises(TypeError, match="not both"):
        vocab_parallel_cross_entropy(X[..., start:end], t, vocab_parallel_logits=X[..., start:end])
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_caller_keyword_spellings(world_size):
    assert all(run_world(_check, world_size))


def test_invalid_reduction_message_starts_as_automodel_expects():
    with pytest.raises(ValueError, match="^Invalid reduction:"):
        ParallelCrossEntropy(reduction="bogus")
    with pytest.raises(ValueError, match="Invalid reduction:"):
        vocab_parallel_cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 2]), reduction="avg")

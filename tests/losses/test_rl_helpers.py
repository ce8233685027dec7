"""Entropy, argmax and top-k over the sharded vocabulary against torch on the gathered logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import vocab_parallel_argmax, vocab_parallel_entropy, vocab_parallel_topk
from shardkit.testing import run_world
from tests.losses.reference import randn, tolerances, transformed, vocab_slice

VOCAB = 13


def _reference_entropy(x, **opts):
    z = transformed(x, **opts)
    return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)


def _check_rl_helpers():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    for dtype in (torch.float64, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        X = randn((3, 4, VOCAB), 31, dtype)
        for opts in ({}, {"temperature": 0.6, "softcap": 2.5, "vocab_size": 11}):
            x = X[..., start:end].clone().requires_grad_()
            out = vocab_parallel_entropy(x, vocab_start_index=start, vocab_end_index=end, **opts)
            ref_x = X.to(torch.float64, copy=True).requires_grad_()
            ref = _reference_entropy(ref_x, **opts)
            torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
            G = randn(out.shape, 32)
            (out * G.to(out.dtype)).sum().backward()
            (ref * G).sum().backward()
            torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
        x = X[..., start:end]
        ids = vocab_parallel_argmax(x, vocab_start_index=start, vocab_end_index=end)
        assert torch.equal(ids, X.argmax(-1))
        ids = vocab_parallel_argmax(x, vocab_start_index=start, vocab_end_index=end, vocab_size=11)
        assert torch.equal(ids, X[..., :11].argmax(-1))
        for k in (1, 4, VOCAB):
            values, ids = vocab_parallel_topk(x, k, vocab_start_index=start, vocab_end_index=end)
            ref_values, _ = X.topk(k, -1)
            assert values.dtype == dtype and torch.equal(values, ref_values)
            fp32, fp32_ids = vocab_parallel_topk(
                x, k, vocab_start_index=start, vocab_end_index=end, out_dtype=torch.float32
            )
            # NeMo RL's fp32 values: the same selection, converted exactly
            assert fp32.dtype == torch.float32 and torch.equal(fp32, ref_values.float())
            assert torch.equal(fp32_ids, ids)
            assert torch.equal(X.gather(-1, ids), values)  # the ids point at those values
            assert torch.equal(ids.sort(-1).values, ids.sort(-1).values.unique_consecutive(dim=-1))
        with pytest.raises(ValueError, match="out_dtype"):
            vocab_parallel_topk(x, 2, vocab_start_index=start, vocab_end_index=end, out_dtype=torch.int64)
        with pytest.raises(ValueError, match="larger than the real vocabulary"):
            vocab_parallel_topk(x, 12, vocab_start_index=start, vocab_end_index=end, vocab_size=11)
    # ties across shards go to the lowest global id, as torch.argmax
    ties = torch.zeros(2, VOCAB)
    ties[0, [2, 7, 12]] = 5.0
    ties[1, [11, 3]] = 1.0
    ids = vocab_parallel_argmax(ties[:, start:end], vocab_start_index=start, vocab_end_index=end)
    assert ids.tolist() == [2, 3]
    values, ids = vocab_parallel_topk(ties[:, start:end], 3, vocab_start_index=start, vocab_end_index=end)
    assert ids.tolist() == [[2, 7, 12], [3, 11, 0]] and values.tolist() == [[5.0] * 3, [1.0, 1.0, 0.0]]
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rl_helpers_match_torch(world_size):
    assert all(run_world(_check_rl_helpers, world_size))

"""Top-k / top-p masks, sampling-aware log-probs, NeMo RL's top-k and gather, against unsharded torch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import (
    apply_top_k_top_p,
    distributed_vocab_topk,
    gather_logits_at_global_indices,
    vocab_parallel_sampling_logprobs,
    vocab_parallel_top_k_top_p_mask,
)
from shardkit.losses.context_parallel import context_parallel_positions
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, tolerances, vocab_slice

SETTINGS = [(None, 0.9), (1, 1.0), (3, 1.0), (5, 0.6), (None, 0.05), (13, 0.999)]


def _reference_mask(logits, top_k, top_p):
    """vLLM's sort-based filter, written out: ascending sort, top-k by the k-th value, top-p by the
    ascending cumulative probability <= 1 - p (the largest always kept). Inputs have no ties."""
    flat = logits.reshape(-1, logits.size(-1)).double()
    sorted_logits, order = flat.sort(-1)
    if top_k is not None:
        kth = sorted_logits[:, -top_k : -top_k + 1 if top_k > 1 else None][:, :1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p < 1.0:
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep.scatter_(1, order, torch.isfinite(sorted_logits))
    return keep.view(logits.shape)


def test_apply_top_k_top_p_matches_the_sort_based_filter():
    X = randn((4, 6, 13), 70)
    for top_k, top_p in SETTINGS:
        filtered, keep = apply_top_k_top_p(X, top_k, top_p)
        assert torch.equal(keep, _reference_mask(X, top_k, top_p)), (top_k, top_p)
        assert torch.equal(filtered, X.masked_fill(~keep, float("-inf")))
    assert apply_top_k_top_p(X, None, 1.0) == (X, None)
    # ties are kept together (vLLM's unstable sort may split them at the boundary)
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert apply_top_k_top_p(tied, 2, 1.0)[1].tolist() == [[True, True, True, False]]
    with pytest.raises(ValueError, match="top_p"):
        apply_top_k_top_p(X, None, 0.0)


def _check_sharded_masks(vocab):
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(vocab, world, rank)
    results = []
    for scale in (3.0, 0.05):  # peaked, and flat (the nucleus then needs more than 64 candidates)
        X = randn((3, 4, vocab), 71) * scale
        for top_k, top_p in SETTINGS:
            if top_k is not None and top_k > vocab:
                continue
            keep = vocab_parallel_top_k_top_p_mask(
                X[..., start:end], top_k, top_p, vocab_start_index=start, vocab_end_index=end
            )
            expected = _reference_mask(X, top_k, top_p)
            assert torch.equal(keep, expected[..., start:end]), (scale, top_k, top_p)
            results.append(int(expected.sum()))
    return results


@pytest.mark.parametrize("world_size, vocab", [(1, 13), (2, 13), (3, 13), (2, 200)])
def test_sharded_mask_equals_the_unsharded_filter(world_size, vocab):
    results = run_world(_check_sharded_masks, world_size, vocab)
    assert all(r == results[0] for r in results)
    if vocab == 200:  # the flat case keeps more tokens than the first 64 candidates
        assert max(results[0]) > 64


def _check_sampling_logprobs():
    world, rank = dist.get_world_size(), dist.get_rank()
    vocab = 13
    start, end = vocab_slice(vocab, world, rank)
    for dtype in (torch.float64, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        X = randn((2, 5, vocab), 72, dtype)
        for top_k, top_p in SETTINGS:
            keep = _reference_mask(X, top_k, top_p)
            # targets the sampler can draw (its own samples), one it cannot on one token
            t = torch.where(keep, X.double(), torch.full_like(X.double(), float("-inf"))).argmax(-1)
            G = randn((2, 5), 73)
            x = X[..., start:end].clone().requires_grad_()
            out = vocab_parallel_sampling_logprobs(
                x, t, top_k, top_p, vocab_start_index=start, vocab_end_index=end
            )
            ref_x = X.to(torch.float64, copy=True).requires_grad_()
            ref = torch.log_softmax(ref_x.masked_fill(~keep, float("-inf")), -1).gather(-1, t[..., None])[
                ..., 0
            ]
            torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
            (out * G.to(out.dtype)).sum().backward()
            (ref * G).sum().backward()
            torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
        if world == 1 or dtype != torch.float64:
            continue
        # a target outside the kept set: -inf, and no NaN in the gradient
        t_out = _reference_mask(X, 1, 1.0).double().argmin(-1)
        x = X[..., start:end].clone().requires_grad_()
        out = vocab_parallel_sampling_logprobs(x, t_out, 1, 1.0, vocab_start_index=start, vocab_end_index=end)
        assert torch.all(out == float("-inf"))
    return True


@pytest.mark.parametrize("world_size", [1, 3])
def test_sampling_logprobs_match_the_filtered_softmax(world_size):
    assert all(run_world(_check_sampling_logprobs, world_size))


def _check_nemo_topk_and_gather(tp):
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // tp
    table = torch.arange(world).reshape(cp, tp)
    tp_groups = [dist.new_group(row.tolist()) for row in table]
    cp_groups = [dist.new_group(col.tolist()) for col in table.t()]
    cp_rank, tp_rank = divmod(rank, tp)
    tp_group, cp_group = tp_groups[cp_rank], cp_groups[tp_rank]
    vocab = 12
    start, end = vocab_slice(vocab, tp, tp_rank, even=True)
    S = 4 * cp
    X = randn((2, S, vocab), 74, torch.bfloat16)
    positions = context_parallel_positions([(0, S)], cp, cp_rank, torch.device("cpu"))
    values, ids = distributed_vocab_topk(
        X[:, positions, start:end], 3, tp_group, vocab_start_index=start, vocab_end_index=end
    )
    ref_values = X[:, positions].float().topk(3, -1).values
    assert values.dtype == torch.float32 and torch.equal(values, ref_values)
    assert torch.equal(X[:, positions].float().gather(-1, ids), values)
    clamped, _ = distributed_vocab_topk(
        X[:, positions, start:end], 50, tp_group, vocab_start_index=start, vocab_end_index=end
    )
    assert clamped.shape[-1] == vocab
    # gather at teacher ids over the full sequence; the last position is padding of the logits
    idx = randint(vocab, (2, S - 1, 4), 75)
    x = X[:, positions, start:end].clone().requires_grad_()
    out = gather_logits_at_global_indices(
        x, idx, tp_group, cp_group if cp > 1 else None, vocab_start_index=start, vocab_end_index=end
    )
    ref_x = X.float().requires_grad_()
    ref = ref_x[:, : S - 1].gather(-1, idx)
    assert out.dtype == torch.float32 and torch.equal(out, ref.detach())
    G = randn((2, S - 1, 4), 76, torch.float32)
    (out * G).sum().backward()  # the same loss on every rank of both groups
    (ref * G).sum().backward()
    # repeated ids accumulate in bf16 here, in fp32 in the reference
    rtol, atol = tolerances(torch.bfloat16)
    torch.testing.assert_close(x.grad.float(), ref_x.grad[:, positions, start:end], rtol=rtol, atol=atol)
    return True


@pytest.mark.parametrize("world_size, tp", [(1, 1), (2, 2), (2, 1), (4, 2)])
def test_nemo_rl_topk_and_gather_at_global_indices(world_size, tp):
    assert all(run_world(_check_nemo_topk_and_gather, world_size, tp))

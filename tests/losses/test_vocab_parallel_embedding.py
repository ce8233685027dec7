"""VocabParallelEmbedding and ParallelLMHead (tied and untied) against the unsharded model.

A tiny LM (embedding -> Linear + tanh -> head tied to the embedding -> cross-entropy) trained 3 SGD
steps on 1, 2, 3 (uneven) and 4 ranks, and on 3 ranks with explicit sizes: the losses of every step,
the embedding shard (both gradients accumulate into it) and the trunk must equal the unsharded model's,
in float64. A rank may hold no rows of the embedding (checked apart: vocab_parallel_cross_entropy
does not take an empty logits shard yet).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.losses.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardkit.testing import run_world

V, H, B, S, STEPS, LR = 11, 6, 3, 5, 3, 0.5


def _data():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(V, H, generator=gen, dtype=torch.float64)
    trunk = torch.randn(H, H, generator=gen, dtype=torch.float64) / H**0.5
    ids = torch.randint(0, V, (STEPS, B, S), generator=gen)
    target = torch.randint(0, V, (STEPS, B, S), generator=gen)
    target[0, 0, 0] = -100  # an ignored position
    return full, trunk, ids, target


def _reference():
    full, trunk, ids, target = _data()
    weight, lin = full.clone().requires_grad_(), trunk.clone().requires_grad_()
    losses = []
    for step in range(STEPS):
        h = torch.tanh(F.embedding(ids[step], weight) @ lin)
        loss = F.cross_entropy(F.linear(h, weight).flatten(0, 1), target[step].flatten())
        loss.backward()
        with torch.no_grad():
            for p in (weight, lin):
                p -= LR * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses, weight.detach(), lin.detach()


def _sharded(sizes):
    full, trunk, ids, target = _data()
    emb = VocabParallelEmbedding(V, H, sizes=sizes, dtype=torch.float64)
    emb.copy_full_weight_(full)
    head = ParallelLMHead(H, V, sizes=sizes, tie_to=emb)
    assert head.weight is emb.weight
    lin = nn.Parameter(trunk.clone())
    params = list({id(p): p for p in [*emb.parameters(), *head.parameters(), lin]}.values())
    assert len(params) == 2  # the tied weight counts once
    optimizer = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        h = torch.tanh(emb(ids[step]) @ lin)
        loss = head.cross_entropy(h, target[step], reduction="mean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    ref_losses, ref_weight, ref_lin = _reference()
    rows = slice(emb.vocab_start_index, emb.vocab_end_index)
    return {
        "rows": (emb.vocab_start_index, emb.vocab_end_index),
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weight": (emb.weight.detach() - ref_weight[rows]).abs().max().item() if emb.weight.numel() else 0.0,
        "trunk": (lin.detach() - ref_lin).abs().max().item(),
    }


def _untied_head_and_errors(sizes):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(V, H, generator=gen)
    hidden = torch.randn(B, S, H, generator=gen)
    head = ParallelLMHead(H, V, sizes=sizes)
    with torch.no_grad():
        head.weight.copy_(full[head.vocab_start_index : head.vocab_end_index])
    expected = F.linear(hidden, full)[..., head.vocab_start_index : head.vocab_end_index]
    same = torch.allclose(head(hidden), expected, atol=1e-6)
    errors = []
    with pytest.raises(ValueError, match="summing to the vocabulary size 11"):
        VocabParallelEmbedding(V, H, sizes=[V] * (dist.get_world_size() + 1))
    with pytest.raises(ValueError, match="hidden_size 5 != the embedding's 6"):
        ParallelLMHead(5, V, tie_to=VocabParallelEmbedding(V, H))
    with pytest.raises(IndexError, match=f"rank {rank}: id 11 is outside the vocabulary"):
        VocabParallelEmbedding(V, H)(torch.tensor([0, 11]))
    errors.append("ok")
    return same, errors


@pytest.mark.parametrize("world, sizes", [(1, None), (2, None), (3, None), (4, None), (3, [2, 4, 5])])
def test_tied_embedding_and_head_train_like_the_unsharded_model(world, sizes):
    results = run_world(_sharded, world, sizes, timeout=120)
    assert [r["rows"] for r in results] == [
        (sum(s[:r]), sum(s[: r + 1])) for s in [sizes or _even(world)] for r in range(world)
    ]
    for r in results:
        assert r["loss"] < 1e-12 and r["weight"] < 1e-12 and r["trunk"] < 1e-12, r


def _even(world):
    return [V // world + (1 if r < V % world else 0) for r in range(world)]


def test_untied_head_gives_the_rank_s_logit_columns_and_bad_input_is_an_error():
    assert run_world(_untied_head_and_errors, 3, None, timeout=120) == [(True, ["ok"])] * 3


def _embedding_with_an_empty_rank():
    full, trunk, ids, _ = _data()
    emb = VocabParallelEmbedding(V, H, sizes=[6, 0, 5], dtype=torch.float64)
    emb.copy_full_weight_(full)
    out = emb(ids[0])
    (out * trunk[0]).sum().backward()
    ref = full.clone().requires_grad_()
    ref_out = F.embedding(ids[0], ref)
    (ref_out * trunk[0]).sum().backward()
    rows = slice(emb.vocab_start_index, emb.vocab_end_index)
    return torch.equal(out, ref_out), torch.equal(emb.weight.grad, ref.grad[rows]), tuple(emb.weight.shape)


def test_a_rank_may_hold_no_rows_of_the_embedding():
    assert run_world(_embedding_with_an_empty_rank, 3, timeout=120) == [
        (True, True, (6, H)),
        (True, True, (0, H)),
        (True, True, (5, H)),
    ]


def test_one_process_without_torch_distributed_is_the_plain_model():
    full, *_ = _data()
    emb = VocabParallelEmbedding(V, H, dtype=torch.float64)
    emb.copy_full_weight_(full)
    ids = torch.tensor([[0, 3, 10]])
    assert torch.equal(emb(ids), F.embedding(ids, full))
    assert (emb.vocab_start_index, emb.vocab_end_index) == (0, V)

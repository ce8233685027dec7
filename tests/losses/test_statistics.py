"""Property test of the kernels: any split of the vocabulary (empty shards included) combines exactly.

The shards are simulated in one process: each shard's statistics and gradient blocks are computed
as its rank would, the statistics are stacked as the all-gather would, and the result is compared
with the loss and gradient of the unsplit logits. This covers many more splits than the multi-rank
tests can afford.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as strat

from shardkit.losses import statistics as st
from tests.losses.reference import reference_cross_entropy


@strat.composite
def _cases(draw):
    vocab = draw(strat.integers(1, 12))
    cuts = sorted(draw(strat.lists(strat.integers(0, vocab), min_size=0, max_size=4)))
    bounds = [0, *cuts, vocab]
    real = draw(strat.integers(1, vocab))
    tokens = draw(strat.integers(0, 5))
    options = {
        "label_smoothing": draw(strat.sampled_from([0.0, 0.25])),
        "z_loss": draw(strat.sampled_from([0.0, 0.1])),
        "softcap": draw(strat.sampled_from([None, 2.0])),
        "temperature": draw(strat.sampled_from([1.0, 0.5])),
    }
    seed = draw(strat.integers(0, 2**16))
    rows = draw(strat.integers(1, 4))
    return vocab, list(zip(bounds[:-1], bounds[1:])), real, tokens, options, seed, rows


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_any_split_combines_to_the_unsplit_loss(case):
    vocab, slices, real, tokens, options, seed, rows = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, vocab, generator=gen, dtype=torch.float64)
    target = torch.randint(0, real, (tokens,), generator=gen)
    if tokens:
        target[0] = -100
    transform = st.LogitTransform(options["softcap"], options["temperature"])
    a, zc = options["label_smoothing"], options["z_loss"]
    per_shard = []
    for start, end in slices:
        shard = st.VocabShard.make(start, end, real)
        index, owned, active = st.local_target_index(target, shard, -100)
        local = x[:, start:end]
        stats = st.shard_statistics(
            lambda i0, i1, local=local: local[i0:i1],
            tokens,
            shard,
            transform,
            index,
            owned,
            rows,
            with_sum=True,
            device=x.device,
            dtype=torch.float64,
        )
        per_shard.append((shard, index, owned, active, local, stats))
    gathered = torch.stack([p[-1] for p in per_shard])
    lse = st.combine_logsumexp(gathered)
    loss = lse - (1 - a) * gathered[..., st.TARGET].sum(0) - (a / real) * gathered[..., st.SUM_Z].sum(0)
    loss = torch.where(target != -100, loss + zc * lse * lse, torch.zeros_like(loss))
    ref_x = x.clone().requires_grad_()
    ref = reference_cross_entropy(ref_x, target, vocab_size=real, **options)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-10)
    ref.sum().backward()
    grad = torch.zeros_like(x)
    ones = torch.ones(tokens, dtype=torch.float64)
    for shard, index, owned, active, local, _ in per_shard:
        blocks = st.softmax_gradient_blocks(
            lambda i0, i1, local=local: local[i0:i1],
            tokens,
            shard,
            transform,
            lse,
            index,
            owned,
            active,
            ones * (1 + 2 * zc * lse),
            ones * (1 - a),
            ones * (a / real),
            rows,
        )
        for i0, i1, block in blocks:
            grad[i0:i1, shard.start : shard.end] = block
    torch.testing.assert_close(grad, ref_x.grad, rtol=1e-10, atol=1e-10)

"""The fused linear losses' blocks of logits on CPU: one buffer per pass, not one allocation per block."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from shardkit.losses import vocab_parallel_linear_cross_entropy

TOKENS, WIDTH, HIDDEN, CHUNK = 64, 256, 4, 8


@pytest.mark.parametrize(
    "reduction, dtype, passes",
    [
        ("none", torch.float32, 2),  # forward blocks, then the backward's recomputed column blocks
        ("none", torch.bfloat16, 2),
        ("mean", torch.float32, 1),  # gradients in forward: one pass
    ],
)
def test_blocks_of_logits_reuse_one_buffer_per_pass(reduction, dtype, passes):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(WIDTH, HIDDEN, generator=gen).to(dtype).requires_grad_()
    t = torch.randint(0, WIDTH, (TOKENS,), generator=gen)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = vocab_parallel_linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=CHUNK)
        out.sum().backward()
    # 8 forward blocks of [8, 256] and 4 backward blocks of [64, 64] (the same elements and more): every
    # allocation of at least one forward block's size is a block (the gradients and statistics are
    # smaller); a fresh tensor per block (a fresh mmap, page faults and all, above malloc's mmap
    # threshold) made 16 (gradients in forward) and 24 such allocations here
    block_bytes = CHUNK * WIDTH * dtype.itemsize
    blocks = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage >= block_bytes]
    assert len(blocks) == passes, blocks
    assert h.grad is not None and w.grad is not None

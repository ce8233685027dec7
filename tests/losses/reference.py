"""Single-process references and sharding helpers shared by the loss tests.

Every rank builds the same global tensors from fixed seeds, takes its shard, and compares the sharded
result with plain torch (``F.cross_entropy`` / ``log_softmax``) on the global tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardkit.distributed.tensor_split import split_offsets, split_sizes


def randn(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def randint(high, shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def vocab_slice(vocab, world, rank, even=False):
    """This rank's ``[start, end)``: even shards (``vocab`` divisible by ``world``) or array_split's rule."""
    if even:
        width = vocab // world
        return rank * width, (rank + 1) * width
    sizes = split_sizes(vocab, world)
    start = split_offsets(sizes)[rank]
    return start, start + sizes[rank]


def transformed(x, softcap=None, temperature=1.0, vocab_size=None):
    z = x
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    if vocab_size is not None:
        z = z[..., :vocab_size]
    return z


def reference_cross_entropy(
    x,
    target,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    temperature=1.0,
    vocab_size=None,
    reduction="none",
):
    """The loss on the gathered logits ``x [..., V]`` with plain torch (all-ignored mean: 0)."""
    z = transformed(x, softcap, temperature, vocab_size)
    flat, t = z.reshape(-1, z.size(-1)), target.reshape(-1)
    loss = F.cross_entropy(
        flat, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
    active = t != ignore_index
    if z_loss:
        lse = torch.logsumexp(flat, -1)
        loss = loss + torch.where(active, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / active.sum().clamp(min=1)


def reference_logprobs(x, target, softcap=None, temperature=1.0, vocab_size=None):
    z = transformed(x, softcap, temperature, vocab_size)
    return torch.log_softmax(z, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def tolerances(dtype):
    """(rtol, atol) for a result computed from ``dtype`` inputs against an fp64 / fp32 reference."""
    if dtype == torch.float64:
        return 1e-10, 1e-12
    if dtype == torch.float32:
        return 1e-5, 1e-6
    return 2e-2, 2e-3  # bf16 / fp16 gradients are rounded once to the input dtype

"""``megatron_cross_entropy``: Megatron's ``vocab_parallel_cross_entropy`` as Megatron computes it.

shardkit's ``vocab_parallel_cross_entropy`` accepts Megatron's call but keeps shardkit's rules. This
entry point follows Megatron where its behaviour is well-defined (docs/names.md lists each difference):

- no ignore index unless asked: as in Megatron, the logits are shifted by the row's max and a target
  outside this rank's columns contributes a shifted target logit of 0 on that rank, so a target outside
  ``[0, V)`` (such as -100) is scored as ``logsumexp(z) - max(z)`` on every rank (the gradient is the
  softmax). ``ignore_index=-100`` gives shardkit's rule (loss 0,
  gradient 0).
- label smoothing: ``smoothing="exact"`` (default) is PyTorch's rule, ``a / V`` on every class of the
  whole vocabulary, the same at every tensor-parallel size. ``smoothing="megatron"`` is Megatron's:
  ``s = a * K / (K - 1)`` with ``K`` this rank's shard width and the mean log-probability taken over
  this rank's shard only, ``loss = (1 - s) * nll - s * mean_shard(log p)``. At tp = 1 that already
  differs from PyTorch (``K = V``: the smoothing mass is spread as ``a / (V - 1)``); at tp > 1 each
  rank's loss differs (each uses its own shard), exactly as in Megatron.

Computed with plain torch ops on fp32 copies of the shard (Megatron's memory profile: a few
``[T, V/tp]`` fp32 tensors, not shardkit's chunked kernels), except the common case (exact rule, every
target in range or ignored) which runs shardkit's kernel. Communication: all-reduces of ``[T]`` fp32
(max, sum of exponentials, target logit, and for the exact rule the sum of logits) over the group.
The gradient on each rank is that of its own loss with respect to its own shard (Megatron's backward).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_size
from shardkit.distributed.regions import reduce_from_region
from shardkit.losses.checks import either_group
from shardkit.losses.cross_entropy import vocab_parallel_cross_entropy
from shardkit.losses.dtensor import resolve_vocab_shard

SMOOTHING_RULES = ("exact", "megatron")


def _all_reduce(value: torch.Tensor, op, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)
    return value


def _plain_loss(z, target, start, vocab, group, label_smoothing, rule) -> torch.Tensor:
    """Per-token loss ``[T]`` fp32 from the fp32 shard ``z`` ``[T, K]`` (see the module doc)."""
    width = z.size(-1)
    with torch.no_grad():
        shift = _all_reduce(
            z.max(-1).values if width else z.new_full(z.shape[:1], -torch.inf), dist.ReduceOp.MAX, group
        )
    sumexp = reduce_from_region((z - shift[:, None]).exp().sum(-1), group)
    lse = shift + sumexp.log()
    index = target - start
    owned = (index >= 0) & (index < width)
    picked = z.gather(-1, index.clamp(0, max(width - 1, 0))[:, None]).squeeze(-1) if width else z.sum(-1)
    # Megatron zeroes a target it does not own *after* subtracting the max: a target no rank owns
    # (-100) scores logsumexp(z) - max(z), the target logit counting as the row's max
    shifted = torch.where(owned, picked - shift, torch.zeros_like(picked))
    nll = sumexp.log() - reduce_from_region(shifted, group)
    if label_smoothing == 0.0:
        return nll
    if rule == "exact":
        mean_logit = reduce_from_region(z.sum(-1), group) / vocab
        return (1.0 - label_smoothing) * nll + label_smoothing * (lse - mean_logit)
    smoothing = label_smoothing * width / (width - 1)  # Megatron's rescaling with the shard width
    return (1.0 - smoothing) * nll + smoothing * (lse - z.mean(-1))


def megatron_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    group: Optional[dist.ProcessGroup] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    ignore_index: Optional[int] = None,
    smoothing: str = "exact",
) -> torch.Tensor:
    """Megatron's ``vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)``.

    Args:
        vocab_parallel_logits: ``[..., V/tp]`` (e.g. ``[S, B, V/tp]``), any float dtype, or a DTensor
            sharded on its last dim; this rank holds ``[vocab_start_index, vocab_end_index)``
            (default: even shards).
        target: ``[...]`` integer global ids, the same on every rank. Ids outside ``[0, V)`` are
            scored as ``logsumexp(z) - max(z)`` (Megatron), unless equal to ``ignore_index``.
        label_smoothing: ``a`` in ``[0, 1]``; its meaning depends on ``smoothing`` (module doc).
        group, tp_group: the tensor-parallel group under either name (None: the default group).
        ignore_index: None (Megatron: nothing ignored) or an id whose tokens get loss 0, gradient 0.
        smoothing: "exact" (default, PyTorch's rule) or "megatron" (Megatron's per-shard rule).
    Returns:
        fp32 (fp64 for fp64 logits) per-token loss ``[...]`` (with ``smoothing="megatron"`` at
        tp > 1, each rank's own).
    """
    op = "megatron_cross_entropy"
    group = either_group(op, group, tp_group)
    if smoothing not in SMOOTHING_RULES:
        raise ValueError(f"{op}: smoothing must be one of {SMOOTHING_RULES}, got {smoothing!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    label_smoothing = float(label_smoothing)
    logits, group, start, end = resolve_vocab_shard(
        vocab_parallel_logits, group, vocab_start_index, vocab_end_index, op
    )
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{op}: target shape {tuple(getattr(target, 'shape', ()))} must be the logits' leading "
            f"shape {tuple(logits.shape[:-1])}"
        )
    width = logits.size(-1)
    if width != end - start:
        raise ValueError(
            f"{op}: the logits have {width} columns but the slice [{start}, {end}) has {end - start}"
        )
    if smoothing == "megatron" and label_smoothing > 0.0 and width < 2:
        raise ValueError(f"{op}: Megatron's smoothing divides by (K - 1); this rank's shard has K = {width}")
    with torch.no_grad():
        vocab = int(
            _all_reduce(torch.tensor([float(width)], device=logits.device), dist.ReduceOp.SUM, group).item()
        )
        flat_target = target.reshape(-1).long()
        kept = (
            flat_target != ignore_index
            if ignore_index is not None
            else torch.ones_like(flat_target, dtype=torch.bool)
        )
        outside = bool((kept & ((flat_target < 0) | (flat_target >= vocab))).any())
    if smoothing == "exact" and not outside:
        # shardkit's kernel computes exactly this (no out-of-range target to score as Megatron does)
        return vocab_parallel_cross_entropy(
            logits,
            target,
            label_smoothing,
            group=group,
            vocab_start_index=start,
            vocab_end_index=end,
            ignore_index=ignore_index,
        )
    z = logits.reshape(-1, width).to(torch.promote_types(logits.dtype, torch.float32))
    loss = _plain_loss(z, flat_target, start, vocab, group, label_smoothing, smoothing)
    loss = torch.where(kept, loss, torch.zeros_like(loss))
    return loss.view(target.shape)


__all__ = ["SMOOTHING_RULES", "megatron_cross_entropy"]

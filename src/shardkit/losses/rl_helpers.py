"""RL helpers over a vocabulary split across ranks: per-token entropy, argmax and top-k with global ids.

All take logits ``[..., V/tp]`` holding the columns ``[start, end)`` (explicit offsets, even shards by
default, or a DTensor sharded on the last dim) and return results replicated on every rank of the group.
Padding columns past ``vocab_size`` are never selected and carry no probability.

- ``vocab_parallel_entropy``: ``H = logsumexp(z) - sum(softmax(z) * z)``, fp32 ``[...]``, differentiable
  (``dH/dz = -softmax(z) * (z - E[z])``, recomputed locally in backward: no communication). Saves a
  reference to the logits and two fp32 ``[T]`` statistics; forward allocates fp32 work blocks only.
  One all-gather of ``[T, 3]`` statistics.
- ``vocab_parallel_argmax``: global ids ``[...]`` int64 of the largest logit, ties to the lowest id (as
  ``torch.argmax``). One all-gather of ``[T, 2]`` fp64 (value, id) pairs. Not differentiable.
- ``vocab_parallel_topk``: values ``[..., k]`` (input dtype, or ``out_dtype=``; exact) and global ids
  ``[..., k]`` int64,
  sorted by value, ties to the lower id. One all-gather of ``[T, k, 2]`` fp64. Not differentiable.

The behaviour on NaN logits is unspecified for argmax / top-k.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import all_gather_flat, group_size
from shardkit.losses import statistics as st
from shardkit.losses.checks import either_group, option_problems, validate_call
from shardkit.losses.dtensor import is_dtensor, resolve_vocab_shard
from shardkit.losses.first_order import first_order_only

# entropy statistics columns: local max, sum exp(z - max), sum exp(z - max) * z
_EMAX, _ESUM, _EZ = 0, 1, 2


def _prepare(op, logits, group, start, end, vocab_size, problems=()):
    logits, group, start, end = resolve_vocab_shard(logits, group, start, end, op)
    validate_call(
        op, group, logits, None, start, end, vocab_size=vocab_size, options=(vocab_size,), problems=problems
    )
    return logits, group, st.VocabShard.make(start, end, vocab_size)


def _all_gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """``[tp, *local.shape]`` of every rank's equally shaped ``local`` (one all-gather)."""
    tp = group_size(group)
    if tp == 1:
        return local.unsqueeze(0)
    out = torch.empty(tp * local.numel(), dtype=local.dtype, device=local.device)
    all_gather_flat(out, local.contiguous().view(-1), group=group)
    return out.view(tp, *local.shape)


def _entropy_statistics(logits2d, shard, transform, rows, group):
    num_rows = logits2d.size(0)
    work = st.work_dtype(logits2d.dtype)
    stats = torch.zeros(num_rows, 3, dtype=work, device=logits2d.device)
    stats[:, _EMAX] = float("-inf")
    if shard.real_width:
        for i0, i1 in st.row_blocks(num_rows, rows):
            z = transform.apply(logits2d[i0:i1, : shard.real_width])
            local_max = z.amax(1)
            shift = torch.where(torch.isfinite(local_max), local_max, torch.zeros_like(local_max))
            e = torch.exp(z - shift[:, None])
            # where: a -inf logit has probability 0 and must contribute 0, not 0 * -inf = NaN
            ez = torch.where(e > 0, e * z, torch.zeros_like(e))
            stats[i0:i1, _EMAX] = local_max
            stats[i0:i1, _ESUM] = e.sum(1)
            stats[i0:i1, _EZ] = ez.sum(1)
    gathered = _all_gather_rows(stats, group)
    top = gathered[..., _EMAX].amax(0)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    scale = torch.exp(gathered[..., _EMAX] - shift)
    total = (gathered[..., _ESUM] * scale).sum(0)
    lse = shift + torch.log(total)
    mean_z = (gathered[..., _EZ] * scale).sum(0) / total
    return lse, mean_z


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, shard, transform, rows, group):  # type: ignore[override]
        logits2d = logits.reshape(-1, logits.size(-1))
        lse, mean_z = _entropy_statistics(logits2d, shard, transform, rows, group)
        ctx.save_for_backward(logits, lse, mean_z)
        ctx.shard, ctx.transform, ctx.rows = shard, transform, rows
        return (lse - mean_z).view(logits.shape[:-1])

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, grad_output):  # type: ignore[override]
        logits, lse, mean_z = ctx.saved_tensors
        shard, transform = ctx.shard, ctx.transform
        logits2d = logits.reshape(-1, logits.size(-1))
        g = grad_output.reshape(-1).to(lse.dtype)
        grad = torch.zeros_like(logits2d, memory_format=torch.contiguous_format)
        for i0, i1 in st.row_blocks(logits2d.size(0), ctx.rows):
            if not shard.real_width:
                break
            z, derivative = transform.apply_with_derivative(logits2d[i0:i1, : shard.real_width])
            p = torch.exp(z - lse[i0:i1, None])
            block = torch.where(p > 0, p * (z - mean_z[i0:i1, None]), torch.zeros_like(p))
            block.mul_(-g[i0:i1, None])
            if derivative is not None:
                block.mul_(derivative)
            elif transform.temperature != 1.0:
                block.div_(transform.temperature)
            grad[i0:i1, : shard.real_width] = block
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_entropy(
    logits: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Entropy of ``softmax(z)`` over the whole vocabulary per token, fp32 ``[...]`` (see the module doc)."""
    op = "vocab_parallel_entropy"
    problems = option_problems(softcap=softcap, temperature=temperature, chunk_size=chunk_size)
    logits, group, shard = _prepare(
        op, logits, group, vocab_start_index, vocab_end_index, vocab_size, problems
    )
    transform = st.LogitTransform(softcap, float(temperature))
    rows = st.chunk_rows(shard.width, chunk_size)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Entropy.apply(logits, shard, transform, rows, group)
    with torch.no_grad():
        logits2d = logits.reshape(-1, logits.size(-1))
        lse, mean_z = _entropy_statistics(logits2d, shard, transform, rows, group)
        return (lse - mean_z).view(logits.shape[:-1])


def _local_top(logits2d: torch.Tensor, shard: st.VocabShard, k: int) -> torch.Tensor:
    """``[T, k, 2]`` fp64 (value, global id) of this shard's ``k`` largest real columns, padded."""
    num_rows = logits2d.size(0)
    pairs = torch.empty(num_rows, k, 2, dtype=torch.float64, device=logits2d.device)
    pairs[..., 0] = float("-inf")
    pairs[..., 1] = float("inf")  # sorts after every real id, and marks "no column"
    kk = min(k, shard.real_width)
    if kk == 0:
        return pairs
    real = logits2d[:, : shard.real_width]
    # row blocks: a sort's int64 index over [T, V/tp] would be 4x a bf16 logits tensor
    for i0, i1 in st.row_blocks(num_rows, st.chunk_rows(shard.real_width, None)):
        if kk == 1:
            values, index = real[i0:i1].max(dim=1, keepdim=True)  # the first maximum, as torch.argmax
        else:
            # a stable sort puts equal values in ascending column order: ties go to the lower id
            values, index = real[i0:i1].sort(dim=1, descending=True, stable=True)
            values, index = values[:, :kk], index[:, :kk]
        pairs[i0:i1, :kk, 0] = values.to(torch.float64)  # exact: fp64 holds every fp32 / bf16 value
        pairs[i0:i1, :kk, 1] = (index + shard.start).to(torch.float64)  # exact below 2**53
    return pairs


def _merge_top(gathered: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of ``[tp, T, k, 2]`` candidates by value, ties to the lower id: ``([T, k], [T, k])``."""
    tp, num_rows = gathered.shape[0], gathered.shape[1]
    candidates = gathered.permute(1, 0, 2, 3).reshape(num_rows, tp * k, 2)
    # two stable sorts: by id, then by value (descending) keeps ids ascending among equal values
    by_id = candidates[..., 1].argsort(dim=1, stable=True)
    candidates = candidates.gather(1, by_id[..., None].expand(-1, -1, 2))
    by_value = candidates[..., 0].argsort(dim=1, descending=True, stable=True)
    best = candidates.gather(1, by_value[:, :k, None].expand(-1, -1, 2))
    return best[..., 0], best[..., 1]


def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits per token over the whole vocabulary: ``(values [..., k], ids [..., k])``.

    Values have ``out_dtype`` (default: the logits' dtype, as ``torch.topk``; ``torch.float32`` gives
    NeMo RL's fp32 values); they are exact either way, selected on the logits' own values. Ids are
    global int64. ``ValueError`` on every rank when ``k`` exceeds the real vocabulary size.
    """
    op = "vocab_parallel_topk"
    problems = [] if isinstance(k, int) and k >= 1 else [f"k must be a positive int, got {k!r}"]
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        problems.append(f"out_dtype must be a floating torch.dtype or None, got {out_dtype!r}")
    logits, group, shard = _prepare(
        op, logits, group, vocab_start_index, vocab_end_index, vocab_size, problems
    )
    logits2d = logits.detach().reshape(-1, logits.size(-1))
    gathered = _all_gather_rows(_local_top(logits2d, shard, k), group)
    values, ids = _merge_top(gathered, k)
    if bool(torch.isinf(ids).any()):
        # the same gathered data on every rank: every rank raises
        raise ValueError(f"{op}: k={k} is larger than the real vocabulary size")
    shape = (*logits.shape[:-1], k)
    return values.to(out_dtype or logits.dtype).view(shape), ids.to(torch.int64).view(shape)


def vocab_parallel_argmax(
    logits: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Global id ``[...]`` int64 of the largest logit per token (ties: the lowest id, as torch.argmax).

    The group is ``group`` or NeMo RL's keyword ``tp_group``. Called with neither a group nor
    ``vocab_start_index`` / ``vocab_end_index`` on a plain tensor, it is NeMo RL's local argmax
    (``logits.argmax(-1)``, no communication: the logits are taken as the whole vocabulary); shardkit's
    sharded call names the group or this rank's slice (or passes a DTensor).
    """
    op = "vocab_parallel_argmax"
    group = either_group(op, group, tp_group)
    local_call = group is None and vocab_start_index is None and vocab_end_index is None
    if local_call and not is_dtensor(logits):
        # NeMo RL's rule: no group, no sharding; padded columns still never win
        width = logits.size(-1) if vocab_size is None else min(vocab_size, logits.size(-1))
        return logits.detach()[..., :width].argmax(-1)
    logits, group, shard = _prepare(op, logits, group, vocab_start_index, vocab_end_index, vocab_size)
    logits2d = logits.detach().reshape(-1, logits.size(-1))
    gathered = _all_gather_rows(_local_top(logits2d, shard, 1), group)
    _, ids = _merge_top(gathered, 1)
    return ids.to(torch.int64).view(logits.shape[:-1])

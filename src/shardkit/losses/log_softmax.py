"""Differentiable log-softmax over a vocabulary split across the ranks of a group.

``out = logits - logsumexp(logits over the whole vocabulary)`` for this rank's shard ``[..., V/tp]``,
returned in the input dtype (the log-sum-exp is computed in fp32, chunk by chunk).

Memory, in units of one ``[T, V/tp]`` tensor of the input dtype: the output (1); forward saves a
reference to the logits and ``lse`` ``[T]`` fp32; backward allocates the gradient (1) plus fp32 work
blocks. Communication: forward one all-gather of ``[T, 3]`` fp32 statistics (plus the validation
descriptor); backward one all-reduce of ``[T]`` fp32, because the gradient of a log-softmax needs the
sum of the incoming gradient over the whole vocabulary: ``dx = g - softmax * sum(g)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_size
from shardkit.losses import statistics as st
from shardkit.losses.checks import option_problems, validate_call
from shardkit.losses.dtensor import is_dtensor, resolve_vocab_shard
from shardkit.losses.first_order import first_order_only


def _lse(logits2d: torch.Tensor, group, rows: int) -> torch.Tensor:
    num_rows, width = logits2d.shape
    shard = st.VocabShard(0, width, width)
    zeros = torch.zeros(num_rows, dtype=torch.int64, device=logits2d.device)
    stats = st.shard_statistics(
        lambda i0, i1: logits2d[i0:i1],
        num_rows,
        shard,
        st.LogitTransform(),
        zeros,
        zeros.bool(),
        rows,
        with_sum=False,
        device=logits2d.device,
        dtype=st.work_dtype(logits2d.dtype),
    )
    gathered, _ = st.gather_statistics(stats, width, group)
    return st.combine_logsumexp(gathered)


def _subtract(logits2d: torch.Tensor, lse: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.empty_like(logits2d, memory_format=torch.contiguous_format)
    for i0, i1 in st.row_blocks(logits2d.size(0), rows):
        out[i0:i1] = logits2d[i0:i1].to(lse.dtype) - lse[i0:i1, None]
    return out


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group, rows):  # type: ignore[override]
        logits2d = logits.reshape(-1, logits.size(-1))
        lse = _lse(logits2d, group, rows)
        ctx.save_for_backward(logits, lse)
        ctx.group, ctx.rows = group, rows
        return _subtract(logits2d, lse, rows).view(logits.shape)

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, grad_output):  # type: ignore[override]
        logits, lse = ctx.saved_tensors
        logits2d = logits.reshape(-1, logits.size(-1))
        g2d = grad_output.reshape(logits2d.shape)
        work = st.work_dtype(logits.dtype)
        total = torch.zeros(logits2d.size(0), dtype=work, device=logits.device)
        for i0, i1 in st.row_blocks(logits2d.size(0), ctx.rows):
            total[i0:i1] = g2d[i0:i1].to(work).sum(1)
        if group_size(ctx.group) > 1:
            dist.all_reduce(total, group=ctx.group)
        grad = torch.empty_like(logits2d, memory_format=torch.contiguous_format)
        for i0, i1 in st.row_blocks(logits2d.size(0), ctx.rows):
            p = (logits2d[i0:i1].to(work) - lse[i0:i1, None]).exp_()
            grad[i0:i1] = g2d[i0:i1].to(work) - p.mul_(total[i0:i1, None])
        return grad.view(logits.shape), None, None


def distributed_log_softmax(
    logits: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Log-softmax of ``[..., V/tp]`` logits over the vocabulary split across ``group`` (or a DTensor).

    Shards may have any widths (no offsets are needed). Returns ``[..., V/tp]`` in the input dtype;
    differentiable (backward: one all-reduce of ``[T]`` fp32). A no-grad call saves nothing.
    """
    op = "distributed_log_softmax"
    dtensor = is_dtensor(logits)
    logits, group, start, end = resolve_vocab_shard(logits, group, None, None, op)
    validate_call(
        op,
        group,
        logits,
        None,
        start,
        end,
        problems=option_problems(chunk_size=chunk_size),
        check_slices=dtensor,
    )
    rows = st.chunk_rows(logits.size(-1), chunk_size)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogSoftmax.apply(logits, group, rows)
    with torch.no_grad():
        logits2d = logits.reshape(-1, logits.size(-1))
        return _subtract(logits2d, _lse(logits2d, group, rows), rows).view(logits.shape)


def _compute_distributed_log_softmax(
    vocab_parallel_logits: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The specification's name for ``distributed_log_softmax(vocab_parallel_logits, group)``."""
    return distributed_log_softmax(vocab_parallel_logits, group)

"""Fused linear + vocab-parallel cross-entropy / log-probs: the ``[T, V/tp]`` logits never exist in full.

``logits = hidden @ weight_shard.T`` is computed ``chunk_size`` tokens at a time, in the input dtype
(as the unfused linear layer would), reduced to per-token statistics, and dropped. Backward recomputes
the logits by blocks of vocabulary columns (over all tokens, the same number of elements per block),
turns them into the softmax gradient locally (``lse`` is known, so a column block needs nothing from
the others), and computes::

    grad_weight[cols] = grad_logits[:, cols].T @ hidden           (input dtype, written once)
    grad_hidden      += grad_logits[:, cols] @ weight_shard[cols]  (fp32 accumulator, [T, H])

Shapes: ``hidden`` ``[..., H]`` (the same on every rank of ``group``, as the input of a column-parallel
linear layer), ``weight_shard`` ``[V/tp, H]`` holding vocabulary rows ``[start, end)``, targets ``[...]``.

Memory: forward saves references to ``hidden``, ``weight_shard`` and the targets plus ``lse`` ``[T]``;
its work is fp32 ``[c, V/tp]`` blocks. Backward allocates ``grad_weight`` (size of the weight), an fp32
``[T, H]`` accumulator for ``grad_hidden`` (plus its cast) and per-block work (``[T, c']`` fp32 and
input dtype, ``c' = c * V/tp / T`` columns). No ``[T, V/tp]`` tensor at any time. The
logits matmul runs twice (forward and backward): the price of not keeping them.

Communication: forward as ``vocab_parallel_cross_entropy`` (one all-gather of per-token statistics).
Backward: the partial ``grad_hidden`` of each rank is summed over ``group`` (one all-reduce of
``[T, H]``, through ``shardkit.distributed.copy_to_region``) unless ``reduce_hidden_grad=False``, for
callers that reduce it themselves (e.g. fused into a sequence-parallel reduce-scatter).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.regions import copy_to_region
from shardkit.losses import statistics as st
from shardkit.losses.checks import option_problems, validate_call
from shardkit.losses.cross_entropy import CrossEntropyOptions, gradient_coefficients, loss_from_source
from shardkit.losses.dtensor import plain_tensor, resolve_vocab_shard
from shardkit.losses.first_order import first_order_only


def _matmul_source(hidden2d: torch.Tensor, weight: torch.Tensor) -> st.Source:
    weight_t = weight.t()
    return lambda i0, i1: hidden2d[i0:i1] @ weight_t


class _FusedLinearLoss(torch.autograd.Function):
    """``forward(ctx, hidden [T, H], weight [w, H], target [T], opts, sign)`` -> ``sign * loss``.

    ``sign`` -1 turns the cross-entropy into log-probs. Saved: references to the three inputs, ``lse``.
    """

    @staticmethod
    def forward(ctx, hidden2d, weight, target1d, opts: CrossEntropyOptions, sign: float):  # type: ignore[override]
        out, lse, count, vocab = loss_from_source(
            _matmul_source(hidden2d, weight), hidden2d.dtype, target1d, target1d.shape, opts
        )
        ctx.save_for_backward(hidden2d, weight, target1d, lse, count, vocab)
        ctx.opts, ctx.sign = opts, sign
        return out * sign if sign != 1.0 else out

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, grad_output):  # type: ignore[override]
        hidden2d, weight, target1d, lse, count, vocab = ctx.saved_tensors
        work = lse.dtype
        grad_output = grad_output * ctx.sign if ctx.sign != 1.0 else grad_output
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        opts = ctx.opts
        num_rows, width = hidden2d.size(0), weight.size(0)
        # blocks of vocabulary columns over all tokens, of the forward's block size in elements: each
        # block's weight gradient is then one matmul over all tokens, written once (no [V/tp, H]
        # accumulator re-read per block), and only the small [T, H] hidden gradient accumulates
        columns = max(1, opts.rows * width // max(1, num_rows))
        index, owned, active, coef_p, coef_target, coef_uniform = gradient_coefficients(
            grad_output, target1d, lse, count, vocab, opts
        )
        weight_t = weight.t()
        blocks = st.softmax_gradient_column_blocks(
            lambda c0, c1: hidden2d @ weight_t[:, c0:c1],
            opts.shard,
            opts.transform,
            lse,
            index,
            owned,
            active,
            coef_p,
            coef_target,
            coef_uniform,
            columns,
        )
        grad_hidden = torch.zeros(hidden2d.shape, dtype=work, device=hidden2d.device) if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        for c0, c1, block in blocks:
            # the block in the input dtype, as the unfused linear layer's backward would see it
            block = block.to(hidden2d.dtype)
            if want_hidden:
                grad_hidden += block @ weight[c0:c1]
            if want_weight:
                torch.mm(block.t(), hidden2d, out=grad_weight[c0:c1])
        if want_hidden:
            grad_hidden = grad_hidden.to(hidden2d.dtype)
        return grad_hidden, grad_weight, None, None, None


def _fused(
    op: str,
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    start: Optional[int],
    end: Optional[int],
    sign: float,
    reduce_hidden_grad: bool,
    *,
    ignore_index: Optional[int],
    vocab_size: Optional[int] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    reduction: str = "none",
    dp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    inference_only: bool = False,
) -> torch.Tensor:
    target = plain_tensor(target)
    problems = option_problems(
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        temperature=temperature,
        reduction=reduction,
        chunk_size=chunk_size,
    )
    ok = isinstance(hidden, torch.Tensor) and isinstance(weight_shard, torch.Tensor)
    if not ok:
        raise TypeError(f"{op}: hidden and weight_shard must be tensors")
    if weight_shard.dim() != 2 or hidden.dim() < 1 or hidden.size(-1) != weight_shard.size(-1):
        problems.append(
            "weight_shard must be [V/tp, H] matching hidden [..., H], got weight "
            f"{tuple(weight_shard.shape)} and hidden {tuple(hidden.shape)}"
        )
    elif hidden.dtype != weight_shard.dtype or hidden.device != weight_shard.device:
        problems.append(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight_shard ({weight_shard.dtype}, "
            f"{weight_shard.device}) must share dtype and device"
        )
    width = weight_shard.size(0) if weight_shard.dim() >= 1 else 0
    # the logits this call stands for, as a meta tensor: the shared checks see their shape and dtype
    logits_like = torch.empty((*hidden.shape[:-1], width), dtype=hidden.dtype, device="meta")
    _, group, start, end = resolve_vocab_shard(logits_like, group, start, end, op)
    validate_call(
        op,
        group,
        logits_like,
        target,
        start,
        end,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        options=(ignore_index, label_smoothing, z_loss, softcap, temperature, reduction, vocab_size, sign),
        problems=problems,
        logits_name="hidden @ weight_shard.T",
        device=hidden.device,
    )
    shard = st.VocabShard.make(start, end, vocab_size)
    opts = CrossEntropyOptions(
        group=group,
        shard=shard,
        transform=st.LogitTransform(softcap, float(temperature)),
        ignore_index=ignore_index,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        reduction=reduction,
        dp_group=dp_group,
        rows=st.chunk_rows(shard.width, chunk_size),
    )
    hidden2d = hidden.reshape(-1, hidden.size(-1))
    target1d = target.reshape(-1)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight_shard.requires_grad)
    if inference_only or not wants_grad:
        with torch.no_grad():  # nothing recorded, nothing saved
            out = loss_from_source(
                _matmul_source(hidden2d, weight_shard), hidden.dtype, target1d, target1d.shape, opts
            )[0]
            out = out * sign if sign != 1.0 else out
    else:
        if reduce_hidden_grad and hidden.requires_grad:
            hidden2d = copy_to_region(hidden2d, group)
        out = _FusedLinearLoss.apply(hidden2d, weight_shard, target1d, opts, sign)
    return out.view(target.shape) if reduction == "none" else out


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    reduction: str = "none",
    dp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(hidden @ weight_shard.T, labels, ...)`` without the logits tensor.

    ``hidden`` ``[..., H]``, ``weight_shard`` ``[V/tp, H]`` (rows ``[start, end)``; default even shards),
    ``labels`` ``[...]``. Options, reductions and the result are those of
    ``vocab_parallel_cross_entropy``. Gradients flow to ``hidden`` (summed over ``group`` unless
    ``reduce_hidden_grad=False``) and to ``weight_shard`` (accumulated in fp32).
    """
    return _fused(
        "vocab_parallel_linear_cross_entropy",
        hidden,
        weight_shard,
        labels,
        group,
        vocab_start_index,
        vocab_end_index,
        1.0,
        reduce_hidden_grad,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        temperature=temperature,
        reduction=reduction,
        dp_group=dp_group,
        chunk_size=chunk_size,
    )


def vocab_parallel_linear_logprobs(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: Optional[int] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    inference_only: bool = False,
    reduce_hidden_grad: bool = True,
) -> torch.Tensor:
    """Per-token ``log softmax(hidden @ weight_shard.T)[target]``, fp32 ``[...]``, without the logits.

    As ``vocab_parallel_logprobs`` on the product; ``inference_only`` (or no grad) saves nothing.
    """
    return _fused(
        "vocab_parallel_linear_logprobs",
        hidden,
        weight_shard,
        target,
        group,
        vocab_start_index,
        vocab_end_index,
        -1.0,
        reduce_hidden_grad,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
        inference_only=inference_only,
    )

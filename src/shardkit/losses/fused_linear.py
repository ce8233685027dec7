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

Gradients in forward (the default for a ``"sum"`` / ``"mean"`` loss on fp32 / fp64 inputs; see
``vocab_parallel_linear_cross_entropy``): the loss is a scalar, so its gradient is known up to the
incoming scalar while each block of logits is at hand. The forward then turns each block into its
softmax gradient at once (one all-gather of that block's statistics first, when tp > 1) and runs the
two gradient matmuls on it; the backward only scales the two buffers. Three matmuls instead of four.

Communication: forward as ``vocab_parallel_cross_entropy`` (one all-gather of per-token statistics;
per token block with gradients in forward).
Backward: the partial ``grad_hidden`` of each rank is summed over ``group`` (one all-reduce of
``[T, H]``, through ``shardkit.distributed.copy_to_region``) unless ``reduce_hidden_grad=False``, for
callers that reduce it themselves (e.g. fused into a sequence-parallel reduce-scatter).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.regions import copy_to_region
from shardkit.losses import statistics as st
from shardkit.losses.ce_gradient import gradient_coefficients, loss_coefficients, per_token_grad
from shardkit.losses.ce_kernel_calls import (
    native_gradient,
    native_kernels,
    native_statistics,
    triton_gradient,
    triton_kernels,
    triton_statistics,
)
from shardkit.losses.checks import option_problems, validate_call
from shardkit.losses.cross_entropy import (
    CrossEntropyOptions,
    loss_from_source,
    loss_from_statistics,
    reduce_tokens,
    token_loss,
)
from shardkit.losses.dtensor import plain_tensor, resolve_vocab_shard
from shardkit.losses.first_order import first_order_only


def _matmul_source(
    hidden2d: torch.Tensor, weight: torch.Tensor, buffer: Optional[torch.Tensor] = None
) -> st.Source:
    """``source(i0, i1)`` = the logits of rows ``[i0, i1)``, ``[i1 - i0, w]`` in the input dtype; with
    ``buffer`` (see :func:`_block_buffer`) written into it, so each block overwrites the previous one."""
    weight_t = weight.t()
    if buffer is None:
        return lambda i0, i1: hidden2d[i0:i1] @ weight_t
    return lambda i0, i1: torch.mm(hidden2d[i0:i1], weight_t, out=_view(buffer, i1 - i0, weight.size(0)))


def _block_buffer(like: torch.Tensor, elements: int) -> Optional[torch.Tensor]:
    """On CPU, one flat buffer of ``elements`` in ``like``'s dtype that every block of logits is written
    into (``torch.mm(..., out=)``), else None (a GPU's caching allocator reuses the blocks anyway).

    Why: a block above glibc's mmap threshold (32 MiB at most) is a fresh ``mmap`` at every
    allocation, so each block's first write page-faults its whole size in again; one buffer reused by
    every block pays that once per call."""
    if like.device.type != "cpu":
        return None
    return torch.empty(elements, dtype=like.dtype, device=like.device)


def _view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The first ``rows * cols`` elements of the flat ``buffer`` as a contiguous ``[rows, cols]``."""
    return buffer[: rows * cols].view(rows, cols)


class _FusedLinearLoss(torch.autograd.Function):
    """``forward(ctx, hidden [T, H], weight [w, H], target [T], opts, sign)`` -> ``sign * loss``.

    ``sign`` -1 turns the cross-entropy into log-probs. Saved: references to the three inputs, ``lse``.
    """

    @staticmethod
    def forward(ctx, hidden2d, weight, target1d, opts: CrossEntropyOptions, sign: float):  # type: ignore[override]
        kernels = triton_kernels(hidden2d.new_empty(0, opts.shard.width), opts)
        if kernels is not None:  # CUDA, the plain loss: one Triton statistics pass per block
            source = _matmul_source(hidden2d, weight)
            stats = torch.cat([
                triton_statistics(kernels, source(i0, i1), target1d[i0:i1], opts)
                for i0, i1 in st.row_blocks(target1d.numel(), opts.rows)
            ]) if target1d.numel() else hidden2d.new_zeros(0, 3, dtype=torch.float32)  # fmt: skip
            _, _, active = st.local_target_index(target1d, opts.shard, opts.ignore_index)
            out, lse, count, vocab = loss_from_statistics(stats, active, target1d.shape, opts)
        else:
            buffer = _block_buffer(hidden2d, min(opts.rows, hidden2d.size(0)) * weight.size(0))
            out, lse, count, vocab = loss_from_source(
                _matmul_source(hidden2d, weight, buffer), hidden2d.dtype, target1d, target1d.shape, opts
            )
            del buffer
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
        columns = st.aligned(opts.rows * width // max(1, num_rows))
        index, owned, active, coef_p, coef_target, coef_uniform = gradient_coefficients(
            grad_output, target1d, lse, count, vocab, opts
        )
        weight_t = weight.t()
        buffer = _block_buffer(hidden2d, num_rows * min(columns, width))

        def column_logits(c0: int, c1: int) -> torch.Tensor:
            if buffer is None:
                return hidden2d @ weight_t[:, c0:c1]
            # each block written over the previous one (the consumer is done with it by then)
            return torch.mm(hidden2d, weight_t[:, c0:c1], out=_view(buffer, num_rows, c1 - c0))

        kernels = triton_kernels(hidden2d.new_empty(0, width), opts)
        native = native_kernels(hidden2d.new_empty(0, width), opts)
        if kernels is not None:  # CUDA, the plain loss: one Triton gradient pass per column block
            blocks = _triton_column_blocks(
                kernels, column_logits, width, columns, target1d, lse, coef_p, opts
            )
        elif native is not None:  # CPU fp32 / bf16: one native pass over each column block
            coefficients = (index, owned, active, coef_p, coef_target, coef_uniform)
            blocks = _native_column_blocks(native, column_logits, width, columns, lse, coefficients, opts)
        else:
            blocks = st.softmax_gradient_column_blocks(
                column_logits,
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


def _triton_column_blocks(kernels, column_logits, width, columns, target1d, lse, coef_p, opts):
    """Yield ``(c0, c1, gradient of the logits' columns [c0, c1))`` ``[T, c1 - c0]`` in the input
    dtype, each written by the Triton gradient pass over its recomputed logits (the plain loss)."""
    for c0 in range(0, width, columns):
        c1 = min(width, c0 + columns)
        logits = column_logits(c0, c1)
        yield c0, c1, triton_gradient(kernels, logits, target1d, lse, coef_p, opts, out=logits, c0=c0)


def _native_column_blocks(ops, column_logits, width, columns, lse, coefficients, opts: CrossEntropyOptions):
    """Yield ``(c0, c1, gradient of the logits' columns [c0, c1))`` ``[T, c1 - c0]`` in the input
    dtype, each written over its recomputed logits by the native gradient kernel."""
    index, owned, active, coef_p, coef_target, coef_uniform = coefficients
    shard = opts.shard
    for c0 in range(0, width, columns):
        c1 = min(width, c0 + columns)
        logits = column_logits(c0, c1)
        # these columns as a shard of their own: their real columns, and the targets that fall in them
        block = st.VocabShard(shard.start + c0, shard.start + c1, max(0, min(shard.real_width, c1) - c0))
        here = owned & (index >= c0) & (index < c1)
        local = torch.where(here, index - c0, torch.zeros_like(index))
        sub = dataclasses.replace(opts, shard=block)
        yield (
            c0,
            c1,
            native_gradient(
                ops, logits, logits, lse, (local, here, active, coef_p, coef_target, coef_uniform), sub
            ),
        )


def _loss_and_gradients(hidden2d, weight, target1d, opts: CrossEntropyOptions, want_hidden, want_weight):
    """The loss of a scalar reduction and its gradients for an incoming gradient of 1, in one pass.

    Per block of ``opts.rows`` tokens: the logits ``[c, V/tp]`` (one matmul), their statistics (one
    all-gather of ``[c, k]`` over ``group`` when tp > 1), the softmax gradient written over the logits
    in cache-sized pieces, then ``grad_hidden[rows] = g @ W`` and ``grad_weight += g.T @ h[rows]``.
    Three matmuls in all, as the unfused linear layer + loss, instead of the recomputing path's four.
    Returns ``(out, count, grad_hidden [T, H] or None, grad_weight [V/tp, H] or None)``, with the
    gradients of the *sum* over tokens (the backward scales them for "mean").
    """
    num_rows, work = target1d.numel(), st.work_dtype(hidden2d.dtype)
    shard, transform = opts.shard, opts.transform
    index, owned, active = st.local_target_index(target1d, shard, opts.ignore_index)
    loss = torch.empty(num_rows, dtype=work, device=hidden2d.device)
    ones = torch.ones(num_rows, dtype=work, device=hidden2d.device)
    grad_hidden = torch.empty_like(hidden2d) if want_hidden else None
    grad_weight = torch.zeros_like(weight) if want_weight else None
    pieces = st.cache_rows(shard.width, opts.rows, hidden2d.device)
    kernels = triton_kernels(hidden2d.new_empty(0, shard.width), opts)
    native = native_kernels(hidden2d.new_empty(0, shard.width), opts)
    source = _matmul_source(hidden2d, weight, _block_buffer(hidden2d, min(opts.rows, num_rows) * shard.width))
    for i0, i1 in st.row_blocks(num_rows, opts.rows):
        logits = source(i0, i1)  # [c, V/tp], the work dtype (fp32 / fp64 inputs only)
        block = lambda a, b, logits=logits: logits[a:b]  # noqa: E731
        rows = slice(i0, i1)
        if kernels is not None:  # CUDA, the plain loss: one Triton pass per step
            stats = triton_statistics(kernels, logits, target1d[rows], opts)
        elif native is not None:  # CPU: one native read of the block
            stats = native_statistics(native, logits, index[rows], owned[rows], opts)
        else:
            stats = st.shard_statistics(
                block, i1 - i0, shard, transform, index[rows], owned[rows], pieces,
                with_sum=opts.label_smoothing > 0.0, device=hidden2d.device, dtype=work,
            )  # fmt: skip
        gathered, vocab = st.gather_statistics(stats, shard.real_width, opts.group)
        loss[rows], lse = token_loss(gathered, vocab, active[rows], opts)
        # the gradient overwrites the logits (no second [c, V/tp] buffer)
        if kernels is not None:
            triton_gradient(kernels, logits, target1d[rows], lse, ones[rows], opts, out=logits)
        elif native is not None:  # CPU: one native pass, written over the logits
            coefs = loss_coefficients(ones[rows], lse, vocab, opts)
            coefficients = (index[rows], owned[rows], active[rows], *coefs)
            native_gradient(native, logits, logits, lse, coefficients, opts)
        else:
            coef_p, coef_target, coef_uniform = loss_coefficients(ones[rows], lse, vocab, opts)
            for _ in st.softmax_gradient_blocks(
                block, i1 - i0, shard, transform, lse, index[rows], owned[rows], active[rows],
                coef_p, coef_target, coef_uniform, pieces, out=logits,
            ):  # fmt: skip
                pass
        if want_hidden:
            torch.mm(logits, weight, out=grad_hidden[rows])
        if want_weight:
            grad_weight.addmm_(logits.t(), hidden2d[rows])
    out, count = reduce_tokens(loss, active, opts.reduction, opts.dp_group, target1d.shape)
    return out, count, grad_hidden, grad_weight


def gradients_in_forward(dtype: torch.dtype, reduction: str, requested: Optional[bool]) -> bool:
    """Whether the forward computes the gradients (see ``vocab_parallel_linear_cross_entropy``)."""
    # bf16 / fp16 would accumulate the weight gradient over token blocks either in the input dtype
    # (one rounding per block, less exact than the unfused layer's one product) or in an fp32 buffer
    # (a [V/tp, H] read-modify-write per block: measured on this CPU, slower than the extra matmul)
    possible = reduction in ("sum", "mean") and st.work_dtype(dtype) == dtype
    if requested and not possible:
        raise ValueError(
            "grad_in_forward=True needs reduction='sum' or 'mean' and fp32 / fp64 hidden states (the "
            f"gradient is accumulated in the input dtype), got reduction={reduction!r}, {dtype}"
        )
    return possible if requested is None else bool(requested)


class _FusedLinearLossGradInForward(torch.autograd.Function):
    """``forward(ctx, hidden [T, H], weight [w, H], target [T], opts)`` -> the reduced loss, with the
    gradients computed in forward (``_loss_and_gradients``); backward scales them by the incoming
    gradient. Kept: the two gradient buffers and the token count (no reference to the inputs)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, target1d, opts: CrossEntropyOptions):  # type: ignore[override]
        out, count, grad_hidden, grad_weight = _loss_and_gradients(
            hidden2d, weight, target1d, opts, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        ctx.grads, ctx.count, ctx.reduction = (grad_hidden, grad_weight), count, opts.reduction
        return out

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight = ctx.grads
        scale = per_token_grad(grad_output, ctx.reduction, ctx.count, 1, torch.float64)[0]
        # scaled copies, not in place: a retained graph (gradcheck, retain_graph=True) backpropagates
        # through the same buffers again
        return (
            None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * scale.to(grad_weight.dtype),
            None,
            None,
        )


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
    grad_in_forward: Optional[bool] = None,
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
        rows=st.linear_chunk_rows(
            shard.width, hidden.numel() // max(1, hidden.size(-1)), hidden.size(-1), hidden.device, chunk_size
        ),
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
        if gradients_in_forward(hidden.dtype, reduction, grad_in_forward):
            out = _FusedLinearLossGradInForward.apply(hidden2d, weight_shard, target1d, opts)
        else:
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
    grad_in_forward: Optional[bool] = None,
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(hidden @ weight_shard.T, labels, ...)`` without the logits tensor.

    ``hidden`` ``[..., H]``, ``weight_shard`` ``[V/tp, H]`` (rows ``[start, end)``; default even shards),
    ``labels`` ``[...]``. Options, reductions and the result are those of
    ``vocab_parallel_cross_entropy``. Gradients flow to ``hidden`` (summed over ``group`` unless
    ``reduce_hidden_grad=False``) and to ``weight_shard`` (accumulated in fp32).

    ``grad_in_forward`` (default: on for ``reduction="sum"`` / ``"mean"`` with fp32 / fp64 inputs when
    a gradient is wanted): the forward also computes both gradients, for an incoming gradient of 1,
    while each block of logits is at hand (three matmuls in all instead of four; one all-gather of
    ``[c, k]`` statistics per block of ``c = chunk_size`` tokens instead of one in all), and the
    backward returns scaled copies. The gradient buffers (``[T, H]`` and the weight's size) then exist
    from the forward on instead of from the backward. ``False`` keeps the recomputing backward.
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
        grad_in_forward=grad_in_forward,
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

"""Vocab-parallel cross-entropy: the loss of ``F.cross_entropy`` on logits split along the vocabulary.

Each rank of ``group`` holds ``logits[..., start:end]`` (``[..., V/tp]``, any float dtype) and the full
targets ``[...]`` (global token ids). The result equals ``F.cross_entropy`` on the gathered logits, for
every tensor-parallel size, without ever gathering them.

Per token, with ``z`` the transformed logits (soft-capping, then temperature), ``a`` the label
smoothing, ``V`` the real vocabulary size and ``lse = logsumexp(z)``::

    loss = lse - (1 - a) * z[target] - (a / V) * sum(z) + z_loss * lse**2

(PyTorch's label smoothing: the mass ``a`` is spread over the whole vocabulary, not one shard.)
Ignored tokens (``target == ignore_index``) have loss 0 and gradient exactly 0.

Memory, in units of one ``[T, V/tp]`` tensor of the input dtype (``T`` tokens): forward saves a
reference to the logits and target (no copy), ``lse`` ``[T]`` fp32 and two 0-d scalars; it allocates
only fp32 work blocks of ``chunk_size`` rows. The one gradient buffer (1 unit) is allocated by the
backward, except on the native CPU path (fp32 / bf16) of :func:`vocab_parallel_cross_entropy`, whose
forward allocates it and maps its pages when the logits' gradient will be wanted
(``SHARDKIT_CE_GRAD_BUFFER``, :func:`shardkit.kernels.cross_entropy.requested_buffer_timing`): the same
1 unit, held from the forward to the backward. Backward recomputes the softmax block by block, locally.
A no-grad call saves and allocates nothing. Non-contiguous logits cost one copy.

Communication per call: forward one all-gather of ``[T, 3]`` fp32 statistics (``[T, 4]`` with label
smoothing) over ``group``, preceded by one small descriptor all-gather when validation is on (see
``shardkit.losses.checks``), plus for ``reduction="mean"`` with ``dp_group`` one all-reduce of two
numbers over ``dp_group``. Backward: none.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.kernels.cross_entropy import requested_buffer_timing
from shardkit.losses import statistics as st
from shardkit.losses.ce_gradient import gradient_blocks, gradient_coefficients, per_token_grad
from shardkit.losses.ce_kernel_calls import (
    native_gradient,
    native_kernels,
    native_statistics,
    triton_gradient,
    triton_kernels,
    triton_statistics,
)
from shardkit.losses.checks import option_problems, validate_call
from shardkit.losses.dtensor import plain_tensor, resolve_vocab_shard
from shardkit.losses.first_order import first_order_only


@dataclass(frozen=True)
class CrossEntropyOptions:
    """Everything about a cross-entropy call except its tensors (hashable, passed through autograd)."""

    group: Optional[dist.ProcessGroup]
    shard: st.VocabShard
    transform: st.LogitTransform
    ignore_index: Optional[int]
    label_smoothing: float
    z_loss: float
    reduction: str
    dp_group: Optional[dist.ProcessGroup]
    rows: int
    # write the gradient into the logits' own storage (opt-in, see vocab_parallel_cross_entropy)
    inplace_backward: bool = False
    # set by apply_cross_entropy when a gradient will be wanted: the forward may then allocate the
    # gradient's buffer (forward_gradient_buffer)
    gradient_wanted: bool = False


def prepare_cross_entropy(
    op: str,
    logits: Any,
    target: Any,
    group: Optional[dist.ProcessGroup],
    vocab_start_index: Optional[int],
    vocab_end_index: Optional[int],
    *,
    vocab_size: Optional[int] = None,
    ignore_index: Optional[int] = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    reduction: str = "none",
    dp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    problems: Sequence[str] = (),
) -> tuple[torch.Tensor, torch.Tensor, CrossEntropyOptions]:
    """Resolve the shard (DTensor, explicit or even offsets), validate on every rank, build the options.

    Returns ``(local logits [..., w], target [...], options)``. Raises before any data collective.
    """
    logits, group, start, end = resolve_vocab_shard(logits, group, vocab_start_index, vocab_end_index, op)
    target = plain_tensor(target)
    options = (ignore_index, label_smoothing, z_loss, softcap, temperature, reduction, vocab_size)
    problems = list(problems) + option_problems(
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        temperature=temperature,
        reduction=reduction,
        chunk_size=chunk_size,
    )
    validate_call(
        op,
        group,
        logits,
        target,
        start,
        end,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        options=options,
        problems=problems,
    )
    shard = st.VocabShard.make(start, end, vocab_size)
    return (
        logits,
        target,
        CrossEntropyOptions(
            group=group,
            shard=shard,
            transform=st.LogitTransform(softcap, float(temperature)),
            ignore_index=ignore_index,
            label_smoothing=float(label_smoothing),
            z_loss=float(z_loss),
            reduction=reduction,
            dp_group=dp_group,
            rows=st.chunk_rows(shard.width, chunk_size),
        ),
    )


def _flat(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # reshape is a view for contiguous logits; a non-contiguous input is copied once (documented). The
    # row count is explicit: -1 is ambiguous for a rank whose shard has no columns
    return logits.reshape(math.prod(logits.shape[:-1]), logits.size(-1)), target.reshape(-1)


def cross_entropy_forward(
    logits: torch.Tensor, target: torch.Tensor, opts: CrossEntropyOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(result, lse [T] fp32, token count (fp64 0-d, for "mean"), real vocabulary size (0-d))``."""
    logits2d, target1d = _flat(logits, target)
    kernels = triton_kernels(logits2d, opts)
    if kernels is not None:
        _, _, active = st.local_target_index(target1d, opts.shard, opts.ignore_index)
        stats = triton_statistics(kernels, logits2d, target1d, opts)
        return loss_from_statistics(stats, active, target.shape, opts)
    native = native_kernels(logits2d, opts)
    if native is not None:  # CPU fp32 / bf16: one read of the shard
        index, owned, active = st.local_target_index(target1d, opts.shard, opts.ignore_index)
        stats = native_statistics(native, logits2d, index, owned, opts)
        return loss_from_statistics(stats, active, target.shape, opts)
    # cache-sized blocks: the statistics read each block of logits once and reuse one small buffer
    rows = st.cache_rows(opts.shard.width, opts.rows, logits.device, logits.element_size())
    source = lambda i0, i1: logits2d[i0:i1]  # noqa: E731
    return loss_from_source(source, logits2d.dtype, target1d, target.shape, opts, rows=rows)


def loss_from_source(
    source: st.Source,
    dtype: torch.dtype,
    target1d: torch.Tensor,
    out_shape: torch.Size,
    opts: CrossEntropyOptions,
    rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward pass over logits produced block by block by ``source`` (a slice, or a matmul).

    ``rows``: rows per block (default ``opts.rows``).
    """
    num_rows = target1d.numel()
    index, owned, active = st.local_target_index(target1d, opts.shard, opts.ignore_index)
    smoothing = opts.label_smoothing > 0.0
    native = native_kernels(torch.empty(0, opts.shard.width, dtype=dtype, device=target1d.device), opts)
    if native is not None:  # CPU fp32 / bf16: each block of logits read once by the native kernel
        blocks = st.row_blocks(num_rows, opts.rows if rows is None else rows)
        parts = [
            native_statistics(native, source(i0, i1), index[i0:i1], owned[i0:i1], opts) for i0, i1 in blocks
        ]
        stats = torch.cat(parts) if parts else torch.zeros(0, 4 if smoothing else 3, device=target1d.device)
        return loss_from_statistics(stats, active, out_shape, opts)
    stats = st.shard_statistics(
        source,
        num_rows,
        opts.shard,
        opts.transform,
        index,
        owned,
        opts.rows if rows is None else rows,
        with_sum=smoothing,
        device=target1d.device,
        dtype=st.work_dtype(dtype),
    )
    return loss_from_statistics(stats, active, out_shape, opts)


def loss_from_statistics(
    stats: torch.Tensor, active: torch.Tensor, out_shape: torch.Size, opts: CrossEntropyOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's end from this rank's ``[T, k]`` statistics: one all-gather, the loss, the reduction."""
    gathered, vocab = st.gather_statistics(stats, opts.shard.real_width, opts.group)
    loss, lse = token_loss(gathered, vocab, active, opts)
    out, count = reduce_tokens(loss, active, opts.reduction, opts.dp_group, out_shape)
    return out, lse, count, vocab


def token_loss(
    gathered: torch.Tensor, vocab: torch.Tensor, active: torch.Tensor, opts: CrossEntropyOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [T], lse [T])`` in the work dtype from every rank's statistics ``[tp, T, k]``."""
    lse = st.combine_logsumexp(gathered)
    loss = lse - (1.0 - opts.label_smoothing) * gathered[..., st.TARGET].sum(0)
    if opts.label_smoothing > 0.0:
        loss = loss - (opts.label_smoothing / vocab) * gathered[..., st.SUM_Z].sum(0)
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    # where, not a multiply: an ignored row with non-finite logits must still give exactly 0
    return torch.where(active, loss, torch.zeros_like(loss)), lse


def reduce_tokens(
    loss: torch.Tensor,
    active: torch.Tensor,
    reduction: str,
    dp_group: Optional[dist.ProcessGroup],
    shape: torch.Size,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reduced loss, token count)``: per-token ``shape``, the sum, or the mean over active tokens.

    "mean" divides by the number of non-ignored tokens, summed over ``dp_group`` when given (one
    all-reduce of [loss sum, count] in fp64), so that the value is the global mean on every rank. An
    all-ignored batch gives 0, not NaN.
    """
    count = active.sum().to(torch.float64)
    if reduction == "none":
        return loss.view(shape), count
    total = loss.sum()
    if reduction == "sum":
        return total, count
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        packed = torch.stack([total.to(torch.float64), count])
        dist.all_reduce(packed, group=dp_group)
        total, count = packed[0], packed[1]
    return (total / count.clamp(min=1.0)).to(loss.dtype), count


def cross_entropy_backward(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    vocab: torch.Tensor,
    opts: CrossEntropyOptions,
    buffer: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient for the logits shard, same shape and dtype as ``logits``: one new buffer, no collective.

    ``buffer``: the gradient's buffer from :func:`forward_gradient_buffer` (pages mapped), or None.
    """
    logits2d, target1d = _flat(logits, target)
    premapped = buffer is not None
    if opts.inplace_backward and logits.is_contiguous():
        # each block's rows are read, then overwritten with their gradient: no new [T, V/tp] buffer
        grad, premapped = logits2d, False
    elif buffer is not None:
        grad = buffer
    else:
        grad = torch.empty_like(logits2d, memory_format=torch.contiguous_format)
    kernels = triton_kernels(logits2d, opts)
    if kernels is not None:
        g = per_token_grad(grad_output, opts.reduction, count, target1d.numel(), lse.dtype)
        return triton_gradient(kernels, logits2d, target1d, lse, g, opts, out=grad).view(logits.shape)
    native = native_kernels(logits2d, opts)
    if native is not None:  # CPU fp32 / bf16: one read of the logits, one write of the gradient
        coefficients = gradient_coefficients(grad_output, target1d, lse, count, vocab, opts)
        return native_gradient(native, logits2d, grad, lse, coefficients, opts, premapped).view(logits.shape)
    # cache-sized blocks written straight into the gradient: one read of the logits, one write of the
    # gradient, instead of one memory pass per step (the blocks are within the chunk_size bound)
    rows = st.cache_rows(opts.shard.width, opts.rows, logits.device, logits.element_size())
    source = lambda i0, i1: logits2d[i0:i1]  # noqa: E731
    for _ in gradient_blocks(source, grad_output, target1d, lse, count, vocab, opts, out=grad, rows=rows):
        pass
    return grad.view(logits.shape)


def forward_gradient_buffer(ctx, logits: torch.Tensor, opts: CrossEntropyOptions) -> Optional[torch.Tensor]:
    """The logits' gradient buffer ``[T, V/tp]``, allocated and its pages mapped in the forward, or None.

    Only where the native CPU kernels will write the gradient into a new buffer (fp32 / bf16 on CPU, no
    in-place backward), the caller said a gradient will be wanted (``opts.gradient_wanted``: set by
    :func:`apply_cross_entropy`, which runs autograd only then), the logits need it
    (``ctx.needs_input_grad``), and ``SHARDKIT_CE_GRAD_BUFFER`` is "forward" (the default). Mapping a
    fresh buffer's pages costs about as much kernel time as the gradient's arithmetic
    (:func:`shardkit.kernels.cross_entropy.requested_buffer_timing`); done here, the backward only
    computes. Same memory (1 unit), held from here on.
    """
    if not opts.gradient_wanted or not ctx.needs_input_grad[0] or requested_buffer_timing() != "forward":
        return None
    if opts.inplace_backward and logits.is_contiguous():
        return None
    rows = math.prod(logits.shape[:-1])
    probe = torch.empty(0, logits.size(-1), dtype=logits.dtype, device=logits.device)
    ops = native_kernels(probe, opts)
    if ops is None:
        return None
    return ops.ce_map_pages(torch.empty(rows, logits.size(-1), dtype=logits.dtype, device=logits.device))


def save_for_backward(ctx, logits, target, lse, count, vocab, opts, buffer=None) -> None:
    """What every cross-entropy Function keeps: two references, ``lse [T]``, the count, the vocab size;
    ``buffer``: the gradient's buffer from :func:`forward_gradient_buffer`, handed to the first backward."""
    ctx.save_for_backward(logits, target, lse, count, vocab)
    ctx.opts = opts
    ctx.gradient_buffer = buffer


def saved_backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
    logits, target, lse, count, vocab = ctx.saved_tensors
    # the buffer goes to the first backward only (a retained graph's second backward allocates anew)
    buffer, ctx.gradient_buffer = getattr(ctx, "gradient_buffer", None), None
    return cross_entropy_backward(grad_output, logits, target, lse, count, vocab, ctx.opts, buffer)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """``forward(ctx, logits [..., V/tp], target [...], opts)`` -> fp32 loss; see the module doc.

    Saved for backward: the logits and target themselves (references, no copy), ``lse`` ``[T]`` fp32
    (the only new per-token tensor) and two 0-d scalars (the token count, the real vocabulary size);
    on the native CPU path, when applied by :func:`apply_cross_entropy`, also the gradient's buffer,
    its pages already mapped (:func:`forward_gradient_buffer`). Backward returns one gradient in the
    logits' dtype and communicates nothing.
    """

    @staticmethod
    def forward(ctx, logits, target, opts: CrossEntropyOptions):  # type: ignore[override]
        out, lse, count, vocab = cross_entropy_forward(logits, target, opts)
        buffer = forward_gradient_buffer(ctx, logits, opts)
        save_for_backward(ctx, logits, target, lse, count, vocab, opts, buffer)
        return out

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, grad_output):  # type: ignore[override]
        return saved_backward(ctx, grad_output), None, None


def apply_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, opts: CrossEntropyOptions
) -> torch.Tensor:
    """Run through autograd only when a gradient is wanted, so that a no-grad call saves nothing."""
    if torch.is_grad_enabled() and logits.requires_grad:
        wanted = dataclasses.replace(opts, gradient_wanted=True)
        return VocabParallelCrossEntropy.apply(logits, target, wanted)
    with torch.no_grad():
        return cross_entropy_forward(logits, target, opts)[0]


def _label_smoothing_and_group(
    label_smoothing: Any, group: Optional[dist.ProcessGroup], tp_group: Optional[dist.ProcessGroup]
) -> tuple[float, Optional[dist.ProcessGroup]]:
    """Megatron's third positional parameter is ``label_smoothing``; earlier shardkit code passed the
    group there. A number always means label smoothing; a ProcessGroup can only mean the group."""
    if group is not None and tp_group is not None:
        raise TypeError("vocab_parallel_cross_entropy: pass group= or tp_group=, not both")
    group = group if group is not None else tp_group
    if label_smoothing is None:
        return 0.0, group
    if isinstance(label_smoothing, dist.ProcessGroup):
        if group is not None:
            raise TypeError(
                "vocab_parallel_cross_entropy: a process group was passed both as the third positional "
                "argument (Megatron's label_smoothing) and as group= / tp_group="
            )
        return 0.0, label_smoothing
    return label_smoothing, group


def vocab_parallel_cross_entropy(
    logits: Optional[torch.Tensor] = None,
    target: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
    *,
    vocab_parallel_logits: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    reduction: str = "none",
    dp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits against global target ids, exact at any tensor-parallel size.

    Megatron's call ``vocab_parallel_cross_entropy(logits, target, label_smoothing)`` means the same
    here (with the group as ``tp_group=`` / ``group=``, a keyword); the smoothing is exact (PyTorch's,
    over the whole vocabulary), where Megatron's is computed per rank at tp > 1. For code written
    against earlier shardkit releases, a ProcessGroup in the third position is taken as the group: a
    number there is always the label smoothing. Megatron's keyword ``vocab_parallel_logits=`` is
    accepted for ``logits``. This function keeps shardkit's defaults (``ignore_index=-100``, exact
    smoothing); ``megatron_cross_entropy`` behaves as Megatron's function does (docs/names.md).

    Args:
        logits: ``[..., V/tp]`` (e.g. ``[B, S, V/tp]`` or ``[S, B, V/tp]``), fp32 / bf16 / fp16 / fp64;
            or a DTensor sharded on its last dim (then no group or offsets).
        target: ``[...]`` integer global token ids, the same on every rank of ``group``.
        label_smoothing: PyTorch's (``F.cross_entropy(label_smoothing=)``), in ``[0, 1]``.
        group, tp_group: the tensor-parallel group, under either name (None: the default group; one
            rank: no communication).
        vocab_start_index, vocab_end_index: this rank's half-open slice; default even shards.
        vocab_size: the real vocabulary size when the sharded vocabulary is padded; columns at and
            past it never receive probability (nor gradient).
        ignore_index: targets equal to it have loss 0 and gradient 0.
        z_loss, softcap, temperature: see the module doc.
        reduction: "none" (``[...]`` fp32 per token), "sum", or "mean" over non-ignored tokens
            (counted over ``dp_group`` too when given; an all-ignored batch gives 0).
        chunk_size: tokens per fp32 work block (default: about 8M elements per block).
        inplace_backward: backward writes the gradient into the logits' storage instead of a new
            ``[..., V/tp]`` buffer (1 unit less memory, and on CPU no fresh pages to fault in): the
            logits hold the gradient afterwards, as Megatron's do. Only for logits nothing else reads
            after the loss; another user of them that autograd saved fails loudly (version check).
            Non-contiguous logits fall back to a new buffer.
    Returns:
        fp32 loss, replicated on every rank of ``group``.
    """
    op = "vocab_parallel_cross_entropy"
    if vocab_parallel_logits is not None:  # Megatron's keyword for the logits
        if logits is not None:
            raise TypeError(f"{op}: pass the logits as logits= or vocab_parallel_logits=, not both")
        logits = vocab_parallel_logits
    if logits is None or target is None:
        raise TypeError(f"{op}: missing {'the logits' if logits is None else 'target'}")
    label_smoothing, group = _label_smoothing_and_group(label_smoothing, group, tp_group)
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"{op}: inplace_backward must be a bool, got {inplace_backward!r}")
    local, target, opts = prepare_cross_entropy(
        op,
        logits,
        target,
        group,
        vocab_start_index,
        vocab_end_index,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        temperature=temperature,
        reduction=reduction,
        dp_group=dp_group,
        chunk_size=chunk_size,
    )
    if inplace_backward:
        opts = dataclasses.replace(opts, inplace_backward=True)
    return apply_cross_entropy(local, target, opts)

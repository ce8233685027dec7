"""Per-token statistics of vocab-sharded logits and the softmax gradient, computed chunk by chunk.

These are the kernels every loss in ``shardkit.losses`` is built from. A rank holds the columns
``[start, end)`` of a vocabulary of ``V`` entries (``V`` may include padding columns past the real
vocabulary size, which never receive probability). Shapes use ``T`` for the number of tokens and
``w = V/tp`` for this rank's shard width.

Memory discipline (why everything here is chunked): a ``[T, w]`` fp32 copy of a bf16 shard is twice
the shard itself, so the fp32 math runs on ``[c, w]`` row blocks (``c`` rows at a time) and only
``[T]``-sized statistics are kept. A ``source(i0, i1)`` callable produces the raw logits of rows
``[i0, i1)``: a slice of a logits tensor, or a matmul of hidden states for the fused linear loss.

Communication: ``gather_statistics`` is the one collective of a forward pass: a single all-gather of
the per-row statistics ``[T, k]`` of every rank (plus the rank's real column count), after which every
rank combines them locally. The gradient needs no communication: it is recomputed from the saved
log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import all_gather_flat, group_size
from shardkit.kernels.cpu_cache import cache_sizes, rows_in_cache

Source = Callable[[int, int], torch.Tensor]

# fp32 elements per [c, w] work block: 8M elements = 32 MiB per fp32 temporary; large enough that the
# per-chunk Python overhead is negligible, small next to any logits tensor worth sharding
DEFAULT_CHUNK_ELEMENTS = 1 << 23


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 inputs; fp64 inputs keep fp64 (so that gradcheck can be exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# columns of the per-row statistics
MAX, SUMEXP, TARGET, SUM_Z = 0, 1, 2, 3


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap * tanh(x / softcap) / temperature`` (each part optional), in the work dtype.

    Soft-capping comes first because it is part of the model (Gemma-style final-logit capping);
    temperature is how the capped logits are sampled, so it applies to the capped value.
    """

    softcap: Optional[float] = None
    temperature: float = 1.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """A fresh tensor ``z`` in the work dtype (never a view of ``x``: callers modify it in place)."""
        if self.softcap is not None:
            z = torch.tanh(x.to(work_dtype(x.dtype)) / self.softcap)
            return z.mul_(self.softcap / self.temperature)
        z = x.to(work_dtype(x.dtype), copy=True)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z

    def apply_with_derivative(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(z, dz/dx)``; the derivative is None when it is the constant ``1 / temperature``."""
        if self.softcap is None:
            return self.apply(x), None
        t = torch.tanh(x.to(work_dtype(x.dtype)) / self.softcap)
        derivative = (1.0 - t * t).div_(self.temperature)
        return t.mul_(self.softcap / self.temperature), derivative


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, end)`` of the (possibly padded) vocabulary.

    ``real_width`` counts the columns whose global id is below the real vocabulary size; the rest are
    padding and are treated as logits of ``-inf``.
    """

    start: int
    end: int
    real_width: int

    @property
    def width(self) -> int:
        return self.end - self.start

    @staticmethod
    def make(start: int, end: int, vocab_size: Optional[int]) -> VocabShard:
        real_end = end if vocab_size is None else min(end, vocab_size)
        return VocabShard(start, end, max(0, real_end - start))


def chunk_rows(width: int, chunk_size: Optional[int]) -> int:
    """Rows per work block: ``chunk_size`` when given, else about ``DEFAULT_CHUNK_ELEMENTS / width``."""
    if chunk_size is not None:
        return max(1, int(chunk_size))
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, width))


def linear_chunk_rows(
    width: int, num_rows: int, hidden_size: int, device: torch.device, chunk_size: Optional[int]
) -> int:
    """Token rows per block of the fused linear losses' ``[rows, width]`` logits.

    ``chunk_size`` when given; on CPU :func:`chunk_rows`. On an accelerator each block is a matmul
    ``[rows, H] @ [H, width]`` that reads the whole ``[width, H]`` weight shard: with ``chunk_rows``'s
    32 MiB blocks (65 rows of a 128k vocabulary) the forward re-read a 1 GiB weight 250 times and ran
    at 0.15x ``F.cross_entropy``'s speed (measured on an H200, T = 16384, H = 4096, bf16). There the
    block grows to as many elements as the ``[T, H]`` hidden states (``T * H / width`` rows), the size
    of the fp32 ``grad_hidden`` buffer that backward allocates anyway, so the peak stays a few
    ``[T, H]`` while the matmuls are large enough to be compute-bound; rounded up to :func:`aligned`.

    On CPU at least :data:`LINEAR_CPU_MIN_ROWS` rows (aligned, at most ``num_rows``): each block's
    matmul re-reads the whole weight shard and, with gradients in forward, re-writes the whole weight
    gradient, so ``chunk_rows``'s 65-131-row blocks cost one pass over the weight per 65-131 tokens.
    With 256 rows the forward's ``[rows, 256] @ [256, 64000]`` bf16 matmuls took 0.30-0.36 s per 4096
    tokens against 0.38-0.43 s with 131 (1 thread, shared machine, loaded). The fused loss writes its
    blocks into one reused buffer (``losses/fused_linear.py``), so a block above malloc's mmap
    threshold costs no page faults per block.
    """
    rows = chunk_rows(width, chunk_size)
    if chunk_size is not None:
        return rows
    if device.type == "cpu":
        return min(max(1, num_rows), aligned(max(rows, LINEAR_CPU_MIN_ROWS)))
    rows = max(rows, -(-num_rows * hidden_size // max(1, width)))
    return min(max(1, num_rows), aligned(rows))


# fewest token rows per block of the fused linear losses on CPU (see linear_chunk_rows)
LINEAR_CPU_MIN_ROWS = 256


# GEMM libraries need leading dimensions in multiples of 16 bytes for their fast kernels: with 131-row
# blocks and 4093-column blocks cuBLAS ran the fused linear loss's matmuls with sm75 kernels at a
# quarter of the speed of its sm90 ones (profiled on an H200)
GEMM_ALIGNMENT = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``GEMM_ALIGNMENT`` elements."""
    return -(-max(1, n) // GEMM_ALIGNMENT) * GEMM_ALIGNMENT


def cache_rows(width: int, limit: int, device: torch.device, item_bytes: int = 4, work_bytes: int = 4) -> int:
    """Rows per block: on CPU as many as keep one block's working set (the source rows, ``item_bytes``
    per element, and the work rows, ``work_bytes``) within half of this CPU's L2
    (:func:`shardkit.kernels.cpu_cache.rows_in_cache`), at least 1, at most ``limit``: the in-place
    steps between (sub, exp, mul, scatter) then re-read the block from L2, not from memory. The L2 size
    is read from the machine (a constant 4 MiB block, tuned where it sat in L3, made the backward 1.7x
    slower on a CPU with a 2 MiB L2 per core). Elsewhere ``limit``, because each block costs a few
    kernel launches (16-row blocks of a 64000-wide shard made a GPU's cross-entropy 60x slower than
    ``F.cross_entropy``, measured on an H100)."""
    if device.type != "cpu":
        return max(1, limit)
    return rows_in_cache(max(1, width) * (item_bytes + work_bytes), cache_sizes().l2, limit)


def row_blocks(num_rows: int, rows: int) -> Iterator[tuple[int, int]]:
    for i0 in range(0, num_rows, rows):
        yield i0, min(num_rows, i0 + rows)


def local_target_index(
    target: torch.Tensor, shard: VocabShard, ignore_index: Optional[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index [T] int64, owned [T] bool, active [T] bool)`` for flat global target ids ``[T]``.

    ``owned``: the target is a real column of this shard. ``index``: its column within the shard,
    clamped into range for rows not owned (so that gathers never go out of bounds, whatever the ids).
    ``active``: the token is not ignored.
    """
    target = target.to(torch.int64)
    active = torch.ones_like(target, dtype=torch.bool) if ignore_index is None else target != ignore_index
    local = target - shard.start
    owned = active & (local >= 0) & (local < shard.real_width)
    index = torch.where(owned, local, torch.zeros_like(local))
    return index, owned, active


def _mask_padding(z: torch.Tensor, shard: VocabShard) -> None:
    if shard.real_width < shard.width:
        z[:, shard.real_width :] = float("-inf")


def shard_statistics(
    source: Source,
    num_rows: int,
    shard: VocabShard,
    transform: LogitTransform,
    index: torch.Tensor,
    owned: torch.Tensor,
    rows: int,
    with_sum: bool,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-row statistics of this shard, ``[T, 3]`` (or ``[T, 4]`` with ``with_sum``), in ``dtype``.

    ``dtype``: the work dtype (``work_dtype`` of the logits). Columns: local max of ``z``;
    ``sum(exp(z - local max))``; ``z`` at the target (0 where this shard does not own it); with
    ``with_sum``, the sum of ``z`` over the real columns (label smoothing).
    Work memory: about two fp32 ``[rows, w]`` blocks.
    """
    k = 4 if with_sum else 3
    stats = torch.zeros(num_rows, k, dtype=dtype, device=device)
    if shard.width == 0:
        stats[:, MAX] = float("-inf")
        return stats
    if transform.softcap is None:
        _plain_statistics(stats, source, num_rows, shard, transform.temperature, index, owned, rows, with_sum)
        return stats
    for i0, i1 in row_blocks(num_rows, rows):
        z = transform.apply(source(i0, i1))
        _mask_padding(z, shard)
        picked = z.gather(1, index[i0:i1, None]).squeeze(1)
        stats[i0:i1, TARGET] = torch.where(owned[i0:i1], picked, torch.zeros_like(picked))
        if with_sum:
            stats[i0:i1, SUM_Z] = z[:, : shard.real_width].sum(1)
        local_max = z.amax(1)
        stats[i0:i1, MAX] = local_max
        # a row whose columns are all -inf (padding only) has max -inf: shift by 0 so that it sums to 0
        shift = torch.where(torch.isfinite(local_max), local_max, torch.zeros_like(local_max))
        stats[i0:i1, SUMEXP] = z.sub_(shift[:, None]).exp_().sum(1)
    return stats


def softmax_gradient_column_blocks(
    column_source: Callable[[int, int], torch.Tensor],
    shard: VocabShard,
    transform: LogitTransform,
    lse: torch.Tensor,
    index: torch.Tensor,
    owned: torch.Tensor,
    active: torch.Tensor,
    coef_p: torch.Tensor,
    coef_target: torch.Tensor,
    coef_uniform: Optional[torch.Tensor],
    columns: int,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(c0, c1, d out / d x[:, c0:c1])``: the gradient of ``softmax_gradient_blocks``, by blocks
    of ``columns`` vocabulary columns over all rows, ``[T, c1 - c0]`` in the dtype of the logits.

    ``column_source(c0, c1)`` gives a fresh tensor of the logits ``[T, c1 - c0]`` of those columns; the
    gradient is written over it (``softmax_gradient_blocks`` on the columns as a shard of their own, in
    cache-sized row pieces), so a block costs no second buffer. The gradient needs no reduction over the
    vocabulary (``lse`` is known), so a column block is complete on its own: the fused linear loss uses
    this to finish each block's weight gradient in one matmul.
    """
    for c0 in range(0, shard.width, columns):
        c1 = min(shard.width, c0 + columns)
        logits = column_source(c0, c1)
        # these columns as a shard: its real columns, and the targets that fall in it
        block = VocabShard(shard.start + c0, shard.start + c1, max(0, min(shard.real_width, c1) - c0))
        here = owned & (index >= c0) & (index < c1)
        local = torch.where(here, index - c0, torch.zeros_like(index))
        rows = cache_rows(c1 - c0, lse.numel(), lse.device)
        for _ in softmax_gradient_blocks(
            lambda i0, i1, logits=logits: logits[i0:i1], lse.numel(), block, transform, lse, local, here,
            active, coef_p, coef_target, coef_uniform, rows, out=logits,
        ):  # fmt: skip
            pass
        yield c0, c1, logits


def _plain_statistics(
    stats: torch.Tensor,
    source: Source,
    num_rows: int,
    shard: VocabShard,
    temperature: float,
    index: torch.Tensor,
    owned: torch.Tensor,
    rows: int,
    with_sum: bool,
) -> None:
    """``shard_statistics`` without soft-capping: no copy of the logits block.

    ``z = x / temperature`` is never materialized: the max, the target value and the sum come from
    ``x`` itself (temperature > 0 keeps the order), and only ``exp(z - max)`` is written, into one
    reused block buffer. Padding columns are left out of the reductions instead of being masked.
    """
    real = shard.real_width
    inv_t = 1.0 / temperature
    dtype = stats.dtype
    buffer = None
    for i0, i1 in row_blocks(num_rows, rows):
        x = source(i0, i1)
        if real == 0:
            stats[i0:i1, MAX] = float("-inf")
            continue
        xr = x[:, :real] if real < x.size(1) else x
        picked = x.gather(1, index[i0:i1, None]).squeeze(1).to(dtype) * inv_t
        stats[i0:i1, TARGET] = torch.where(owned[i0:i1], picked, torch.zeros_like(picked))
        if with_sum:
            stats[i0:i1, SUM_Z] = xr.sum(1, dtype=dtype) * inv_t
        local_max = xr.amax(1).to(dtype) * inv_t
        stats[i0:i1, MAX] = local_max
        # a row whose columns are all -inf has max -inf: shift by 0 so that it sums to 0
        shift = torch.where(torch.isfinite(local_max), local_max, torch.zeros_like(local_max))
        if buffer is None or buffer.size(0) < i1 - i0:
            buffer = torch.empty((i1 - i0, real), dtype=dtype, device=x.device)
        work = buffer[: i1 - i0]
        if inv_t != 1.0:
            # convert first, then scale in the work dtype (torch.mul(bf16, t, out=fp32) would round the
            # product to bf16: losses off by 2% at temperature 0.7)
            work.copy_(xr).mul_(inv_t).sub_(shift[:, None])
        else:
            torch.sub(xr, shift[:, None], out=work)
        stats[i0:i1, SUMEXP] = work.exp_().sum(1)


def gather_statistics(
    stats: torch.Tensor, real_width: int, group: Optional[dist.ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``[T, k]`` statistics as ``[tp, T, k]`` and the real vocabulary size (one all-gather).

    The real column count rides along as one extra element, so that the global vocabulary size is
    known without a separate collective (exact in fp32 up to 2**24 columns). It stays a 0-d tensor
    on the device: reading it would cost a host sync on every call.
    """
    tp = group_size(group)
    if tp == 1:
        return stats.unsqueeze(0), stats.new_tensor(float(real_width))
    num_rows, k = stats.shape
    send = torch.cat([stats.reshape(-1), stats.new_tensor([float(real_width)])])
    out = torch.empty(tp * send.numel(), dtype=stats.dtype, device=stats.device)
    all_gather_flat(out, send, group=group)
    out = out.view(tp, send.numel())
    return out[:, :-1].reshape(tp, num_rows, k), out[:, -1].sum()


def combine_logsumexp(gathered: torch.Tensor) -> torch.Tensor:
    """Global ``logsumexp(z)`` per row, ``[T]`` fp32, from every rank's (max, sum-exp) in ``[tp, T, k]``."""
    maxes = gathered[..., MAX]
    top = maxes.amax(0)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = (gathered[..., SUMEXP] * torch.exp(maxes - shift)).sum(0)
    return shift + torch.log(total)


def softmax_gradient_blocks(
    source: Source,
    num_rows: int,
    shard: VocabShard,
    transform: LogitTransform,
    lse: torch.Tensor,
    index: torch.Tensor,
    owned: torch.Tensor,
    active: torch.Tensor,
    coef_p: torch.Tensor,
    coef_target: torch.Tensor,
    coef_uniform: Optional[torch.Tensor],
    rows: int,
    out: Optional[torch.Tensor] = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(i0, i1, d out / d x)`` for row blocks, fp32 ``[i1 - i0, w]``, with no communication.

    The gradient with respect to ``z`` of every loss here has the form
    ``coef_p * softmax(z) - coef_target * onehot(target) - coef_uniform * 1[real column]`` (all
    coefficients ``[T]`` fp32 and already multiplied by the incoming gradient), chained through the
    logit transform. Rows that are not ``active`` get exactly zero, even where their logits are not
    finite. Without ``out``, the yielded block is a fresh buffer the consumer may keep or modify.

    ``out`` (``[T, w]``, any float dtype): the gradient is written there and the yielded block is
    ``out[i0:i1]``. When ``out`` has the work dtype (and there is no soft-capping) every step runs in
    place in ``out``: the logits are read once and the gradient written once, and with blocks of
    ``cache_rows`` rows the steps in between stay in the CPU cache.
    """
    if shard.width == 0:
        return
    direct = out is not None and out.dtype == lse.dtype and transform.softcap is None
    # per-row coefficients once, not per block (a block may be a single row of a large vocabulary)
    minus_target = torch.where(owned, -coef_target, torch.zeros_like(coef_target))
    scale = None
    if direct and transform.temperature != 1.0:
        # the gradient is linear in the coefficients: fold d z / d x = 1 / temperature into them
        scale = 1.0 / transform.temperature
        coef_p, minus_target = coef_p * scale, minus_target * scale
        coef_uniform = None if coef_uniform is None else coef_uniform * scale
    # rows that must come out exactly zero whatever their logits: on CPU, find the blocks that have
    # any (one host read per call); on other devices mask every block rather than synchronize
    if lse.device.type == "cpu":
        inactive = ~active
        masked_blocks = {i0 for i0, i1 in row_blocks(num_rows, rows) if bool(inactive[i0:i1].any())}
    else:
        masked_blocks = None
    for i0, i1 in row_blocks(num_rows, rows):
        if direct:
            # z - lse straight into the output rows: no fresh buffer, no copy at the end
            grad, derivative = out[i0:i1], None
            if scale is not None:
                grad.copy_(source(i0, i1)).mul_(scale).sub_(lse[i0:i1, None])  # scaled in the work dtype
            else:
                torch.sub(source(i0, i1), lse[i0:i1, None], out=grad)
            _mask_padding(grad, shard)
            grad.exp_().mul_(coef_p[i0:i1, None])
        else:
            z, derivative = transform.apply_with_derivative(source(i0, i1))
            _mask_padding(z, shard)
            grad = z.sub_(lse[i0:i1, None]).exp_().mul_(coef_p[i0:i1, None])
        if coef_uniform is not None and shard.real_width:
            grad[:, : shard.real_width].sub_(coef_uniform[i0:i1, None])
        # rows not owned here add 0 at their clamped index: no data-dependent indexing, no host sync
        grad.scatter_add_(1, index[i0:i1, None], minus_target[i0:i1, None])
        if derivative is not None:
            grad.mul_(derivative)
        elif transform.temperature != 1.0 and scale is None:
            grad.div_(transform.temperature)
        if masked_blocks is None or i0 in masked_blocks:
            grad.masked_fill_(~active[i0:i1, None], 0.0)
        if out is not None and not direct:
            out[i0:i1].copy_(grad)
            grad = out[i0:i1]
        yield i0, i1, grad

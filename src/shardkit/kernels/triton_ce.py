"""Triton kernels of the vocab-parallel cross-entropy over one rank's vocabulary shard (CUDA tensors).

:mod:`shardkit.losses` runs them on CUDA for the plain loss (the dispatch: :mod:`.cross_entropy`). A
rank holds logits ``[T, V/tp]`` for the vocabulary ids ``[vocab_start, vocab_start + V/tp)``; the loss
needs two passes over them:

1. :func:`ce_statistics`: per token, the shard's max logit, the sum of ``exp(logit - that max)`` and the
   target's logit when the target is in the shard (0 otherwise), all fp32 ``[T]``. The caller combines
   them across ranks (max, then sum of ``s_r * exp(m_r - M)``, then sum of target logits), after which
   ``loss_t = log(S_t) + M_t - target_logit_t``.
2. :func:`ce_gradient`: ``(softmax - one_hot(target)) * grad_scale_t`` from the global ``M`` and ``S``,
   in the logits' dtype, into a new tensor or in place over the logits (``out=logits``), so that the
   backward needs no memory beyond one ``[T, V/tp]`` shard.

Each pass reads the shard once (one program per token, ``BLOCK_V`` columns at a time, an online
max / sum in fp32). Tokens whose target is ``ignore_index`` get target logit 0 and a zero gradient.
Like :mod:`.triton_embedding`, the kernels run on CUDA tensors, or on CPU tensors in Triton's
interpreter when ``TRITON_INTERPRET=1`` was set before the import (how CI tests them).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from shardkit.kernels.triton_embedding import INTERPRETED, triton_failure

try:
    import triton
    import triton.language as tl
except Exception:  # triton_failure() says why
    triton = None
    tl = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available(logits: torch.Tensor) -> bool:
    """True when these kernels can run on ``logits`` (see :func:`.triton_embedding.available`)."""
    if triton is None or logits.dtype not in _DTYPES or logits.dim() != 2:
        return False
    return logits.device.type == ("cpu" if INTERPRETED else "cuda")


# The kernels and their launches keep related arguments on shared lines (one argument per line, as
# the formatter would write them, hides their structure): no formatting from here on.
# fmt: off
if triton is not None:

    @triton.jit
    def _ce_statistics_kernel(
        logits_ptr, target_ptr, max_ptr, sum_ptr, target_logit_ptr, stride_t, V, vocab_start, ignore_index,
        BLOCK_V: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + t * stride_t
        # a finite start below any logit keeps exp(m_old - m_new) free of inf - inf
        m_vec = tl.full([BLOCK_V], -3.0e38, dtype=tl.float32)
        s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        v0 = t * 0
        while v0 < V:
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < V
            x = tl.load(row_ptr + cols, mask=ok, other=-3.0e38).to(tl.float32)
            new_m = tl.maximum(m_vec, x)
            s_vec = s_vec * tl.exp(m_vec - new_m) + tl.where(ok, tl.exp(x - new_m), 0.0)
            m_vec = new_m
            v0 += BLOCK_V
        m = tl.max(m_vec, axis=0)
        s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
        target = tl.load(target_ptr + t).to(tl.int64)
        local = target - vocab_start
        mine = (target != ignore_index) & (local >= 0) & (local < V)
        x_target = tl.load(row_ptr + tl.where(mine, local, 0), mask=mine, other=0.0).to(tl.float32)
        tl.store(max_ptr + t, m)
        tl.store(sum_ptr + t, s)
        tl.store(target_logit_ptr + t, tl.where(mine, x_target, 0.0))

    @triton.jit
    def _ce_gradient_kernel(
        logits_ptr, out_ptr, target_ptr, max_ptr, sum_ptr, scale_ptr, stride_t, stride_o, V, vocab_start,
        ignore_index, BLOCK_V: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        m = tl.load(max_ptr + t)
        inv_s = 1.0 / tl.load(sum_ptr + t)
        target = tl.load(target_ptr + t).to(tl.int64)
        scale = tl.where(target == ignore_index, 0.0, tl.load(scale_ptr + t))
        local = target - vocab_start
        v0 = t * 0
        while v0 < V:
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < V
            x = tl.load(logits_ptr + t * stride_t + cols, mask=ok, other=0.0).to(tl.float32)
            p = tl.exp(x - m) * inv_s
            g = tl.where(cols == local, p - 1.0, p) * scale
            tl.store(out_ptr + t * stride_o + cols, g.to(out_ptr.dtype.element_ty), mask=ok)
            v0 += BLOCK_V


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    if not available(logits):
        where = "CPU (Triton interpreter)" if INTERPRETED else "CUDA"
        raise RuntimeError(
            f"triton CE kernels need 2-d {where} fp32/fp16/bf16 logits; got {tuple(logits.shape)} "
            f"{logits.dtype} on {logits.device}" + (f" ({triton_failure()})" if triton_failure() else "")
        )
    if logits.stride(1) != 1:
        raise ValueError("triton CE kernels need logits with contiguous rows (stride(1) == 1)")
    if target.shape != (logits.shape[0],):
        raise ValueError(f"target has shape {tuple(target.shape)}; expected ({logits.shape[0]},)")


def _block_v(V: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(max(V, 1))))


def ce_statistics(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int = -100
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum of exp(logit - max), target logit or 0), each fp32 ``[T]``, of the shard ``logits``
    ``[T, V/tp]`` holding vocabulary ids from ``vocab_start``; ``target`` int ``[T]`` global ids."""
    _check(logits, target)
    T, V = logits.shape
    stats = torch.empty(3, T, dtype=torch.float32, device=logits.device)
    if T:
        _ce_statistics_kernel[(T,)](
            logits, target.contiguous(), stats[0], stats[1], stats[2], logits.stride(0), V, vocab_start,
            ignore_index, BLOCK_V=_block_v(V), num_warps=8 if V >= 8192 else 4,
        )
    return stats[0], stats[1], stats[2]


def ce_gradient(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    global_max: torch.Tensor,
    global_sum: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int = -100,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(exp(logit - M) / S - one_hot(target)) * grad_scale`` ``[T, V/tp]`` in ``out``'s dtype (default
    a new tensor like ``logits``; ``out=logits`` overwrites the logits). ``global_max`` / ``global_sum``:
    fp32 ``[T]`` over the whole vocabulary; ``grad_scale``: fp32 ``[T]`` (the loss gradient of each token,
    e.g. ``grad_output / valid_tokens`` for a mean). Tokens whose target is ``ignore_index`` get zeros."""
    _check(logits, target)
    T, V = logits.shape
    if out is None:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if out.shape != logits.shape or out.stride(1) != 1 or out.device != logits.device:
        raise ValueError(f"out must be {tuple(logits.shape)} on {logits.device} with contiguous rows")
    if T:
        _ce_gradient_kernel[(T,)](
            logits, out, target.contiguous(), global_max.to(torch.float32).contiguous(),
            global_sum.to(torch.float32).contiguous(), grad_scale.to(torch.float32).contiguous(),
            logits.stride(0), out.stride(0), V, vocab_start, ignore_index,
            BLOCK_V=_block_v(V), num_warps=8 if V >= 8192 else 4,
        )
    return out

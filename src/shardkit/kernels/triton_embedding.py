"""Triton backend of the embedding kernels (CUDA tensors), same semantics as :mod:`.embedding_torch`.

The interface is the one :mod:`shardkit.kernels.embedding` dispatches to: :func:`available`,
:func:`embedding_forward`, :func:`embedding_fused_backward` (arguments and shapes documented there).

- Pooled forward: one program per bag loads ``[BLOCK_N, D]`` tiles of rows and sums them in fp32
  (times the per-sample weights, times ``bag_scale``), one store per bag in the table's dtype.
- Sequence forward: a row gather, ``[BLOCK_N, D]`` tiles per program.
- Fused backward: the ids are sorted by buffer row with ``torch.sort`` (stable) and the first sorted
  position of each distinct row is found and compacted with torch ops (no host sync). Each lane of a
  program owns one distinct row: it sums the row's id gradients in fp32 one id at a time in id order
  (the reference's order), applies the optimizer step to the row and its state and writes it back in
  place. Rows read by more than :data:`LONG_SEGMENT` ids are listed (through an integer counter) and
  get a program each that sums tiles of their ids. Each row is written by exactly one program and
  there are no float atomics: results are deterministic.

Triton is optional: this module imports without it (then :func:`available` is False and
:func:`triton_failure` says why). The kernels are compiled for the GPU unless ``TRITON_INTERPRET=1``
was set before this module was first imported; then they run on CPU tensors in Triton's interpreter
(how CI tests them without a GPU), and :func:`available` is True for CPU tensors instead of CUDA ones.

Ids outside the buffer are never read or written. The forward raises
:class:`~shardkit.kernels.embedding.RowOutOfRange` for them, at the cost of one host sync per call;
``SHARDKIT_TRITON_CHECK_IDS=0`` turns that check (and its sync) off, and such ids then contribute zeros.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from shardkit.kernels import embedding_torch
from shardkit.kernels import triton_tiles as tiles
from shardkit.kernels.row_optimizer import OPTIMIZERS, RowOptimizerArgs

try:
    import triton
    import triton.language as tl

    _TRITON_ERROR: Optional[str] = None
except Exception as error:  # ImportError, or a triton that fails while importing
    triton = None
    tl = None
    _TRITON_ERROR = f"{type(error).__name__}: {error}"

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHECK_IDS = os.environ.get("SHARDKIT_TRITON_CHECK_IDS", "1") != "0"
# rows read by more ids than this in one backward get a program of their own (tiles of ids at a time)
LONG_SEGMENT = 32


def _interpreter_on() -> bool:
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# decided once: triton.jit builds an interpreted or a compiled function when the kernels are defined
INTERPRETED = _interpreter_on()


def triton_failure() -> Optional[str]:
    """Why triton could not be imported, or None when it was."""
    return _TRITON_ERROR


def available(weight: torch.Tensor) -> bool:
    """True when these kernels can run on ``weight``: triton imported, a supported dtype, and the
    tensor on CUDA (on the CPU instead when the kernels were built for Triton's interpreter)."""
    if triton is None or weight.dtype not in _DTYPES or weight.dim() != 2:
        return False
    return weight.device.type == ("cpu" if INTERPRETED else "cuda")


# The kernels and their launches keep related arguments on shared lines (one argument per line, as
# the formatter would write them, hides their structure): no formatting from here on.
# fmt: off
if triton is not None:

    @triton.jit
    def _pooled_forward_kernel(
        weight_ptr,
        ids_ptr,
        offsets_ptr,
        shift_ptr,
        psw_ptr,
        scale_ptr,
        out_ptr,
        bad_ptr,
        num_rows,
        D,
        HAS_SHIFT: tl.constexpr,
        HAS_PSW: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        CHECK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        bag = tl.program_id(0).to(tl.int64)
        start = tl.load(offsets_ptr + bag)
        end = tl.load(offsets_ptr + bag + 1)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        # a while loop, not range(start, end, BLOCK_N): Triton's interpreter cannot take tensor bounds
        first = start
        while first < end:
            pos = first + tl.arange(0, BLOCK_N)
            first += BLOCK_N
            in_bag = pos < end
            rows = tl.load(ids_ptr + pos, mask=in_bag, other=0).to(tl.int64)
            if HAS_SHIFT:
                rows += tl.load(shift_ptr + bag)
            ok = in_bag & (rows >= 0) & (rows < num_rows)
            if CHECK:
                bad = in_bag & (ok == 0)
                if tl.sum(bad.to(tl.int32), axis=0) > 0:
                    tl.atomic_min(bad_ptr, tl.min(tl.where(bad, pos, 2**62), axis=0))
            vals = tl.load(
                weight_ptr + rows[:, None] * D + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
            ).to(tl.float32)
            if HAS_PSW:
                w = tl.load(psw_ptr + pos, mask=in_bag, other=0.0).to(tl.float32)
                vals = vals * w[:, None]
            acc += tl.sum(vals, axis=0)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + bag).to(tl.float32)
        tl.store(out_ptr + bag * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)

    @triton.jit
    def _gather_rows_kernel(
        weight_ptr,
        rows_ptr,
        out_ptr,
        bad_ptr,
        N,
        num_rows,
        D,
        CHECK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pos = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = pos < N
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        rows = tl.load(rows_ptr + pos, mask=in_range, other=0).to(tl.int64)
        ok = in_range & (rows >= 0) & (rows < num_rows)
        if CHECK:
            bad = in_range & (ok == 0)
            if tl.sum(bad.to(tl.int32), axis=0) > 0:
                tl.atomic_min(bad_ptr, tl.min(tl.where(bad, pos, 2**62), axis=0))
        vals = tl.load(
            weight_ptr + rows[:, None] * D + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
        )
        tl.store(out_ptr + pos[:, None] * D + cols[None, :], vals, mask=in_range[:, None] & col_ok[None, :])

    @triton.jit
    def _row_step(
        weight_ptr, state0_ptr, state1_ptr, row, lane, cols, col_ok, param, acc,
        D, float_D, neg_lr, eps, one_minus_beta1, one_minus_beta2, neg_step_size, OPT: tl.constexpr,
    ):
        """One optimizer step on rows ``row`` [S] (lanes where ``lane``), gradients ``acc`` [S, BLOCK_D].

        Each rule follows the op sequence of row_optimizer.apply_rows_ (fp32, rounded division/sqrt).
        """
        tile = lane[:, None] & col_ok[None, :]
        ptrs = row[:, None] * D + cols[None, :]
        if OPT == 0:
            param = param + neg_lr * acc
        elif OPT == 1:
            state_sum = tl.load(state0_ptr + ptrs, mask=tile, other=0.0) + acc * acc
            tl.store(state0_ptr + ptrs, state_sum, mask=tile)
            param = param + neg_lr * tl.div_rn(acc, tl.sqrt_rn(state_sum) + eps)
        elif OPT == 2:
            state_sum = tl.load(state0_ptr + row, mask=lane, other=0.0) + tl.div_rn(
                tl.sum(acc * acc, axis=1), float_D
            )
            tl.store(state0_ptr + row, state_sum, mask=lane)
            param = param + neg_lr * tl.div_rn(acc, tl.sqrt_rn(state_sum)[:, None] + eps)
        else:
            old_avg = tl.load(state0_ptr + ptrs, mask=tile, other=0.0)
            old_avg_sq = tl.load(state1_ptr + ptrs, mask=tile, other=0.0)
            avg = (acc - old_avg) * one_minus_beta1 + old_avg
            avg_sq = (acc * acc - old_avg_sq) * one_minus_beta2 + old_avg_sq
            tl.store(state0_ptr + ptrs, avg, mask=tile)
            tl.store(state1_ptr + ptrs, avg_sq, mask=tile)
            param = param + neg_step_size * tl.div_rn(avg, tl.sqrt_rn(avg_sq) + eps)
        tl.store(weight_ptr + ptrs, param.to(weight_ptr.dtype.element_ty), mask=tile)

    @triton.jit
    def _id_gradients(
        pos, active, cols, col_ok, param, order_ptr, bag_ptr, psw_ptr, scale_ptr, grad_ptr, psw_grad_ptr, D,
        POOLED: tl.constexpr, HAS_PSW: tl.constexpr, HAS_SCALE: tl.constexpr, WANT_PSW_GRAD: tl.constexpr,
    ):
        """fp32 ``w_i * scale_b * grad[b]`` [S, BLOCK_D] of the ids at sorted positions ``pos`` [S, 1]
        (zero where not ``active`` [S, 1]); stores their per-sample-weight gradients against ``param``.

        Every index is a [S, 1] column of the tile's own layout: with [S] vectors here Triton 3.6 fails
        to compile some specializations (TritonGPURemoveLayoutConversions).
        """
        id_pos = tl.load(order_ptr + pos, mask=active, other=0)
        if POOLED:
            src = tl.load(bag_ptr + id_pos, mask=active, other=0)
        else:
            src = id_pos
        tile = active & col_ok[None, :]
        g = tl.load(grad_ptr + src * D + cols[None, :], mask=tile, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g * tl.load(scale_ptr + src, mask=active, other=0.0).to(tl.float32)
        if WANT_PSW_GRAD:
            # against the row before this step's update, as the forward read it
            tl.store(psw_grad_ptr + id_pos, tl.sum(g * param, axis=1, keep_dims=True), mask=active)
        if HAS_PSW:
            g = g * tl.load(psw_ptr + id_pos, mask=active, other=0.0).to(tl.float32)
        return g

    @triton.jit
    def _segments_kernel(
        weight_ptr, sorted_rows_ptr, order_ptr, starts_ptr, num_segs_ptr, bag_ptr, psw_ptr, scale_ptr,
        grad_ptr, state0_ptr, state1_ptr, psw_grad_ptr, long_count_ptr, long_list_ptr,
        num_rows, D, float_D, neg_lr, eps, one_minus_beta1, one_minus_beta2, neg_step_size,
        OPT: tl.constexpr, POOLED: tl.constexpr, HAS_PSW: tl.constexpr, HAS_SCALE: tl.constexpr,
        WANT_PSW_GRAD: tl.constexpr, LONG: tl.constexpr, SEGS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """SEGS distinct rows per program, one lane each, their ids summed one by one in id order;
        rows read by more than LONG ids are only listed (for _long_segments_kernel)."""
        k = tl.program_id(0).to(tl.int64) * SEGS + tl.arange(0, SEGS)
        lane = k < tl.load(num_segs_ptr)
        start = tl.load(starts_ptr + k, mask=lane, other=0)
        length = tl.load(starts_ptr + k + 1, mask=lane, other=0) - start
        row = tl.load(sorted_rows_ptr + start, mask=lane, other=-1).to(tl.int64)
        lane = lane & (row >= 0) & (row < num_rows)
        is_long = lane & (length > LONG)
        if tl.sum(is_long.to(tl.int32), axis=0) > 0:
            # an integer counter: which program handles which long row does not change any result
            slot = tl.atomic_add(long_count_ptr + tl.zeros([SEGS], dtype=tl.int32), 1, mask=is_long)
            tl.store(long_list_ptr + slot, k, mask=is_long)
        lane = lane & (length <= LONG)
        length = tl.where(lane, length, 0)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        tile = lane[:, None] & col_ok[None, :]
        param = tl.load(weight_ptr + row[:, None] * D + cols[None, :], mask=tile, other=0.0).to(tl.float32)
        acc = tl.zeros([SEGS, BLOCK_D], dtype=tl.float32)
        steps = tl.max(length, axis=0)
        j = steps * 0
        while j < steps:
            active = j < length
            acc += _id_gradients(
                (start + j)[:, None], active[:, None], cols, col_ok, param, order_ptr, bag_ptr, psw_ptr,
                scale_ptr, grad_ptr, psw_grad_ptr, D, POOLED, HAS_PSW, HAS_SCALE, WANT_PSW_GRAD,
            )
            j += 1
        _row_step(
            weight_ptr, state0_ptr, state1_ptr, row, lane, cols, col_ok, param, acc,
            D, float_D, neg_lr, eps, one_minus_beta1, one_minus_beta2, neg_step_size, OPT,
        )

    @triton.jit
    def _long_segments_kernel(
        weight_ptr, sorted_rows_ptr, order_ptr, starts_ptr, bag_ptr, psw_ptr, scale_ptr,
        grad_ptr, state0_ptr, state1_ptr, psw_grad_ptr, long_count_ptr, long_list_ptr,
        D, float_D, neg_lr, eps, one_minus_beta1, one_minus_beta2, neg_step_size,
        OPT: tl.constexpr, POOLED: tl.constexpr, HAS_PSW: tl.constexpr, HAS_SCALE: tl.constexpr,
        WANT_PSW_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One row read by many ids per program, BLOCK_N of its ids at a time."""
        q = tl.program_id(0)
        if q < tl.load(long_count_ptr):
            one = tl.arange(0, 1)
            k = tl.load(long_list_ptr + q + one)
            start = tl.load(starts_ptr + k)
            end = tl.load(starts_ptr + k + 1)
            row = tl.load(sorted_rows_ptr + start).to(tl.int64)
            lane = one == 0
            cols = tl.arange(0, BLOCK_D)
            col_ok = cols < D
            param = tl.load(weight_ptr + row[:, None] * D + cols[None, :], mask=col_ok[None, :], other=0.0)
            param = param.to(tl.float32)
            acc = tl.zeros([1, BLOCK_D], dtype=tl.float32)
            first = tl.sum(start, axis=0)
            last = tl.sum(end, axis=0)
            while first < last:
                pos = first + tl.arange(0, BLOCK_N)
                first += BLOCK_N
                # the same param row broadcast to every id of the tile
                g = _id_gradients(
                    pos[:, None], (pos < last)[:, None], cols, col_ok, param, order_ptr, bag_ptr, psw_ptr,
                    scale_ptr, grad_ptr, psw_grad_ptr, D, POOLED, HAS_PSW, HAS_SCALE, WANT_PSW_GRAD,
                )
                acc += tl.sum(g, axis=0)[None, :]
            _row_step(
                weight_ptr, state0_ptr, state1_ptr, row, lane, cols, col_ok, param, acc,
                D, float_D, neg_lr, eps, one_minus_beta1, one_minus_beta2, neg_step_size, OPT,
            )


def _tile(D: int, elements: int = 4096, most_ids: int = 64):
    """(BLOCK_N, BLOCK_D, num_warps): a full row per tile, ~``elements`` values per tile."""
    block_d = triton.next_power_of_2(max(D, 1))
    block_n = max(1, min(most_ids, elements // block_d))
    num_warps = 4 if block_n * block_d <= 4096 else 8
    return block_n, block_d, num_warps


def _segment_tile(D: int):
    """(SEGS, BLOCK_D, num_warps) of the fused backward's one-row-per-lane kernel."""
    block_d = triton.next_power_of_2(max(D, 1))
    segs = max(1, min(64, 2048 // block_d))
    return segs, block_d, 4 if segs * block_d <= 2048 else 8


def _check_weight(weight: torch.Tensor) -> None:
    if not available(weight):
        where = "CPU (Triton interpreter)" if INTERPRETED else "CUDA"
        raise RuntimeError(
            f"triton embedding kernels need a 2-d {where} fp32/fp16/bf16 table; got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}" + (f" ({_TRITON_ERROR})" if _TRITON_ERROR else "")
        )
    if not weight.is_contiguous():
        raise ValueError("triton embedding kernels need a contiguous weight")


def _raise_if_bad(first_bad: torch.Tensor, weight, ids, offsets, bag_shift) -> None:
    position = int(first_bad.item())
    if position < ids.numel():
        from shardkit.kernels.embedding import RowOutOfRange

        rows = embedding_torch.buffer_rows(ids, offsets, bag_shift)
        raise RowOutOfRange(position, int(rows[position]), weight.shape[0])


def embedding_forward(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor],
    per_sample_weights: Optional[torch.Tensor],
    bag_scale: Optional[torch.Tensor],
    pooled: bool,
    check_ids: bool = True,
) -> torch.Tensor:
    """``[B, D]`` bag sums (pooled) or ``[N, D]`` rows, in weight's dtype; see :mod:`.embedding`.
    ``check_ids=False`` (rows in range by construction: a row cache's slots) skips the bounds check and
    its host sync, as ``SHARDKIT_TRITON_CHECK_IDS=0`` does for every call."""
    _check_weight(weight)
    check = CHECK_IDS and check_ids
    num_rows, D = weight.shape
    device = weight.device
    ids = ids.contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    N, B = ids.numel(), offsets.numel() - 1
    block_n, block_d, num_warps = _tile(D)
    # the first bad id's position (read back by a host sync), or, unchecked, a dummy int64 pointer
    first_bad = torch.full((1,), 2**62, dtype=torch.int64, device=device) if check else offsets
    if pooled:
        out = torch.empty(B, D, dtype=weight.dtype, device=device)
        if B == 0:
            return out
        dummy = offsets
        shift = dummy if bag_shift is None else bag_shift.to(torch.int64).contiguous()
        psw = dummy if per_sample_weights is None else per_sample_weights.contiguous()
        scale = dummy if bag_scale is None else bag_scale.to(torch.float32).contiguous()

        def launch(tile):
            _pooled_forward_kernel[(B,)](
                weight, ids, offsets, shift, psw, scale, out, first_bad, num_rows, D,
                HAS_SHIFT=bag_shift is not None, HAS_PSW=per_sample_weights is not None,
                HAS_SCALE=bag_scale is not None, CHECK=check,
                BLOCK_N=tile[0], BLOCK_D=block_d, num_warps=tile[1],
            )

        tile = (block_n, num_warps)
        if tiles.tuning_applies(device, N, INTERPRETED):
            flags = (bag_shift is not None, per_sample_weights is not None, bag_scale is not None, check)
            key = tiles.key_of("forward", D, weight.dtype, ids.dtype, flags, num_ids=N)
            tile = tiles.fastest(key, tiles.forward_candidates(D), launch, device)
        launch(tile)
    else:
        out = torch.empty(N, D, dtype=weight.dtype, device=device)
        if N == 0:
            return out
        rows = ids if bag_shift is None else embedding_torch.buffer_rows(ids, offsets, bag_shift)
        _gather_rows_kernel[(triton.cdiv(N, block_n),)](
            weight,
            rows,
            out,
            first_bad,
            N,
            num_rows,
            D,
            CHECK=check,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    if check:
        _raise_if_bad(first_bad, weight, ids, offsets, bag_shift)
    return out


def _state_tensors(weight: torch.Tensor, optimizer: RowOptimizerArgs):
    num_rows, D = weight.shape
    shapes = {
        "SGD": (),
        "ADAGRAD": ((num_rows, D),),
        "ROWWISE_ADAGRAD": ((num_rows,),),
        "ADAM": ((num_rows, D), (num_rows, D)),
    }[optimizer.kind]
    if len(optimizer.state) != len(shapes):
        raise ValueError(f"{optimizer.kind} takes {len(shapes)} state tensors, got {len(optimizer.state)}")
    for index, (state, shape) in enumerate(zip(optimizer.state, shapes)):
        if tuple(state.shape) != shape or state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError(
                f"{optimizer.kind} state {index} must be a contiguous fp32 tensor of shape {shape}; got "
                f"{tuple(state.shape)} {state.dtype}"
            )
        if state.device != weight.device:
            raise ValueError(
                f"{optimizer.kind} state {index} is on {state.device}, the table on {weight.device}"
            )
    unused = torch.empty(1, dtype=torch.float32, device=weight.device)
    states = list(optimizer.state) + [unused] * (2 - len(optimizer.state))
    return states[0], states[1]


@torch.no_grad()
def embedding_fused_backward(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor],
    per_sample_weights: Optional[torch.Tensor],
    bag_scale: Optional[torch.Tensor],
    grad: torch.Tensor,
    pooled: bool,
    optimizer: RowOptimizerArgs,
    want_psw_grad: bool,
) -> Optional[torch.Tensor]:
    """One optimizer step on every row the forward read, in place; see :mod:`.embedding`.

    Returns fp32 ``[N]`` per-sample-weight gradients when ``want_psw_grad``, else None.
    """
    _check_weight(weight)
    if optimizer.kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{optimizer.kind}'; expected one of {OPTIMIZERS}")
    tile = None
    if tiles.tuning_applies(weight.device, ids.numel(), INTERPRETED):
        tile = _measured_segment_tile(
            weight, ids, offsets, per_sample_weights, bag_scale, grad, pooled, optimizer, want_psw_grad
        )
    return _fused_backward(
        weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, grad, pooled, optimizer,
        want_psw_grad, tile,
    )


def _measured_segment_tile(weight, ids, offsets, psw, bag_scale, grad, pooled, optimizer, want_psw_grad):
    """The fastest (SEGS, num_warps) for this call's kind, timed on a scratch problem of the same
    width, dtypes, flags and number of ids (see :mod:`.triton_tiles`)."""
    D, N, B = weight.shape[1], ids.numel(), offsets.numel() - 1
    flags = (optimizer.kind, pooled, psw is not None, bag_scale is not None, want_psw_grad)
    key = tiles.key_of("segments", D, weight.dtype, ids.dtype, grad.dtype, flags, num_ids=N)
    if key in tiles.chosen():
        return tiles.chosen()[key]
    device, rows = weight.device, tiles.scratch_rows(D, weight.dtype, N)
    gen = torch.Generator(device=device).manual_seed(0)
    table = torch.randn(rows, D, device=device, generator=gen).to(weight.dtype)
    scratch_ids = torch.randint(0, rows, (N,), device=device, generator=gen).to(ids.dtype)
    scratch_offsets = torch.arange(B + 1, device=device, dtype=torch.int64) * N // max(1, B)
    scratch_grad = torch.randn(grad.shape, device=device, generator=gen).to(grad.dtype)
    scratch_psw = None if psw is None else torch.rand(N, device=device, generator=gen).to(psw.dtype)
    scratch_scale = None if bag_scale is None else torch.ones_like(bag_scale)
    state = tuple(torch.zeros(rows, *s.shape[1:], device=device) for s in optimizer.state)
    scratch_opt = RowOptimizerArgs(
        optimizer.kind, lr=optimizer.lr, eps=optimizer.eps, beta1=optimizer.beta1, beta2=optimizer.beta2,
        step=optimizer.step, state=state,
    )

    def run(tile):
        _fused_backward(
            table, scratch_ids, scratch_offsets, None, scratch_psw, scratch_scale, scratch_grad, pooled,
            scratch_opt, want_psw_grad, tile,
        )

    return tiles.fastest(key, tiles.segment_candidates(D), run, device)


def _fused_backward(
    weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, grad, pooled, optimizer, want_psw_grad,
    tile,
):
    """``embedding_fused_backward`` with ``tile`` = (SEGS, num_warps) of the segments kernel, or None
    for the fixed one."""
    state0, state1 = _state_tensors(weight, optimizer)
    num_rows, D = weight.shape
    device = weight.device
    offsets = offsets.to(torch.int64).contiguous()
    N = ids.numel()
    psw_grad = torch.zeros(N, dtype=torch.float32, device=device) if want_psw_grad else None
    if N == 0:
        return psw_grad
    grad = grad.contiguous()
    bags = embedding_torch.bag_of_each_id(offsets, N) if (pooled or bag_shift is not None) else None
    rows = ids.to(torch.int64)
    if bag_shift is not None:
        rows = rows + bag_shift.to(torch.int64).index_select(0, bags)
    if num_rows < 2**31 - 1:
        # a radix sort of 32-bit keys makes half the passes of one of 64-bit keys; clamping first keeps
        # every id outside the buffer outside it (the kernel skips those)
        rows = rows.clamp(-1, num_rows).to(torch.int32)
    sorted_rows, order = torch.sort(rows, stable=True)
    # the first sorted position of each distinct row, compacted without a host sync: starts[k] for
    # k < U (U = num_segs, on the device), starts[U] = N; slot N collects the non-heads' writes
    is_head = torch.ones(N, dtype=torch.bool, device=device)
    torch.ne(sorted_rows[1:], sorted_rows[:-1], out=is_head[1:])
    seg_id = torch.cumsum(is_head, 0) - 1
    num_segs = seg_id[-1:] + 1
    positions = torch.arange(N, device=device)
    starts = torch.empty(N + 1, dtype=torch.int64, device=device)
    starts.scatter_(0, torch.where(is_head, seg_id, N), positions)
    starts.scatter_(0, num_segs, positions[-1:] + 1)
    long_count = torch.zeros(1, dtype=torch.int32, device=device)
    long_list = torch.empty(N // (LONG_SEGMENT + 1) + 1, dtype=torch.int64, device=device)
    dummy = order
    common = (
        dummy if bags is None else bags,
        dummy if per_sample_weights is None else per_sample_weights.contiguous(),
        dummy if not (pooled and bag_scale is not None) else bag_scale.to(torch.float32).contiguous(),
        grad,
        state0,
        state1,
        dummy if psw_grad is None else psw_grad,
        long_count,
        long_list,
    )
    hyper = (
        D, float(D), -optimizer.lr, optimizer.eps, 1.0 - optimizer.beta1, 1.0 - optimizer.beta2,
        -optimizer.adam_step_size,
    )
    flags = dict(
        OPT=OPTIMIZERS.index(optimizer.kind),
        POOLED=pooled,
        HAS_PSW=per_sample_weights is not None,
        HAS_SCALE=pooled and bag_scale is not None,
        WANT_PSW_GRAD=want_psw_grad,
    )
    segs, block_d, num_warps = _segment_tile(D)
    if tile is not None:
        segs, num_warps = tile
    _segments_kernel[(triton.cdiv(N, segs),)](
        weight, sorted_rows, order, starts, num_segs, *common, num_rows, *hyper,
        LONG=LONG_SEGMENT, SEGS=segs, BLOCK_D=block_d, num_warps=num_warps, **flags,
    )
    if N > LONG_SEGMENT:
        block_n, block_d, num_warps = _tile(D, elements=2048, most_ids=32)
        _long_segments_kernel[(long_list.numel(),)](
            weight, sorted_rows, order, starts, *common, *hyper,
            BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, **flags,
        )
    return psw_grad

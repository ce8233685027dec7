"""The embedding-lookup kernels behind one interface, with the backend chosen at run time.

Two ops, each with a pure-torch backend (always), a native C++ backend (CPU tensors, built on this
machine: :mod:`shardkit.kernels.native_build`) and a Triton backend (CUDA tensors, when ``triton``
imports and :mod:`shardkit.kernels.triton_embedding` exists):

- :func:`embedding_forward`: pooled (weighted) sums of rows per bag, or one row per id;
- :func:`embedding_fused_backward`: sums each touched row's gradient and applies one sparse
  optimizer step to it in place; no ``[N, D]`` intermediate and no gradient tensor for the table.

Common arguments (N ids in B bags; rows of one ``[R, D]`` buffer holding several tables' shards):

- weight: ``[R, D]`` fp32 / fp16 / bf16, contiguous.
- ids: int32 or int64 ``[N]``; offsets: int64 ``[B + 1]``, from 0 to N.
- bag_shift: int64 ``[B]`` or None: buffer row = ``ids[i] + bag_shift[bag of i]`` (a table's id 0
  is its shard's first buffer row minus the shard's first table row).
- per_sample_weights: float ``[N]`` or None (pooled only). bag_scale: fp32 ``[B]`` or None: multiplies
  bag b's sum (``1 / length`` for MEAN pooling).
- pooled: True for ``[B, D]`` bag sums, False for ``[N, D]`` rows (then weights and scale are unused).
- batch_major: 0, or (pooled only) the batch size S when bags are feature-major (bag ``f * S + s``):
  then the output (and the gradient the backward takes) is sample-major ``[S, B / S * D]``, feature f
  of sample s in columns ``[f * D, (f + 1) * D)`` - a KeyedTensor's values, with no transpose copy.

An id whose buffer row is outside ``[0, R)`` raises IndexError (native, Triton) before anything is
read; the callers validate ids against their table with a named error before that.

:func:`kernel_backend` picks a backend for a block of code (tests compare the backends this way);
``SHARDKIT_NATIVE=0`` keeps the native one off. The native forward's software-prefetch distance is
chosen per machine at run time (:mod:`shardkit.kernels.prefetch`; ``SHARDKIT_PREFETCH_ROWS`` overrides).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional

import torch

from shardkit.kernels import embedding_torch
from shardkit.kernels.native_build import native_ops
from shardkit.kernels.prefetch import prefetch_rows
from shardkit.kernels.row_optimizer import RowOptimizerArgs

BACKENDS = ("torch", "native", "triton")
_forced: Optional[str] = None
_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RowOutOfRange(IndexError):
    """An id whose buffer row is outside ``[0, R)``; ``position`` is its index in ids."""

    def __init__(self, position: int, row: int, num_rows: int) -> None:
        super().__init__(f"id at position {position} maps to buffer row {row}, outside [0, {num_rows})")
        self.position = position


@contextlib.contextmanager
def kernel_backend(name: Optional[str]) -> Iterator[None]:
    """Use backend ``name`` (one of :data:`BACKENDS`, or None for automatic) inside the block.

    Raises RuntimeError inside the block if that backend cannot run the tensors given.
    """
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend '{name}'; expected one of {BACKENDS}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def forced_backend() -> Optional[str]:
    """The backend :func:`kernel_backend` forces in the current block, or None (automatic)."""
    return _forced


def _triton_module():
    try:
        return importlib.import_module("shardkit.kernels.triton_embedding")
    except ImportError:
        return None


def _triton_can_run(weight: torch.Tensor) -> bool:
    triton = _triton_module()
    return triton is not None and triton.available(weight)


def _native_can_run(weight: torch.Tensor, ids: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and ids.device.type == "cpu"
        and weight.dtype in _NATIVE_DTYPES
        and ids.dtype in (torch.int32, torch.int64)
        and weight.is_contiguous()
        and native_ops() is not None
    )


def native_for(device: torch.device):
    """``torch.ops.shardkit_native`` when native kernels may run on ``device`` (a CPU device, kernels
    built, no other backend forced by :func:`kernel_backend`), else None. For ops outside this module
    (bucketize, segment permutes) that have a native and a pure-torch path."""
    # a torch.device's type read directly: constructing one costs a few us, and this runs per step
    kind = device.type if type(device) is torch.device else torch.device(device).type
    if kind != "cpu" or _forced in ("torch", "triton"):
        return None
    return native_ops()


def select_backend(weight: torch.Tensor, ids: torch.Tensor) -> str:
    """The backend that runs these tensors: the forced one, else the fastest available."""
    if _forced is not None:
        if _forced == "native" and not _native_can_run(weight, ids):
            raise RuntimeError("the native kernel backend is not available for these tensors")
        if _forced == "triton" and not _triton_can_run(weight):
            raise RuntimeError("the triton kernel backend is not available for these tensors")
        return _forced
    if weight.device.type == "cuda":
        return "triton" if _triton_can_run(weight) else "torch"
    return "native" if _native_can_run(weight, ids) else "torch"


def rows_of_unit_stride(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` itself where the native kernels read it in place (2-D, unit column stride: a column
    slice of a wider matrix, such as one lookup group's part of several groups' output gradient), else
    a contiguous copy."""
    if (
        matrix.dim() == 2
        and (matrix.size(1) <= 1 or matrix.stride(1) == 1)
        and matrix.stride(0) >= matrix.size(1)
    ):
        return matrix
    return matrix.contiguous()


def _native_args(ids, offsets, bag_shift, per_sample_weights, bag_scale):
    return (
        ids.contiguous(),
        offsets.to(torch.int64).contiguous(),
        None if bag_shift is None else bag_shift.to(torch.int64).contiguous(),
        None if per_sample_weights is None else per_sample_weights.to(torch.float32).contiguous(),
        None if bag_scale is None else bag_scale.to(torch.float32).contiguous(),
    )


def embedding_forward(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor] = None,
    per_sample_weights: Optional[torch.Tensor] = None,
    bag_scale: Optional[torch.Tensor] = None,
    pooled: bool = True,
    batch_major: int = 0,
    check_ids: bool = True,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, D]`` (pooled), ``[S, B / S * D]`` (batch_major S) or ``[N, D]`` rows in weight's dtype.

    Not differentiable (see the module doc). ``check_ids=False``: the caller guarantees every buffer
    row is in ``[0, R)`` (slot ids from a row cache), so the Triton kernel skips its bounds check and
    the host sync that reads it; never for ids from a user (an id outside the buffer then adds zeros).
    ``out``: written with the result and returned (its shape and weight's dtype; a column slice of a
    wider matrix is written in place by the native kernel, with a copy by the others).
    """
    if not pooled:  # one row per id: nothing to weight or scale
        per_sample_weights = bag_scale = None
    backend = select_backend(weight, ids)
    if backend == "native":
        ids, offsets, bag_shift, psw, bag_scale = _native_args(
            ids, offsets, bag_shift, per_sample_weights, bag_scale
        )
        args = (weight, ids, offsets, bag_shift, psw, bag_scale, pooled, batch_major, prefetch_rows())
        if out is not None and rows_of_unit_stride(out) is out:
            native_ops().embedding_forward_into(*args, out)
            return out
        result = native_ops().embedding_forward(*args)
    elif backend == "triton":
        result = _triton_module().embedding_forward(
            weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, pooled, check_ids
        )
        result = embedding_torch.to_batch_major(result, batch_major)
    else:
        with torch.no_grad():
            result = embedding_torch.embedding_forward(
                weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, pooled, batch_major
            )
    return result if out is None else out.copy_(result)


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
    want_psw_grad: bool = False,
    batch_major: int = 0,
) -> Optional[torch.Tensor]:
    """Apply ``optimizer`` to every row the forward read, in place; ``weight`` gets no gradient.

    grad: ``[B, D]`` (pooled), ``[S, B / S * D]`` (batch_major S) or ``[N, D]``, any float dtype (used in
    fp32; the native kernel reads an fp32 column slice of a wider matrix in place). Each distinct row is
    updated once with the fp32 sum over its ids of ``w_i * scale_b * grad[b]``, summed in id order.
    Returns the per-sample weights' gradient (fp32 ``[N]``: ``scale_b * <grad[b], row before the
    update>``) when ``want_psw_grad``, else None.
    """
    if not pooled:
        per_sample_weights = bag_scale = None
        want_psw_grad = False
    backend = select_backend(weight, ids)
    if backend == "native":
        ids, offsets, bag_shift, psw, bag_scale = _native_args(
            ids, offsets, bag_shift, per_sample_weights, bag_scale
        )
        psw_grad = native_ops().embedding_fused_backward(
            weight,
            ids,
            offsets,
            bag_shift,
            psw,
            bag_scale,
            rows_of_unit_stride(grad.to(torch.float32)),
            pooled,
            batch_major,
            optimizer.code,
            optimizer.lr,
            optimizer.eps,
            optimizer.beta1,
            optimizer.beta2,
            optimizer.adam_step_size,
            list(optimizer.state),
            want_psw_grad,
        )
        return psw_grad if want_psw_grad else None
    if backend == "triton":
        return _triton_module().embedding_fused_backward(
            weight,
            ids,
            offsets,
            bag_shift,
            per_sample_weights,
            bag_scale,
            embedding_torch.from_batch_major(grad, batch_major, weight.size(1)),
            pooled,
            optimizer,
            want_psw_grad,
        )
    return embedding_torch.embedding_fused_backward(
        weight,
        ids,
        offsets,
        bag_shift,
        per_sample_weights,
        bag_scale,
        grad,
        pooled,
        optimizer,
        want_psw_grad,
        batch_major,
    )

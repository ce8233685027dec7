"""Lookups of quantized tables that dequantize only the rows they read, inside the pooled lookup.

:func:`quant_embedding_forward` takes the stored rows of :mod:`shardkit.kernels.quant_rows` (a
``uint8`` ``[R, row_bytes]`` buffer) and the arguments of :func:`shardkit.kernels.embedding_forward`.
No fp32 copy of the table is ever made: the pure-torch backend gathers the ``[N, row_bytes]`` bytes of
the ids' rows, dequantizes those ``N`` rows to fp32 and pools them in id order (``embedding_bag`` over
``0 .. N-1``); the native C++ backend (CPU, when built) dequantizes each row it reads into a row-sized
fp32 buffer and adds it to the bag's accumulator. Both compute ``code * scale + bias`` in fp32 and
sum in id order, so they agree bitwise (``tests/kernels/test_quant_embedding.py``). Inference only:
nothing here is differentiable.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from shardkit.kernels import embedding
from shardkit.kernels.embedding_torch import buffer_rows, to_batch_major
from shardkit.kernels.native_build import native_ops
from shardkit.kernels.prefetch import prefetch_rows
from shardkit.kernels.quant_rows import FLOAT_STORAGES, INT_BITS, check_storage, dequantize_rows, row_bytes


def _native_quant_can_run(weight: torch.Tensor, ids: torch.Tensor) -> bool:
    ops = native_ops()
    return (
        weight.device.type == "cpu"
        and ids.device.type == "cpu"
        and ids.dtype in (torch.int32, torch.int64)
        and embedding._forced in (None, "native")
        and ops is not None
        and hasattr(ops, "quant_embedding_forward")
    )


def quant_backend(weight: torch.Tensor, ids: torch.Tensor) -> str:
    """``"native"`` or ``"torch"``: the backend :func:`quant_embedding_forward` uses for these tensors
    (``kernel_backend("torch")`` forces pure torch; ``kernel_backend("native")`` raises if it cannot run)."""
    if _native_quant_can_run(weight, ids):
        return "native"
    if embedding._forced == "native":
        raise RuntimeError("the native quantized lookup is not available for these tensors")
    return "torch"


@torch.no_grad()
def quant_embedding_forward(
    weight: torch.Tensor,
    storage: str,
    dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor] = None,
    per_sample_weights: Optional[torch.Tensor] = None,
    bag_scale: Optional[torch.Tensor] = None,
    pooled: bool = True,
    batch_major: int = 0,
    check_ids: bool = True,
) -> torch.Tensor:
    """fp32 ``[B, dim]`` pooled rows (``[S, B / S * dim]`` with batch_major S) or ``[N, dim]`` rows.

    weight: uint8 ``[R, row_bytes(dim, storage)]``, contiguous. Other arguments as for
    :func:`shardkit.kernels.embedding_forward`; per-sample weights and bag scales are applied in fp32.
    An id whose buffer row is outside ``[0, R)`` raises IndexError before any row is read, unless
    ``check_ids`` is False: the caller guarantees the rows are in range (a row cache's slots), and the
    pure-torch path skips the check's host syncs (never for ids from a user).
    """
    check_storage(storage)
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.size(1) != row_bytes(dim, storage):
        raise ValueError(
            f"a {storage} table of {dim} columns is uint8 [rows, {row_bytes(dim, storage)}], got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    if not pooled:
        per_sample_weights = bag_scale = None
    if quant_backend(weight, ids) == "native":
        _register_fake()
        return native_ops().quant_embedding_forward(
            weight.contiguous(),
            _STORAGE_CODES[storage],
            dim,
            ids.contiguous(),
            offsets.to(torch.int64).contiguous(),
            None if bag_shift is None else bag_shift.to(torch.int64).contiguous(),
            None if per_sample_weights is None else per_sample_weights.to(torch.float32).contiguous(),
            None if bag_scale is None else bag_scale.to(torch.float32).contiguous(),
            pooled,
            batch_major,
            prefetch_rows(),
        )
    rows = buffer_rows(ids, offsets, bag_shift)
    # a host read of the ids' range: not while torch.export / compile traces (index_select still checks)
    if (
        not torch.compiler.is_compiling()
        and rows.numel()
        and check_ids
        and (int(rows.min()) < 0 or int(rows.max()) >= weight.size(0))
    ):
        position = int(((rows < 0) | (rows >= weight.size(0))).nonzero()[0, 0])
        raise embedding.RowOutOfRange(position, int(rows[position]), weight.size(0))
    values = dequantize_rows(weight.index_select(0, rows), dim, storage)  # [N, dim] fp32: read rows only
    if not pooled:
        return values
    psw = None if per_sample_weights is None else per_sample_weights.to(torch.float32)
    out = F.embedding_bag(
        torch.arange(rows.numel(), device=rows.device),
        values,
        offsets.to(torch.int64),
        mode="sum",
        per_sample_weights=psw,
        include_last_offset=True,
    )
    if bag_scale is not None:
        out = out * bag_scale.to(torch.float32).unsqueeze(1)
    return to_batch_major(out, batch_major)


# the storage argument of the native op
_STORAGE_CODES = {name: i for i, name in enumerate((*FLOAT_STORAGES, *INT_BITS))}
_fake_registered = False


def _register_fake() -> None:
    """Shapes of the native op for torch.export / torch.compile tracing (once, after the build loaded)."""
    global _fake_registered
    if _fake_registered:
        return
    _fake_registered = True

    @torch.library.register_fake("shardkit_native::quant_embedding_forward")
    def _(
        weight,
        storage,
        dim,
        ids,
        offsets,
        bag_shift,
        per_sample_weights,
        bag_scale,
        pooled,
        batch,
        prefetch=16,
    ):
        bags = offsets.size(0) - 1
        if not pooled:
            return weight.new_empty((ids.size(0), dim), dtype=torch.float32)
        if batch > 0:
            return weight.new_empty((batch, bags // batch * dim), dtype=torch.float32)
        return weight.new_empty((bags, dim), dtype=torch.float32)


__all__ = ["quant_backend", "quant_embedding_forward"]

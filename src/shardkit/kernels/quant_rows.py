"""Row formats of quantized embedding tables: how a row of ``dim`` values is stored as bytes.

A quantized table is one ``uint8`` tensor ``[rows, row_bytes(dim, storage)]``. ``storage`` is one of
:data:`STORAGES`:

- ``"fp32"``, ``"fp16"``, ``"bf16"``: the ``dim`` values in that dtype, as bytes (no scale).
- ``"int8"``, ``"int4"``, ``"int2"``: row-wise affine quantization in the fused layout of fbgemm's
  ``FusedNBitRowwiseQuantizedSBHalf``: the ``dim`` codes packed low bits first (``8 / bits`` codes a
  byte; code ``j`` in byte ``j // (8 / bits)`` at bit ``(j % (8 / bits)) * bits``; the last byte
  zero-padded), then the row's fp16 ``scale`` and fp16 ``bias`` (4 bytes, little-endian). A value is
  ``code * scale + bias`` computed in fp32 (two roundings, no fused multiply-add).

Quantization picks, per row, ``bias`` = the row minimum rounded *down* to fp16 and ``scale`` =
``(max - bias) / (2**bits - 1)`` rounded *up* to fp16, so every value lies in
``[bias, bias + (2**bits - 1) * scale]`` and the nearest code is within ``scale / 2`` of it: the round
trip error of every element is at most ``scale / 2`` (plus the fp32 rounding of the dequantization).
A row whose values are not finite or exceed fp16's range (65504) cannot be stored (ValueError).
"""

from __future__ import annotations

from typing import Optional

import torch

FLOAT_STORAGES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
STORAGES = tuple(FLOAT_STORAGES) + tuple(INT_BITS)
SCALE_BIAS_BYTES = 4  # fp16 scale, fp16 bias
_FP16_MAX = 65504.0


def check_storage(storage: str) -> str:
    if storage not in STORAGES:
        raise ValueError(f"unknown table storage {storage!r}; expected one of {STORAGES}")
    return storage


def data_bytes(dim: int, storage: str) -> int:
    """Bytes of a row's values (codes), without the scale and bias."""
    check_storage(storage)
    if storage in FLOAT_STORAGES:
        return dim * FLOAT_STORAGES[storage].itemsize
    per_byte = 8 // INT_BITS[storage]
    return -(-dim // per_byte)


def row_bytes(dim: int, storage: str) -> int:
    """Bytes of one stored row of ``dim`` values: values plus, for int storages, the 4-byte scale/bias."""
    return data_bytes(dim, storage) + (SCALE_BIAS_BYTES if storage in INT_BITS else 0)


def _fp16_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """fp32 ``x`` rounded to fp16 toward ``direction`` (-inf: down, +inf: up); fp16 result."""
    h = x.to(torch.float16)
    off = (h.float() > x) if direction < 0 else (h.float() < x)
    return torch.where(off, torch.nextafter(h, torch.full_like(h, direction)), h)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``[R, D]`` codes (each < 2**bits) -> uint8 ``[R, ceil(D * bits / 8)]``, low bits first."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.contiguous()
    rows, dim = codes.shape
    padded = -(-dim // per_byte) * per_byte
    if padded != dim:
        codes = torch.nn.functional.pad(codes, (0, padded - dim))
    groups = codes.reshape(rows, padded // per_byte, per_byte).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (groups << shifts).sum(dim=2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """uint8 ``[N, ceil(dim * bits / 8)]`` -> uint8 ``[N, dim]`` codes (inverse of :func:`pack_codes`)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:, :dim]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.size(0), packed.size(1) * per_byte)[:, :dim]  # not -1: N may be 0


def _scale_bias(qrows: torch.Tensor, dim: int, storage: str) -> torch.Tensor:
    """uint8 ``[N, 4]``: the stored fp16 scale and bias bytes of each row."""
    start = data_bytes(dim, storage)
    return qrows[:, start : start + SCALE_BIAS_BYTES]


def _scale_bias_fp32(qrows: torch.Tensor, dim: int, storage: str) -> torch.Tensor:
    """fp32 ``[N, 2]``: each row's scale and bias. A copy, not ``contiguous()``: the bytes of a single
    row are already contiguous, at an offset a view as fp16 refuses when it is odd."""
    raw = _scale_bias(qrows, dim, storage).clone(memory_format=torch.contiguous_format)
    return raw.view(torch.float16).to(torch.float32)


@torch.no_grad()
def quantize_rows(
    rows: torch.Tensor,
    storage: str,
    row_min: Optional[torch.Tensor] = None,
    row_max: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float ``[R, D]`` -> uint8 ``[R, row_bytes(D, storage)]`` (see the module doc for the format).

    ``row_min`` / ``row_max`` (fp32 ``[R]``, int storages): the range of each *whole* row when ``rows``
    holds only some of its columns (a column block), so that the block gets the codes, scale and bias
    the whole row would (default: the range of ``rows`` itself).
    """
    check_storage(storage)
    if rows.dim() != 2:
        raise ValueError(f"quantize_rows takes [rows, dim], got {tuple(rows.shape)}")
    if storage in FLOAT_STORAGES:
        return rows.to(FLOAT_STORAGES[storage]).contiguous().view(torch.uint8)
    x = rows.to(torch.float32)
    if x.numel() and not bool((x.abs() <= _FP16_MAX).all()):
        bad = int((~(x.abs() <= _FP16_MAX)).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"row {bad} has a value that is not finite or exceeds fp16's range (65504): "
            f"it cannot be stored as {storage} with an fp16 scale and bias"
        )
    levels = (1 << INT_BITS[storage]) - 1
    if x.size(1) == 0 and row_min is None:
        bias = scale = torch.zeros(x.size(0), dtype=torch.float16, device=x.device)
    else:
        low = x.amin(dim=1) if row_min is None else row_min.to(torch.float32)
        high = x.amax(dim=1) if row_max is None else row_max.to(torch.float32)
        bias = _fp16_toward(low, float("-inf"))
        scale = _fp16_toward((high - bias.float()) / levels, float("inf"))
    s, b = scale.float().unsqueeze(1), bias.float().unsqueeze(1)
    # a constant row (scale 0) stores code 0: its value is the bias
    codes = torch.where(s > 0, ((x - b) / torch.where(s > 0, s, 1.0)).round(), 0.0).clamp(0, levels)
    packed = pack_codes(codes.to(torch.uint8), INT_BITS[storage])
    scale_bias = torch.stack([scale, bias], dim=1).view(torch.uint8)
    return torch.cat([packed, scale_bias], dim=1)


def dequantize_rows(qrows: torch.Tensor, dim: int, storage: str) -> torch.Tensor:
    """uint8 ``[N, row_bytes(dim, storage)]`` -> fp32 ``[N, dim]``: ``code * scale + bias``, or the
    stored floats."""
    check_storage(storage)
    if storage in FLOAT_STORAGES:
        return qrows.contiguous().view(FLOAT_STORAGES[storage]).to(torch.float32)
    bits = INT_BITS[storage]
    codes = unpack_codes(qrows[:, : data_bytes(dim, storage)], dim, bits)
    scale_bias = _scale_bias_fp32(qrows, dim, storage)
    return codes.to(torch.float32) * scale_bias[:, :1] + scale_bias[:, 1:]


def row_scale_bias(qrows: torch.Tensor, dim: int, storage: str) -> torch.Tensor:
    """fp32 ``[N, 2]``: each stored row's scale and bias (int storages only)."""
    if storage not in INT_BITS:
        raise ValueError(f"{storage} rows have no scale and bias")
    return _scale_bias_fp32(qrows, dim, storage)


def slice_columns(qrows: torch.Tensor, dim: int, storage: str, col_start: int, col_end: int) -> torch.Tensor:
    """The stored rows of columns ``[col_start, col_end)`` of ``qrows`` (``[N, row_bytes(dim)]``), as
    ``[N, row_bytes(col_end - col_start)]``: the same codes with the row's own scale and bias, so that
    the columns dequantize to exactly the values they had in the whole row (no re-quantization)."""
    check_storage(storage)
    if not 0 <= col_start < col_end <= dim:
        raise ValueError(f"columns [{col_start}, {col_end}) do not fit rows of {dim} values")
    if (col_start, col_end) == (0, dim):
        return qrows
    if storage in FLOAT_STORAGES:
        values = qrows.contiguous().view(FLOAT_STORAGES[storage])[:, col_start:col_end]
        return values.contiguous().view(torch.uint8)
    bits = INT_BITS[storage]
    codes = unpack_codes(qrows[:, : data_bytes(dim, storage)], dim, bits)[:, col_start:col_end]
    return torch.cat([pack_codes(codes, bits), _scale_bias(qrows, dim, storage)], dim=1)


__all__ = [
    "FLOAT_STORAGES",
    "INT_BITS",
    "SCALE_BIAS_BYTES",
    "STORAGES",
    "check_storage",
    "data_bytes",
    "dequantize_rows",
    "pack_codes",
    "quantize_rows",
    "row_bytes",
    "row_scale_bias",
    "slice_columns",
    "unpack_codes",
]

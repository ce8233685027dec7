"""Row formats of quantized tables: round-trip error bounds per storage, packing, column slices.

Bounds asserted (stated in docs/quant.md): int8 / int4 / int2 max abs error per element <= scale / 2 of
its row (plus the fp32 rounding of ``code * scale + bias``, <= 2**-22 of the magnitudes); fp16 <= 2**-11
relative (2**-25 absolute below fp16's normal range) and bf16 <= 2**-8 relative (one rounding); fp32
exact.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels.quant_rows import (
    INT_BITS,
    STORAGES,
    dequantize_rows,
    pack_codes,
    quantize_rows,
    row_bytes,
    row_scale_bias,
    slice_columns,
    unpack_codes,
)

FP32_SLACK = 2.0**-22


def _rows(dim: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different ranges: tiny, unit, large, all negative, constant, one outlier."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(6, dim, generator=gen)
    rows = torch.stack(
        [
            base[0] * 1e-4,
            base[1],
            base[2] * 300.0,
            -base[3].abs() - 5.0,
            torch.full((dim,), 0.3),
            torch.cat([base[5, :-1] * 0.01, torch.tensor([40.0])]),
        ]
    )
    return torch.cat([rows, torch.randn(50, dim, generator=gen) * 0.05])


@pytest.mark.parametrize("dim", [1, 7, 8, 33])
@pytest.mark.parametrize("storage", list(INT_BITS))
def test_int_round_trip_within_half_a_scale(storage, dim):
    x = _rows(dim)
    q = quantize_rows(x, storage)
    assert q.dtype == torch.uint8 and q.shape == (x.size(0), row_bytes(dim, storage))
    back = dequantize_rows(q, dim, storage)
    scale, bias = row_scale_bias(q, dim, storage).unbind(1)
    bound = scale.unsqueeze(1) / 2 + FP32_SLACK * (x.abs() + x.abs().amax(dim=1, keepdim=True))
    assert bool(((back - x).abs() <= bound).all()), (back - x).abs().max()
    # bias: the row minimum rounded down to fp16; scale: (max - bias) / levels rounded up to fp16
    levels = (1 << INT_BITS[storage]) - 1
    low, high = x.amin(dim=1), x.amax(dim=1)
    assert bool((bias <= low).all()) and bool((low - bias <= 2.0**-10 * low.abs() + 2.0**-24).all())
    span = (high - bias) / levels
    assert bool((scale >= span * (1 - 2.0**-23)).all())
    assert bool((scale <= span * (1 + 2.0**-10) + 2.0**-24).all())
    if dim >= 8:
        # the codes are used: the error reaches a good part of the bound somewhere
        assert float(((back - x).abs() / scale.unsqueeze(1).clamp(min=1e-30))[1:4].max()) > 0.25


@pytest.mark.parametrize(
    "storage, rel, tiny", [("fp32", 0.0, 0.0), ("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 0.0)]
)
def test_float_storages_round_once(storage, rel, tiny):
    # one rounding: half an ulp, relative; fp16 values below 2**-14 are subnormal (absolute half-step)
    x = _rows(12)
    back = dequantize_rows(quantize_rows(x, storage), 12, storage)
    assert bool(((back - x).abs() <= rel * x.abs() + tiny).all())


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_inverse(bits):
    gen = torch.Generator().manual_seed(bits)
    for dim in (1, 3, 5, 16):
        codes = torch.randint(0, 1 << bits, (9, dim), generator=gen, dtype=torch.int32).to(torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape == (9, -(-dim * bits // 8))
        assert torch.equal(unpack_codes(packed, dim, bits), codes)
    # low bits first: codes 1, 2 (int4) are byte 0x21
    assert pack_codes(torch.tensor([[1, 2]], dtype=torch.uint8), 4).tolist() == [[0x21]]


@pytest.mark.parametrize("storage", STORAGES)
def test_column_slices_keep_the_values(storage):
    x = _rows(10, seed=3)
    q = quantize_rows(x, storage)
    full = dequantize_rows(q, 10, storage)
    for c0, c1 in [(0, 10), (0, 3), (3, 7), (7, 10), (5, 6)]:
        part = slice_columns(q, 10, storage, c0, c1)
        assert part.shape == (x.size(0), row_bytes(c1 - c0, storage))
        assert torch.equal(dequantize_rows(part, c1 - c0, storage), full[:, c0:c1])


def test_unstorable_rows_are_named():
    x = torch.zeros(3, 4)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="row 1"):
        quantize_rows(x, "int8")
    x[1, 2] = 1e6
    with pytest.raises(ValueError, match="row 1 .*65504"):
        quantize_rows(x, "int4")
    with pytest.raises(ValueError, match="unknown table storage 'int3'"):
        quantize_rows(x, "int3")


def test_memory_per_row():
    # 64 values: fp32 256 bytes; int8 64 + 4; int4 32 + 4; int2 16 + 4; fp16 / bf16 128
    assert [row_bytes(64, s) for s in ("fp32", "fp16", "bf16", "int8", "int4", "int2")] == [
        256,
        128,
        128,
        68,
        36,
        20,
    ]


@pytest.mark.parametrize("storage", list(INT_BITS))
def test_one_row_dequantizes_like_the_same_row_among_others(storage):
    # one row (a rank's only id): its scale and bias bytes are a contiguous slice at an odd offset,
    # which a view as fp16 refused ("storage_offset() must be divisible by 2")
    q = quantize_rows(_rows(7), storage)
    for i in range(3):
        one = q[i : i + 1]
        assert torch.equal(dequantize_rows(one, 7, storage), dequantize_rows(q, 7, storage)[i : i + 1])
        assert torch.equal(row_scale_bias(one, 7, storage), row_scale_bias(q, 7, storage)[i : i + 1])

"""Quantized comm codecs: round trips within each precision's stated error, sizes, configuration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed.codecs import (
    CastCommCodec,
    CommType,
    FP8CommCodec,
    NoOpQuantizedCommCodec,
    QCommsConfig,
    QuantizedCommCodecs,
    get_qcomm_codecs,
    make_codec,
)

# (relative error, absolute floor) of one round trip, as documented in shardkit.distributed.codecs
TOLERANCE = {"fp32": (0.0, 0.0), "fp16": (2.0**-11, 2.0**-25), "bf16": (2.0**-8, 2.0**-133)}
FP8_RELATIVE = 2.0**-4


def _values(n, seed, low=-3.0, high=3.0):
    """Normal values scaled by magnitudes spread over 10**low .. 10**high."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.logspace(low, high, n)[torch.randperm(n, generator=gen)]


def _assert_within(decoded, x, rtol, atol):
    error = (decoded - x).abs()
    bound = rtol * x.abs() + atol
    assert bool((error <= bound).all()), f"worst excess {(error - bound).max().item()}"


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_cast_round_trip_within_precision(precision):
    codec = make_codec(precision)
    x = _values(1000, 1)
    wire = codec.encode(x)
    assert wire.dtype == codec.quantized_dtype and wire.numel() == codec.calc_quantized_size(x.numel())
    decoded = codec.decode(wire)
    assert decoded.dtype == torch.float32 and decoded.shape == x.shape
    _assert_within(decoded, x, *TOLERANCE[precision])


def test_fp32_and_no_op_codecs_are_exact_on_fp32():
    x = _values(100, 2)
    for codec in (make_codec("fp32"), NoOpQuantizedCommCodec(), QuantizedCommCodecs().forward):
        assert torch.equal(codec.decode(codec.encode(x)), x)
        assert codec.quantized_dtype == torch.float32


def test_fp16_overflows_to_inf_outside_its_range():
    codec = make_codec("fp16")
    decoded = codec.decode(codec.encode(torch.tensor([65504.0, 1e5, -1e5])))
    assert decoded.tolist() == [65504.0, float("inf"), float("-inf")]


@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_fp8_round_trip_within_precision(block_size):
    codec = FP8CommCodec(block_size)
    x = _values(1000, 3)
    wire = codec.encode(x)
    assert wire.dtype == torch.uint8 == codec.quantized_dtype
    assert wire.numel() == codec.calc_quantized_size(1000) == 1000 + 4 * -(-1000 // block_size)
    decoded = codec.decode(wire)
    blocks = torch.nn.functional.pad(x, (0, -1000 % block_size)).view(-1, block_size)
    amax = blocks.abs().amax(dim=1, keepdim=True).expand_as(blocks).reshape(-1)[:1000]
    _assert_within(decoded, x, FP8_RELATIVE, amax * 2.0**-17)


def test_fp8_block_scales_keep_small_blocks_precise():
    # a block of tiny values next to a block of huge ones keeps its own relative precision
    x = torch.cat([torch.full((4,), 1e-20), torch.full((4,), 1e20)]) * torch.tensor([1, -2, 3, -4] * 2)
    codec = FP8CommCodec(block_size=4)
    _assert_within(codec.decode(codec.encode(x)), x, FP8_RELATIVE, 0.0)


def test_fp8_zeros_and_decode_at_any_offset():
    codec = FP8CommCodec(block_size=4)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(6))), torch.zeros(6))
    x = _values(9, 4, low=0.0, high=1.0)
    wire = codec.encode(x)
    # the wire as a piece of a larger receive buffer, starting at an odd byte
    buffer = torch.cat([torch.zeros(1, dtype=torch.uint8), wire])
    assert torch.equal(codec.decode(buffer[1:]), codec.decode(wire))


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 300), block_size=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_fp8_length_is_recovered_from_the_wire(n, block_size, seed):
    codec = FP8CommCodec(block_size)
    x = _values(n, seed) if n else torch.zeros(0)
    wire = codec.encode(x)
    assert wire.numel() == codec.calc_quantized_size(n)
    decoded = codec.decode(wire)
    assert decoded.shape == (n,) and bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize(
    "rows, cols, block_size", [(3, 10, 4), (1, 64, 64), (5, 7, 64), (2, 0, 4), (0, 10, 4), (0, 70, 64)]
)
def test_fp8_two_dimensional_input_round_trips_row_by_row(rows, cols, block_size):
    codec = FP8CommCodec(block_size)
    # one order of magnitude: no value falls under the fp8 floor of its block
    x = _values(rows * cols, 7, low=0.0, high=1.0).view(rows, cols) if cols else torch.zeros(rows, 0)
    wire = codec.encode(x)
    assert wire.shape == (rows, codec.calc_quantized_size(cols))  # each row its own 1-D wire
    decoded = codec.decode(wire)
    assert decoded.shape == (rows, cols)
    for r in range(rows):
        assert torch.equal(wire[r], codec.encode(x[r]))
        assert torch.equal(decoded[r], codec.decode(wire[r]))
        _assert_within(decoded[r], x[r], FP8_RELATIVE, 0.0)


def test_configuration():
    codecs = get_qcomm_codecs(QCommsConfig(forward_precision="bf16", backward_precision=CommType.FP8))
    assert codecs.forward == CastCommCodec(CommType.BF16) and codecs.backward == FP8CommCodec(64)
    assert get_qcomm_codecs(None) == QuantizedCommCodecs()
    assert QCommsConfig().forward_precision is CommType.FP32
    assert CastCommCodec(CommType.FP16).sums_on_wire and not FP8CommCodec().sums_on_wire
    with pytest.raises(ValueError):
        make_codec("int3")
    with pytest.raises(ValueError):
        CastCommCodec(CommType.FP8)
    with pytest.raises(ValueError):
        FP8CommCodec(block_size=0)

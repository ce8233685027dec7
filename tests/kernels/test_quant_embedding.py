"""The quantized lookup against dequantize-the-whole-table-then-embedding_bag, on every backend.

The lookup dequantizes only the rows it reads; its result must equal the reference built from a full
fp32 copy of the table within fp32 rounding (both sum the same fp32 values in id order), and the
native and pure-torch backends must agree bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardkit.kernels import kernel_backend
from shardkit.kernels.embedding_torch import to_batch_major
from shardkit.kernels.quant_embedding import quant_backend, quant_embedding_forward
from shardkit.kernels.quant_rows import STORAGES, dequantize_rows, quantize_rows

ROWS, BAGS = 120, 24


def _case(dim, storage, seed=0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(ROWS, dim, generator=gen)
    lengths = torch.randint(0, 6, (BAGS,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, ROWS // 2, (int(lengths.sum()),), generator=gen)
    shift = torch.randint(0, ROWS // 2, (BAGS,), generator=gen)
    psw = torch.rand(ids.numel(), generator=gen) + 0.5
    scale = 1.0 / lengths.clamp(min=1).float()
    return quantize_rows(table, storage), ids, offsets, shift, psw, scale


def _reference(q, dim, storage, ids, offsets, shift, psw, scale, pooled, batch):
    table = dequantize_rows(q, dim, storage)  # the full fp32 copy the lookup never makes
    rows = ids + torch.repeat_interleave(shift, offsets.diff())
    if not pooled:
        return table[rows]
    out = F.embedding_bag(rows, table, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)
    if scale is not None:
        out = out * scale.unsqueeze(1)
    return to_batch_major(out, batch)


def _backends():
    from shardkit.kernels import native_ops

    return ["torch"] + (
        ["native"] if native_ops() is not None and hasattr(native_ops(), "quant_embedding_forward") else []
    )


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("dim", [5, 16])
def test_lookup_equals_dequantize_then_embedding_bag(storage, dim):
    q, ids, offsets, shift, psw, scale = _case(dim, storage)
    outs = {}
    for backend in _backends():
        with kernel_backend(backend):
            assert quant_backend(q, ids) == backend
            for pooled, weights, bag_scale, batch in [
                (True, None, None, 0),
                (True, psw, None, 0),
                (True, psw, scale, 0),
                (True, None, scale, BAGS // 4),
                (False, None, None, 0),
            ]:
                out = quant_embedding_forward(
                    q, storage, dim, ids, offsets, shift, weights, bag_scale, pooled, batch
                )
                ref = _reference(q, dim, storage, ids, offsets, shift, weights, bag_scale, pooled, batch)
                assert out.dtype == torch.float32 and out.shape == ref.shape
                torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
                outs.setdefault((pooled, weights is None, bag_scale is None, batch), []).append(out)
    for results in outs.values():  # native == torch, bitwise
        assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_row_outside_the_buffer_raises_before_reading(backend):
    if backend not in _backends():
        pytest.skip("native quantized lookup not built here")
    q, ids, offsets, shift, _, _ = _case(8, "int4")
    ids = ids.clone()
    ids[3] = ROWS + 5
    with kernel_backend(backend), pytest.raises(IndexError, match="position 3"):
        quant_embedding_forward(q, "int4", 8, ids, offsets, shift)


def test_wrong_buffer_shape_is_named():
    q, ids, offsets, _, _, _ = _case(8, "int8")
    with pytest.raises(ValueError, match=r"int4 table of 8 columns is uint8 \[rows, 8\]"):
        quant_embedding_forward(q, "int4", 8, ids, offsets)

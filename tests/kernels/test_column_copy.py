"""The column-range copy of the pooled all-to-all's placement (``kernels/column_copy.py``): the native
op against its pure-torch twin (bitwise: copies only), its bounds and argument checks."""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels import native_enabled_by_env
from shardkit.kernels.column_copy import column_copier, copy_column_ranges, copy_column_ranges_torch

needs_native = pytest.mark.skipif(
    not native_enabled_by_env(), reason="SHARDKIT_NATIVE=0: the native kernels are switched off"
)


def _ranges(src_cols: int, dst_cols: int, gen: torch.Generator) -> torch.Tensor:
    """Disjoint destination ranges of random lengths (0 included), from anywhere in the source."""
    ranges, d = [], 0
    while d < dst_cols:
        n = int(torch.randint(0, min(9, dst_cols - d) + 1, (1,), generator=gen))
        s = int(torch.randint(0, src_cols - n + 1, (1,), generator=gen))
        ranges.append([s, d, n])
        d += max(n, 1)
    return torch.tensor(ranges, dtype=torch.int64).view(-1, 3)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_native_copy_is_the_twins(dtype, rows):
    assert column_copier() is copy_column_ranges
    gen = torch.Generator().manual_seed(rows)
    src = (torch.randn(rows, 37, generator=gen) * 50).to(dtype)
    ranges = _ranges(37, 53, gen)
    got = torch.full((rows, 53), 3).to(dtype)
    want = got.clone()
    copy_column_ranges(got, src, ranges)
    copy_column_ranges_torch(want, src, ranges)
    assert torch.equal(got, want)
    # the columns no range writes keep their values
    written = torch.zeros(53, dtype=torch.bool)
    for _, d, n in ranges.tolist():
        written[d : d + n] = True
    assert bool((got[:, ~written] == 3).all())


@needs_native
@pytest.mark.parametrize("copy", [copy_column_ranges, copy_column_ranges_torch])
def test_a_range_outside_either_matrix_is_an_error(copy):
    src, dst = torch.zeros(4, 10), torch.zeros(4, 6)
    for bad in ([8, 0, 3], [0, 4, 3], [-1, 0, 2]):
        with pytest.raises(RuntimeError, match="outside src"):
            copy(dst, src, torch.tensor([bad]))
    assert bool((dst == 0).all())


@needs_native
def test_the_native_op_checks_its_arguments():
    src, dst, ranges = torch.zeros(4, 10), torch.zeros(4, 6), torch.tensor([[0, 0, 2]])
    with pytest.raises(RuntimeError, match="contiguous 2-d"):
        copy_column_ranges(dst, src.t(), ranges)
    with pytest.raises(RuntimeError, match="dst is Float, src is Double"):
        copy_column_ranges(dst, src.double(), ranges)
    with pytest.raises(RuntimeError, match="dst has 4 rows, src 5"):
        copy_column_ranges(dst, torch.zeros(5, 10), ranges)
    with pytest.raises(RuntimeError, match="int64 \\[K, 3\\]"):
        copy_column_ranges(dst, src, ranges.to(torch.int32))

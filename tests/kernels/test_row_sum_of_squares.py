"""row_sum_of_squares: the fixed order in which both backends sum a row's squared gradient (row-wise
Adagrad), checked against a plain Python transcription of that order and against float64."""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels import RowOptimizerArgs, embedding_fused_backward, kernel_backend, native_ops
from shardkit.kernels.row_optimizer import SQUARE_LANES, row_sum_of_squares


def _lanes_in_python(row: torch.Tensor) -> torch.Tensor:
    """The documented order, one fp32 rounding at a time (0-d fp32 tensors: each op rounds to fp32)."""
    lanes = [torch.zeros((), dtype=torch.float32) for _ in range(SQUARE_LANES)]
    for j in range(row.numel()):
        lanes[j % SQUARE_LANES] = lanes[j % SQUARE_LANES] + row[j] * row[j]
    width = SQUARE_LANES // 2
    while width > 0:
        lanes = [lanes[i] + lanes[i + width] for i in range(width)]
        width //= 2
    return lanes[0]


@pytest.mark.parametrize("dim", [1, 8, 16, 24, 40, 128, 130])
def test_the_order_is_lanes_then_a_pairwise_tree(dim):
    gen = torch.Generator().manual_seed(dim)
    # magnitudes spread over 2^-20 .. 2^20: a different order of the sums would round differently
    grad = torch.randn(5, dim, generator=gen) * torch.exp2(torch.randint(-20, 21, (5, dim), generator=gen))
    got = row_sum_of_squares(grad)
    assert got.dtype == torch.float32 and got.shape == (5,)
    for r in range(5):
        assert torch.equal(got[r], _lanes_in_python(grad[r]))
    torch.testing.assert_close(got.double(), grad.double().pow(2).sum(1), rtol=1e-5, atol=0.0)


def test_an_empty_batch_of_rows():
    assert row_sum_of_squares(torch.zeros(0, 24)).shape == (0,)


@pytest.mark.skipif(native_ops() is None, reason="the native kernels are switched off or did not build")
@pytest.mark.parametrize("dim", [8, 16, 24, 64, 128, 130])  # compile-time widths and run-time ones
def test_native_row_wise_adagrad_equals_torch_bitwise(dim):
    # one id per row (rows spread), so each row's update depends on its own squares only; magnitudes
    # spread as above so that a change of summation order would show
    rows, bags = 4096, 512
    gen = torch.Generator().manual_seed(dim + 1)
    ids = torch.randperm(rows, generator=gen)[:bags]
    offsets = torch.arange(bags + 1)
    grad = torch.randn(bags, dim, generator=gen) * torch.exp2(
        torch.randint(-12, 13, (bags, dim), generator=gen)
    )
    initial = torch.randn(rows, dim, generator=gen)
    results = []
    for backend in ("torch", "native"):
        weight, state = initial.clone(), torch.full((rows,), 0.25)
        with kernel_backend(backend):
            embedding_fused_backward(
                weight,
                ids,
                offsets,
                None,
                None,
                None,
                grad,
                True,
                RowOptimizerArgs("ROWWISE_ADAGRAD", 0.1, 1e-8, state=(state,)),
            )
        results.append((weight, state))
    (w_t, s_t), (w_n, s_n) = results
    assert not torch.equal(w_n, initial)
    assert torch.equal(s_n, s_t) and torch.equal(w_n, w_t)

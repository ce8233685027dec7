"""Non-negative least squares (the calibration fit's solver): exact solutions, the active bound, and
the optimality conditions on random problems."""

from __future__ import annotations

import pytest
import torch

from shardkit.planner.least_squares import nnls


def test_nnls_solves_with_and_without_active_constraints():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    assert nnls(a, a @ torch.tensor([2.0, 3.0], dtype=torch.float64)).tolist() == pytest.approx([2.0, 3.0])
    # the unconstrained least squares is (2, -1): the second is held at 0, the first refitted
    b = a @ torch.tensor([2.0, -1.0], dtype=torch.float64)
    x = nnls(a, b)
    assert x[1].item() == 0.0
    assert x[0].item() == pytest.approx(float((a[:, 0] @ b) / (a[:, 0] @ a[:, 0])))
    # a column of zeros (a feature no configuration exercises) gets 0
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    assert nnls(z, torch.tensor([1.0, 2.0], dtype=torch.float64)).tolist() == pytest.approx([1.0, 0.0])


def test_nnls_meets_the_optimality_conditions_on_random_problems():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        a = torch.rand(12, 6, generator=gen, dtype=torch.float64)
        b = torch.randn(12, generator=gen, dtype=torch.float64)
        x = nnls(a, b)
        w = a.T @ (b - a @ x)  # minus the gradient of |a x - b|^2 / 2
        assert bool((x >= 0).all())
        assert bool((w <= 1e-9).all())  # no coordinate could go up and help
        free = x > 0
        if bool(free.any()):  # the coordinates off the bound: at their optimum
            assert w[free].abs().max().item() < 1e-9

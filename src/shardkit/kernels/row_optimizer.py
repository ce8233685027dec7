"""What a fused backward needs to know of a sparse optimizer, and its rules in pure torch.

:class:`RowOptimizerArgs` is the one description every kernel backend (pure torch, native C++,
Triton) takes: the rule, its hyper-parameters for this step, and the fp32 state tensors, which the
backend updates in place for the touched rows only. :func:`apply_rows_` is the pure-torch rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch

OPTIMIZERS = ("SGD", "ADAGRAD", "ROWWISE_ADAGRAD", "ADAM")


@dataclass(frozen=True)
class RowOptimizerArgs:
    """One step of a sparse row optimizer.

    kind: one of :data:`OPTIMIZERS`. step: the step count including this step (Adam's bias
    correction). state: fp32, first dim = table rows: ``()`` SGD, ``(sum [R, D],)`` Adagrad,
    ``(sum [R],)`` row-wise Adagrad, ``(exp_avg [R, D], exp_avg_sq [R, D])`` Adam.
    """

    kind: str
    lr: float
    eps: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    step: int = 1
    state: Tuple[torch.Tensor, ...] = ()

    @property
    def code(self) -> int:
        """The rule's index in :data:`OPTIMIZERS` (the native kernels' encoding)."""
        return OPTIMIZERS.index(self.kind)

    @property
    def adam_step_size(self) -> float:
        """``lr * sqrt(1 - beta2^t) / (1 - beta1^t)``, computed in double as torch.optim does."""
        if self.kind != "ADAM":
            return 0.0
        return self.lr * math.sqrt(1 - self.beta2**self.step) / (1 - self.beta1**self.step)


# partial sums of row_sum_of_squares (csrc/embedding_backward.cpp kSquareLanes: the native rule's order)
SQUARE_LANES = 16


def row_sum_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """``[U]``: the sum of each row's squares of ``grad`` ``[U, D]``, in the native kernel's order.

    Lane ``l`` (of :data:`SQUARE_LANES`) sums ``grad[:, j] ** 2`` for ``j = l, l + 16, ...`` in
    increasing ``j``; then lanes ``l`` and ``l + w`` are added for ``w = 8, 4, 2, 1``. Elementwise ops
    only, so every sum rounds as the native kernel's (a torch reduction's order is its own, and varies
    with the CPU's vector width): the two backends' row-wise Adagrad results are bitwise equal.
    """
    squares = grad * grad
    rows, dim = squares.shape
    lanes = torch.zeros(rows, SQUARE_LANES, dtype=squares.dtype, device=squares.device)
    full = dim - dim % SQUARE_LANES
    for j in range(0, full, SQUARE_LANES):
        lanes.add_(squares[:, j : j + SQUARE_LANES])
    if full < dim:
        lanes[:, : dim - full].add_(squares[:, full:])
    width = SQUARE_LANES // 2
    while width > 0:
        lanes = lanes[:, :width] + lanes[:, width : 2 * width]
        width //= 2
    return lanes[:, 0]


@torch.no_grad()
def apply_rows_(weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, args: RowOptimizerArgs) -> None:
    """One optimizer step on ``rows`` of ``weight`` (and of the state), in place.

    weight: ``[R, D]`` any float dtype. rows: int64 ``[U]`` distinct. grad: fp32 ``[U, D]`` summed per
    row. Each branch mirrors the op sequence of its torch.optim counterpart (computed in fp32), so
    results agree bitwise or to the last ulp, not merely to a tolerance.
    """
    if rows.numel() == 0:
        return
    if args.kind == "SGD" and weight.dtype == torch.float32:
        # stateless and already fp32: scatter the step straight into the table
        weight.index_add_(0, rows, grad, alpha=-args.lr)
        return
    param = weight.index_select(0, rows).to(torch.float32)
    lr, eps = args.lr, args.eps
    if args.kind == "SGD":
        param.add_(grad, alpha=-lr)
    elif args.kind == "ADAGRAD":
        (state,) = args.state
        state_sum = state.index_select(0, rows)
        state_sum.addcmul_(grad, grad, value=1)
        param.addcdiv_(grad, state_sum.sqrt().add_(eps), value=-lr)
        state.index_copy_(0, rows, state_sum)
    elif args.kind == "ROWWISE_ADAGRAD":
        (state,) = args.state
        state_sum = state.index_select(0, rows)
        state_sum.add_(row_sum_of_squares(grad).div_(grad.size(1)))
        # the correctly rounded fp32 sqrt, as the native kernel's: torch's own fp32 sqrt on CPU is off by
        # one ulp for ~20% of inputs on some CPUs (Zen 5, torch 2.13); a float64 sqrt rounded to fp32 is
        # exact (only [U] values)
        denom = state_sum.double().sqrt().to(torch.float32).add_(eps)
        param.addcdiv_(grad, denom.unsqueeze(1), value=-lr)
        state.index_copy_(0, rows, state_sum)
    else:
        exp_avg, exp_avg_sq = args.state
        old_avg = exp_avg.index_select(0, rows)
        old_avg_sq = exp_avg_sq.index_select(0, rows)
        avg = grad.sub(old_avg).mul_(1 - args.beta1).add_(old_avg)
        avg_sq = grad.pow(2).sub_(old_avg_sq).mul_(1 - args.beta2).add_(old_avg_sq)
        exp_avg.index_copy_(0, rows, avg)
        exp_avg_sq.index_copy_(0, rows, avg_sq)
        param.add_(avg.div(avg_sq.sqrt().add_(eps)), alpha=-args.adam_step_size)
    weight.index_copy_(0, rows, param.to(weight.dtype))

"""Sparse optimizers fused into the backward of an embedding lookup: only the touched rows change.

The lookup's backward sums the gradients of repeated ids into one gradient per touched row and hands
them to :meth:`SparseRowOptimizer.step_rows_`; the optimizer rule runs on those rows alone and writes
them back in place; no ``[num_rows, dim]`` gradient ever exists. Each rule computes
in fp32 (whatever the table dtype) and is numerically the rule of a ``torch.optim`` optimizer:

- ``SGD``: ``torch.optim.SGD`` (no momentum) - untouched rows have zero gradient and do not move.
- ``ADAGRAD``: ``torch.optim.Adagrad`` - likewise exact, state ``sum`` ``[rows, dim]``.
- ``ROWWISE_ADAGRAD``: one accumulator per row (``sum`` ``[rows]``) that adds the mean of the row's
  squared gradient; the row moves by ``lr * g / (sqrt(sum) + eps)``. 1/dim of Adagrad's memory.
- ``ADAM``: lazy Adam, i.e. ``torch.optim.SparseAdam``: moments of untouched rows are not decayed and
  the bias correction uses the number of steps this buffer has taken (state ``exp_avg``, ``exp_avg_sq``).
  Dense ``torch.optim.Adam`` would move every row each step, which a sparse update cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, unique
from typing import Dict, Optional, Tuple

import torch
from torch import nn


@unique
class OptimType(Enum):
    """The fused sparse optimizers (names as in the specification's ``OptimType``)."""

    SGD = "SGD"
    ADAGRAD = "ADAGRAD"
    ROWWISE_ADAGRAD = "ROWWISE_ADAGRAD"
    ADAM = "ADAM"


_DEFAULT_EPS = {OptimType.ADAGRAD: 1e-10, OptimType.ROWWISE_ADAGRAD: 1e-10, OptimType.ADAM: 1e-8}


@dataclass(frozen=True)
class FusedOptimizerConfig:
    """Which optimizer the lookup's backward applies, and its hyper-parameters.

    ``eps`` defaults to torch's default for that optimizer (1e-10 Adagrad, 1e-8 Adam).
    ``initial_accumulator_value`` seeds the (row-wise) Adagrad sums.
    """

    optimizer: OptimType
    lr: float = 0.01
    eps: Optional[float] = None
    betas: Tuple[float, float] = (0.9, 0.999)
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", OptimType(self.optimizer))
        if self.lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {self.lr}")
        if not (0.0 <= self.betas[0] < 1.0 and 0.0 <= self.betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if self.initial_accumulator_value < 0:
            raise ValueError(f"initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}")

    def get_eps(self) -> float:
        return _DEFAULT_EPS.get(self.optimizer, 0.0) if self.eps is None else self.eps


def _state_shapes(optimizer: OptimType, num_rows: int, dim: int) -> Dict[str, Tuple[int, ...]]:
    if optimizer is OptimType.ADAGRAD:
        return {"sum": (num_rows, dim)}
    if optimizer is OptimType.ROWWISE_ADAGRAD:
        return {"sum": (num_rows,)}
    if optimizer is OptimType.ADAM:
        return {"exp_avg": (num_rows, dim), "exp_avg_sq": (num_rows, dim)}
    return {}


class SparseRowOptimizer(nn.Module):
    """Optimizer state of one ``[num_rows, dim]`` embedding buffer and the in-place row update.

    State tensors are fp32 non-persistent buffers (they follow ``.to()`` but stay out of the module's
    ``state_dict``; :meth:`state_dict` of this object holds them). ``lr`` may be changed between steps.
    """

    def __init__(
        self, config: FusedOptimizerConfig, num_rows: int, dim: int, device: Optional[torch.device] = None
    ) -> None:
        super().__init__()
        self.config = config
        self.lr = config.lr
        self.step_count = 0
        for name, shape in _state_shapes(config.optimizer, num_rows, dim).items():
            self.register_buffer(
                name, torch.empty(shape, dtype=torch.float32, device=device), persistent=False
            )
        if torch.device(device or "cpu").type != "meta":
            self.reset_state()

    def reset_state(self) -> None:
        """Zero the moments (Adagrad sums start at ``initial_accumulator_value``) and the step count."""
        self.step_count = 0
        with torch.no_grad():
            for name, buf in self.named_buffers(recurse=False):
                buf.fill_(self.config.initial_accumulator_value if name == "sum" else 0.0)

    @torch.no_grad()
    def step_rows_(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step on ``rows`` of ``weight``, in place; the other rows are not read.

        weight: ``[num_rows, dim]`` (any float dtype). rows: int64 ``[U]``, distinct. grad: fp32
        ``[U, dim]``, the summed gradient of each row.
        """
        self.step_count += 1
        if rows.numel() == 0:
            return
        if self.config.optimizer is OptimType.SGD and weight.dtype == torch.float32:
            # stateless and already fp32: scatter the step straight into the table
            weight.index_add_(0, rows, grad, alpha=-self.lr)
            return
        param = weight.index_select(0, rows).to(torch.float32)
        self._rule(param, grad, rows)
        weight.index_copy_(0, rows, param.to(weight.dtype))

    def _rule(self, param: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor) -> None:
        # each branch mirrors the op sequence of its torch.optim counterpart so results agree bitwise
        # or to the last ulp, not merely to a tolerance
        opt, lr, eps = self.config.optimizer, self.lr, self.config.get_eps()
        if opt is OptimType.SGD:
            param.add_(grad, alpha=-lr)
        elif opt is OptimType.ADAGRAD:
            state_sum = self.sum.index_select(0, rows)
            state_sum.addcmul_(grad, grad, value=1)
            param.addcdiv_(grad, state_sum.sqrt().add_(eps), value=-lr)
            self.sum.index_copy_(0, rows, state_sum)
        elif opt is OptimType.ROWWISE_ADAGRAD:
            state_sum = self.sum.index_select(0, rows)
            state_sum.add_(grad.pow(2).mean(dim=1))
            param.addcdiv_(grad, state_sum.sqrt().add_(eps).unsqueeze(1), value=-lr)
            self.sum.index_copy_(0, rows, state_sum)
        else:
            beta1, beta2 = self.config.betas
            old_avg = self.exp_avg.index_select(0, rows)
            old_avg_sq = self.exp_avg_sq.index_select(0, rows)
            avg = grad.sub(old_avg).mul_(1 - beta1).add_(old_avg)
            avg_sq = grad.pow(2).sub_(old_avg_sq).mul_(1 - beta2).add_(old_avg_sq)
            self.exp_avg.index_copy_(0, rows, avg)
            self.exp_avg_sq.index_copy_(0, rows, avg_sq)
            step_size = lr * math.sqrt(1 - beta2**self.step_count) / (1 - beta1**self.step_count)
            param.add_(avg.div(avg_sq.sqrt().add_(eps)), alpha=-step_size)

    def state_slices(self, row_start: int, row_end: int) -> Dict[str, torch.Tensor]:
        """Views of the state tensors restricted to buffer rows ``[row_start, row_end)``."""
        return {name: buf[row_start:row_end] for name, buf in self.named_buffers(recurse=False)}

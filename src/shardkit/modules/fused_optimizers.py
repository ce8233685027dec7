"""Sparse optimizers fused into the backward of an embedding lookup: only the touched rows change.

The lookup's backward sums the gradients of repeated ids into one gradient per touched row and applies
the rule to those rows alone, in place (:mod:`shardkit.kernels`: the rules in pure torch in
``row_optimizer.py``, natively in ``csrc/embedding_backward.cpp``); no ``[num_rows, dim]`` gradient ever
exists.
Each rule computes in fp32 (whatever the table dtype) and is numerically the rule of a ``torch.optim``
optimizer:

- ``SGD``: ``torch.optim.SGD`` (no momentum) - untouched rows have zero gradient and do not move.
- ``ADAGRAD``: ``torch.optim.Adagrad`` - likewise exact, state ``sum`` ``[rows, dim]``.
- ``ROWWISE_ADAGRAD``: one accumulator per row (``sum`` ``[rows]``) that adds the mean of the row's
  squared gradient; the row moves by ``lr * g / (sqrt(sum) + eps)``. 1/dim of Adagrad's memory.
- ``ADAM``: lazy Adam, i.e. ``torch.optim.SparseAdam``: moments of untouched rows are not decayed and
  the bias correction uses the number of steps this buffer has taken (state ``exp_avg``, ``exp_avg_sq``).
  Dense ``torch.optim.Adam`` would move every row each step, which a sparse update cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from shardkit import huge_pages
from shardkit.kernels.row_optimizer import RowOptimizerArgs


class OptimType(Enum):
    """The fused sparse optimizers (names as in the specification's ``OptimType``).

    Iterating gives the four rules; the ``EXACT_*`` names are aliases (not ``enum.unique`` for them).
    """

    SGD = "SGD"
    ADAGRAD = "ADAGRAD"
    ROWWISE_ADAGRAD = "ROWWISE_ADAGRAD"
    ADAM = "ADAM"
    # fbgemm's EmbOptimType spellings: its EXACT_* rules sum the gradients of a row's duplicate ids
    # before one update, which is what every shardkit kernel does, so each is an alias of the same
    # member (OptimType.EXACT_ROWWISE_ADAGRAD is OptimType.ROWWISE_ADAGRAD)
    EXACT_SGD = "SGD"
    EXACT_ADAGRAD = "ADAGRAD"
    EXACT_ROWWISE_ADAGRAD = "ROWWISE_ADAGRAD"


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
                name, huge_pages.empty(shape, dtype=torch.float32, device=device), persistent=False
            )
        if torch.device(device or "cpu").type != "meta":
            self.reset_state()

    def reset_state(self) -> None:
        """Zero the moments (Adagrad sums start at ``initial_accumulator_value``) and the step count."""
        self.step_count = 0
        with torch.no_grad():
            for name, buf in self.named_buffers(recurse=False):
                buf.fill_(self.config.initial_accumulator_value if name == "sum" else 0.0)

    def step_args(self) -> RowOptimizerArgs:
        """Count one step and describe it for a kernel backend (state tensors by reference)."""
        self.step_count += 1
        beta1, beta2 = self.config.betas
        # this module's own buffers (it has no submodules), in registration order, as
        # named_buffers(recurse=False) gives them, without its generator machinery (every step)
        state = tuple(buf for buf in self._buffers.values() if buf is not None)
        return RowOptimizerArgs(
            self.config.optimizer.value, self.lr, self.config.get_eps(), beta1, beta2, self.step_count, state
        )

    def state_slices(self, row_start: int, row_end: int) -> Dict[str, torch.Tensor]:
        """Views of the state tensors restricted to buffer rows ``[row_start, row_end)``."""
        return {name: buf[row_start:row_end] for name, buf in self.named_buffers(recurse=False)}

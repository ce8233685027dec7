"""``RowWiseAdagrad``: Adagrad with one accumulator per row of a 2-D parameter (torchrec's optimizer).

The dense twin of the fused ``OptimType.ROWWISE_ADAGRAD``: the same rule, for parameters that get a
``.grad`` (an unsharded table, a data-parallel one). Handed to ``apply_optimizer_in_backward`` for
tables that the sharders shard, it selects the fused ROWWISE_ADAGRAD kernel.
"""

from __future__ import annotations

from typing import Iterable

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    """Per row r of a ``[rows, dim]`` parameter: ``sum[r] += mean(g[r] ** 2)``,
    ``w[r] -= lr * g[r] / (sqrt(sum[r]) + eps)``. A 1-D parameter is one row per element.

    Args: ``lr`` (1e-2), ``lr_decay`` (0: the rate is ``lr / (1 + (step - 1) * lr_decay)``),
    ``weight_decay`` (0: adds ``weight_decay * w`` to the gradient), ``initial_accumulator_value``
    (0), ``eps`` (1e-10), ``maximize``. State ``sum`` ``[rows]`` fp32 and ``step``, created at the
    first step (so that building it over meta parameters allocates nothing).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        for name, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay), ("eps", eps)):
            if value < 0:
                raise ValueError(f"RowWiseAdagrad: {name} must be >= 0, got {value}")
        if initial_accumulator_value < 0:
            raise ValueError(
                f"RowWiseAdagrad: initial_accumulator_value must be >= 0, got {initial_accumulator_value}"
            )
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("RowWiseAdagrad does not support sparse gradients")
                state = self.state[param]
                rows = param if param.dim() > 1 else param.view(-1, 1)
                if not state:
                    state["step"] = 0
                    state["sum"] = torch.full(
                        (rows.size(0),),
                        group["initial_accumulator_value"],
                        dtype=torch.float32,
                        device=param.device,
                    )
                state["step"] += 1
                grad = param.grad if not group["maximize"] else -param.grad
                grad = grad.reshape(rows.shape).float()
                if group["weight_decay"]:
                    grad = grad.add(rows.float(), alpha=group["weight_decay"])
                state["sum"].add_(grad.pow(2).mean(dim=1))
                rate = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
                update = grad / state["sum"].sqrt().add_(group["eps"]).unsqueeze(1)
                rows.add_(update.to(param.dtype), alpha=-rate)
        return loss

"""torchrec's ``apply_optimizer_in_backward`` (``torchrec.optim.apply_optimizer_in_backward``)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Type

import torch


def apply_optimizer_in_backward(
    optimizer_class: Type[torch.optim.Optimizer],
    params: Iterable[torch.Tensor],
    optimizer_kwargs: Dict[str, Any],
) -> None:
    """Step ``optimizer_class(param, **optimizer_kwargs)`` for each parameter as soon as its gradient is
    accumulated (torch's ``_apply_optimizer_in_backward``). On an embedding collection that is then
    sharded, the sharders turn it into the equivalent fused optimizer (docs/model_parallel.md)."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    _apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)

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
    sharded, the sharders turn it into the equivalent fused optimizer (docs/model_parallel.md).

    Raises ``ValueError`` when ``params`` is empty: nothing would be trained by the optimizer, which is
    what torchrec's per-table idiom ``ebc.embedding_bags[t].parameters()`` gives here (a table is a view
    of its group's buffer and owns no parameter, docs/names.md).
    """
    from torch.distributed.optim import _apply_optimizer_in_backward

    params = list(params)
    if not params:
        raise ValueError(
            "apply_optimizer_in_backward: no parameters given, so the optimizer would train nothing. "
            "A shardkit table (ebc.embedding_bags[t] / ec.embeddings[t]) owns no parameter: tables of one "
            "width share one buffer. Pass the collection's parameters (ebc.parameters()): one optimizer "
            "for all its tables"
        )
    _apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)

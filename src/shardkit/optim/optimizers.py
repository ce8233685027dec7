"""torchrec's ``in_backward_optimizer_filter``.

A parameter with an optimizer applied in backward carries ``_in_backward_optimizers`` (torch's
``_apply_optimizer_in_backward`` sets it; shardkit's fused tables carry it too, sharded or not), so
the dense optimizer can be built from the other parameters only.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Tuple

from torch import nn


def in_backward_optimizer_filter(
    named_parameters: Iterable[Tuple[str, nn.Parameter]], include: bool = False
) -> Iterator[Tuple[str, nn.Parameter]]:
    """The ``(name, parameter)`` pairs without an in-backward optimizer (``include=True``: with one)."""
    for name, param in named_parameters:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param

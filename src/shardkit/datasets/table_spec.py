"""``TableSpec``: one categorical feature of a synthetic data set and the table that embeds it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One table with one feature of the same name; ``pooling`` is the mean number of ids per bag."""

    name: str
    rows: int
    dim: int
    pooling: float = 1.0

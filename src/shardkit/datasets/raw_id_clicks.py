"""Synthetic clicks whose chosen features carry raw 64-bit ids (user ids, hashed strings), not rows.

``RawIdClicks`` draws every feature as :class:`SyntheticClicks` does (a feature's ``rows`` is then its
cardinality: how many distinct ids exist) and replaces the ids of ``raw_features`` by
``id * RAW_ID_STRIDE + RAW_ID_SALT``: distinct, spread over ``[0, 2**63)``, a function of the id alone.
A managed collision module maps them to the rows of a fixed-size table.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardkit.datasets.synthetic_clicks import SyntheticClicks
from shardkit.datasets.table_spec import TableSpec
from shardkit.datasets.utils import Batch
from shardkit.sparse import KeyedJaggedTensor

RAW_ID_STRIDE = 9_223_372_036_000  # (cardinality <= 10**6) * stride < 2**63
RAW_ID_SALT = 811_338_211


class RawIdClicks(SyntheticClicks):
    """:class:`SyntheticClicks` with the ids of ``raw_features`` as raw 64-bit ids (cardinality <= 10**6)."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        batch_size: int,
        dense_in: int,
        seed: int = 0,
        raw_features: Sequence[str] = (),
        alpha: float = 1.1,
    ) -> None:
        super().__init__(tables, batch_size, dense_in, seed, alpha)
        too_many = [t.name for t in tables if t.name in raw_features and t.rows > 10**6]
        if too_many:
            raise ValueError(f"raw-id features {too_many} have more than 10**6 distinct ids")
        self.raw_features = list(raw_features)

    def batch(self, step: int, rank: int) -> Batch:
        batch = super().batch(step, rank)
        kjt = batch.sparse_features
        parts = list(kjt.values().split(kjt.length_per_key()))
        for i, key in enumerate(kjt.keys()):
            if key in self.raw_features:
                parts[i] = parts[i] * RAW_ID_STRIDE + RAW_ID_SALT
        values = torch.cat(parts) if parts else kjt.values()
        return Batch(
            batch.dense_features, KeyedJaggedTensor(kjt.keys(), values, lengths=kjt.lengths()), batch.labels
        )


__all__ = ["RAW_ID_SALT", "RAW_ID_STRIDE", "RawIdClicks"]

"""Synthetic click data: Zipf-distributed ids and labels the model can learn.

Real categorical ids are skewed: a few ids (popular items, big countries) make most of the lookups.
Each table draws ids with ``P(k-th most popular) ~ 1 / k**alpha``; a fixed permutation per table
scatters the popular ids over the rows, as hashing does, so a row-wise split does not put all hot rows
on one rank. Each id has a hidden click propensity; a sample's label is drawn from the sigmoid of its
dense features' and ids' propensities, so the loss has something to go down to.

Every batch is a function of ``(seed, step, rank)`` alone, so any process can rebuild any rank's
batch, and the unsharded reference can train on the global batch of a step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardkit.datasets.table_spec import TableSpec
from shardkit.datasets.utils import Batch, concat_batches
from shardkit.sparse import KeyedJaggedTensor


class SyntheticClicks:
    """Batches of ``batch_size`` samples with ``dense_in`` dense features and one feature per table."""

    def __init__(
        self, tables: Sequence[TableSpec], batch_size: int, dense_in: int, seed: int = 0, alpha: float = 1.1
    ) -> None:
        self.tables, self.batch_size, self.dense_in, self.seed = list(tables), batch_size, dense_in, seed
        gen = torch.Generator().manual_seed(seed)
        self._cdfs, self._perms, self._propensity = [], [], []
        for table in self.tables:
            weights = torch.arange(1, table.rows + 1, dtype=torch.float64).pow(-alpha)
            self._cdfs.append(torch.cumsum(weights / weights.sum(), 0))
            self._perms.append(torch.randperm(table.rows, generator=gen))
            self._propensity.append(0.5 * torch.randn(table.rows, generator=gen) / max(table.pooling, 1.0))
        self._dense_weight = 2 * torch.randn(dense_in, generator=gen) / dense_in**0.5

    def batch(self, step: int, rank: int) -> Batch:
        """Rank ``rank``'s batch of step ``step``."""
        gen = torch.Generator().manual_seed(1_000_003 * self.seed + 7919 * step + rank + 1)
        b = self.batch_size
        dense = torch.randn(b, self.dense_in, generator=gen)
        score = dense @ self._dense_weight - 1.0  # a click rate well below one half, as in real logs
        lengths, values = [], []
        for table, cdf, perm, propensity in zip(self.tables, self._cdfs, self._perms, self._propensity):
            # bag sizes uniform on [0, 2 * pooling]: mean ``pooling``, some bags empty
            n = torch.randint(0, int(2 * table.pooling) + 1, (b,), generator=gen)
            ranks = torch.searchsorted(cdf, torch.rand(int(n.sum()), generator=gen, dtype=torch.float64))
            ids = perm[ranks.clamp_(max=table.rows - 1)]
            bags = torch.repeat_interleave(torch.arange(b), n)
            score.index_add_(0, bags, propensity[ids])
            lengths.append(n)
            values.append(ids)
        kjt = KeyedJaggedTensor([t.name for t in self.tables], torch.cat(values), lengths=torch.cat(lengths))
        labels = torch.bernoulli(torch.sigmoid(score), generator=gen)
        return Batch(dense, kjt, labels)

    def global_batch(self, step: int, world_size: int) -> Batch:
        """Every rank's batch of ``step``, in rank order, as one batch."""
        return concat_batches([self.batch(step, r) for r in range(world_size)])

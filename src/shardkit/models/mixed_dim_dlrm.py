"""A DLRM-style click model over tables of mixed widths (``shardkit demo``, ``examples/dlrm_criteo.py``).

The model is the usual recommender shape: a dense MLP over the float features, an
``EmbeddingBagCollection`` over the categorical ones, pairwise dot products between the dense output
and the tables as wide as it (the *interaction*), and an over-arch MLP that sees the dense output, the
dot products and the wider tables' pooled vectors. Its forward takes one :class:`Batch` and returns
``(mean BCE loss, detached loss)``: the train pipelines backpropagate the first and hand back the
second, which is how a training loop reads the loss of each step.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch
from torch import nn

from shardkit.datasets.table_spec import TableSpec
from shardkit.datasets.utils import Batch
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
    OptimType,
)


class MixedDimDLRM(nn.Module):
    """Dense arch + ``EmbeddingBagCollection`` (fused SGD) + dot interaction + over-arch.

    ``mc_tables`` (rows = slots) adds ``mc_ebc``, a ManagedCollisionEmbeddingBagCollection for features
    of raw 64-bit ids (LFU, eviction every step, ``mc_buckets`` buckets per map); its tables join the
    others in the interaction / over-arch.

    Tables of width ``dense_out`` interact with the dense output and each other; wider or narrower
    tables go to the over-arch as they are. ``lr`` is the tables' fused SGD rate; the dense parameters
    need an SGD of the same rate for a data-parallel table to train like a sharded one.

    ``activation`` builds the MLPs' activation modules (default ``nn.ReLU``). A model whose sharded and
    unsharded training must agree to a tolerance wants a smooth one (``nn.SiLU``): their float32 sums
    differ in the last bits, and a ReLU input that lands within those bits of zero takes the other
    branch in one of the two, so that sample's gradient through the unit is dropped in one and kept in
    the other (``shardkit demo``: 3e-8 from zero at step 45 of 100 gave dense weights 7.9e-4 apart).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        dense_in: int,
        dense_out: int = 16,
        hidden: int = 64,
        lr: float = 0.1,
        device: torch.device = None,
        mc_tables: Sequence[TableSpec] = (),
        mc_buckets: int = 1,
        activation: Callable[[], nn.Module] = nn.ReLU,
    ) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(
            nn.Linear(dense_in, hidden, device=device),
            activation(),
            nn.Linear(hidden, dense_out, device=device),
            activation(),
        )
        configs = [EmbeddingBagConfig(t.rows, t.dim, name=t.name, feature_names=[t.name]) for t in tables]
        self.ebc = EmbeddingBagCollection(
            configs, device=device, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=lr)
        )
        self.mc_ebc = managed_collision_ebc(mc_tables, mc_buckets, lr, device) if mc_tables else None
        tables = [*tables, *mc_tables]  # the raw-id features' pooled vectors come after the others
        self._dims = [t.dim for t in tables]
        self._interacting = [i for i, t in enumerate(tables) if t.dim == dense_out]
        self._wide = [i for i, t in enumerate(tables) if t.dim != dense_out]
        n = len(self._interacting) + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self._pair_rows, self._pair_cols = rows.tolist(), cols.tolist()
        over_in = dense_out + len(self._pair_rows) + sum(self._dims[i] for i in self._wide)
        self.over_arch = nn.Sequential(
            nn.Linear(over_in, hidden, device=device), activation(), nn.Linear(hidden, 1, device=device)
        )

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(batch.dense_features, batch.sparse_features)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.squeeze(1), batch.labels)
        return loss, loss.detach()

    def logits(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        """Click logits ``[B, 1]`` of ``dense_features`` ``[B, dense_in]`` and the sparse KJT (what
        serving needs: no labels)."""
        dense = self.dense_arch(dense_features)
        pooled = self.ebc(sparse_features).values()
        if self.mc_ebc is not None:
            pooled = torch.cat([pooled, self.mc_ebc(sparse_features)[0].values()], dim=1)
        pooled = pooled.split(self._dims, dim=1)
        stacked = torch.stack([dense, *[pooled[i] for i in self._interacting]], dim=1)  # [B, n, dense_out]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self._pair_rows, self._pair_cols]
        return self.over_arch(torch.cat([dense, dots, *[pooled[i] for i in self._wide]], dim=1))


def managed_collision_ebc(
    tables: Sequence[TableSpec], buckets: int, lr: float, device: torch.device = None
) -> ManagedCollisionEmbeddingBagCollection:
    """One table of ``rows`` slots per raw-id feature, behind an LFU map evicting every step."""
    configs = [EmbeddingBagConfig(t.rows, t.dim, name=t.name, feature_names=[t.name]) for t in tables]
    maps = {
        t.name: MCHManagedCollisionModule(
            t.rows, device, LFU_EvictionPolicy(), 1, name=t.name, buckets=buckets
        )
        for t in tables
    }
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(
            configs, device=device, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=lr)
        ),
        ManagedCollisionCollection(maps, configs),
    )


def dense_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The parameters the dense optimizer trains in an unsharded model (the tables train themselves)."""
    return [p for name, p in model.named_parameters() if not name.startswith(("ebc.", "mc_ebc."))]

"""torchrec's ``DLRM`` (dense arch, sparse arch, dot interaction, over arch) and ``DLRMTrain``.

Notation: ``B`` batch size, ``F`` sparse features, ``D`` embedding dimension (the same for every
table, and the width of the dense arch's output).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from shardkit.datasets.utils import Batch
from shardkit.distributed.awaitable import LazyAwaitable
from shardkit.modules import EmbeddingBagCollection
from shardkit.modules.mlp import MLP
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor


class SparseArch(nn.Module):
    """``KeyedJaggedTensor`` -> pooled embeddings ``[B, F, D]``, features in the collection's order."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("SparseArch: the EmbeddingBagCollection has no tables")
        self.embedding_bag_collection = embedding_bag_collection
        self.D: int = configs[0].embedding_dim
        self._sparse_feature_names = [f for c in configs for f in c.feature_names]
        self.F: int = len(self._sparse_feature_names)

    @property
    def sparse_feature_names(self) -> List[str]:
        return list(self._sparse_feature_names)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return _features_by_name(
            self.embedding_bag_collection(features), self._sparse_feature_names, self.F, self.D
        )


def _features_by_name(pooled: KeyedTensor, names: List[str], num: int, dim: int) -> torch.Tensor:
    """The pooled embeddings of ``names`` in that order, ``[B, num, dim]``. A leaf of fx traces
    (``torch.fx.wrap`` below): it looks at the pooled keys, which a trace does not know."""
    if isinstance(pooled, LazyAwaitable):  # a sharded collection's: wait once here rather than
        pooled = pooled.wait()  # forwarding each of the attribute reads below through the awaitable
    if pooled.key_dim() == 1 and pooled.keys() == names and pooled.length_per_key() == [dim] * num:
        # the values already hold the features in this order, dim columns each: a per-feature split
        # and concatenation would copy them into the same [B, num * dim] (and add a split and a cat
        # to the backward)
        return pooled.values().reshape(-1, num, dim)
    by_key = pooled.to_dict()
    return torch.cat([by_key[f] for f in names], dim=1).reshape(-1, num, dim)


torch.fx.wrap("_features_by_name")


class DenseArch(nn.Module):
    """Dense features ``[B, in_features]`` -> ``[B, layer_sizes[-1]]`` through ReLU layers."""

    def __init__(
        self, in_features: int, layer_sizes: List[int], device: Optional[torch.device] = None
    ) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class InteractionArch(nn.Module):
    """``[B, D]`` dense and ``[B, F, D]`` sparse -> ``[B, D + F + F choose 2]``: the dense vector and the
    dot products of every pair among the ``F + 1`` vectors."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.register_buffer(
            "triu_indices", torch.triu_indices(self.F + 1, self.F + 1, offset=1), persistent=False
        )
        # the same pairs as positions in the flattened [F + 1, F + 1] dots: one index_select picks
        # them (half the forward time of indexing with two index tensors at B = 32, F = 26, and an
        # index_add backward instead of an accumulating index_put; same values, bitwise)
        self.register_buffer(
            "triu_flat_indices", self.triu_indices[0] * (self.F + 1) + self.triu_indices[1], persistent=False
        )

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)  # [B, F + 1, D]
        dots = torch.bmm(combined, combined.transpose(1, 2))
        return torch.cat((dense_features, dots.flatten(1).index_select(1, self.triu_flat_indices)), dim=1)


class OverArch(nn.Module):
    """``[B, in_features]`` -> ``[B, layer_sizes[-1]]``: ReLU layers, then a plain linear last layer."""

    def __init__(
        self, in_features: int, layer_sizes: List[int], device: Optional[torch.device] = None
    ) -> None:
        super().__init__()
        if len(layer_sizes) <= 1:
            raise ValueError(f"OverArch needs at least two layer sizes, got {layer_sizes}")
        self.model = nn.Sequential(
            MLP(in_features, layer_sizes[:-1], bias=True, activation="relu", device=device),
            nn.Linear(layer_sizes[-2], layer_sizes[-1], device=device),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class DLRM(nn.Module):
    """The DLRM recommender (arXiv:1906.00091) over an ``EmbeddingBagCollection`` of equal-width tables.

    Args:
        embedding_bag_collection: the sparse arch's tables; every table has the same ``embedding_dim``.
        dense_in_features: width of the dense input.
        dense_arch_layer_sizes: the dense arch's layers; the last equals the tables' ``embedding_dim``.
        over_arch_layer_sizes: the over arch's layers (the input width is derived).
        dense_device: where the dense layers are built.

    forward(dense_features ``[B, dense_in_features]``, sparse_features KJT of batch B) -> logits
    ``[B, over_arch_layer_sizes[-1]]``.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: List[int],
        over_arch_layer_sizes: List[int],
        dense_device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        dims = {c.name: c.embedding_dim for c in configs}
        if not configs or len(set(dims.values())) != 1:
            raise ValueError(f"DLRM needs at least one table, all of one embedding_dim; got {dims}")
        dim = configs[0].embedding_dim
        if dense_arch_layer_sizes[-1] != dim:
            raise ValueError(
                f"DLRM: the last dense arch layer ({dense_arch_layer_sizes[-1]}) must equal the tables' "
                f"embedding_dim ({dim})"
            )
        self.sparse_arch = SparseArch(embedding_bag_collection)
        num_features = self.sparse_arch.F
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, dense_device)
        self.inter_arch = InteractionArch(num_features)
        over_in = dim + num_features + num_features * (num_features - 1) // 2
        self.over_arch = OverArch(over_in, over_arch_layer_sizes, dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if type(self.sparse_arch).forward is not SparseArch.forward:  # a user's sparse arch: as torchrec
            embedded_dense = self.dense_arch(dense_features)
            return self.over_arch(self.inter_arch(embedded_dense, self.sparse_arch(sparse_features)))
        # the collection first: a sharded one returns a LazyAwaitable, so its output all-to-all runs
        # while the dense arch computes; and in backward (the autograd engine runs the ready node made
        # last first) the dense arch's gradient is computed while the pooled gradient's all-to-all
        # runs, where the dense-first order waited for it at once. Same values, bitwise.
        sparse_arch = self.sparse_arch
        pooled = sparse_arch.embedding_bag_collection(sparse_features)
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = _features_by_name(
            pooled, sparse_arch._sparse_feature_names, sparse_arch.F, sparse_arch.D
        )
        return self.over_arch(self.inter_arch(embedded_dense, embedded_sparse))


class DLRMTrain(nn.Module):
    """A ``DLRM`` with its loss: forward(batch) -> ``(BCE loss, (loss, logits [B], labels [B]))`` detached."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())

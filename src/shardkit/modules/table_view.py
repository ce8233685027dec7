"""``TableView``: one table of a grouped collection, as ``embedding_bags[name]`` / ``embeddings[name]``.

torchrec's collections hold one ``nn.EmbeddingBag`` / ``nn.Embedding`` per table; shardkit's store the
tables of one width and dtype in one buffer (one kernel call per group). A view stands in for the
per-table module: it owns no parameter (the state dict and ``parameters()`` stay the collection's) and
its ``weight`` is the table's rows, a view of the group's buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from shardkit.modules.embedding_configs import BaseEmbeddingConfig


class TableView(nn.Module):
    """Table ``config.name`` of ``owner``: ``weight`` ``[num_embeddings, embedding_dim]`` (a view).

    ``weight`` is not an ``nn.Parameter``: hand the collection's ``parameters()`` to an optimizer.
    Writing into it (``with torch.no_grad(): view.weight.copy_(rows)``) writes the table.
    """

    def __init__(self, owner: nn.Module, config: BaseEmbeddingConfig) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a submodule: the owner holds this view
        self.config = config
        self.num_embeddings = config.num_embeddings
        self.embedding_dim = config.embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        return self._owner.table_weight(self.config.name)

    def extra_repr(self) -> str:
        return f"{self.config.name}: {self.num_embeddings}, {self.embedding_dim}"

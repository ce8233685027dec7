"""Table-column-wise sharding: a table's column blocks on the ranks of one node.

Data movement is column-wise sharding's (each block is a table to the dists); what differs is the
placement, which the plan gives (``sharding_plan.table_column_wise(host_index)``): keeping a table's
blocks on one node keeps the ids of its features from crossing nodes more than once per block.
"""

from __future__ import annotations

from shardkit.sharding.column_wise import CwPooledEmbeddingSharding, CwSequenceEmbeddingSharding


class TwCwPooledEmbeddingSharding(CwPooledEmbeddingSharding):
    """Table-column-wise pooled embeddings."""


class TwCwSequenceEmbeddingSharding(CwSequenceEmbeddingSharding):
    """Table-column-wise sequence embeddings."""


__all__ = ["TwCwPooledEmbeddingSharding", "TwCwSequenceEmbeddingSharding"]

"""Column-wise sharding: each table's columns are cut into blocks, block ``i`` on ``ranks[i]``.

A column block is looked up like a table of its own (all rows, its columns), so the features of a
column-wise table are sent, whole, to the rank of every block: the input dist permutes the input
with each feature repeated once per block, and the output dists are the table-wise ones
(:class:`~shardkit.sharding.table_wise.PermuteRouting`). Blocks may be uneven and a rank may hold
several blocks of one table. The sharded module puts a feature's blocks back side by side in column
order (pooled: one column permutation of the concatenated output; sequence: ``split_sequence_rows``).

Optimizers: an element-wise rule (SGD, Adagrad, Adam) gives the unsharded result; row-wise Adagrad
keeps one accumulator per *block* row (the mean over the block's columns), as in torchrec, so it
differs from the unsharded table's.
"""

from __future__ import annotations

from shardkit.sharding.table_wise import TwPooledEmbeddingSharding, TwSequenceEmbeddingSharding


class CwPooledEmbeddingSharding(TwPooledEmbeddingSharding):
    """Column-wise pooled embeddings (the table-wise dists over column blocks)."""


class CwSequenceEmbeddingSharding(TwSequenceEmbeddingSharding):
    """Column-wise sequence embeddings (the table-wise dists over column blocks)."""


__all__ = ["CwPooledEmbeddingSharding", "CwSequenceEmbeddingSharding"]

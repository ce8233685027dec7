"""Grid sharding: a table's columns cut into blocks, each block's rows cut over the ranks of one node.

``grid_shard(host_indexes=[h0, h1, ...])`` puts column block ``j`` on node ``h_j`` and splits its rows
over that node's ranks, so a table too wide *and* too tall for one rank is spread over several nodes
while each id's partial sums are reduced inside one node.

Each column block is looked up and reduced exactly as a table-row-wise table of its own (its rows
over its node's ranks, its width the block's): :class:`GridPooledEmbeddingSharding` hands one
``ShardedTable`` per column block (same config, the block's shards) to table-row-wise sharding. The
features of a grid table therefore appear once per column block in the sharding's input, and its
output layout lists each feature's column blocks; the sharded module puts them side by side in
column order, as it does for column-wise tables.

Optimizers: element-wise rules (SGD, Adagrad, Adam) give the unsharded result; row-wise Adagrad keeps
one accumulator per row *and column block* (the mean over the block's columns), as column-wise
sharding does. Pooled tables only (``EmbeddingBagCollection``), as in torchrec.
"""

from __future__ import annotations

import dataclasses
from typing import List

from shardkit.sharding.embedding_sharding import ShardedTable
from shardkit.sharding.table_row_wise import TwRwPooledEmbeddingSharding


def column_block_tables(tables: List[ShardedTable]) -> List[ShardedTable]:
    """Each grid table as one table per column block (column order), holding that block's shards."""
    out = []
    for table in tables:
        blocks = sorted({(s.col_start, s.col_end) for s in table.shards})
        for c0, c1 in blocks:
            shards = [s for s in table.shards if (s.col_start, s.col_end) == (c0, c1)]
            out.append(dataclasses.replace(table, shards=shards))
    return out


class GridPooledEmbeddingSharding(TwRwPooledEmbeddingSharding):
    """Grid-sharded pooled embeddings: ``[B_me, sum of block widths]`` in :meth:`output_layout`.

    Raises ``ValueError`` for a column block whose row blocks are not all on one node. Construction
    is collective (it creates or fetches the node groups).
    """

    def __init__(self, tables: List[ShardedTable], *args, **kwargs) -> None:
        super().__init__(column_block_tables(tables), *args, **kwargs)


__all__ = ["GridPooledEmbeddingSharding", "column_block_tables"]

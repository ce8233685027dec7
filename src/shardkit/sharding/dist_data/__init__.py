"""Distribution modules: move features to the ranks that own their tables, and embeddings back.

One file per family: ``jagged_tensor_all_to_all`` for the rows of one JaggedTensor,
``kjt_all_to_all`` (+ ``kjt_splits``, ``recat``) for features, ``pooled`` and ``variable_batch`` for
pooled embeddings, ``sequence`` for sequence embeddings, ``kjt_one_to_all`` and ``all_to_one`` for
single-process multi-device inference, ``permute`` for reordering pooled feature blocks. See
docs/sharding.md.
"""

from shardkit.sharding.dist_data.all_to_one import (
    EmbeddingsAllToOne,
    EmbeddingsAllToOneReduce,
    SeqEmbeddingsAllToOne,
)
from shardkit.sharding.dist_data.jagged_tensor_all_to_all import JaggedTensorAllToAll
from shardkit.sharding.dist_data.kjt_all_to_all import (
    KJTAllToAll,
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
)
from shardkit.sharding.dist_data.kjt_one_to_all import KJTOneToAll
from shardkit.sharding.dist_data.permute import PermutePooledEmbeddings
from shardkit.sharding.dist_data.pooled import (
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsAwaitable,
    PooledEmbeddingsReduceScatter,
)
from shardkit.sharding.dist_data.recat import get_recat
from shardkit.sharding.dist_data.sequence import SequenceEmbeddingsAllToAll, SequenceEmbeddingsAwaitable
from shardkit.sharding.dist_data.variable_batch import (
    VariableBatchPooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsReduceScatter,
)

__all__ = [
    "EmbeddingsAllToOne",
    "EmbeddingsAllToOneReduce",
    "JaggedTensorAllToAll",
    "KJTAllToAll",
    "KJTAllToAllSplitsAwaitable",
    "KJTAllToAllTensorsAwaitable",
    "KJTOneToAll",
    "PermutePooledEmbeddings",
    "PooledEmbeddingsAllGather",
    "PooledEmbeddingsAllToAll",
    "PooledEmbeddingsAwaitable",
    "PooledEmbeddingsReduceScatter",
    "SeqEmbeddingsAllToOne",
    "SequenceEmbeddingsAllToAll",
    "SequenceEmbeddingsAwaitable",
    "VariableBatchPooledEmbeddingsAllToAll",
    "VariableBatchPooledEmbeddingsReduceScatter",
    "get_recat",
]

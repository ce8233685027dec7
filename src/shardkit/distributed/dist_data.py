"""torchrec's ``torchrec.distributed.dist_data`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.distributed.absent_names import absent
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
from shardkit.sharding.dist_data.pooled import (
    PooledEmbeddingsAllGather,
    PooledEmbeddingsAllToAll,
    PooledEmbeddingsAwaitable,
    PooledEmbeddingsReduceScatter,
)
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
    "PooledEmbeddingsAllGather",
    "PooledEmbeddingsAllToAll",
    "PooledEmbeddingsAwaitable",
    "PooledEmbeddingsReduceScatter",
    "SeqEmbeddingsAllToOne",
    "SequenceEmbeddingsAllToAll",
    "SequenceEmbeddingsAwaitable",
    "VariableBatchPooledEmbeddingsAllToAll",
    "VariableBatchPooledEmbeddingsReduceScatter",
]

# torchrec's names here that shardkit lacks: importing one is an ImportError naming it
__getattr__ = absent(__name__, ["SplitsAllToAllAwaitable"])

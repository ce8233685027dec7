"""Differentiable, asynchronous comm ops for sharded embeddings (the specification's ``comm_ops``).

Every op validates its arguments (across ranks when validation is on), starts one collective and
returns a ``Request`` (an ``Awaitable``) whose ``wait()`` gives the output. Each is differentiable:
its backward is the dual collective (all-to-all with swapped sizes; reduce-scatter <-> all-gather),
itself asynchronous, with the gradient divided by the world size while ``get_gradient_division()``
(default True). ``codecs`` (``shardkit.distributed.codecs.QuantizedCommCodecs``) choose the wire
precision of the forward data and of the gradients separately.

Modules: ``infos`` (the info dataclasses), ``exchange`` (the collectives with codecs and the
cross-rank size check), ``request`` (the Awaitable and the autograd Functions), ``alltoall`` and
``reduce_scatter`` (the ops). See docs/comm_ops.md.
"""

from shardkit.distributed.absent_names import absent
from shardkit.distributed.comm_ops.alltoall import (
    alltoall_sequence,
    alltoallv,
    variable_batch_alltoall_pooled,
)
from shardkit.distributed.comm_ops.infos import (
    All2AllPooledInfo,
    All2AllSequenceInfo,
    All2AllVInfo,
    AllGatherBaseInfo,
    ReduceScatterBaseInfo,
    ReduceScatterInfo,
    ReduceScatterVInfo,
    VariableBatchAll2AllPooledInfo,
)
from shardkit.distributed.comm_ops.pooled_alltoall import alltoall_pooled
from shardkit.distributed.comm_ops.reduce_scatter import (
    all_gather_base_pooled,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
)
from shardkit.distributed.comm_ops.request import Request, get_gradient_division, set_gradient_division

__all__ = [
    "All2AllPooledInfo",
    "All2AllSequenceInfo",
    "All2AllVInfo",
    "AllGatherBaseInfo",
    "ReduceScatterBaseInfo",
    "ReduceScatterInfo",
    "ReduceScatterVInfo",
    "Request",
    "VariableBatchAll2AllPooledInfo",
    "all_gather_base_pooled",
    "alltoall_pooled",
    "alltoall_sequence",
    "alltoallv",
    "get_gradient_division",
    "reduce_scatter_base_pooled",
    "reduce_scatter_pooled",
    "reduce_scatter_v_per_feature_pooled",
    "reduce_scatter_v_pooled",
    "set_gradient_division",
    "variable_batch_alltoall_pooled",
]

# torchrec's names here that shardkit lacks (its comm ops are autograd functions of another shape, see
# docs/distributed.md): importing one is an ImportError naming it
__getattr__ = absent(
    __name__,
    [
        "All2AllDenseInfo",
        "All2All_Pooled_Req",
        "All2All_Pooled_Wait",
        "All2All_Seq_Req",
        "All2All_Seq_Req_Wait",
        "All2Allv_Req",
        "All2Allv_Wait",
        "AllGatherBase_Req",
        "AllGatherBase_Wait",
        "ReduceScatterBase_Req",
        "ReduceScatterBase_Wait",
        "ReduceScatterV_Req",
        "ReduceScatterV_Wait",
        "ReduceScatter_Req",
        "ReduceScatter_Wait",
        "Variable_Batch_All2All_Pooled_Req",
        "Variable_Batch_All2All_Pooled_Wait",
    ],
)

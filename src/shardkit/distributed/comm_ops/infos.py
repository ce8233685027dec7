"""The specification's info dataclasses: what a comm op remembers between its forward and backward.

Each op builds one from its arguments before communicating; the backward reads the sizes it needs
from it. Sizes are in rows / elements of the op's input dtype, never in wire bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from shardkit.distributed.codecs import QuantizedCommCodecs


@dataclasses.dataclass
class All2AllPooledInfo:
    """``alltoall_pooled``: rank ``r`` has ``batch_size_per_rank[r]`` samples, ``dim_sum_per_rank[r]`` cols.

    ``dim_sum_per_rank_tensor`` / ``cumsum_dim_sum_per_rank_tensor`` are the specification's tensor
    forms for a fused recat kernel; the PyTorch implementation keeps them only for the caller.
    """

    batch_size_per_rank: list[int]
    dim_sum_per_rank: list[int]
    dim_sum_per_rank_tensor: Optional[torch.Tensor]
    cumsum_dim_sum_per_rank_tensor: Optional[torch.Tensor]
    codecs: Optional[QuantizedCommCodecs] = None


@dataclasses.dataclass
class VariableBatchAll2AllPooledInfo:
    """``variable_batch_alltoall_pooled``.

    ``batch_size_per_rank_per_feature[r][f]``: rank ``r``'s batch size of this rank's local feature
    ``f``; ``batch_size_per_feature_pre_a2a[g]``: this rank's batch size of global feature ``g``
    (features ordered by owning rank); ``emb_dim_per_rank_per_feature[r][f]``: the dimension of rank
    ``r``'s local feature ``f``. ``input_splits`` / ``output_splits``: elements sent to / received from
    each rank, filled in by the op.
    """

    batch_size_per_rank_per_feature: list[list[int]]
    batch_size_per_feature_pre_a2a: list[int]
    emb_dim_per_rank_per_feature: list[list[int]]
    codecs: Optional[QuantizedCommCodecs] = None
    input_splits: Optional[list[int]] = None
    output_splits: Optional[list[int]] = None


@dataclasses.dataclass
class All2AllSequenceInfo:
    """``alltoall_sequence``: splits are those of the sparse (ids) all-to-all this op answers.

    ``input_splits[r]``: ids this rank sent to rank ``r`` (embedding rows it receives back);
    ``output_splits[r]``: ids it received from rank ``r`` (embedding rows it sends back).
    ``permuted_lengths_after_sparse_data_all2all``: the lengths after the forward recat, filled in by
    the op and used by the backward recat.
    """

    embedding_dim: int
    lengths_after_sparse_data_all2all: torch.Tensor
    forward_recat_tensor: Optional[torch.Tensor]
    backward_recat_tensor: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    variable_batch_size: bool = False
    codecs: Optional[QuantizedCommCodecs] = None
    permuted_lengths_after_sparse_data_all2all: Optional[torch.Tensor] = None


@dataclasses.dataclass
class All2AllVInfo:
    """``alltoallv``: ``B_global`` rows per input are split over ranks as ``B_local_list``.

    ``dims_sum_per_rank[r]``: columns received from rank ``r``; ``B_local``: this rank's rows;
    ``D_local_list``: the columns of each local input; ``input_split_sizes`` /
    ``output_split_sizes``: elements sent to / received from each rank, filled in by the op.
    """

    dims_sum_per_rank: list[int]
    B_global: int
    B_local: int
    B_local_list: list[int]
    D_local_list: list[int]
    input_split_sizes: list[int] = dataclasses.field(default_factory=list)
    output_split_sizes: list[int] = dataclasses.field(default_factory=list)
    codecs: Optional[QuantizedCommCodecs] = None


@dataclasses.dataclass
class ReduceScatterInfo:
    """``reduce_scatter_pooled``: the sizes of the per-rank inputs, to shape their gradients."""

    input_sizes: list[torch.Size]
    codecs: Optional[QuantizedCommCodecs] = None


@dataclasses.dataclass
class ReduceScatterBaseInfo:
    """``reduce_scatter_base_pooled``: the size of the flat input (``world`` times the output's)."""

    input_sizes: torch.Size
    codecs: Optional[QuantizedCommCodecs] = None


@dataclasses.dataclass
class ReduceScatterVInfo:
    """``reduce_scatter_v_pooled`` / ``reduce_scatter_v_per_feature_pooled``.

    ``input_splits[r]``: the dim-0 size of rank ``r``'s chunk (the number of elements for the 1-D
    per-feature variant); ``input_sizes[r]``: that chunk's full size; ``equal_splits``: all chunks have
    one size; ``total_input_size``: the input's size.
    """

    input_sizes: list[list[int]]
    input_splits: list[int]
    equal_splits: bool
    total_input_size: list[int]
    codecs: Optional[QuantizedCommCodecs]


@dataclasses.dataclass
class AllGatherBaseInfo:
    """``all_gather_base_pooled``: the size of this rank's input (the output is ``world`` of them)."""

    input_size: torch.Size
    codecs: Optional[QuantizedCommCodecs] = None


__all__ = [
    "All2AllPooledInfo",
    "All2AllSequenceInfo",
    "All2AllVInfo",
    "AllGatherBaseInfo",
    "ReduceScatterBaseInfo",
    "ReduceScatterInfo",
    "ReduceScatterVInfo",
    "VariableBatchAll2AllPooledInfo",
]

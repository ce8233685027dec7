"""ShardedEmbeddingBagCollection and its sharder (the specification's ``embeddingbag``).

The sharded plain ``nn.EmbeddingBag`` (``ShardedEmbeddingBag`` / ``EmbeddingBagSharder``) is in
``embedding_bag_module.py``, built on this collection.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional, Tuple, Type

import torch

from shardkit.distributed.awaitable import Awaitable, LazyAwaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops.placement import ColumnPlacement
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels.column_copy import column_copier
from shardkit.modules import EmbeddingBagCollection, FusedOptimizerConfig
from shardkit.sharding.column_wise import CwPooledEmbeddingSharding
from shardkit.sharding.data_parallel import DpPooledEmbeddingSharding
from shardkit.sharding.embedding_sharder import BaseEmbeddingSharder
from shardkit.sharding.embedding_sharding import ColumnBlock
from shardkit.sharding.fused_optimizer_config import resolve_fused_optimizer
from shardkit.sharding.grid_sharding import GridPooledEmbeddingSharding
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.row_wise import RwPooledEmbeddingSharding
from shardkit.sharding.sharded_embedding_module import (
    EmbeddingModuleContext,
    ShardedEmbeddingModule,
)
from shardkit.sharding.table_column_wise import TwCwPooledEmbeddingSharding
from shardkit.sharding.table_row_wise import TwRwPooledEmbeddingSharding
from shardkit.sharding.table_wise import TwPooledEmbeddingSharding
from shardkit.sharding.types import (
    EmbeddingModuleShardingPlan,
    ShardingType,
)
from shardkit.sparse import KeyedTensor

POOLED_SHARDINGS = {
    ShardingType.DATA_PARALLEL.value: DpPooledEmbeddingSharding,
    ShardingType.TABLE_WISE.value: TwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: CwPooledEmbeddingSharding,
    ShardingType.ROW_WISE.value: RwPooledEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: TwRwPooledEmbeddingSharding,
    ShardingType.TABLE_COLUMN_WISE.value: TwCwPooledEmbeddingSharding,
    ShardingType.GRID_SHARD.value: GridPooledEmbeddingSharding,
}


def column_permutation(
    blocks: List[ColumnBlock], names: List[str], dims: Dict[str, int]
) -> Optional[List[int]]:
    """Index of each output column (features ``names`` in order, all their columns) among the
    concatenated ``blocks``; None when the blocks are already in that order."""
    where: Dict[tuple, int] = {}
    start = 0
    for feature, c0, c1 in blocks:
        for c in range(c0, c1):
            where[(feature, c)] = start + c - c0
        start += c1 - c0
    index = [where[(f, c)] for f in names for c in range(dims[f])]
    return None if index == list(range(len(index))) else index


def column_runs(permutation: List[int]) -> List[Tuple[int, int]]:
    """``permutation`` as ranges ``[start, end)`` of consecutive source columns, in output order."""
    runs: List[Tuple[int, int]] = []
    for column in permutation:
        if runs and runs[-1][1] == column:
            runs[-1] = (runs[-1][0], column + 1)
        else:
            runs.append((column, column + 1))
    return runs


def column_placement(permutation: List[int], dims_per_rank: List[int]) -> ColumnPlacement:
    """``permutation`` (see :func:`column_permutation`) of the rank-ordered columns of an all-to-all
    whose rank ``r`` computes ``dims_per_rank[r]`` columns, as a ``ColumnPlacement``: blocks of the
    largest width dividing every run edge and rank boundary."""
    bounds = [0, *itertools.accumulate(dims_per_rank)]
    edges = [edge for run in column_runs(permutation) for edge in run]
    width = math.gcd(*edges, *bounds) or 1
    output_of = [0] * len(permutation)
    for out_column, source in enumerate(permutation):
        output_of[source] = out_column
    dest = [
        [output_of[c] // width for c in range(bounds[r], bounds[r + 1], width)]
        for r in range(len(dims_per_rank))
    ]
    return ColumnPlacement(width, dest, column_copier())


class ColumnBlocks:
    """The column ranges ``runs`` (a permutation of all ``C`` columns, see :func:`column_runs`) as whole
    blocks: the ranges are cut into blocks of the largest width that divides every range boundary (a
    feature's dim, typically); ``order`` lists the source block of each output block, ``inverse`` the
    reverse. Depends on the plan only: built once per device, not per forward."""

    def __init__(self, runs: List[Tuple[int, int]], device: torch.device) -> None:
        self.width = math.gcd(*[edge for run in runs for edge in run])
        blocks = [b for start, end in runs for b in range(start // self.width, end // self.width)]
        self.order = torch.tensor(blocks, device=device)
        self.inverse = torch.empty_like(self.order).index_copy_(
            0, self.order, torch.arange(len(blocks), device=device)
        )


class _PermuteColumnRuns(torch.autograd.Function):
    """``[B, C]`` -> ``[B, C]`` with the column ranges of ``blocks`` (a :class:`ColumnBlocks`) in order.

    One ``index_select`` over the ``[B, C / width, width]`` view moves whole blocks: a copy at memcpy
    speed each way. (A per-column ``index_select`` gathers element by element and its backward
    scatters into zeros; slices + ``torch.cat`` under autograd zero a full-size gradient for every
    range.)
    """

    @staticmethod
    def forward(ctx, values: torch.Tensor, blocks: ColumnBlocks) -> torch.Tensor:
        ctx.blocks = blocks
        # explicit block count, not -1: a zero-sample batch ([0, C]) has no elements to infer it from
        blocks_view = values.view(values.size(0), values.size(1) // blocks.width, blocks.width)
        return blocks_view.index_select(1, blocks.order).view(values.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        width = ctx.blocks.width
        blocks_view = grad.view(grad.size(0), grad.size(1) // width, width)
        return blocks_view.index_select(1, ctx.blocks.inverse).view(grad.shape), None


class _PooledOutputAwaitable(LazyAwaitable[KeyedTensor]):
    """Waits each sharding's output dist and assembles the KeyedTensor of the unsharded module
    (columns put in the unsharded order by :class:`_PermuteColumnRuns`). ``layout`` is the module's
    ``(names, dims, offsets)``, checked once when the module was built."""

    def __init__(
        self,
        parts: List[Awaitable[torch.Tensor]],
        layout,
        runs: Optional[List[Tuple[int, int]]],
        blocks: Dict[torch.device, ColumnBlocks],
    ) -> None:
        """``runs`` None: the parts' columns are in the module's order already."""
        super().__init__()
        self._parts, self._layout, self._runs, self._blocks = parts, layout, runs, blocks

    def _wait_impl(self) -> KeyedTensor:
        tensors = [aw.wait() for aw in self._parts]
        values = torch.cat(tensors, dim=1) if len(tensors) > 1 else tensors[0]
        if self._runs is not None:
            blocks = self._blocks.get(values.device)
            if blocks is None:  # the module's cache, one entry per device
                blocks = self._blocks[values.device] = ColumnBlocks(self._runs, values.device)
            values = _PermuteColumnRuns.apply(values, blocks)
        names, dims, offsets = self._layout
        return KeyedTensor(names, dims, values, offset_per_key=list(offsets))


class ShardedEmbeddingBagCollection(ShardedEmbeddingModule):
    """An EmbeddingBagCollection whose tables are placed by a plan.

    forward(features: KeyedJaggedTensor of this rank's batch B_me, all features) ->
    ``LazyAwaitable[KeyedTensor]`` with the unsharded module's keys, key order and dims:
    ``values`` ``[B_me, sum of dims]``, equal to the unsharded module's rows of these samples.
    The tables' initial values are copied from ``module``. Every rank must call forward (and
    backward) the same number of times: each step runs collectives over the group.

    State: ``state_dict()`` has the unsharded module's keys, ``embedding_bags.<table>.weight``, each a
    DTensor or ShardedTensor of this rank's shards (see ``ShardedEmbeddingModule``).
    """

    table_key = "embedding_bags"
    sharding_classes = POOLED_SHARDINGS  # the quantized collection brings its own

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        on_meta = any(t.device.type == "meta" for t in itertools.chain(module.parameters(), module.buffers()))
        super().__init__(
            module.embedding_bag_configs(),
            table_name_to_parameter_sharding,
            env,
            True,
            self.sharding_classes,
            fused_optimizer or resolve_fused_optimizer(module, None),
            None if on_meta else module.table_weight,
            device,
            qcomm_codecs_registry,
            module.is_weighted(),
        )
        # one name per (table, feature), torchrec's: a feature's, or feature@table for one of several tables
        self._embedding_names = [f for t in self._tables for f in t.config.feature_names]
        self._dims = {f: t.config.embedding_dim for t in self._tables for f in t.config.feature_names}
        blocks = [block for s in self._shardings for block in s.output_layout()]
        permutation = column_permutation(blocks, self._embedding_names, self._dims)
        self._column_runs = None if permutation is None else column_runs(permutation)
        self._column_blocks: Dict[torch.device, ColumnBlocks] = {}
        dims = [self._dims[f] for f in self._embedding_names]
        self._layout = (self._embedding_names, dims, [0, *itertools.accumulate(dims)])
        # one table-/column-wise sharding: its all-to-all puts the columns in place as it assembles
        # them (the permutation costs no copy of its own, either way)
        self._placement: Optional[ColumnPlacement] = None
        only = self._shardings[0] if len(self._shardings) == 1 else None
        if permutation is not None and isinstance(only, TwPooledEmbeddingSharding):
            self._placement = column_placement(permutation, only.dims_per_rank())

    def compute(self, ctx: EmbeddingModuleContext, dist_input: KJTList) -> List[torch.Tensor]:
        return [
            s.compute(c, lk, kjt)
            for s, c, lk, kjt in zip(self._shardings, ctx.sharding_contexts, self.lookups, dist_input)
        ]

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        if self._placement is not None:
            return self._placed_output_dist(ctx, output[0])
        parts = [s.output_dist(c, out) for s, c, out in zip(self._shardings, ctx.sharding_contexts, output)]
        return self._assemble(parts)

    def compute_and_output_dist(
        self, ctx: EmbeddingModuleContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        if self._placement is not None:  # one sharding: its lookup, then its output dist
            return self._placed_output_dist(ctx, self.compute(ctx, input)[0])
        return self._assemble(self._compute_and_start(ctx, input))

    def _placed_output_dist(
        self, ctx: EmbeddingModuleContext, output: torch.Tensor
    ) -> LazyAwaitable[KeyedTensor]:
        sharding, sharding_ctx = self._shardings[0], ctx.sharding_contexts[0]
        part = sharding.output_dist(sharding_ctx, output, placement=self._placement)
        runs = None if sharding.placed(sharding_ctx) else self._column_runs
        return _PooledOutputAwaitable([part], self._layout, runs, self._column_blocks)

    def _assemble(self, parts: List[Awaitable[torch.Tensor]]) -> LazyAwaitable[KeyedTensor]:
        return _PooledOutputAwaitable(parts, self._layout, self._column_runs, self._column_blocks)


class EmbeddingBagCollectionSharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    """Shards an EmbeddingBagCollection: every sharding type, grid included; FUSED or DENSE kernels
    (DENSE only for data-parallel tables, whose gradients the model's data-parallel wrapper averages)."""

    @property
    def module_type(self) -> Type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(POOLED_SHARDINGS)

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedEmbeddingBagCollection:
        return ShardedEmbeddingBagCollection(
            module,
            self.plan_with_cache_params(params),
            env,
            device,
            self.qcomm_codecs_registry,
            self.fused_optimizer_for(module),
        )

    def shardable_parameters(self, module: EmbeddingBagCollection) -> Dict[str, torch.Tensor]:
        return {t.name: module.table_weight(t.name) for t in module.embedding_bag_configs()}


__all__ = ["EmbeddingBagCollectionSharder", "ShardedEmbeddingBagCollection", "column_permutation"]

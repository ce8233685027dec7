"""What every sharding type shares: the placed tables, the per-forward context, the sharding interface.

A sharded embedding module splits its tables by sharding type and hands each type's tables to one
``EmbeddingShardingImpl`` (``table_wise.TwPooledEmbeddingSharding``, ``row_wise.RwSequenceEmbeddingSharding``,
...). Each sharding builds the same three pieces (DESIGN.md, "data flow of a sharded embedding
module"):

- ``input_dist(ctx, features)``: the features of its tables (a KeyedJaggedTensor in
  :meth:`EmbeddingShardingImpl.feature_names` order, this rank's batch) -> ``Awaitable[Awaitable[KJT]]``
  of the features this rank's shards look up;
- ``compute(ctx, lookup, dist_input)``: the grouped lookup of this rank's shards
  (``embedding_lookup.ShardedGroupedLookup``);
- ``output_dist(ctx, local_out)``: the collective that sends the looked-up embeddings back to the ranks
  that own the samples -> ``Awaitable[Tensor]``.

Pooled shardings return ``[B_me, sum of output widths]`` whose column blocks :attr:`output_layout`
describes; sequence shardings return one ``[ids of the feature, embedding_dim]`` tensor per feature.

``EmbeddingShardingImpl`` is shardkit's internal interface (its contexts carry more than torchrec's);
torchrec's ``EmbeddingSharding`` interface, for user-written sharded modules, is in
``sharding_interface``, and ``sharding_factory`` offers these shardings behind it.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels.offload import OffloadSpec
from shardkit.modules.embedding_configs import BaseEmbeddingConfig
from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.modules.grouped_lookup import ShardSpec
from shardkit.sharding.dist_data import (
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
    SequenceEmbeddingsAllToAll,
)
from shardkit.sharding.dist_data.kjt_slots import SlotCapacity
from shardkit.sharding.offload_plan import offload_spec
from shardkit.sharding.types import CommOp, ParameterSharding, ShardingType
from shardkit.sparse import KeyedJaggedTensor


@dataclasses.dataclass(frozen=True)
class TableShard:
    """Rows ``[row_start, row_end)`` x columns ``[col_start, col_end)`` of a table, held by ``rank``."""

    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def empty(self) -> bool:
        return self.row_end <= self.row_start or self.col_end <= self.col_start


@dataclasses.dataclass
class ShardedTable:
    """A table config with its sharding type and its shards (plan order; DATA_PARALLEL: none)."""

    config: BaseEmbeddingConfig
    sharding_type: str
    compute_kernel: str
    shards: List[TableShard]
    # the backing tier of an offloading kernel (fused_uvm / fused_uvm_caching), else None
    offload: Optional[OffloadSpec] = None

    @property
    def name(self) -> str:
        return self.config.name

    def spec(self, shard: TableShard) -> ShardSpec:
        """The grouped lookup's view of ``shard`` (rows and columns of this table)."""
        return ShardSpec(self.config, shard.row_start, shard.row_end, shard.col_start, shard.col_end)


def sharded_table(config: BaseEmbeddingConfig, sharding: ParameterSharding, world_size: int) -> ShardedTable:
    """``config`` placed as ``sharding`` says; ``ValueError`` naming the table if it cannot be.

    Checks the plan against the table (``ParameterSharding.check``: ranks in range, shards tile the
    table) and the shape each type implies: TABLE_WISE one whole-table shard, ROW_WISE /
    TABLE_ROW_WISE full-width row blocks (at most one non-empty block per rank), COLUMN_WISE /
    TABLE_COLUMN_WISE full-height column blocks, GRID_SHARD column blocks of row blocks (at most one
    non-empty block per rank).
    No communication, so every rank reaches the same verdict from the same plan.
    """
    shape = (config.num_embeddings, config.embedding_dim)
    sharding.check(config.name, shape, world_size)
    kind = ShardingType(sharding.sharding_type)
    offload = offload_spec(config.name, sharding, config.data_type)
    if kind is ShardingType.DATA_PARALLEL:
        return ShardedTable(config, kind.value, sharding.compute_kernel, [])
    shards = [
        TableShard(
            s.rank,
            s.shard_offsets[0],
            s.shard_offsets[0] + s.shard_sizes[0],
            s.shard_offsets[1],
            s.shard_offsets[1] + s.shard_sizes[1],
        )
        for s in sharding.sharding_spec.shards
    ]
    rows, cols = shape
    full_height = all(s.row_start == 0 and s.row_end == rows for s in shards)
    full_width = all(s.col_start == 0 and s.col_end == cols for s in shards)
    if kind is ShardingType.TABLE_WISE and not (len(shards) == 1 and full_height and full_width):
        raise ValueError(f"table {config.name!r}: a table_wise sharding has one shard of the whole table")
    if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        if not full_width:
            raise ValueError(f"table {config.name!r}: {kind.value} shards must span all {cols} columns")
        holders = [s.rank for s in shards if not s.empty]
        if len(set(holders)) != len(holders):
            # a rank's partial sums of one feature are one block of the output: one row block per rank
            raise ValueError(f"table {config.name!r}: a rank holds two {kind.value} blocks (ranks {holders})")
    if kind in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE) and not full_height:
        raise ValueError(f"table {config.name!r}: {kind.value} shards must span all {rows} rows")
    if kind is ShardingType.GRID_SHARD:
        _check_grid(config.name, shards)
    return ShardedTable(config, kind.value, sharding.compute_kernel, shards, offload)


def _check_grid(name: str, shards: List[TableShard]) -> None:
    """A grid's shards are column blocks that do not overlap, each cut into row blocks; a rank holds at
    most one non-empty shard of the table (its row block of one column block)."""
    blocks = sorted({(s.col_start, s.col_end) for s in shards})
    if any(b0 < a1 for (_, a1), (b0, _) in zip(blocks, blocks[1:])):
        raise ValueError(f"table {name!r}: grid_shard column blocks {blocks} overlap")
    holders = [s.rank for s in shards if not s.empty]
    if len(set(holders)) != len(holders):
        raise ValueError(
            f"table {name!r}: a rank holds two grid_shard blocks (ranks {holders}); each column block "
            "goes to its own node (grid_shard(host_indexes=...) with distinct hosts)"
        )


@dataclasses.dataclass
class ShardingContext:
    """What one forward of one sharding carries from input_dist to output_dist.

    stride_per_rank: each rank's batch size (None with a variable batch per feature).
    input_splits / output_splits: ids sent to / received from each rank (the KJT all-to-all's "values").
    recat: the KJT all-to-all's reordering of received rows (``KJTAllToAllTensorsAwaitable.recat``).
    batch_size: this rank's batch size B_me.
    sent_lengths_per_key: ids per key of the KJT this rank sent (sequence outputs split by it).
    unbucketize: row-wise sequence: ``rows_in_input_order = returned.index_select(0, unbucketize)``.
    received: the KJT this rank's shards looked up.
    variable_batch: whether the input has a variable batch per feature; then
    inverse_indices: the input's ``[F, B_me]`` inverse indices (sample -> bag, per feature), and
    sent_batches: this rank's bags per sent key.
    input_counts: ids per feature of this sharding's input (row-wise sequence outputs split by it).
    mean_bag_lengths: row-wise pooled: ``[B_me]`` bag lengths of each MEAN feature of the input.
    input_verdict: the sharded module's input check (``input_checks.InputVerdict``), carried by this
        sharding's KJT all-to-all header (set by the module before ``input_dist``; None: not carried).
    """

    stride_per_rank: Optional[List[int]] = None
    input_splits: Optional[List[int]] = None
    output_splits: Optional[List[int]] = None
    recat: Optional[torch.Tensor] = None
    batch_size: int = 0
    sent_lengths_per_key: Optional[List[int]] = None
    unbucketize: Optional[torch.Tensor] = None
    received: Optional[KeyedJaggedTensor] = None
    variable_batch: bool = False
    inverse_indices: Optional[torch.Tensor] = None
    sent_batches: Optional[List[int]] = None
    input_counts: Optional[List[int]] = None
    mean_bag_lengths: Optional[Dict[str, torch.Tensor]] = None
    input_verdict: Optional[Any] = None

    def record_stream(self, stream: torch.Stream) -> None:
        for tensor in (self.recat, self.unbucketize):
            if tensor is not None:
                tensor.record_stream(stream)


def record_input(ctx: ShardingContext, features: KeyedJaggedTensor) -> None:
    """Record the batch size and, with a variable batch per feature, the input's inverse indices."""
    ctx.batch_size = features.stride()
    ctx.variable_batch = features.variable_stride_per_key()
    if ctx.variable_batch:
        if features.inverse_indices_or_none() is None:
            raise ValueError("a KeyedJaggedTensor with a variable batch per feature needs inverse_indices")
        ctx.inverse_indices = features.inverse_indices()[1]


def start_kjt_all_to_all(
    ctx: ShardingContext,
    pg: Optional[dist.ProcessGroup],
    send: KeyedJaggedTensor,
    splits: List[int],
    stagger: int = 1,
    need_recat: bool = False,
    slots: Optional[SlotCapacity] = None,
) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
    """Start ``KJTAllToAll(pg, splits, stagger)(send)``, recording into ``ctx`` what the output dist needs.

    ``need_recat`` (sequence shardings) reads the awaitable's ``recat`` once the KJT has arrived.
    ``slots``: the calling sharding's ``input_slots`` (the tensors then travel with the header: one
    collective per step at small batches; ``kjt_slots``).
    """
    ctx.sent_lengths_per_key = send.length_per_key()
    if ctx.variable_batch:
        ctx.sent_batches = send.stride_per_key()
    # the awaitable KJTAllToAll's forward returns, without constructing the nn.Module every step
    splits_awaitable = KJTAllToAllSplitsAwaitable(pg, send, list(splits), stagger, ctx.input_verdict, slots)

    def record(tensors: KJTAllToAllTensorsAwaitable) -> KJTAllToAllTensorsAwaitable:
        ctx.stride_per_rank = tensors.stride_per_rank
        ctx.input_splits = tensors.input_splits["values"]
        ctx.output_splits = tensors.output_splits["values"]

        # keep runs inside tensors.wait(), so a weak reference is alive then; a strong one made a cycle
        # (tensors -> its callbacks -> keep -> tensors) that kept ctx and the received KJT (the batch's
        # ids) alive until Python's garbage collector ran (docs/offload/memory.md)
        awaited = weakref.ref(tensors)

        def keep(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
            ctx.received = kjt
            if need_recat:
                ctx.recat = awaited().recat
            return kjt

        tensors.callbacks.append(keep)
        return tensors

    splits_awaitable.callbacks.append(record)
    return splits_awaitable


# (feature, first column, end column) of one block of a pooled output
ColumnBlock = Tuple[str, int, int]


class EmbeddingShardingImpl(abc.ABC):
    """The tables of one sharding type in one sharded module: input dist, lookup and output dist.

    Args:
        tables: the tables (all of this sharding's type), in the module's declaration order.
        env: the world (``env.process_group``, ``env.world_size``, ``env.rank``).
        pooled: bags (EmbeddingBagCollection) or one row per id (EmbeddingCollection).
        fused_optimizer: the optimizer applied in the lookups' backward (None: dense gradients).
        device: where this rank's shards live.
        qcomm_codecs_registry: ``CommOp`` value -> wire precision of that output dist (None: full).
        weighted: pool with the input's per-id weights.
    """

    def __init__(
        self,
        tables: List[ShardedTable],
        env: ShardingEnv,
        pooled: bool,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        weighted: bool = False,
    ) -> None:
        self.tables = list(tables)
        self.env = env
        self.pooled = pooled
        self.fused_optimizer = fused_optimizer
        self.device = device
        self.weighted = weighted
        self._codecs = dict(qcomm_codecs_registry or {})
        self._feature_names: List[str] = [f for t in self.tables for f in t.config.feature_names]
        # the slot capacity of this sharding's KJT all-to-all (if it makes one): the same on every rank
        self.input_slots = SlotCapacity()

    def feature_names(self) -> List[str]:
        """The input features of this sharding's tables, in order (the keys ``input_dist`` takes)."""
        return list(self._feature_names)

    @property
    def pg(self) -> Optional[dist.ProcessGroup]:
        return self.env.process_group

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype of every rank's lookup output (the tables' dtypes promoted): the output dists
        need the same dtype on every rank, also on ranks that hold no table or tables of one dtype."""
        return functools.reduce(torch.promote_types, [t.config.dtype for t in self.tables])

    def codecs(self, op: CommOp) -> Optional[QuantizedCommCodecs]:
        """The wire precision configured for ``op`` (None: full precision); the registry may key it by
        the op's value (shardkit) or its name (torchrec's ``get_qcomm_codecs_registry``)."""
        return self._codecs.get(op.value, self._codecs.get(op.name))

    @abc.abstractmethod
    def received_features(self) -> List[str]:
        """The feature of each key of the KJT this rank's lookup receives, in order."""

    @abc.abstractmethod
    def create_lookup(self) -> torch.nn.Module:
        """This rank's lookup module (holds this rank's shards); built once by the sharded module."""

    @abc.abstractmethod
    def input_dist(
        self, ctx: ShardingContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Start sending ``features`` (``feature_names`` order, this rank's batch) to the shards' ranks."""

    def compute(self, ctx: ShardingContext, lookup: torch.nn.Module, dist_input: KeyedJaggedTensor):
        """This rank's lookup of ``dist_input`` (pooled ``[rows, cols]`` or sequence ``[ids, width]``)."""
        return lookup(dist_input)

    @abc.abstractmethod
    def output_dist(self, ctx: ShardingContext, local_out):
        """Start sending ``local_out`` back: pooled -> ``Awaitable[[B_me, sum widths]]``, sequence ->
        ``Awaitable[Dict[feature, [ids, dim]]]``."""

    def sequence_output_dist(
        self,
        ctx: ShardingContext,
        local_out: torch.Tensor,
        splits: List[int],
        counts: List[int],
        keys: List[ColumnBlock],
        dims: Dict[str, int],
        unbucketize: Optional[torch.Tensor] = None,
    ) -> Awaitable[Dict[str, torch.Tensor]]:
        """Send looked-up rows ``[ids, width]`` back to the ranks their ids came from (the reverse of
        the KJT all-to-all with ``splits`` keys per rank), then split them into ``{feature: [ids, dim]}``
        by ``counts`` ids per key of ``keys``; ``unbucketize`` restores the input order of row-wise ids."""
        dist = SequenceEmbeddingsAllToAll(
            self.pg, splits, codecs=self.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
        )
        awaitable = dist(
            local_out,
            ctx.received.lengths(),
            ctx.input_splits,
            ctx.output_splits,
            unbucketize_permute_tensor=unbucketize,
            batch_size_per_rank=ctx.stride_per_rank,
            sparse_features_recat=ctx.recat,
        )
        return MappedAwaitable(awaitable, lambda rows: split_sequence_rows(rows, counts, keys, dims))

    def output_layout(self) -> List[ColumnBlock]:
        """Pooled: the column blocks of the output dist's result, in order (same on every rank)."""
        # only pooled shardings override this; a sequence sharding's output is a dict, not columns
        raise TypeError(f"{type(self).__name__} is a sequence sharding: its output has no column layout")


class MappedAwaitable(Awaitable):
    """``fn(inner.wait())``: post-processing attached to an awaitable without waiting for it."""

    def __init__(self, inner: Awaitable, fn) -> None:
        super().__init__()
        self._inner, self._fn = inner, fn

    def _wait_impl(self):
        return self._fn(self._inner.wait())


class CommOpGradientScaling(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale_gradient_factor`` (torchrec's
    ``embedding_lookup.CommOpGradientScaling``: e.g. ``1 / world_size`` on a replicated table whose
    gradient an all-reduce later sums)."""

    @staticmethod
    def forward(ctx, input_tensor: torch.Tensor, scale_gradient_factor: float) -> torch.Tensor:
        ctx.scale_gradient_factor = scale_gradient_factor
        return input_tensor.view_as(input_tensor)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output * ctx.scale_gradient_factor, None


def with_weights(kjt: KeyedJaggedTensor, weights: torch.Tensor) -> KeyedJaggedTensor:
    """``kjt`` with its weights replaced (everything else shared)."""
    return KeyedJaggedTensor(
        kjt.keys(),
        kjt.values(),
        weights,
        lengths=kjt.lengths(),
        stride=None if kjt.variable_stride_per_key() else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None,
        length_per_key=kjt.length_per_key(),
        inverse_indices=kjt.inverse_indices_or_none(),
        validate=False,
    )


def split_sequence_rows(
    rows: torch.Tensor, counts: List[int], keys: List[Tuple[str, int, int]], dims: Dict[str, int]
) -> Dict[str, torch.Tensor]:
    """Per-feature ``[ids, dim]`` rows from a sequence output dist's ``[sum counts, width]`` result.

    ``rows`` holds, key by key, ``counts[k]`` rows of which the first ``c1 - c0`` columns are columns
    ``[c0, c1)`` of feature ``keys[k] = (feature, c0, c1)``; a feature's column blocks (column-wise
    shards) are put side by side in column order.
    """
    pieces: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
    for (feature, c0, c1), part in zip(keys, rows.split(counts)):
        pieces.setdefault(feature, []).append((c0, part[:, : c1 - c0]))
    out = {}
    for feature, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        out[feature] = parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts], dim=1)
        if out[feature].size(1) != dims[feature]:
            raise RuntimeError(
                f"feature {feature!r}: column blocks give {out[feature].size(1)} of {dims[feature]}"
            )
    return out


__all__ = [
    "ColumnBlock",
    "EmbeddingShardingImpl",
    "MappedAwaitable",
    "CommOpGradientScaling",
    "ShardedTable",
    "ShardingContext",
    "TableShard",
    "record_input",
    "sharded_table",
    "split_sequence_rows",
    "start_kjt_all_to_all",
    "with_weights",
]

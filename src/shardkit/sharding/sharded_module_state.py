"""The state of a sharded embedding module: its tables and its fused optimizer, one value per table.

A rank's shards of a table live in its lookups' buffers (``embedding_lookup.ShardedGroupedLookup``:
one ``GroupedEmbeddingLookup`` per width and dtype, several tables' shards stacked in one buffer).
:class:`TableStates` finds, for every table, this rank's pieces of it in the order of the plan's
shards on this rank (``ShardLayout.local_metadata``), so that ``sharded_state`` can wrap them into one
DTensor / ShardedTensor per table (docs/sharded_state.md). Shards the plan leaves empty on this rank
are held by no lookup; they get empty tensors, because the layout still counts them.

:class:`ShardedFusedOptimizer` gives the fused optimizer's state in the same layout: one value per
table and state name, so a rank holding several column blocks of one table (several shards of it,
possibly in different buffers) saves each block at its own place instead of one overwriting another.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from shardkit.modules.fused_optimizer_state import FusedOptimizer
from shardkit.modules.fused_optimizers import FusedOptimizerConfig, _state_shapes
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup
from shardkit.modules.optimizer_facade import LearningRateGroup, OptimizerFacade
from shardkit.sharding.embedding_sharding import ShardedTable
from shardkit.sharding.sharded_state import full_table, load_full_table, load_state_value, to_state_value
from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sharding.state_chunks import chunked_layout, chunked_local
from shardkit.sharding.state_layout import ShardLayout, row_state_layout, table_layout
from shardkit.sharding.types import EmbeddingComputeKernel, EmbeddingModuleShardingPlan

# where a shard lives: (the grouped lookup whose buffer holds it, its index there); None: empty shard
Piece = Optional[Tuple[GroupedEmbeddingLookup, int]]


def _shard_key(name: str, md: ShardMetadata) -> Tuple[str, int, int, int, int]:
    (r0, c0), (rows, cols) = md.shard_offsets, md.shard_sizes
    return (name, r0, r0 + rows, c0, c0 + cols)


def _empty(layout: ShardLayout, md: ShardMetadata, dtype: torch.dtype) -> torch.Tensor:
    # the layout's device for the shard: ShardedTensor checks that a local shard sits where it says
    return torch.empty(layout.local_shape(md), dtype=dtype, device=torch.device(md.device))


class TableStates:
    """Per table: its layout and this rank's pieces, from the plan and the module's lookups.

    Args:
        tables: the placed tables, in declaration order.
        plan: table name -> ``ParameterSharding``.
        world_size, rank: the world's (state values support the default group only: their
            placements name global ranks).
        lookups: the sharded module's ``ShardedGroupedLookup`` s.
    """

    def __init__(
        self,
        tables: List[ShardedTable],
        plan: EmbeddingModuleShardingPlan,
        world_size: int,
        rank: int,
        lookups: List[Any],
    ) -> None:
        self.rank = rank
        self.tables = {t.name: t for t in tables}
        shape = {t.name: (t.config.num_embeddings, t.config.embedding_dim) for t in tables}
        self.layouts: Dict[str, ShardLayout] = {
            t.name: table_layout(t.name, plan[t.name], shape[t.name], world_size) for t in tables
        }
        self.row_layouts: Dict[str, ShardLayout] = {
            t.name: row_state_layout(t.name, plan[t.name], shape[t.name], world_size) for t in tables
        }
        where: Dict[Tuple[str, int, int, int, int], Tuple[GroupedEmbeddingLookup, int]] = {}
        for lookup in lookups:
            for group, placed in zip(lookup.lookups, lookup.placed):
                for i, (table, shard) in enumerate(placed):
                    where[(table.name, shard.row_start, shard.row_end, shard.col_start, shard.col_end)] = (
                        group,
                        i,
                    )
        self.pieces: Dict[str, List[Piece]] = {
            name: [where.get(_shard_key(name, md)) for md in layout.local_metadata(rank)]
            for name, layout in self.layouts.items()
        }

    def weights(self, name: str) -> List[torch.Tensor]:
        """This rank's shards of table ``name`` (views of the lookups' buffers; empty shards as empty
        tensors), in ``local_metadata`` order."""
        layout = self.layouts[name]
        dtype = self.tables[name].config.dtype
        return [
            _empty(layout, md, dtype) if piece is None else piece[0].shard_rows(piece[1])
            for piece, md in zip(self.pieces[name], layout.local_metadata(self.rank))
        ]

    def streamed(self, name: str, pieces: List[torch.Tensor], layout: ShardLayout, dtype: torch.dtype):
        """``(pieces, layout)`` as a state value holds them: an offloaded table's cut into row chunks
        (``state_chunks``: a checkpoint streams it), any other table's unchanged."""
        if self.tables[name].offload is None:
            return pieces, layout
        return chunked_local(pieces, layout, self.rank, dtype), chunked_layout(layout, dtype)

    def state_value(self, name: str):
        dtype = self.tables[name].config.dtype
        pieces, layout = self.streamed(name, self.weights(name), self.layouts[name], dtype)
        return to_state_value(pieces, layout, dtype)

    def load_value(self, name: str, value) -> None:
        dtype = self.tables[name].config.dtype
        load_state_value(value, *self.streamed(name, self.weights(name), self.layouts[name], dtype))

    def full(self, name: str, dst: Optional[int] = None) -> Optional[torch.Tensor]:
        return full_table(self.weights(name), self.layouts[name], dst)

    def load_full(self, name: str, full: torch.Tensor) -> None:
        load_full_table(full, self.weights(name), self.layouts[name], self.rank)


class ShardedFusedOptimizer(OptimizerFacade):
    """The fused optimizer of a sharded module's shards: learning rate and a per-table state dict.

    A ``torch.optim.Optimizer`` for LR schedulers: ``param_groups`` is one group whose ``"lr"`` is the
    learning rate the next backward uses (``state`` is empty: the state is per table).

    ``state_dict()``: ``{"state": {table: {"step": int, name: value}}, "lr": float}`` for every table
    of a fused kernel (also those this rank holds no shard of, so every rank has the same keys; a
    rank holding no fused-kernel shard at all has no ``"step"``, which it cannot know), each
    ``value`` a DTensor / ShardedTensor (``sharded_state.to_state_value``) aliasing the optimizer's
    fp32 state: per-element state (Adagrad ``sum``, Adam ``exp_avg`` / ``exp_avg_sq``) in the table's
    layout, per-row state (row-wise Adagrad ``sum``) in ``row_state_layout``. ``load_state_dict``
    accepts such values (e.g. filled by ``dcp.load``) or plain full tensors of the global shape.
    The update itself runs in backward; ``step`` / ``zero_grad`` do nothing.

    Args:
        config: the module's fused optimizer config.
        groups: the ``GroupedEmbeddingLookup`` s of this rank's fused-kernel shards; empty on a rank
            that holds none (its state dict still names every fused table, with empty values, so
            that every rank saves and loads the same keys).
        states: the module's :class:`TableStates`.
    """

    def __init__(
        self, config: FusedOptimizerConfig, groups: List[GroupedEmbeddingLookup], states: TableStates
    ) -> None:
        super().__init__()
        self._fused = FusedOptimizer(config, groups)
        self._states = states
        self._tables = [
            name
            for name, table in states.tables.items()
            if table.compute_kernel != EmbeddingComputeKernel.DENSE.value
        ]
        # state names and whether per row (every buffer has the same kind of state)
        self._kinds = {name: len(shape) == 1 for name, shape in _state_shapes(config.optimizer, 1, 1).items()}
        self._groups = groups
        self.state = {}
        # a rank without buffers keeps the learning rate in its group only
        self.param_groups = [LearningRateGroup(self.set_learning_rate, config.lr)]

    @property
    def config(self) -> FusedOptimizerConfig:
        return self._fused.config

    @property
    def lr(self) -> float:
        return self._fused.lr if self._groups else self.param_groups[0]["lr"]

    def set_learning_rate(self, lr: float) -> None:
        if self._groups:
            self._fused.set_learning_rate(lr)
        elif lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.param_groups[0].show(lr)

    def step(self) -> None:
        """No-op: the update already happened during backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: fused tables never hold a gradient."""

    def _step_count(self) -> Optional[int]:
        # every buffer steps once per backward (its lookup output is always in the graph); a rank
        # without buffers does not know the step (None)
        if not self._groups:
            return None
        steps = {g.optimizer.step_count for g in self._groups}
        if len(steps) != 1:
            rank = self._states.rank
            raise RuntimeError(f"the fused buffers on rank {rank} have step counts {sorted(steps)}")
        return steps.pop()

    def _local(self, table: str, state: str) -> Tuple[List[torch.Tensor], ShardLayout]:
        """This rank's pieces of optimizer state ``state`` of ``table`` and their layout."""
        per_row = self._kinds[state]
        layout = (self._states.row_layouts if per_row else self._states.layouts)[table]
        pieces = []
        for piece, md in zip(self._states.pieces[table], layout.local_metadata(self._states.rank)):
            if piece is None:
                pieces.append(_empty(layout, md, torch.float32))
                continue
            group, i = piece
            start, end = group.row_offsets[i], group.row_offsets[i + 1]
            pieces.append(group.optimizer.state_slices(start, end)[state])
        return pieces, layout

    def state_dict(self) -> Dict[str, Any]:
        step = self._step_count()
        state: Dict[str, Dict[str, Any]] = {}
        for table in self._tables:
            entry: Dict[str, Any] = {} if step is None else {"step": step}
            for name in self._kinds:
                pieces, layout = self._states.streamed(table, *self._local(table, name), torch.float32)
                entry[name] = to_state_value(pieces, layout, torch.float32)
            state[table] = entry
        return {"state": state, "lr": self.lr}

    def check_state_dict(self, state_dict: Dict[str, Any]) -> List[str]:
        """What would make :meth:`load_state_dict` refuse ``state_dict`` (a missing table or state, a
        global shape that differs, step counts that differ, a negative lr), found without writing."""
        tables = state_dict["state"]
        problems = [f"fused optimizer state has no table(s) {[t for t in self._tables if t not in tables]}"]
        if all(t in tables for t in self._tables):
            problems = []
        steps = {int(tables[t]["step"]) for t in self._tables if t in tables and "step" in tables[t]}
        if len(steps) > 1:
            problems.append(f"fused optimizer state: the tables' step counts differ: {sorted(steps)}")
        for table in (t for t in self._tables if t in tables):
            for name in self._kinds:
                if name not in tables[table]:
                    problems.append(f"fused optimizer state of table {table!r} has no {name!r}")
                    continue
                value = tables[table][name]
                shape = tuple(value.metadata().size if isinstance(value, ShardedTensor) else value.shape)
                expected = tuple(self._local(table, name)[1].global_shape)
                if shape != expected:
                    problems.append(
                        f"fused optimizer state {name!r} of table {table!r} has shape {list(shape)}, "
                        f"the table's is {list(expected)}"
                    )
        if float(state_dict.get("lr", self.lr)) < 0:
            problems.append(f"learning rate must be >= 0, got {state_dict['lr']}")
        return problems

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` (same or full-tensor values) into the optimizer state.

        Raises ``KeyError`` for a missing table or state, ``ValueError`` for a wrong shape or tables
        whose steps differ (they are stepped together)."""
        tables = state_dict["state"]
        missing = [t for t in self._tables if t not in tables]
        if missing:
            raise KeyError(f"fused optimizer state has no table(s) {missing}")
        problems = self.check_state_dict(state_dict)
        if problems:
            raise ValueError("; ".join(problems))
        steps = {int(tables[t]["step"]) for t in self._tables if "step" in tables[t]}
        for table in self._tables:
            for name in self._kinds:
                pieces, layout = self._states.streamed(table, *self._local(table, name), torch.float32)
                load_state_value(tables[table][name], pieces, layout)
        if steps:
            step = steps.pop()
            for group in self._groups:
                group.optimizer.step_count = step
        self.set_learning_rate(float(state_dict.get("lr", self.lr)))


__all__ = ["ShardedFusedOptimizer", "TableStates"]

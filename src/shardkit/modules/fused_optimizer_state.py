"""The fused optimizer of a collection, seen per table: learning rate and a state dict.

The update itself runs inside each group's backward (:mod:`shardkit.modules.fused_optimizers`);
this object is how a training loop reaches it: read or set the learning rate, and save / load the
state under table names (``{"state": {table: {"step": int, "sum": Tensor, ...}}, "lr": float}``),
independent of how tables are grouped into buffers. ``step()`` and ``zero_grad()`` do nothing, so it
can sit in a loop next to dense optimizers.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from shardkit.modules.fused_optimizers import FusedOptimizerConfig, SparseRowOptimizer
from shardkit.modules.optimizer_facade import LearningRateGroup, OptimizerFacade


class FusedOptimizer(OptimizerFacade):
    """Per-table access to the fused optimizers of a list of grouped lookups (all with one config).

    A ``torch.optim.Optimizer`` for LR schedulers: ``param_groups`` is one group whose ``"lr"`` is the
    learning rate the next backward uses (``state`` is empty: the state is per table, see
    :meth:`state_dict`).
    """

    def __init__(self, config: FusedOptimizerConfig, lookups: List[Any]) -> None:
        super().__init__()
        self.config = config
        self._lookups = lookups  # GroupedEmbeddingLookup; typed Any to keep this file import-light
        self.state = {}
        self.param_groups = [LearningRateGroup(self.set_learning_rate, config.lr)]

    def _optimizers(self) -> List[SparseRowOptimizer]:
        return [lookup.optimizer for lookup in self._lookups]

    @property
    def lr(self) -> float:
        return self._optimizers()[0].lr

    def set_learning_rate(self, lr: float) -> None:
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        for optimizer in self._optimizers():
            optimizer.lr = lr
        self.param_groups[0].show(lr)

    def step(self) -> None:
        """No-op: the update already happened during backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: fused tables never hold a gradient."""

    def state_dict(self) -> Dict[str, Any]:
        """``{"state": {table: {"step": int, name: fp32 view [rows, ...]}}, "lr": float}`` (no copies)."""
        state: Dict[str, Dict[str, Any]] = {}
        for lookup in self._lookups:
            opt = lookup.optimizer
            for i, shard in enumerate(lookup.shards):
                start, end = lookup.row_offsets[i], lookup.row_offsets[i + 1]
                state[shard.table_name] = {"step": opt.step_count, **opt.state_slices(start, end)}
        return {"state": state, "lr": self.lr}

    def check_state_dict(self, state_dict: Dict[str, Any]) -> List[str]:
        """What would make :meth:`load_state_dict` refuse ``state_dict``, found without writing."""
        tables = state_dict["state"]
        problems = []
        for lookup in self._lookups:
            opt = lookup.optimizer
            steps = set()
            for i, shard in enumerate(lookup.shards):
                if shard.table_name not in tables:
                    problems.append(f"fused optimizer state has no table '{shard.table_name}'")
                    continue
                saved = tables[shard.table_name]
                steps.add(int(saved["step"]))
                start, end = lookup.row_offsets[i], lookup.row_offsets[i + 1]
                for name, target in opt.state_slices(start, end).items():
                    if name not in saved or tuple(saved[name].shape) != tuple(target.shape):
                        problems.append(
                            f"fused optimizer state of table '{shard.table_name}': expected '{name}' of "
                            f"shape {tuple(target.shape)}"
                        )
            if len(steps) > 1:
                problems.append(f"tables sharing one buffer must share one step count, got {sorted(steps)}")
        if float(state_dict.get("lr", self.lr)) < 0:
            problems.append(f"learning rate must be >= 0, got {state_dict['lr']}")
        return problems

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` back; every table must be present with matching shapes
        (``ValueError`` naming what is not, raised before anything is written)."""
        problems = self.check_state_dict(state_dict)
        if problems:
            raise ValueError("; ".join(problems))
        tables = state_dict["state"]
        for lookup in self._lookups:
            opt = lookup.optimizer
            steps = set()
            for i, shard in enumerate(lookup.shards):
                saved = tables[shard.table_name]
                steps.add(int(saved["step"]))
                start, end = lookup.row_offsets[i], lookup.row_offsets[i + 1]
                for name, target in opt.state_slices(start, end).items():
                    with torch.no_grad():
                        target.copy_(saved[name])
            if steps:
                opt.step_count = steps.pop()
        self.set_learning_rate(float(state_dict.get("lr", self.lr)))

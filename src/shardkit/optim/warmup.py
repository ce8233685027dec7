"""torchrec's learning-rate warm-up (``torchrec.optim.warmup``): ``WarmupOptimizer``, ``WarmupStage``,
``WarmupPolicy``.

A ``WarmupOptimizer`` wraps an optimizer and, after each of its steps, sets ``lr x multiplier`` as the
learning rate of every param group. The multiplier comes from the stage the step count is in: stages
run back to back, stage ``i`` until step ``stages[i].max_iters`` (strictly increasing), then a last
stage of multiplier 1 forever. ``iter`` below is the global step count (it does not restart per
stage); every multiplier is then scaled by the stage's ``lr_scale``:

- NONE: 1; LINEAR: ``value + (1 - value) * iter / max_iters``; CONSTANT: ``value``;
- POLY: ``(1 - iter / decay_iters) ** value``; STEP: ``value ** (iter // decay_iters)``;
- INVSQRT: ``1 / sqrt(iter)``;
- COSINE_ANNEALING_WARM_RESTARTS: ``value + (1 - value) * (1 + cos(pi * (iter % sgdr_period) /
  sgdr_period)) / 2`` (``value`` is the floor);
- INTERPOLATE: from ``value`` at ``start_interpolating_iters`` linearly to ``end_value`` at
  ``max_iters``.

``decay_iters`` <= 0 means ``max_iters`` (STEP: 1). The learning rate is set at construction too (step
0), so fused tables, which update in the backward before the first ``step()``, start warmed up.

The step count and stage live in the state dict under ``param_name`` (``{"warmup": tensor([iter,
stage])}``): inside ``"state"`` when the wrapped optimizer's state dict has one keyed by parameter
name (a ``KeyedOptimizer``, as torchrec), else at the top level (a ``CombinedOptimizer``, whose
state dict is one entry per optimizer). Loading a state dict restores the learning rate of the
loaded step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from shardkit.modules.optimizer_facade import OptimizerFacade


@enum.unique
class WarmupPolicy(enum.Enum):
    """How a stage's multiplier changes with the step count (module doc)."""

    NONE = "none"
    LINEAR = "linear"
    CONSTANT = "constant"
    POLY = "poly"
    STEP = "step"
    INVSQRT = "inv_sqrt"
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"
    INTERPOLATE = "interpolate"


@dataclasses.dataclass
class WarmupStage:
    """One stage: its policy, the step it ends at and the policy's parameters (module doc)."""

    policy: WarmupPolicy = WarmupPolicy.LINEAR
    max_iters: int = 1
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1
    sgdr_period: int = 1
    start_interpolating_iters: Optional[int] = None
    end_value: Optional[float] = None


_FOREVER = WarmupStage(policy=WarmupPolicy.NONE, max_iters=1 << 63, value=1.0)


def _checked_stages(stages: List[WarmupStage]) -> List[WarmupStage]:
    """Copies of ``stages`` with their default ``decay_iters`` filled in, then the last stage;
    ``ValueError`` naming the stage for an order or parameter that cannot work."""
    out, previous_end = [], 0
    for i, stage in enumerate(stages):
        if stage.max_iters <= previous_end:
            raise ValueError(
                f"warm-up stage {i}: max_iters {stage.max_iters} must be greater than the previous "
                f"stage's {previous_end}"
            )
        if stage.policy is WarmupPolicy.INTERPOLATE:
            start = stage.start_interpolating_iters
            if start is None or stage.end_value is None:
                raise ValueError(
                    f"warm-up stage {i}: INTERPOLATE needs start_interpolating_iters and end_value"
                )
            if stage.max_iters <= start:
                raise ValueError(
                    f"warm-up stage {i}: max_iters {stage.max_iters} must be greater than "
                    f"start_interpolating_iters {start}"
                )
        if stage.decay_iters <= 0:
            decay = 1 if stage.policy is WarmupPolicy.STEP else stage.max_iters
            stage = dataclasses.replace(stage, decay_iters=decay)
        out.append(stage)
        previous_end = stage.max_iters
    return out + [_FOREVER]


def multiplier(stage: WarmupStage, iteration: int) -> float:
    """The learning-rate multiplier of ``stage`` at global step ``iteration`` (module doc)."""
    p, value = stage.policy, stage.value
    if p is WarmupPolicy.LINEAR:
        m = value + (1.0 - value) * iteration / stage.max_iters
    elif p is WarmupPolicy.CONSTANT:
        m = value
    elif p is WarmupPolicy.POLY:
        m = math.pow(1.0 - iteration / stage.decay_iters, value)
    elif p is WarmupPolicy.STEP:
        m = math.pow(value, iteration // stage.decay_iters)
    elif p is WarmupPolicy.INVSQRT:
        m = 1.0 / math.sqrt(iteration)
    elif p is WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:
        phase = (iteration % stage.sgdr_period) / stage.sgdr_period
        m = value + (1.0 - value) * 0.5 * (1.0 + math.cos(math.pi * phase))
    elif p is WarmupPolicy.INTERPOLATE:
        start = float(stage.start_interpolating_iters)
        m = value + (stage.end_value - value) * (iteration - start) / (stage.max_iters - start)
    else:
        m = 1.0
    return m * stage.lr_scale


class WarmupOptimizer(OptimizerFacade):
    """Sets the learning rate of ``optimizer`` by warm-up stages (module doc).

    Args:
        optimizer: any optimizer with ``param_groups`` (a ``KeyedOptimizer``, a ``CombinedOptimizer``
            with fused tables, a torch optimizer).
        stages: the stages, in order.
        lr: the base learning rate the multipliers scale.
        lr_param: the param-group entry to set.
        param_name: the state-dict name of the warm-up state.
    """

    def __init__(
        self,
        optimizer: Any,
        stages: List[WarmupStage],
        lr: float = 0.1,
        lr_param: str = "lr",
        param_name: str = "__warmup",
    ) -> None:
        super().__init__()
        self._optimizer = optimizer
        self._stages = _checked_stages(list(stages))
        self._lr, self._lr_param, self._param_name = lr, lr_param, param_name
        self._iter, self._stage = 0, 0
        self._set_lr()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        return getattr(self._optimizer, "state", {})

    @property
    def params(self) -> Dict[str, Any]:
        return getattr(self._optimizer, "params", {})

    @property
    def warmup_state(self) -> Tuple[int, int]:
        """(global step count, stage index)."""
        return self._iter, self._stage

    def _set_lr(self) -> None:
        lr = self._lr * multiplier(self._stages[self._stage], self._iter)
        for group in self.param_groups:
            group[self._lr_param] = lr

    def step(self, closure: Any = None) -> Any:
        out = self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        self._iter += 1
        if self._iter > self._stages[self._stage].max_iters and self._stage + 1 < len(self._stages):
            self._stage += 1
        self._set_lr()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        inner = dict(self._optimizer.state_dict())
        entry = {"warmup": torch.tensor([self._iter, self._stage], dtype=torch.long)}
        if isinstance(inner.get("state"), dict):
            inner["state"] = {**inner["state"], self._param_name: entry}
        else:
            inner[self._param_name] = entry
        return inner

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        inner = dict(state_dict)
        if isinstance(inner.get("state"), dict) and self._param_name in inner["state"]:
            inner["state"] = dict(inner["state"])
            entry = inner["state"].pop(self._param_name)
        elif self._param_name in inner:
            entry = inner.pop(self._param_name)
        else:
            raise KeyError(f"WarmupOptimizer.load_state_dict: no warm-up state {self._param_name!r}")
        self._optimizer.load_state_dict(inner)
        self._iter, self._stage = (int(v) for v in torch.as_tensor(entry["warmup"]).tolist())
        self._set_lr()

    def __repr__(self) -> str:
        return f"WarmupOptimizer(step {self._iter}, stage {self._stage}, {self._optimizer!r})"


__all__ = ["WarmupOptimizer", "WarmupPolicy", "WarmupStage", "multiplier"]

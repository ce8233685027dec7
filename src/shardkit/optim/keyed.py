"""torchrec's keyed optimizers: ``CombinedOptimizer`` (several optimizers stepped, zeroed, saved and
loaded as one) and ``KeyedOptimizerWrapper`` (a torch optimizer over a dict of named parameters);
``KeyedOptimizer`` and ``OptimizerWrapper`` live in :mod:`shardkit.optim.keyed_optimizer` and are
importable from here, torchrec's module.

A model under ``DistributedModelParallel`` is trained by two kinds of optimizer: the fused optimizers of
the sharded tables (their update already ran inside backward; ``step`` does nothing) and a regular
``torch.optim`` optimizer of the dense, data-parallel parameters. A training loop or a train pipeline
takes one optimizer; this class is that one.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple, Union

import torch

from shardkit.modules.optimizer_facade import OptimizerFacade
from shardkit.optim.keyed_optimizer import KeyedOptimizer, OptimizerWrapper

Named = Tuple[str, Any]


class CombinedOptimizer(OptimizerFacade):
    """Steps, zeroes, saves and loads a list of optimizers, each under a key.

    Args:
        optimizers: optimizers (``torch.optim.Optimizer``, ``FusedOptimizer``, another
            ``CombinedOptimizer``, anything with ``step`` / ``zero_grad`` / ``state_dict`` /
            ``load_state_dict``), each optionally as ``(key, optimizer)``. Unnamed ones are keyed by
            their position (``"0"``, ``"1"``, ...). Keys must be unique.

    ``state_dict()`` is ``{key: optimizer.state_dict()}``; ``load_state_dict`` needs every key.
    ``param_groups`` are its optimizers' groups (the same dicts, in order) and ``state`` their states
    merged, so a torch LR scheduler given a ``CombinedOptimizer`` schedules every part, the fused
    tables' learning rate included (their groups pass ``"lr"`` on).
    """

    def __init__(self, optimizers: Sequence[Union[Any, Named]]) -> None:
        super().__init__()
        named: List[Named] = []
        for i, entry in enumerate(optimizers):
            key, optimizer = entry if isinstance(entry, tuple) else (str(i), entry)
            named.append((key, optimizer))
        keys = [k for k, _ in named]
        if len(set(keys)) != len(keys):
            raise ValueError(f"CombinedOptimizer: repeated keys in {keys}")
        self._optimizers = named

    @property
    def optimizers(self) -> List[Named]:
        """``(key, optimizer)`` in order."""
        return list(self._optimizers)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return [group for _, opt in self._optimizers for group in getattr(opt, "param_groups", [])]

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        return {p: s for _, opt in self._optimizers for p, s in getattr(opt, "state", {}).items()}

    def step(self, closure: Any = None) -> None:
        """Step every optimizer, in order (a closure is not supported: it would run once per optimizer)."""
        if closure is not None:
            raise ValueError("CombinedOptimizer.step does not take a closure")
        for _, optimizer in self._optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {key: optimizer.state_dict() for key, optimizer in self._optimizers}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        missing = [key for key, _ in self._optimizers if key not in state_dict]
        unexpected = [key for key in state_dict if key not in dict(self._optimizers)]
        if missing or unexpected:
            raise KeyError(
                f"CombinedOptimizer.load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        for key, optimizer in self._optimizers:
            optimizer.load_state_dict(state_dict[key])

    def __repr__(self) -> str:
        inner = ", ".join(f"{key}: {type(opt).__name__}" for key, opt in self._optimizers)
        return f"CombinedOptimizer({inner})"


class KeyedOptimizerWrapper:
    """A torch optimizer over named parameters, as torchrec's ``KeyedOptimizerWrapper``.

    Args:
        params: ``{name: parameter}`` (e.g. ``dict(in_backward_optimizer_filter(model.named_parameters()))``).
        optim_factory: builds the optimizer from the list of parameters
            (``lambda params: torch.optim.Adagrad(params, lr=0.1)``).

    ``state_dict()`` keys the per-parameter state by parameter name (``{"state": {name: ...},
    "param_groups": [...]}``), so that it survives a change of parameter order.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        optim_factory: Callable[[List[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        self.params: Dict[str, torch.Tensor] = dict(params)
        self._names = list(self.params)
        self._optimizer = optim_factory(list(self.params.values()))

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self._optimizer.param_groups

    @property
    def state(self) -> Dict[torch.Tensor, Any]:
        return self._optimizer.state

    def step(self, closure: Any = None) -> Any:
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        inner = self._optimizer.state_dict()
        return {
            "state": {self._names[i]: s for i, s in inner["state"].items()},
            "param_groups": inner["param_groups"],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        unknown = [name for name in state_dict["state"] if name not in self.params]
        if unknown:
            raise KeyError(f"KeyedOptimizerWrapper.load_state_dict: unknown parameter(s) {unknown}")
        index = {name: i for i, name in enumerate(self._names)}
        inner = {
            "state": {index[n]: s for n, s in state_dict["state"].items()},
            "param_groups": state_dict["param_groups"],
        }
        self._optimizer.load_state_dict(inner)

    def __repr__(self) -> str:
        return f"KeyedOptimizerWrapper({type(self._optimizer).__name__}, {len(self.params)} parameters)"


__all__ = ["CombinedOptimizer", "KeyedOptimizer", "KeyedOptimizerWrapper", "OptimizerWrapper"]

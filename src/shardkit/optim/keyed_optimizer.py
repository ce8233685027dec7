"""torchrec's ``KeyedOptimizer`` (an optimizer whose state dict names parameters by key) and
``OptimizerWrapper`` (a KeyedOptimizer that forwards everything to another one, the base of wrappers
that add behaviour around ``step``).

A ``KeyedOptimizer`` is built from ``params`` (``{key: parameter}``), ``state`` (``{parameter: {name:
value}}``, values being tensors, ``ShardedTensor`` / ``DTensor`` or plain objects) and ``param_groups``
(dicts whose ``"params"`` are parameters). Its ``state_dict()`` keys the state by parameter key, and
includes the groups (their ``"params"`` as keys) only after ``save_param_groups(True)``, as torchrec.
``load_state_dict`` writes into the existing state: tensors are copied in place (so shards stay where
they are), other values replaced; call ``init_state()`` first on an optimizer that has not stepped yet.
It is a ``torch.optim.Optimizer``, so LR schedulers accept it.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

_OWNER = "KeyedOptimizer"


class KeyedOptimizer(torch.optim.Optimizer):
    """An optimizer over named parameters whose state dict uses the names (torchrec's base class).

    Args:
        params: ``{key: parameter}``; the keys name the parameters in ``state_dict()``.
        state: ``{parameter: {state name: value}}``; every key must be one of ``params``' values
            (else ``ValueError("All state keys must be params.")``). Kept by reference.
        param_groups: dicts with ``"params"`` (parameters) and hyper-parameters. Kept by reference,
            so a subclass can share them with an optimizer it drives.

    ``step`` is the subclass's (this base class has nothing to step).
    """

    def __init__(
        self,
        params: Mapping[str, Any],
        state: Mapping[Any, Any],
        param_groups: Collection[Mapping[str, Any]],
    ) -> None:
        # torch's bookkeeping (hooks, profiling names) from one empty group; the real groups follow
        super().__init__([{"params": []}], {})
        self.params: Dict[str, Any] = dict(params)
        self.state = state  # type: ignore[assignment]
        self.param_groups = param_groups  # type: ignore[assignment]
        self.defaults = {"_save_param_groups": False}
        known = {id(p) for p in self.params.values()}
        if any(id(key) not in known for key in self.state):
            raise ValueError("All state keys must be params.")

    def _keys_by_id(self) -> Dict[int, str]:
        return {id(param): key for key, param in self.params.items()}

    def save_param_groups(self, save: bool) -> None:
        """Whether ``state_dict()`` includes the param groups (torchrec's default: no)."""
        self.defaults["_save_param_groups"] = save

    def state_dict(self) -> Dict[str, Any]:
        """``{"state": {key: {name: value}}}`` plus ``"param_groups"`` (``"params"`` as keys) if saved."""
        keys = self._keys_by_id()
        out: Dict[str, Any] = {"state": {keys[id(p)]: s for p, s in self.state.items()}}
        if self.defaults["_save_param_groups"]:
            out["param_groups"] = [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [keys[id(p)] for p in g["params"]],
                }
                for g in self.param_groups
            ]
        return out

    def _problems(self, state_dict: Mapping[str, Any]) -> List[Tuple[type, str]]:
        """``(exception type, message)`` for everything :meth:`load_state_dict` would refuse."""
        keys = self._keys_by_id()
        loaded = state_dict["state"]
        problems: List[Tuple[type, str]] = []
        for param, param_state in self.state.items():
            key = keys[id(param)]
            if key not in loaded:
                problems.append((KeyError, f"{_OWNER}.load_state_dict: no state for parameter {key!r}"))
                continue
            missing = sorted(set(param_state) - set(loaded[key]))
            if missing:
                message = f"{_OWNER}.load_state_dict: parameter {key!r} has no {missing} in the state dict"
                problems.append((KeyError, message))
                continue
            for name, current in param_state.items():
                problem = _value_problem(current, loaded[key][name], f"{key}.{name}")
                if problem:
                    problems.append((ValueError, problem))
        groups = state_dict.get("param_groups")
        if self.defaults["_save_param_groups"] and groups is not None:
            if len(groups) != len(self.param_groups):
                problems.append(
                    (
                        ValueError,
                        f"{_OWNER}.load_state_dict: {len(groups)} param groups given, "
                        f"{len(self.param_groups)} here",
                    )
                )
            for i, (group, new) in enumerate(zip(self.param_groups, groups)):
                ours = [keys[id(p)] for p in group["params"]]
                if sorted(ours) != sorted(new["params"]):
                    problems.append(
                        (
                            ValueError,
                            f"{_OWNER}.load_state_dict: param group {i} holds {ours}, the state dict's "
                            f"holds {list(new['params'])}",
                        )
                    )
        return problems

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> List[str]:
        """What would make :meth:`load_state_dict` refuse ``state_dict``, found without writing."""
        return [message for _, message in self._problems(state_dict)]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Write ``state_dict`` into the current state (tensors in place) and, if groups are saved,
        the groups' hyper-parameters. Every parameter with state here must have the same entries there
        (``KeyError``), of the same shapes (``ValueError``); checked before anything is written."""
        problems = self._problems(state_dict)
        if problems:
            kind, message = problems[0]
            raise kind(message)
        keys = self._keys_by_id()
        loaded = state_dict["state"]
        for param, param_state in self.state.items():
            key = keys[id(param)]
            for name, current in list(param_state.items()):
                param_state[name] = _loaded_value(current, loaded[key][name], f"{key}.{name}")
        if self.defaults["_save_param_groups"] and "param_groups" in state_dict:
            for group, new in zip(self.param_groups, state_dict["param_groups"]):
                group.update({k: v for k, v in new.items() if k != "params"})

    def init_state(self, sparse_grad_parameter_names: Optional[Set[str]] = None) -> None:
        """Create the state by one step on zero gradients (sparse ones for the named parameters),
        so that ``load_state_dict`` has state to write into. Parameters keep those zero gradients."""
        sparse = sparse_grad_parameter_names or set()
        for key, param in self.params.items():
            if not param.requires_grad or param.grad is not None:
                continue
            zeros = torch.zeros_like(param)
            param.grad = zeros.to_sparse() if key in sparse else zeros
        self.step()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if "params" not in self.__dict__:  # torch's __init__ adding its placeholder group
            return super().add_param_group(param_group)
        raise NotImplementedError(f"{_OWNER}: the parameters are fixed at construction (pass them in params)")


def _value_problem(current: Any, new: Any, where: str) -> Optional[str]:
    """Why ``new`` cannot be written into ``current`` (:func:`_loaded_value`), or None."""
    if isinstance(current, ShardedTensor):
        if not isinstance(new, ShardedTensor):
            return f"{_OWNER}.load_state_dict: {where} is sharded here, not in the state dict"
        ours, theirs = current.local_shards(), new.local_shards()
        if len(ours) != len(theirs):
            return f"{_OWNER}.load_state_dict: {where} has {len(theirs)} local shards, {len(ours)} here"
        for dst, src in zip(ours, theirs):
            if dst.tensor.shape != src.tensor.shape:
                return (
                    f"{_OWNER}.load_state_dict: {where} has a local shard of shape "
                    f"{tuple(src.tensor.shape)}, {tuple(dst.tensor.shape)} here"
                )
        return None
    if isinstance(current, torch.Tensor) and not isinstance(new, torch.Tensor):
        return f"{_OWNER}.load_state_dict: {where} is a tensor here, {type(new).__name__} in the state dict"
    if isinstance(current, torch.Tensor) and new.shape != current.shape and new.numel() != 1:
        return f"{_OWNER}.load_state_dict: {where} has shape {tuple(new.shape)}, {tuple(current.shape)} here"
    return None


def _loaded_value(current: Any, new: Any, where: str) -> Any:
    """``new`` written into ``current``'s storage when both are tensors (shards copied shard by shard)."""
    if isinstance(current, ShardedTensor):
        ours, theirs = current.local_shards(), new.local_shards()
        if len(ours) != len(theirs):
            raise ValueError(
                f"{_OWNER}.load_state_dict: {where} has {len(theirs)} local shards, {len(ours)} here"
            )
        for dst, src in zip(ours, theirs):
            dst.tensor.detach().copy_(src.tensor)
        return current
    if isinstance(current, torch.Tensor):
        current.detach().copy_(new)
        return current
    return new


class OptimizerWrapper(KeyedOptimizer):
    """A KeyedOptimizer that forwards everything (params, state, groups, step, state dict) to
    ``optimizer``: subclass it to add behaviour around ``step`` (clipping, warm-up, ...)."""

    def __init__(self, optimizer: KeyedOptimizer) -> None:
        self._optimizer = optimizer
        super().__init__(optimizer.params, optimizer.state, optimizer.param_groups)

    def step(self, closure: Any = None) -> Any:
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> List[str]:
        return self._optimizer.check_state_dict(state_dict)

    def save_param_groups(self, save: bool) -> None:
        self._optimizer.save_param_groups(save)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._optimizer!r})"

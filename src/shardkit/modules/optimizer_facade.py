"""Optimizers that are not built from a list of parameters, made usable where torch wants an optimizer.

torch's LR schedulers (``torch.optim.lr_scheduler``) accept only a ``torch.optim.Optimizer`` and
change the learning rate by writing ``group["lr"]`` into each of its ``param_groups``. shardkit's
fused optimizers (their update runs inside backward, with a learning rate of their own) and
``CombinedOptimizer`` (several optimizers as one) have no parameter groups of torch's kind, so they
derive from :class:`OptimizerFacade` and expose :class:`LearningRateGroup` s: dicts whose ``"lr"``
writes reach the optimizer that owns them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch


class LearningRateGroup(dict):
    """A param group (``{"lr": float, "params": []}``) whose ``"lr"`` is its owner's learning rate.

    Writing ``group["lr"] = x`` (what LR schedulers do) calls ``set_lr(x)``; the owner calls
    :meth:`show` when its learning rate is set another way, so that the group reads the same.
    """

    def __init__(self, set_lr: Callable[[float], None], lr: float) -> None:
        super().__init__(lr=lr, params=[])
        self._set_lr = set_lr

    def __setitem__(self, key: str, value: Any) -> None:
        # "lr" is absent only while copy / pickle rebuild the dict, before its owner is whole
        if key == "lr" and "lr" in self:
            self._set_lr(float(value))
        super().__setitem__(key, value)

    def show(self, lr: float) -> None:
        """Record ``lr`` as the group's value without calling the owner back."""
        super().__setitem__("lr", lr)


class OptimizerFacade(torch.optim.Optimizer):
    """Base of optimizers whose parameter groups and state are their own (not torch's bookkeeping).

    It is a ``torch.optim.Optimizer`` for ``isinstance`` checks (LR schedulers) with torch's hook
    registries, but ``torch.optim.Optimizer.__init__`` (which needs parameters) is not run: the
    subclass sets or computes ``param_groups`` and ``state`` and defines ``step``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict``.
    """

    def __init__(self) -> None:
        self.defaults = {}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    # torch's versions keep only defaults, state and param_groups; a facade's state is its attributes
    def __getstate__(self) -> dict:
        return self.__dict__.copy()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={[g.get('lr') for g in self.param_groups]})"


__all__ = ["LearningRateGroup", "OptimizerFacade"]

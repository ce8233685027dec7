"""Helpers users call around sharded modules (the specification's ``torchrec.distributed.utils``).

State-dict keys: :func:`append_prefix`, :func:`filter_state_dict`, :func:`add_prefix_to_state_dict`.
Fused-optimizer parameters (the per-table options handed to a sharder's fused kernels):
:func:`merge_fused_params`, :func:`add_params_from_parameter_sharding`,
:func:`optimizer_type_to_emb_opt_type`. Modules: :class:`CopyableMixin`, :func:`copy_to_device`,
:func:`get_unsharded_module_names`. And :func:`none_throws`. ``PermutePooledEmbeddings`` lives in
``shardkit.sharding.dist_data`` and is re-exported here under the specification's path.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Type, TypeVar

import torch
from torch import nn

from shardkit.modules.fused_optimizers import OptimType
from shardkit.optim.rowwise_adagrad import RowWiseAdagrad
from shardkit.sharding.dist_data.permute import PermutePooledEmbeddings
from shardkit.sharding.types import ParameterSharding, ShardedModule

_T = TypeVar("_T")


def none_throws(optional: Optional[_T], message: str = "Unexpected `None`") -> _T:
    """``optional`` itself, or ``AssertionError(message)`` when it is None."""
    if optional is None:
        raise AssertionError(message)
    return optional


def append_prefix(prefix: str, name: str) -> str:
    """``name`` under ``prefix``: ``("a", "b")`` and ``("a.", "b")`` give ``"a.b"``; an empty side drops."""
    if not prefix or not name:
        return prefix + name
    return prefix + name if prefix.endswith(".") else f"{prefix}.{name}"


def filter_state_dict(state_dict: OrderedDict[str, Any], name: str) -> OrderedDict[str, Any]:
    """The entries under module ``name`` with ``name.`` stripped from their keys, in order.

    ``filter_state_dict({"ebc.t1.weight": w, "dense.bias": b}, "ebc") == {"t1.weight": w}``; an
    empty ``name`` keeps every entry. ``name`` may end with ``"."``. The values are not copied.
    """
    prefix = name if not name or name.endswith(".") else name + "."
    return OrderedDict(
        (key[len(prefix) :], value) for key, value in state_dict.items() if key.startswith(prefix)
    )


def add_prefix_to_state_dict(state_dict: Dict[str, Any], prefix: str) -> None:
    """Prepend ``prefix`` (e.g. ``"model."``) to every key of ``state_dict``, in place, keeping order.

    A ``state_dict()`` also carries ``_metadata`` (per-module versions, keyed by module path without
    the trailing dot); its keys are moved under the prefix too, so ``load_state_dict`` still finds them.
    """
    items = list(state_dict.items())
    state_dict.clear()
    state_dict.update((prefix + key, value) for key, value in items)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        moved = [(prefix + key if key else prefix.rstrip("."), value) for key, value in metadata.items()]
        metadata.clear()
        metadata.update(moved)


# shardkit's FusedOptimizerConfig calls the learning rate ``lr``; torchrec configs say ``learning_rate``.
_ALIASES = {"learning_rate": "lr"}


def _canonical(params: Optional[Dict[str, Any]], which: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in (params or {}).items():
        name = _ALIASES.get(key, key)
        if name in out and out[name] != value:
            raise ValueError(f"{which} fused params set {name!r} twice with different values: {params}")
        out[name] = value
    return out


def merge_fused_params(
    fused_params: Optional[Dict[str, Any]] = None, param_fused_params: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """The fused parameters of one table: the sharder-wide ``fused_params`` overridden by the table's.

    Returns a new dict (the inputs are not modified), never None. ``learning_rate`` is accepted as
    an alias of ``lr`` (the key of ``FusedOptimizerConfig``) on either side.
    """
    return {**_canonical(fused_params, "sharder"), **_canonical(param_fused_params, "table")}


_SHARDING_OPTIONS = ("cache_params", "enforce_hbm", "stochastic_rounding", "bounds_check_mode")


def add_params_from_parameter_sharding(
    fused_params: Optional[Dict[str, Any]], parameter_sharding: ParameterSharding
) -> Dict[str, Any]:
    """``fused_params`` plus the kernel options the plan set on ``parameter_sharding``.

    Each of ``cache_params``, ``enforce_hbm``, ``stochastic_rounding``, ``bounds_check_mode`` that is
    not None on the sharding overrides the same key of ``fused_params``. Returns a new dict.
    """
    out = dict(fused_params or {})
    for option in _SHARDING_OPTIONS:
        value = getattr(parameter_sharding, option)
        if value is not None:
            out[option] = value
    return out


# torch.optim classes whose update the fused kernels reproduce. Adam maps to the fused ADAM, which
# is lazy (SparseAdam's rule: rows absent from a batch keep their moments), as in the specification.
_FUSED_OPTIMIZERS = {
    torch.optim.SGD: OptimType.SGD,
    torch.optim.Adagrad: OptimType.ADAGRAD,
    torch.optim.Adam: OptimType.ADAM,
    torch.optim.SparseAdam: OptimType.ADAM,
    RowWiseAdagrad: OptimType.ROWWISE_ADAGRAD,
}


def optimizer_type_to_emb_opt_type(optimizer_class: Type[torch.optim.Optimizer]) -> Optional[OptimType]:
    """The fused ``OptimType`` for a ``torch.optim`` class (SGD, Adagrad, Adam, SparseAdam) or
    ``shardkit.optim.RowWiseAdagrad``, None if none."""
    return _FUSED_OPTIMIZERS.get(optimizer_class)


class CopyableMixin(nn.Module):
    """A module that knows how to copy itself to a device; :func:`copy_to_device` defers to it.

    The default ``copy`` is a deep copy moved with ``.to(device)``; override it for modules whose
    tensors must not all move (e.g. a table kept in host memory).
    """

    def copy(self, device: torch.device) -> nn.Module:
        """A copy of this module on ``device``."""
        return copy.deepcopy(self).to(device)


def copy_to_device(module: nn.Module, current_device: torch.device, to_device: torch.device) -> nn.Module:
    """A deep copy of ``module`` in which the tensors on ``current_device`` are on ``to_device``.

    Parameters and buffers on other devices are copied where they are; submodules that are a
    :class:`CopyableMixin` are copied by their own ``copy(to_device)``. Tensors that move are copied
    once, straight to ``to_device`` (no intermediate copy on ``current_device``).
    """
    current_device, to_device = torch.device(current_device), torch.device(to_device)
    if isinstance(module, CopyableMixin):
        return module.copy(to_device)
    # deepcopy takes the memo's entry for every object listed in it: the moved tensors and the
    # self-copied submodules (whose own tensors it then never visits)
    memo: Dict[int, Any] = {}
    _fill_memo(module, current_device, to_device, memo)
    return copy.deepcopy(module, memo)


def _fill_memo(module: nn.Module, current: torch.device, to: torch.device, memo: Dict[int, Any]) -> None:
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if id(tensor) not in memo and tensor.device == current:
            moved = tensor.detach().to(to, copy=True)
            if isinstance(tensor, nn.Parameter):
                moved = nn.Parameter(moved, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = moved
    for child in module.children():
        if id(child) in memo:
            continue
        if isinstance(child, CopyableMixin):
            memo[id(child)] = child.copy(to)
        else:
            _fill_memo(child, current, to, memo)


@torch.no_grad()
def init_parameters(module: nn.Module, device: torch.device) -> None:
    """Allocate on ``device`` every parameter and buffer of ``module`` still on the meta device and let
    its submodule initialize it (``reset_parameters``, where the submodule has one).

    Submodules whose tensors are all materialized keep their values and device (torchrec's version
    also moves and re-initializes those when any parameter is elsewhere); DistributedModelParallel
    calls this for ``init_parameters=True``."""
    for sub in module.modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if any(t.device.type == "meta" for t in own):
            sub.to_empty(device=device, recurse=False)
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()


def get_unsharded_module_names(model: nn.Module) -> List[str]:
    """Names of ``model``'s direct children that hold no ``ShardedModule`` (the data-parallel part)."""
    return [
        name
        for name, child in model.named_children()
        if not any(isinstance(m, ShardedModule) for m in child.modules())
    ]


__all__ = [
    "CopyableMixin",
    "PermutePooledEmbeddings",
    "add_params_from_parameter_sharding",
    "add_prefix_to_state_dict",
    "append_prefix",
    "copy_to_device",
    "filter_state_dict",
    "get_unsharded_module_names",
    "init_parameters",
    "merge_fused_params",
    "none_throws",
    "optimizer_type_to_emb_opt_type",
]

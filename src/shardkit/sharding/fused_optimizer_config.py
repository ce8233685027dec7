"""Which fused optimizer a sharded collection's FUSED tables apply, from the three ways to ask for one.

1. The collection was built with ``fused_optimizer=FusedOptimizerConfig(...)`` (shardkit's way).
2. torch's ``_apply_optimizer_in_backward(cls, collection.parameters(), kwargs)`` (torchrec's way,
   also ``shardkit.optim.apply_optimizer_in_backward``): the class and kwargs on the parameters.
3. The sharder's ``fused_params={"optimizer": ..., "learning_rate": ...}`` (torchrec's sharder way).

The first that applies wins; with none, the collection has no fused optimizer and the planner gives
its tables the DENSE kernel only.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, TypeVar

import torch
from torch import nn

from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.modules import FusedOptimizerConfig, OptimType
from shardkit.sharding.cache_params import FUSED_PARAMS_KEYS, cache_params_from_fused_params
from shardkit.sharding.types import ModuleSharder
from shardkit.sharding.utils import merge_fused_params, optimizer_type_to_emb_opt_type

M = TypeVar("M", bound=nn.Module)

# fbgemm's EmbOptimType names for the rules shardkit's kernels implement (shardkit's are exact)
_EMB_OPT_NAMES = {"EXACT_SGD": "SGD", "EXACT_ADAGRAD": "ADAGRAD", "EXACT_ROWWISE_ADAGRAD": "ROWWISE_ADAGRAD"}
# torch.optim / torchrec keyword -> FusedOptimizerConfig field, and keywords that must keep their default
_FIELDS = {"lr", "eps", "betas", "initial_accumulator_value"}
_NEUTRAL = {"weight_decay": 0.0, "lr_decay": 0.0, "momentum": 0.0, "maximize": False, "amsgrad": False}


def _optim_type(optimizer: Any) -> OptimType:
    if isinstance(optimizer, type):
        fused = optimizer_type_to_emb_opt_type(optimizer)
        if fused is None:
            raise ValueError(f"fused_params: {optimizer.__name__} has no fused equivalent")
        return fused
    name = str(getattr(optimizer, "name", optimizer)).upper()
    try:
        return OptimType(_EMB_OPT_NAMES.get(name, name))
    except ValueError:
        supported = [t.value for t in OptimType] + list(_EMB_OPT_NAMES)
        raise ValueError(
            f"fused_params: optimizer {optimizer!r} has no fused kernel; supported: {supported}"
        ) from None


def fused_optimizer_config(fused_params: Optional[Dict[str, Any]]) -> Optional[FusedOptimizerConfig]:
    """The ``FusedOptimizerConfig`` of a sharder's ``fused_params`` (None for None or ``{}``).

    Keys: ``optimizer`` (an ``OptimType``, fbgemm's ``EmbOptimType`` or its name, a ``torch.optim``
    class with a fused equivalent, or ``shardkit.optim.RowWiseAdagrad``), ``lr`` (alias
    ``learning_rate``), ``eps``, ``betas`` (or ``beta1`` / ``beta2``), ``initial_accumulator_value``;
    ``weight_decay`` / ``lr_decay`` / ``momentum`` only at 0 (the fused kernels have none). The cache
    keys of the offloading kernels (``cache_load_factor``, ``cache_algorithm``, ... :
    ``shardkit.sharding.cache_params.FUSED_PARAMS_KEYS``) are read by the sharders, not here. Anything
    else is a ``ValueError`` that names the key.
    """
    params = merge_fused_params(fused_params)
    for key in (*FUSED_PARAMS_KEYS, "cache_params"):  # the offloading kernels' cache options
        params.pop(key, None)
    if not params:
        return None
    if "optimizer" not in params:
        raise ValueError(f"fused_params {fused_params} name no 'optimizer'")
    optimizer = _optim_type(params.pop("optimizer"))
    if "beta1" in params or "beta2" in params:
        default = FusedOptimizerConfig(optimizer).betas
        params["betas"] = (params.pop("beta1", default[0]), params.pop("beta2", default[1]))
    for key, neutral in _NEUTRAL.items():
        if key in params and params.pop(key) != neutral:
            raise ValueError(
                f"fused_params: {key}={fused_params[key]!r} is not supported by the fused kernels (only "
                f"{neutral!r}); drop it or use the DENSE kernel with a torch optimizer"
            )
    unknown = sorted(set(params) - _FIELDS)
    if unknown:
        raise ValueError(f"fused_params: unknown key(s) {unknown}; known: ['optimizer', *{sorted(_FIELDS)}]")
    return FusedOptimizerConfig(optimizer, **params)


def in_backward_optimizer_config(params: Iterable[torch.Tensor]) -> Optional[FusedOptimizerConfig]:
    """The fused equivalent of the optimizer torch's ``_apply_optimizer_in_backward`` put on ``params``
    (None if none has one); ``ValueError`` if they carry different optimizers (one collection
    applies one)."""
    found = {}
    for param in params:
        classes = getattr(param, "_optimizer_classes", None)
        if classes:
            kwargs = dict(param._optimizer_kwargs[0])
            found[(classes[0], tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))] = kwargs
    if not found:
        return None
    if len(found) > 1:
        described = [f"{cls.__name__}({kwargs})" for (cls, _), kwargs in found.items()]
        raise ValueError(f"the tables of one collection carry different in-backward optimizers: {described}")
    (cls, _), kwargs = next(iter(found.items()))
    return fused_optimizer_config({"optimizer": cls, **kwargs})


def resolve_fused_optimizer(
    module: nn.Module, fused_params: Optional[Dict[str, Any]]
) -> Optional[FusedOptimizerConfig]:
    """``module``'s own fused optimizer, else its parameters' in-backward one, else ``fused_params``'."""
    own = getattr(module, "_fused_optimizer", None)
    if own is not None:
        return own.config
    return in_backward_optimizer_config(module.parameters()) or fused_optimizer_config(fused_params)


class FusedParamsSharder(ModuleSharder[M]):
    """A sharder built as torchrec's: ``(fused_params=None, qcomm_codecs_registry=None)``; a bad
    ``fused_params`` fails here, not at the first ``shard()``."""

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        fused_optimizer_config(fused_params)
        cache_params_from_fused_params(fused_params)  # a bad cache key fails here too
        self._fused_params = fused_params

    @property
    def fused_params(self) -> Optional[Dict[str, Any]]:
        return self._fused_params

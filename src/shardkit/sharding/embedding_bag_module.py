"""ShardedEmbeddingBag and its sharder: a plain ``torch.nn.EmbeddingBag`` placed by a plan.

The module is sharded as a one-table ``ShardedEmbeddingBagCollection`` (every sharding type, the same
dists, lookups, checks and state helpers): the table is the module's ``weight``, its one feature has
the table's name, the forward's ``input`` / ``offsets`` / ``per_sample_weights`` become a one-key
KeyedJaggedTensor and the output is that key's pooled ``[B, D]`` values.

- Table name: the plan's one key. ``EmbeddingBagSharder.shardable_parameters`` calls it ``"weight"``
  (the parameter's name), so a plan is e.g. ``{"weight": row_wise()("weight", (rows, dim), L, W, "cpu")}``.
- Modes ``sum`` and ``mean``. A ``mean`` bag is pooled as a sum and divided by its length on the
  rank that owns the bag: row-wise shardings pool each rank's part of a bag, and a collection's MEAN
  table there averages the parts separately (the mean of partial sums is not the bag's mean).
  ``max`` (which the collections do not pool), ``padding_idx``,
  ``max_norm`` and ``scale_grad_by_freq`` are a ``ValueError`` at shard time, on every rank.
- ``per_sample_weights`` (mode ``sum`` only, as nn.EmbeddingBag): a ``sum`` module is always sharded
  as a weighted table, and a call without weights sends ones, so ranks need not agree on passing them
  (one more float per id on the wire). Their gradient reaches the caller, as unsharded.
- Optimizers: ``fused_params`` (the specification's dict, see :func:`fused_optimizer_config`) makes
  FUSED-kernel plans possible, updating the shards in backward; without it the plan must use the
  DENSE kernel and the shards are parameters for a dense optimizer.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from shardkit.distributed.agreement import gather_objects
from shardkit.distributed.awaitable import Awaitable, LazyAwaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.validation import validation_enabled
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    PoolingType,
)
from shardkit.sharding.embeddingbag import POOLED_SHARDINGS, ShardedEmbeddingBagCollection
from shardkit.sharding.fused_optimizer_config import FusedParamsSharder, fused_optimizer_config
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.sharded_embedding_module import EmbeddingModuleContext
from shardkit.sharding.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
)
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor

DEFAULT_TABLE_NAME = "weight"

_DATA_TYPES = {torch.float32: DataType.FP32, torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16}


def _table_config(module: nn.EmbeddingBag, name: str) -> EmbeddingBagConfig:
    """The one-table config of ``module`` (its feature is also called ``name``), pooled as a SUM in
    both modes (see ``ShardedEmbeddingBag``); rows of a shard initialized from it follow
    nn.EmbeddingBag's ``normal_`` init. ``ValueError`` for what the sharded collections cannot
    reproduce (mode ``max``, ``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, a weight dtype
    other than fp32 / fp16 / bf16)."""
    if not isinstance(module, nn.EmbeddingBag):
        raise TypeError(f"expected a torch.nn.EmbeddingBag, got {type(module).__name__}")
    if module.mode not in ("sum", "mean"):
        raise ValueError(
            f"nn.EmbeddingBag mode {module.mode!r} cannot be sharded: the sharded collections pool with "
            f"'sum' or 'mean' only"
        )
    unsupported = [
        f"{attr}={getattr(module, attr)!r}"
        for attr, default in (("padding_idx", None), ("max_norm", None), ("scale_grad_by_freq", False))
        if getattr(module, attr) != default
    ]
    if unsupported:
        raise ValueError(f"nn.EmbeddingBag with {', '.join(unsupported)} cannot be sharded")
    if module.weight.dtype not in _DATA_TYPES:
        raise ValueError(
            f"nn.EmbeddingBag weight dtype {module.weight.dtype} cannot be sharded (fp32 / fp16 / bf16 only)"
        )
    return EmbeddingBagConfig(
        module.num_embeddings,
        module.embedding_dim,
        name=name,
        data_type=_DATA_TYPES[module.weight.dtype],
        feature_names=[name],
        pooling=PoolingType.SUM,
        init_fn=nn.init.normal_,
    )


class _BagContext(EmbeddingModuleContext):
    """One forward's context, plus (mode ``mean``) its bags' lengths ``[B, 1]`` fp32, at least 1: the
    divisor of the pooled sums (an empty bag stays zeros, as nn.EmbeddingBag's)."""

    def __init__(self, num_shardings: int) -> None:
        super().__init__(num_shardings)
        self.bag_lengths: Optional[torch.Tensor] = None

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.bag_lengths is not None:
            self.bag_lengths.record_stream(stream)


class _ValuesAwaitable(LazyAwaitable[torch.Tensor]):
    """The one-key KeyedTensor's ``[B, D]`` values, divided by ``bag_lengths`` ``[B, 1]`` when given."""

    def __init__(self, pooled: Awaitable[KeyedTensor], bag_lengths: Optional[torch.Tensor]) -> None:
        super().__init__()
        self._pooled, self._bag_lengths = pooled, bag_lengths

    def _wait_impl(self) -> torch.Tensor:
        values = self._pooled.wait().values()
        if self._bag_lengths is None:
            return values
        # divided in fp32 (a long bag's length is not exact in bf16), returned in the table's dtype
        return (values / self._bag_lengths.to(values.device)).to(values.dtype)


class ShardedEmbeddingBag(ShardedEmbeddingBagCollection):
    """An nn.EmbeddingBag whose table is placed by a plan (see the module doc).

    Args:
        module: the unsharded nn.EmbeddingBag (not modified); the shards are copied from its weight,
            or initialized like it (``normal_``) when it is on the meta device.
        table_name_to_parameter_sharding: one entry, ``table name -> ParameterSharding`` (a plan with
            another number of entries is a ``ValueError`` on every rank).
        env: the world.
        fused_params: the fused optimizer for FUSED-kernel plans (:func:`fused_optimizer_config`).
        device, qcomm_codecs_registry: as for ``ShardedEmbeddingBagCollection``.

    forward(input, offsets=None, per_sample_weights=None), nn.EmbeddingBag's arguments for this rank's
    B_me bags: ``input`` ``[N]`` ids with ``offsets`` ``[B_me]`` (``[B_me + 1]`` with
    ``include_last_offset``), or ``input`` ``[B_me, L]``; ``per_sample_weights`` of ``input``'s shape
    and the weight's dtype. Returns ``LazyAwaitable[Tensor]`` ``[B_me, D]``, the unsharded module's
    rows of these bags. Bad input on any rank (shapes, offsets, ids out of range) is a ``ValueError``
    on every rank before any data moves (offsets and ids: while validation is on).

    State: ``state_dict()`` key ``weight`` (a DTensor / ShardedTensor of this rank's shards, as the
    collection's tables); ``full_table(name)`` / ``load_full_table(name, full)`` and
    ``fused_optimizer`` as the collection's, with the plan's table name.
    """

    def __init__(
        self,
        module: nn.EmbeddingBag,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        plan = table_name_to_parameter_sharding
        # with another number of entries the collection's plan check reports the names on every rank
        name = next(iter(plan)) if len(plan) == 1 else DEFAULT_TABLE_NAME
        config, optimizer = _agreed_config(module, name, fused_params, env)
        table = EmbeddingBagCollection(
            [config],
            is_weighted=module.mode == "sum",
            device=torch.device("meta"),  # a template only: the shards are copied from module.weight
            fused_optimizer=optimizer,
        )
        super().__init__(table, plan, env, device, qcomm_codecs_registry)
        if module.weight.device.type != "meta":
            self.load_full_table(name, module.weight.detach())
        self._name = name
        self._mean = module.mode == "mean"
        self._weight_dtype = module.weight.dtype
        self._include_last_offset = module.include_last_offset
        self._extra_input_check = self._raise_conversion_error
        self._conversion_error: Optional[Exception] = None
        self.register_state_dict_post_hook(_weight_to_state_dict)

    @property
    def table_name(self) -> str:
        """The table's name (the plan's key; also the name of the input's one feature)."""
        return self._name

    def input_dist(
        self,
        ctx: _BagContext,
        input: torch.Tensor,
        offsets: Optional[torch.Tensor] = None,
        per_sample_weights: Optional[torch.Tensor] = None,
    ) -> Awaitable[Awaitable[KJTList]]:
        """nn.EmbeddingBag's inputs as a one-key KJT, checked on every rank, then the collection's."""
        self._conversion_error = None
        try:
            features = self._to_features(input, offsets, per_sample_weights)
        except (TypeError, ValueError) as err:
            if not validation_enabled():
                raise
            # report it through the collection's cross-rank input check, so that every rank raises
            self._conversion_error = err
            features = self._placeholder(input)
        if self._mean:
            ctx.bag_lengths = features.lengths().clamp(min=1).to(torch.float32).unsqueeze(1)
        return super().input_dist(ctx, features)

    def _raise_conversion_error(self, features: KeyedJaggedTensor) -> None:
        """The collection's extra input check: this forward's conversion error, as a ValueError (the
        type the cross-rank check reports on every rank)."""
        if self._conversion_error is not None:
            raise ValueError(str(self._conversion_error))

    def _placeholder(self, input: torch.Tensor) -> KeyedJaggedTensor:
        """A valid empty one-key KJT, only carried into the input check that raises the real error."""
        device = input.device if isinstance(input, torch.Tensor) else None
        values = torch.zeros(0, dtype=torch.int64, device=device)
        weights = torch.zeros(0, dtype=self._weight_dtype, device=device) if self._weighted else None
        lengths = torch.zeros(0, dtype=torch.int64, device=device)
        return KeyedJaggedTensor([self._name], values, weights, lengths=lengths)

    def _to_features(
        self, input: torch.Tensor, offsets: Optional[torch.Tensor], per_sample_weights: Optional[torch.Tensor]
    ) -> KeyedJaggedTensor:
        owner = type(self).__name__
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{owner}: input must be an int32 / int64 tensor")
        if per_sample_weights is not None:
            if self._mean:
                raise ValueError(f"{owner}: per_sample_weights need mode 'sum' (as nn.EmbeddingBag)")
            if per_sample_weights.shape != input.shape or per_sample_weights.dtype != self._weight_dtype:
                raise ValueError(
                    f"{owner}: per_sample_weights {list(per_sample_weights.shape)} "
                    f"{per_sample_weights.dtype} must have input's shape {list(input.shape)} "
                    f"and the weight's dtype {self._weight_dtype}"
                )
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError(f"{owner}: a 2-D input [B, L] takes no offsets")
            bags, length = input.shape
            values = input.reshape(-1)
            lengths = torch.full((bags,), length, dtype=torch.int64, device=input.device)
        elif input.dim() == 1:
            values, lengths = input, self._lengths(offsets, input.numel())
        else:
            raise ValueError(f"{owner}: input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
        weights = None
        if self._weighted:
            weights = (
                torch.ones(values.numel(), dtype=self._weight_dtype, device=values.device)
                if per_sample_weights is None
                else per_sample_weights.reshape(-1)
            )
        return KeyedJaggedTensor(
            [self._name], values.to(torch.int64), weights, lengths=lengths, validate=validation_enabled()
        )

    def _lengths(self, offsets: Optional[torch.Tensor], num_ids: int) -> torch.Tensor:
        """Bag lengths ``[B]`` of nn.EmbeddingBag's ``offsets`` over ``num_ids`` ids."""
        owner = type(self).__name__
        if offsets is None or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{owner}: a 1-D input needs 1-D int32 / int64 offsets")
        offsets = offsets.to(torch.int64)
        if self._include_last_offset:
            if offsets.numel() == 0:
                raise ValueError(f"{owner}: include_last_offset needs at least one offset")
            bounds = offsets
        else:
            bounds = torch.cat([offsets, torch.tensor([num_ids], device=offsets.device)])
        if validation_enabled() and offsets.numel():
            # include_last_offset: the last offset must be the number of ids, as documented for
            # nn.EmbeddingBag (with ids past it, its mode mean divides by a count that includes them)
            last_ok = int(bounds[-1]) == num_ids if self._include_last_offset else int(bounds[-1]) <= num_ids
            if int(offsets[0]) != 0 or bool((bounds[1:] < bounds[:-1]).any()) or not last_ok:
                last = "end at" if self._include_last_offset else "stay within"
                raise ValueError(
                    f"{owner}: offsets {offsets.tolist()} must start at 0, not decrease and {last} "
                    f"the {num_ids} ids"
                )
        return bounds[1:] - bounds[:-1]

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        # the collection's load hook (run by super()) reads the table under the collection's key
        key, internal = f"{prefix}weight", self._internal_key(prefix)
        if key in state_dict:
            state_dict[internal] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        missing_keys[:] = [key if k == internal else k for k in missing_keys]

    def _internal_key(self, prefix: str) -> str:
        return f"{prefix}{self.table_key}.{self._name}.weight"

    def create_context(self) -> _BagContext:
        return _BagContext(len(self._shardings))

    def output_dist(self, ctx: _BagContext, output: List[torch.Tensor]) -> LazyAwaitable[torch.Tensor]:
        return _ValuesAwaitable(super().output_dist(ctx, output), ctx.bag_lengths)

    def compute_and_output_dist(self, ctx: _BagContext, input: KJTList) -> LazyAwaitable[torch.Tensor]:
        return _ValuesAwaitable(super().compute_and_output_dist(ctx, input), ctx.bag_lengths)


def _agreed_config(
    module: nn.EmbeddingBag, name: str, fused_params: Optional[Dict[str, Any]], env: ShardingEnv
) -> Tuple[EmbeddingBagConfig, Optional[FusedOptimizerConfig]]:
    """The table config and fused optimizer, or a ``ValueError`` on every rank if any rank's module or
    fused_params cannot be sharded (one small all-gather, at construction)."""
    error = None
    try:
        config, optimizer = _table_config(module, name), fused_optimizer_config(fused_params)
    except (TypeError, ValueError) as err:
        error = f"{type(err).__name__}: {err}"
    verdicts = [error] if env.world_size == 1 else gather_objects(error, env.process_group)
    problems = [f"rank {r}: {e}" for r, e in enumerate(verdicts) if e is not None]
    if problems:
        raise ValueError("cannot shard nn.EmbeddingBag: " + "; ".join(problems))
    return config, optimizer


def _weight_to_state_dict(module: ShardedEmbeddingBag, state_dict, prefix: str, local_metadata) -> None:
    # runs after the collection's hook, which stored the table under the collection's key
    state_dict[f"{prefix}weight"] = state_dict.pop(module._internal_key(prefix))


class EmbeddingBagSharder(FusedParamsSharder[nn.EmbeddingBag]):
    """Shards an nn.EmbeddingBag: every sharding type; DENSE kernels, and FUSED ones when built with
    ``fused_params`` (data-parallel too, as for the collections).

    Args:
        fused_params: the fused optimizer of FUSED-kernel plans (:func:`fused_optimizer_config`).
        qcomm_codecs_registry: as for ``ModuleSharder``.
    """

    @property
    def module_type(self) -> Type[nn.EmbeddingBag]:
        return nn.EmbeddingBag

    def shard(
        self,
        module: nn.EmbeddingBag,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedEmbeddingBag:
        return ShardedEmbeddingBag(
            module, params, env, self._fused_params, device, self.qcomm_codecs_registry
        )

    def shardable_parameters(self, module: nn.EmbeddingBag) -> Dict[str, nn.Parameter]:
        return {DEFAULT_TABLE_NAME: module.weight}

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(POOLED_SHARDINGS)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if not self._fused_params:
            return [EmbeddingComputeKernel.DENSE.value]
        return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]


__all__ = [
    "DEFAULT_TABLE_NAME",
    "EmbeddingBagSharder",
    "ShardedEmbeddingBag",
    "fused_optimizer_config",
]

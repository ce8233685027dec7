"""Plan and module types of sharding (the specification's ``torchrec.distributed.types``).

A *plan* says how each parameter of each module is split: ``ShardingPlan`` maps a module path to an
``EmbeddingModuleShardingPlan``, which maps a parameter (table) name to a ``ParameterSharding``
(sharding type, compute kernel, ranks, shard offsets and sizes). A ``ModuleSharder`` turns a module
and its plan into a ``ShardedModule``, whose forward is ``input_dist -> compute -> output_dist``, each
step an awaitable so that communication overlaps compute (see docs/sharding.md).

``ShardingEnv``, the awaitables and the codecs live in ``shardkit.distributed`` and are re-exported
here under their specification names.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Dict, Generic, Iterator, List, Optional, Sequence, Type, TypeVar

import torch
from torch import nn

from shardkit.distributed.awaitable import (
    Awaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)
from shardkit.distributed.codecs import NoOpQuantizedCommCodec, QuantizedCommCodec, QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.sharding.cache_params import CacheAlgorithm, CacheParams, CacheStatistics
from shardkit.sharding.sharding_spec import EnumerableShardingSpec, ShardMetadata

CompIn = TypeVar("CompIn")
DistOut = TypeVar("DistOut")
Out = TypeVar("Out")
ShrdCtx = TypeVar("ShrdCtx")
M = TypeVar("M", bound=nn.Module)


class ShardingType(enum.Enum):
    """How a table is split across ranks.

    DATA_PARALLEL: every rank holds the whole table. TABLE_WISE: one rank holds the whole table.
    COLUMN_WISE: column blocks, each on one rank (each block acts as its own table). ROW_WISE: row
    blocks over all ranks. TABLE_ROW_WISE: row blocks over the ranks of one node. TABLE_COLUMN_WISE:
    column blocks over the ranks of one node. GRID_SHARD: column blocks, each cut into row blocks over
    the ranks of one node (pooled tables only, as in torchrec).
    """

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    COLUMN_WISE = "column_wise"
    ROW_WISE = "row_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    GRID_SHARD = "grid_shard"


class ComputeKernel(enum.Enum):
    """The generic compute kernel of a module that has no specialized ones."""

    DEFAULT = "default"


class EmbeddingComputeKernel(enum.Enum):
    """How a rank computes the lookup of its embedding shards.

    DENSE: a plain lookup whose table gets a dense gradient (for a regular torch optimizer). FUSED:
    the grouped lookup with the optimizer applied inside backward (``shardkit.modules``). The UVM /
    caching variants name GPU placements of the fused kernel and behave as FUSED where unified memory
    is not available; the QUANT kernels are the inference lookups of quantized tables.
    """

    DENSE = "dense"
    FUSED = "fused"
    FUSED_UVM = "fused_uvm"
    FUSED_UVM_CACHING = "fused_uvm_caching"
    QUANT = "quant"
    QUANT_UVM = "quant_uvm"
    QUANT_UVM_CACHING = "quant_uvm_caching"


class CommOp(enum.Enum):
    """Collectives whose wire precision a ``qcomm_codecs_registry`` can set, by their value."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"


class ParameterStorage(enum.Enum):
    """Physical memory a planner can constrain: device memory (HBM) or host memory (DDR)."""

    HBM = "hbm"
    DDR = "ddr"


_SHARDING_TYPES = frozenset(t.value for t in ShardingType)
_COMPUTE_KERNELS = frozenset(k.value for k in (*EmbeddingComputeKernel, *ComputeKernel))


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


@dataclasses.dataclass
class ParameterSharding:
    """How one parameter (usually a table) is sharded.

    Attributes:
        sharding_type: a ``ShardingType`` value (an enum member is converted to its value).
        compute_kernel: an ``EmbeddingComputeKernel`` (or ``ComputeKernel``) value.
        ranks: TABLE_WISE: the one rank holding the table; COLUMN_WISE / TABLE_COLUMN_WISE /
            ROW_WISE / TABLE_ROW_WISE / GRID_SHARD: the rank of each shard, in shard order;
            DATA_PARALLEL: unused.
        sharding_spec: the shards' offsets, sizes and placements (None for DATA_PARALLEL).
        cache_params: the ``CacheParams`` of the offloading kernels (``fused_uvm_caching``, ...);
            they win over the sharder's ``fused_params`` cache keys
            (``shardkit.sharding.cache_params.cache_params_from_fused_params``).
        enforce_hbm, stochastic_rounding, bounds_check_mode: kernel options, carried for the kernels
            that use them.

    Raises ``ValueError`` at construction for an unknown sharding type or compute kernel
    (``TypeError`` for a ``cache_params`` that is not a ``CacheParams``); use
    :meth:`check` for the checks that need the table's shape and the world size.
    """

    sharding_type: str
    compute_kernel: str
    ranks: Optional[List[int]] = None
    sharding_spec: Optional[EnumerableShardingSpec] = None
    cache_params: Optional[CacheParams] = None
    enforce_hbm: Optional[bool] = None
    stochastic_rounding: Optional[bool] = None
    bounds_check_mode: Optional[Any] = None

    def __post_init__(self) -> None:
        self.sharding_type = _enum_value(self.sharding_type)
        self.compute_kernel = _enum_value(self.compute_kernel)
        if self.sharding_type not in _SHARDING_TYPES:
            raise ValueError(
                f"ParameterSharding: unknown sharding_type {self.sharding_type!r}; "
                f"known: {sorted(_SHARDING_TYPES)}"
            )
        if self.compute_kernel not in _COMPUTE_KERNELS:
            raise ValueError(
                f"ParameterSharding: unknown compute_kernel {self.compute_kernel!r}; "
                f"known: {sorted(_COMPUTE_KERNELS)}"
            )
        if self.ranks is not None:
            self.ranks = [int(r) for r in self.ranks]
        if self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            given = type(self.cache_params).__name__
            raise TypeError(f"ParameterSharding: cache_params must be a CacheParams, got {given}")

    def check(self, name: str, shape: Sequence[int], world_size: int) -> None:
        """Raise ``ValueError`` naming ``name`` if this sharding cannot place a ``shape`` table on the world.

        Checks that every rank is in ``[0, world_size)``, that a TABLE_WISE sharding names one rank,
        that the shards tile the table exactly (``EnumerableShardingSpec.check``) and that ``ranks``,
        when given with a spec, lists the shards' ranks in order. No communication: every rank
        reaches the same verdict from the same plan.
        """
        if self.ranks is not None:
            bad = [r for r in self.ranks if not 0 <= r < world_size]
            if bad:
                raise ValueError(f"parameter {name!r}: ranks {bad} are outside a world of {world_size} ranks")
        if (
            self.sharding_type == ShardingType.TABLE_WISE.value
            and self.ranks is not None
            and len(self.ranks) != 1
        ):
            raise ValueError(f"parameter {name!r}: a table_wise sharding names one rank, got {self.ranks}")
        if self.sharding_spec is None:
            if self.sharding_type != ShardingType.DATA_PARALLEL.value:
                raise ValueError(f"parameter {name!r}: a {self.sharding_type} sharding needs a sharding_spec")
            return
        self.sharding_spec.check(name, shape, world_size)
        shard_ranks = [s.rank for s in self.sharding_spec.shards]
        if self.ranks is not None and self.ranks != shard_ranks:
            raise ValueError(
                f"parameter {name!r}: ranks {self.ranks} disagree with the shards' placements {shard_ranks}"
            )


class ModuleShardingPlan:
    """The plan of one module (base of every module's plan type)."""


class EmbeddingModuleShardingPlan(ModuleShardingPlan, Dict[str, ParameterSharding]):
    """Parameter (table) name -> ``ParameterSharding`` for one embedding module."""

    def __str__(self) -> str:
        """torchrec's layout: a table of the parameters, then one of their shards (blank lines before)."""
        params = [[name, ps.sharding_type, ps.compute_kernel, ps.ranks] for name, ps in self.items()]
        shards = [
            [name, shard.shard_offsets, shard.shard_sizes, shard.placement]
            for name, ps in self.items()
            if ps.sharding_spec is not None
            for shard in ps.sharding_spec.shards
        ]
        out = "\n\n" + _tabulate(params, ["param", "sharding type", "compute kernel", "ranks"])
        if shards:
            out += "\n\n" + _tabulate(shards, ["param", "shard offsets", "shard sizes", "placement"])
        return out


def _tabulate(rows: List[List[Any]], headers: List[str]) -> str:
    """Columns padded to their widest cell and joined by `` | ``, a dashed line under the header.

    torchrec's layout: header cells centred (``str.center``), body cells left-aligned.
    """
    body = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in [headers, *body]) for i in range(len(headers))]
    lines = [" | ".join(h.center(w) for h, w in zip(headers, widths))]
    lines.append(" | ".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


@dataclasses.dataclass
class ShardingPlan:
    """The plan of a whole model: module path (dot-separated FQN) -> that module's plan."""

    plan: Dict[str, ModuleShardingPlan]

    def get_plan_for_module(self, module_path: str) -> Optional[ModuleShardingPlan]:
        """The plan of the module at ``module_path``, or None when the plan does not shard it."""
        return self.plan.get(module_path)

    def __str__(self) -> str:
        """torchrec's layout: per module ``module: <path>`` and its tables, modules a blank line apart."""
        return "\n\n".join(f"module: {path}{plan}" for path, plan in self.plan.items())


class NullShardedModuleContext:
    """The context of a sharded module that needs none (nothing to carry from input_dist to output_dist)."""

    def record_stream(self, stream: torch.Stream) -> None:
        """Nothing to record (no tensors)."""


class NullShardingContext:
    """The context of a sharding that needs none."""

    def record_stream(self, stream: torch.Stream) -> None:
        """Nothing to record (no tensors)."""


class ShardedModule(abc.ABC, nn.Module, Generic[CompIn, DistOut, Out, ShrdCtx]):
    """A model-parallel module: data-parallel input and output, model-parallel parameters in between.

    Subclasses implement the three steps; ``forward`` chains them::

        ctx = create_context()
        dist_input = input_dist(ctx, *input).wait().wait()   # splits, then tensors (two phases)
        return compute_and_output_dist(ctx, dist_input)      # compute, start output dist -> LazyAwaitable

    ``input_dist`` returns an awaitable of an awaitable so that a pipeline can start the first phase
    (the sizes) of the next batch early and the second (the data) later. ``output_dist`` returns a
    ``LazyAwaitable``: the caller uses it like the result, and it waits only when first used.

    Args:
        qcomm_codecs_registry: ``CommOp`` value -> ``QuantizedCommCodecs`` for the module's
            collectives (None: full precision).
    """

    def __init__(self, qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None) -> None:
        super().__init__()
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @property
    def qcomm_codecs_registry(self) -> Optional[Dict[str, QuantizedCommCodecs]]:
        return self._qcomm_codecs_registry

    @abc.abstractmethod
    def create_context(self) -> ShrdCtx:
        """A fresh context object for one forward (what input_dist records for output_dist)."""

    @abc.abstractmethod
    def input_dist(self, ctx: ShrdCtx, *input: Any, **kwargs: Any) -> Awaitable[Awaitable[CompIn]]:
        """Start sending the data-parallel input to the ranks that own its parameters."""

    @abc.abstractmethod
    def compute(self, ctx: ShrdCtx, dist_input: CompIn) -> DistOut:
        """The local computation on this rank's shards."""

    @abc.abstractmethod
    def output_dist(self, ctx: ShrdCtx, output: DistOut) -> LazyAwaitable[Out]:
        """Start sending the model-parallel output back to the ranks that own the samples."""

    def compute_and_output_dist(self, ctx: ShrdCtx, input: CompIn) -> LazyAwaitable[Out]:
        """``output_dist(ctx, compute(ctx, input))``; override to start each output dist as soon as
        its part of the computation is done when there are several."""
        return self.output_dist(ctx, self.compute(ctx, input))

    def forward(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Out]:
        """input_dist -> compute -> output_dist; returns the output dist's ``LazyAwaitable``."""
        ctx = self.create_context()
        dist_input = self.input_dist(ctx, *input, **kwargs).wait().wait()
        return self.compute_and_output_dist(ctx, dist_input)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Names of the parameters this module holds shards of (all of its parameters by default)."""
        for name, _ in self.named_parameters(prefix):
            yield name


def get_tensor_size_bytes(t: torch.Tensor) -> int:
    """Bytes the tensor's elements occupy (also for a meta tensor, which has no storage)."""
    return t.numel() * t.element_size()


_STORAGE_OF_DEVICE = {"cuda": ParameterStorage.HBM, "mtia": ParameterStorage.HBM, "cpu": ParameterStorage.DDR}


class ModuleSharder(abc.ABC, Generic[M]):
    """Knows how to shard one module type: which sharding types and kernels it supports, and ``shard``.

    Args:
        qcomm_codecs_registry: ``CommOp`` value -> ``QuantizedCommCodecs``, handed to the sharded
            modules it creates.
    """

    def __init__(self, qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None) -> None:
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @property
    def qcomm_codecs_registry(self) -> Optional[Dict[str, QuantizedCommCodecs]]:
        return self._qcomm_codecs_registry

    @property
    @abc.abstractmethod
    def module_type(self) -> Type[M]:
        """The module class this sharder shards."""

    @abc.abstractmethod
    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedModule[Any, Any, Any, Any]:
        """The sharded version of ``module``, its parameters placed as ``params`` says, on ``device``."""

    def shardable_parameters(self, module: M) -> Dict[str, nn.Parameter]:
        """Parameters a plan may shard, by name (all parameters by default)."""
        return dict(module.named_parameters())

    def sharding_types(self, compute_device_type: str) -> List[str]:
        """Sharding types this sharder supports on ``compute_device_type`` (data parallel by default)."""
        return [ShardingType.DATA_PARALLEL.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        """Compute kernels supported for ``sharding_type`` on ``compute_device_type``."""
        return [ComputeKernel.DEFAULT.value]

    def storage_usage(
        self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str
    ) -> Dict[str, int]:
        """Bytes of each storage kind (``ParameterStorage`` value) that ``tensor`` takes on that device."""
        storage = _STORAGE_OF_DEVICE.get(compute_device_type)
        if storage is None:
            raise ValueError(
                f"storage_usage: unknown compute_device_type {compute_device_type!r}; "
                f"known: {sorted(_STORAGE_OF_DEVICE)}"
            )
        return {storage.value: get_tensor_size_bytes(tensor)}


class ShardingPlanner(abc.ABC):
    """Makes a ``ShardingPlan`` for a module and its sharders (implemented in ``shardkit.planner``)."""

    @abc.abstractmethod
    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """The plan for ``module``."""

    @abc.abstractmethod
    def collective_plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """The plan computed on rank 0 and broadcast, so that every rank uses the same one."""


__all__ = [
    "Awaitable",
    "CacheAlgorithm",
    "CacheParams",
    "CacheStatistics",
    "CommOp",
    "ComputeKernel",
    "EmbeddingComputeKernel",
    "EmbeddingModuleShardingPlan",
    "EnumerableShardingSpec",
    "GetItemLazyAwaitable",
    "LazyAwaitable",
    "LazyGetItemMixin",
    "LazyNoWait",
    "ModuleSharder",
    "ModuleShardingPlan",
    "NoOpQuantizedCommCodec",
    "NoWait",
    "NullShardedModuleContext",
    "NullShardingContext",
    "ParameterSharding",
    "ParameterStorage",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "ShardMetadata",
    "ShardedModule",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingPlanner",
    "ShardingType",
    "get_tensor_size_bytes",
]

"""shardkit's built-in shardings behind torchrec's ``EmbeddingSharding`` interface:
``create_embedding_bag_sharding`` (pooled) and ``create_embedding_sharding`` (sequence).

A user-written sharded module gets, for one sharding type and its ``EmbeddingShardingInfo`` list, the
three modules of torchrec's data flow (docs/extension.md)::

    input_dist(features) -> Awaitable[Awaitable[KJT]]   # features: this rank's batch, keys feature_names()
    lookup(kjt) -> local embeddings
    output_dist(local, sharding_ctx) -> Awaitable[Tensor]   # pooled [B, sum embedding_dims()];
                                                            # sequence [ids, dim], keys in input order

each backed by the sharding classes shardkit's own collections use (``table_wise``, ``row_wise``, ...).
The output dist needs what the input dist recorded: the module wraps its input dists' awaitables in
``KJTListSplitsAwaitable(awaitables, ctx)``, whose ``ctx.sharding_contexts[i]`` (an
``EmbeddingShardingContext``) then carries it to output dist ``i`` (``dist_context``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from shardkit.distributed.agreement import gather_objects
from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules.feature_processor import BaseGroupedFeatureProcessor
from shardkit.sharding.embedding import SEQUENCE_SHARDINGS
from shardkit.sharding.embedding_sharding import MappedAwaitable, ShardingContext
from shardkit.sharding.embeddingbag import POOLED_SHARDINGS, column_permutation
from shardkit.sharding.fused_optimizer_config import fused_optimizer_config
from shardkit.sharding.sharded_embedding_module import check_input, place_tables, with_keys
from shardkit.sharding.sharded_embedding_table import ShardedEmbeddingTable
from shardkit.sharding.sharding_infos import EmbeddingShardingInfo
from shardkit.sharding.sharding_interface import (
    BaseEmbeddingDist,
    BaseEmbeddingLookup,
    BaseSparseFeaturesDist,
    EmbeddingSharding,
)
from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sharding.types import EmbeddingComputeKernel, ShardingType
from shardkit.sparse import KeyedJaggedTensor

_FUSED = {
    k.value
    for k in (
        EmbeddingComputeKernel.FUSED,
        EmbeddingComputeKernel.FUSED_UVM,
        EmbeddingComputeKernel.FUSED_UVM_CACHING,
    )
}
# the plan's kernel options ride in a table's fused_params; they are not optimizer settings
_PLAN_OPTIONS = ("cache_params", "enforce_hbm", "stochastic_rounding", "bounds_check_mode")


class _TensorsWithContext(Awaitable[KeyedJaggedTensor]):
    """Phase two of a built-in input dist; ``dist_context`` is what its output dist needs."""

    def __init__(self, inner: Awaitable[KeyedJaggedTensor], dist_context: ShardingContext) -> None:
        super().__init__()
        self._inner, self.dist_context = inner, dist_context

    def _wait_impl(self) -> KeyedJaggedTensor:
        return self._inner.wait()


class _SplitsWithContext(Awaitable[Awaitable[KeyedJaggedTensor]]):
    def __init__(self, inner: Awaitable[Awaitable[KeyedJaggedTensor]], dist_context: ShardingContext) -> None:
        super().__init__()
        self._inner, self.dist_context = inner, dist_context

    def _wait_impl(self) -> _TensorsWithContext:
        return _TensorsWithContext(self._inner.wait(), self.dist_context)


class BuiltinSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Input dist of a built-in sharding: checks the input on every rank (as shardkit's collections do:
    a bad input on one rank is a ``ValueError`` on all), then starts the sharding's KJT all-to-all."""

    def __init__(self, sharding: BuiltinEmbeddingSharding) -> None:
        super().__init__()
        self._sharding = sharding

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        s = self._sharding
        keys_ok = sparse_features.keys() == s.feature_names()
        features = with_keys(sparse_features, s.lookup_keys) if s.renamed and keys_ok else sparse_features

        def keys_check(_: KeyedJaggedTensor) -> None:
            if not keys_ok:
                raise ValueError(
                    f"the input dist takes the keys {s.feature_names()} in this order, got "
                    f"{sparse_features.keys()}"
                )

        # the key check runs inside the cross-rank input check: wrong keys on one rank fail every rank
        check_input(features, s.impl.tables, s.impl.weighted, s.owner, s.impl.env, keys_check)
        ctx = ShardingContext()
        return _SplitsWithContext(s.impl.input_dist(ctx, features), ctx)


class BuiltinEmbeddingLookup(BaseEmbeddingLookup[KeyedJaggedTensor, torch.Tensor]):
    """This rank's shards of a built-in sharding (``lookup``: shardkit's grouped lookup)."""

    def __init__(self, lookup: torch.nn.Module) -> None:
        super().__init__()
        self.lookup = lookup

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return self.lookup(sparse_features)


class BuiltinEmbeddingDist(BaseEmbeddingDist[Any, torch.Tensor, torch.Tensor]):
    """Output dist of a built-in sharding; ``sharding_ctx`` must carry its input dist's context."""

    def __init__(self, sharding: BuiltinEmbeddingSharding) -> None:
        super().__init__()
        self._sharding = sharding

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: Optional[Any] = None
    ) -> Awaitable[torch.Tensor]:
        s = self._sharding
        ctx = (
            sharding_ctx
            if isinstance(sharding_ctx, ShardingContext)
            else getattr(sharding_ctx, "dist_context", None)
        )
        if ctx is None:
            raise ValueError(
                f"{s.owner}: the output dist needs the context its input dist recorded: wrap the input "
                "dists' awaitables in KJTListSplitsAwaitable(awaitables, ctx) and pass "
                "ctx.sharding_contexts[i] "
                "(an EmbeddingShardingContext) here"
            )
        out = s.impl.output_dist(ctx, local_embs)
        if s.pooled:
            runs = s.output_permutation
            return out if runs is None else MappedAwaitable(out, lambda v: v[:, runs])
        keys = s.lookup_keys
        return MappedAwaitable(out, lambda rows: torch.cat([rows[k] for k in keys], dim=0))


class BuiltinEmbeddingSharding(EmbeddingSharding[Any, KeyedJaggedTensor, torch.Tensor, torch.Tensor]):
    """One sharding type of shardkit's (``sharding_type``) over ``sharding_infos``' tables; see the module
    docstring. All infos must have that sharding type, one compute kernel and, for a fused kernel,
    the same optimizer; ``ValueError`` naming the tables otherwise."""

    def __init__(
        self,
        sharding_type: str,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
        pooled: bool,
        permute_embeddings: bool,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]],
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        self.owner = (
            f"{'create_embedding_bag_sharding' if pooled else 'create_embedding_sharding'}({sharding_type!r})"
        )
        classes = POOLED_SHARDINGS if pooled else SEQUENCE_SHARDINGS
        problem, checked = None, None
        try:
            checked = self._check(sharding_type, sharding_infos, classes)
        except (ValueError, TypeError, KeyError) as err:
            problem = f"{type(err).__name__}: {err}"
        # the ranks agree before any of them goes on to the plan's agreement (no rank left waiting)
        problems = [f"rank {r}: {p}" for r, p in enumerate(gather_objects(problem, env.process_group)) if p]
        if problems:
            raise ValueError(f"{self.owner}: " + "; ".join(problems))
        optimizer, weighted = checked
        self.pooled, self.env, self._infos = pooled, env, list(sharding_infos)
        # inside, every (table, feature) lookup has its own key: its embedding name
        configs = []
        for info in sharding_infos:
            c = info.embedding_config
            lookup_names = list(c.embedding_names) or list(c.feature_names)
            configs.append(dataclasses.replace(c, feature_names=lookup_names, embedding_names=lookup_names))
        self._features = [f for i in sharding_infos for f in i.embedding_config.feature_names]
        self.lookup_keys = [f for c in configs for f in c.feature_names]
        self.renamed = self.lookup_keys != self._features
        # every rank checks the plan against the tables and the ranks agree on both (ValueError on all)
        plan = {c.name: i.param_sharding for c, i in zip(configs, sharding_infos)}
        placed = place_tables(configs, plan, env, optimizer)
        self.impl = classes[sharding_type](
            placed, env, pooled, optimizer, device, qcomm_codecs_registry, weighted
        )
        self._permute = permute_embeddings
        self.output_permutation: Optional[List[int]] = None
        if pooled:
            blocks = self.impl.output_layout()
            dims = {f: c.embedding_dim for c in configs for f in c.feature_names}
            self._blocks = blocks
            if permute_embeddings:
                self.output_permutation = column_permutation(blocks, self.lookup_keys, dims)

    def _check(self, sharding_type: str, sharding_infos: List[EmbeddingShardingInfo], classes) -> tuple:
        """(fused optimizer config or None, weighted) of the infos; ``ValueError`` naming what is wrong."""
        if sharding_type not in classes:
            raise ValueError(f"unknown sharding type; known: {list(classes)}")
        if not sharding_infos:
            raise ValueError("no tables (sharding_infos is empty)")
        names = [i.embedding_config.name for i in sharding_infos]
        wrong = [n for n, i in zip(names, sharding_infos) if i.param_sharding.sharding_type != sharding_type]
        kernels = {i.param_sharding.compute_kernel for i in sharding_infos}
        weighted = {bool(i.embedding_config.is_weighted) for i in sharding_infos}
        if wrong or len(kernels) > 1 or len(weighted) > 1:
            raise ValueError(
                "every table needs this sharding type, one compute kernel and one weightedness; tables "
                f"{names}: other types {wrong}, kernels {sorted(kernels)}, weighted {sorted(weighted)}"
            )
        kernel = kernels.pop()
        if kernel not in _FUSED:
            return None, weighted.pop()
        settings = [
            {k: v for k, v in (i.fused_params or {}).items() if k not in _PLAN_OPTIONS}
            for i in sharding_infos
        ]
        if any(s != settings[0] for s in settings):
            raise ValueError(f"the fused tables {names} have different fused_params {settings}")
        optimizer = fused_optimizer_config(settings[0])
        if optimizer is None:
            raise ValueError(f"tables {names} use the {kernel} kernel but no fused_params optimizer")
        return optimizer, weighted.pop()

    # -- the three modules
    def create_input_dist(self, device: Optional[torch.device] = None) -> BuiltinSparseFeaturesDist:
        return BuiltinSparseFeaturesDist(self)

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BuiltinEmbeddingLookup:
        """A new lookup of this rank's shards, copied from the infos' parameters (initialized from the
        configs where those are on the meta device). A feature processor or other fused_params than
        the infos' are a ``ValueError``: the built-in lookups take them from the infos only."""
        if feature_processor is not None:
            raise ValueError(
                f"{self.owner}: the built-in lookups take no feature_processor "
                "(FeatureProcessedEmbeddingBagCollection runs one before its lookups)"
            )
        if fused_params and any(fused_params != (i.fused_params or {}) for i in self._infos):
            raise ValueError(
                f"{self.owner}: create_lookup's fused_params {fused_params} differ from the tables' "
                "(give them through the sharding infos)"
            )
        lookup = self.impl.create_lookup()
        params = {c.name: i.param for c, i in zip(self.impl.tables, self._infos)}
        if all(p.device.type != "meta" for p in params.values()):
            lookup.load_tables(lambda name: params[name].detach())
        return BuiltinEmbeddingLookup(lookup)

    def create_output_dist(self, device: Optional[torch.device] = None) -> BuiltinEmbeddingDist:
        return BuiltinEmbeddingDist(self)

    # -- what the sharding produces
    def _holders(self, table) -> List[int]:
        if table.sharding_type == ShardingType.DATA_PARALLEL.value:
            return list(range(self.env.world_size))
        return sorted({s.rank for s in table.shards if not s.empty})

    def feature_names(self) -> List[str]:
        return list(self._features)

    def feature_names_per_rank(self) -> List[List[str]]:
        return [
            [
                f
                for t, i in zip(self.impl.tables, self._infos)
                if r in self._holders(t)
                for f in i.embedding_config.feature_names
            ]
            for r in range(self.env.world_size)
        ]

    def features_per_rank(self) -> List[int]:
        return [len(names) for names in self.feature_names_per_rank()]

    def embedding_names(self) -> List[str]:
        if self.pooled and not self._permute:
            return [f for f, _, _ in self._blocks]
        return list(self.lookup_keys)

    def embedding_dims(self) -> List[int]:
        if self.pooled and not self._permute:
            return [c1 - c0 for _, c0, c1 in self._blocks]
        return [t.config.embedding_dim for t in self.impl.tables for _ in t.config.feature_names]

    def uncombined_embedding_names(self) -> List[str]:
        return [f for f, _, _ in self._blocks] if self.pooled else self.embedding_names()

    def uncombined_embedding_dims(self) -> List[int]:
        return [c1 - c0 for _, c0, c1 in self._blocks] if self.pooled else self.embedding_dims()

    def embedding_names_per_rank(self) -> List[List[str]]:
        return [
            [f for t in self.impl.tables if r in self._holders(t) for f in t.config.feature_names]
            for r in range(self.env.world_size)
        ]

    def _local_shard(self, table) -> Optional[ShardMetadata]:
        for shard in table.shards:
            if shard.rank == self.env.rank and not shard.empty:
                return ShardMetadata(
                    [shard.row_start, shard.col_start],
                    [shard.row_end - shard.row_start, shard.col_end - shard.col_start],
                    f"rank:{shard.rank}/{self.impl.device or 'cpu'}",
                )
        return None

    def embedding_shard_metadata(self) -> List[Optional[ShardMetadata]]:
        return [self._local_shard(t) for t in self.impl.tables for _ in t.config.feature_names]

    def embedding_tables(self) -> List[ShardedEmbeddingTable]:
        """This rank's tables: each with its local shard's size and metadata."""
        out = []
        for t, info in zip(self.impl.tables, self._infos):
            if self.env.rank not in self._holders(t):
                continue
            meta = self._local_shard(t)
            rows, cols = (
                (t.config.num_embeddings, t.config.embedding_dim) if meta is None else meta.shard_sizes
            )
            fields = {
                f.name: getattr(info.embedding_config, f.name)
                for f in dataclasses.fields(info.embedding_config)
            }
            out.append(
                ShardedEmbeddingTable(
                    **fields,
                    compute_kernel=EmbeddingComputeKernel(t.compute_kernel),
                    local_rows=rows,
                    local_cols=cols,
                    local_metadata=meta,
                    fused_params=info.fused_params,
                )
            )
        return out


def create_embedding_bag_sharding(
    sharding_type: str,
    sharding_infos: List[EmbeddingShardingInfo],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    permute_embeddings: bool = False,
    qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
) -> BuiltinEmbeddingSharding:
    """The pooled ``EmbeddingSharding`` of ``sharding_type`` over ``sharding_infos``' tables.

    Its output dist delivers ``[B_me, sum(embedding_dims())]`` with columns named
    ``embedding_names()``: with ``permute_embeddings`` in table / feature order, each feature's column
    blocks joined; without, in the sharding's own block order (``uncombined_embedding_names()``, a
    column-wise table's feature once per block)."""
    return BuiltinEmbeddingSharding(
        sharding_type, sharding_infos, env, device, True, permute_embeddings, qcomm_codecs_registry
    )


def create_embedding_sharding(
    sharding_type: str,
    sharding_infos: List[EmbeddingShardingInfo],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
) -> BuiltinEmbeddingSharding:
    """The sequence ``EmbeddingSharding`` of ``sharding_type`` over ``sharding_infos``' tables; its output
    dist delivers ``[ids of this rank's input, embedding_dim]``, keys in ``feature_names()`` order (one
    embedding width for all its tables, as torchrec's)."""
    return BuiltinEmbeddingSharding(
        sharding_type, sharding_infos, env, device, False, False, qcomm_codecs_registry
    )


__all__ = [
    "BuiltinEmbeddingDist",
    "BuiltinEmbeddingLookup",
    "BuiltinEmbeddingSharding",
    "BuiltinSparseFeaturesDist",
    "create_embedding_bag_sharding",
    "create_embedding_sharding",
]

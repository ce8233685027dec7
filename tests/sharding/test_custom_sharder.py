"""A user-written sharded module in torchrec's style trains under DistributedModelParallel.

The module is a two-tower model whose towers are "embedding towers" (an EmbeddingBagCollection and an
interaction layer on top of it). Its sharder is written here the way a torchrec user writes one, only
from the extension API (torchrec's import paths, ``shardkit.distributed.*``):

- ``EmbeddingTowerSharder`` (a ``ModuleSharder``) puts a whole tower, tables and interaction, on one rank
  (the rank its tables' table-wise plan names);
- ``TowerSharding`` (an ``EmbeddingSharding``) builds the tower's dists from ``BaseSparseFeaturesDist``
  (a ``KJTAllToAll`` sending the tower's features of every rank's samples to the owner) and
  ``BaseEmbeddingDist`` (a ``PooledEmbeddingsAllToAll`` sending the interaction's output back), and its
  lookup (``BaseEmbeddingLookup``) runs the tower on the owner;
- ``ShardedEmbeddingTower`` (a ``ShardedModule``) chains them with ``EmbeddingBagCollectionContext``,
  ``EmbeddingShardingContext``, ``KJTListSplitsAwaitable`` and ``EmbeddingBagCollectionAwaitable``.

At world size 2 each tower lives on its own rank; forward values and every weight after a few SGD
steps equal those of the unsharded twin trained on the global batches. A second test runs shardkit's
built-in shardings through the same interface (``create_sharding_infos_by_sharding`` +
``create_embedding_bag_sharding``) in a user's module and compares with the unsharded collection.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Type

import pytest
import torch
from torch import nn

from shardkit.distributed.dist_data import KJTAllToAll, PooledEmbeddingsAllToAll
from shardkit.distributed.embedding import (
    EmbeddingCollectionAwaitable,
    EmbeddingCollectionContext,
    create_embedding_sharding,
)
from shardkit.distributed.embedding import (
    create_sharding_infos_by_sharding as create_ec_sharding_infos_by_sharding,
)
from shardkit.distributed.embedding_lookup import embeddings_cat_empty_rank_handle, fx_wrap_tensor_view2d
from shardkit.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingSharding,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
    KJTListSplitsAwaitable,
)
from shardkit.distributed.embedding_types import (
    BaseEmbeddingLookup,
    FeatureShardingMixIn,
    KJTList,
    ModuleShardingMixIn,
)
from shardkit.distributed.embeddingbag import (
    EmbeddingBagCollectionAwaitable,
    EmbeddingBagCollectionContext,
    construct_output_kt,
    create_embedding_bag_sharding,
    create_sharding_infos_by_sharding,
)
from shardkit.distributed.model_parallel import DistributedModelParallel
from shardkit.distributed.sharding.sequence_sharding import SequenceShardingContext
from shardkit.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.distributed.types import (
    Awaitable,
    LazyAwaitable,
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
    ShardingPlan,
)
from shardkit.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from shardkit.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from shardkit.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from shardkit.testing import run_world

BATCH = 4  # per rank
OUT = 3  # each tower's output width
LR = 0.5
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-6)

QUERY_TABLES = [("q_user", 20, 4, ["user"]), ("q_hist", 16, 6, ["hist"])]
ITEM_TABLES = [("i_item", 24, 5, ["item", "cat"])]
FEATURES = ["user", "hist", "item", "cat"]
ROWS = {"user": 20, "hist": 16, "item": 24, "cat": 24}


# ---- the unsharded model -------------------------------------------------------------------------


class TowerInteraction(nn.Module):
    """The tower's layer over its pooled embeddings: ``[B, sum dims] -> [B, OUT]``."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, embeddings: KeyedTensor) -> torch.Tensor:
        return torch.tanh(self.linear(embeddings.values()))


class EmbeddingTower(nn.Module):
    """An EmbeddingBagCollection and its interaction; returns a KeyedTensor with one key, ``name``."""

    def __init__(self, name: str, embedding: EmbeddingBagCollection, interaction: TowerInteraction) -> None:
        super().__init__()
        self.name = name
        self.embedding = embedding
        self.interaction = interaction

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        out = self.interaction(self.embedding(select(features, self.feature_names())))
        return construct_output_kt([out], [self.name], [out.size(1)])

    def feature_names(self) -> List[str]:
        return [f for t in self.embedding.embedding_bag_configs() for f in t.feature_names]


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = _tower("query", QUERY_TABLES)
        self.item = _tower("item", ITEM_TABLES)
        self.over = nn.Linear(2 * OUT, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        q, i = self.query(features), self.item(features)
        return self.over(torch.cat([q.values(), i.values()], dim=1)).squeeze(1)


def _tower(name: str, tables) -> EmbeddingTower:
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=fs)
        for t, n, d, fs in tables
    ]
    ebc = EmbeddingBagCollection(tables=configs)
    return EmbeddingTower(name, ebc, TowerInteraction(sum(d * len(fs) for _, _, d, fs in tables), OUT))


def select(features: KeyedJaggedTensor, names: List[str]) -> KeyedJaggedTensor:
    keys = features.keys()
    return features.permute([keys.index(n) for n in names])


# ---- the user's sharded tower, torchrec style ----------------------------------------------------


class TowerSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Every rank's samples of the tower's features to the owner rank (one KJT all-to-all)."""

    def __init__(self, pg, world_size: int, owner: int, num_features: int) -> None:
        super().__init__()
        self._dist = KJTAllToAll(pg, [num_features if r == owner else 0 for r in range(world_size)])

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self._dist(sparse_features)


class TowerLookup(BaseEmbeddingLookup[KeyedJaggedTensor, torch.Tensor]):
    """The owner runs the tower on the global batch: ``[sum of batches, OUT]``; other ranks return an
    empty ``[batch, 0]`` that requires grad (as torchrec's lookups on a rank without shards do), so that
    their output dist takes part in the backward all-to-all."""

    def __init__(self, tower: Optional[EmbeddingTower]) -> None:
        super().__init__()
        self.tower = tower
        self._dummy = torch.empty([0], requires_grad=True)

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if self.tower is None:
            empty = embeddings_cat_empty_rank_handle([], self._dummy)
            return fx_wrap_tensor_view2d(empty, sparse_features.stride(), 0)
        return self.tower.interaction(self.tower.embedding(sparse_features))


class TowerEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]):
    """The owner's ``[global batch, OUT]`` back to the samples' ranks (a pooled all-to-all)."""

    def __init__(self, pg, world_size: int, owner: int, out_dim: int) -> None:
        super().__init__()
        self._dist = PooledEmbeddingsAllToAll(pg, [out_dim if r == owner else 0 for r in range(world_size)])

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: Optional[EmbeddingShardingContext] = None
    ) -> Awaitable[torch.Tensor]:
        batches = sharding_ctx.batch_size_per_rank if sharding_ctx is not None else None
        return self._dist(local_embs, batch_size_per_rank=batches or None)


class TowerSharding(
    EmbeddingSharding[EmbeddingShardingContext, KeyedJaggedTensor, torch.Tensor, torch.Tensor]
):
    """A whole tower on one rank: the owner every one of its tables' plans names."""

    def __init__(self, tower: EmbeddingTower, infos: List[EmbeddingShardingInfo], env: ShardingEnv) -> None:
        super().__init__()
        owners = {r for info in infos for r in info.param_sharding.ranks}
        if len(owners) != 1:
            raise ValueError(
                f"tower {tower.name!r}: its tables are planned on ranks {sorted(owners)}, not one"
            )
        self.owner, self.env, self.tower, self.infos = owners.pop(), env, tower, infos

    def create_input_dist(self, device=None) -> TowerSparseFeaturesDist:
        return TowerSparseFeaturesDist(
            self.env.process_group, self.env.world_size, self.owner, len(self.feature_names())
        )

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> TowerLookup:
        return TowerLookup(self.tower if self.env.rank == self.owner else None)

    def create_output_dist(self, device=None) -> TowerEmbeddingDist:
        return TowerEmbeddingDist(self.env.process_group, self.env.world_size, self.owner, OUT)

    def feature_names(self) -> List[str]:
        return [f for info in self.infos for f in info.embedding_config.feature_names]

    def feature_names_per_rank(self) -> List[List[str]]:
        return [self.feature_names() if r == self.owner else [] for r in range(self.env.world_size)]

    def features_per_rank(self) -> List[int]:
        return [len(names) for names in self.feature_names_per_rank()]

    def embedding_dims(self) -> List[int]:
        return [OUT]

    def embedding_names(self) -> List[str]:
        return [self.tower.name]

    def embedding_names_per_rank(self) -> List[List[str]]:
        return [self.embedding_names() if r == self.owner else [] for r in range(self.env.world_size)]

    def embedding_shard_metadata(self):
        return [None]


class ShardedEmbeddingTower(
    ShardedModule[KJTList, List[torch.Tensor], KeyedTensor, EmbeddingBagCollectionContext],
    ModuleShardingMixIn,
):
    def __init__(self, module: EmbeddingTower, params, env: ShardingEnv, device=None) -> None:
        super().__init__()
        infos = create_sharding_infos_by_sharding(module.embedding, params, "embedding.", None)
        if list(infos) != ["table_wise"]:
            raise ValueError(f"tower {module.name!r}: a tower is sharded table_wise only, got {list(infos)}")
        self._sharding = TowerSharding(module, infos["table_wise"], env)
        self._features = self._sharding.feature_names()
        self._input_dist = self._sharding.create_input_dist()
        self._lookup = self._sharding.create_lookup()
        self._output_dist = self._sharding.create_output_dist()

    @property
    def shardings(self) -> Dict[str, FeatureShardingMixIn]:
        return {"table_wise": self._sharding}

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext(sharding_contexts=[EmbeddingShardingContext()])

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor):
        return KJTListSplitsAwaitable([self._input_dist(select(features, self._features))], ctx)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> List[torch.Tensor]:
        return [self._lookup(dist_input[0])]

    def output_dist(
        self, ctx: EmbeddingBagCollectionContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        awaitables = [self._output_dist(output[0], ctx.sharding_contexts[0])]
        return EmbeddingBagCollectionAwaitable(
            awaitables, self._sharding.embedding_dims(), self._sharding.embedding_names()
        )


class EmbeddingTowerSharder(ModuleSharder[EmbeddingTower]):
    @property
    def module_type(self) -> Type[EmbeddingTower]:
        return EmbeddingTower

    def shard(self, module: EmbeddingTower, params, env: ShardingEnv, device=None) -> ShardedEmbeddingTower:
        return ShardedEmbeddingTower(module, params, env, device)

    def shardable_parameters(self, module: EmbeddingTower) -> Dict[str, nn.Parameter]:
        return {
            t.name: module.embedding.table_weight(t.name) for t in module.embedding.embedding_bag_configs()
        }

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return ["table_wise"]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return ["dense"]


# ---- data and the workers ------------------------------------------------------------------------


def batch(step: int, rank: int) -> tuple:
    """Rank ``rank``'s samples of step ``step``: features (some empty bags) and labels."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 3, (len(FEATURES), BATCH), generator=g)
    values = [
        torch.randint(0, ROWS[f], (int(lengths[i].sum()),), generator=g) for i, f in enumerate(FEATURES)
    ]
    kjt = KeyedJaggedTensor(FEATURES, torch.cat(values), lengths=lengths.flatten())
    return kjt, torch.rand(BATCH, generator=g)


def global_batch(step: int, world_size: int) -> tuple:
    parts = [batch(step, r) for r in range(world_size)]
    kjts = [p[0] for p in parts]
    lengths = torch.cat([k.lengths().view(len(FEATURES), -1) for k in kjts], dim=1)
    values = torch.cat([v for f in FEATURES for k in kjts for v in [k[f].values()]])
    return KeyedJaggedTensor(FEATURES, values, lengths=lengths.flatten()), torch.cat([p[1] for p in parts])


def _loss(model: nn.Module, features: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(features), labels)


def _tower_worker() -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = TwoTower()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    sharder = EmbeddingTowerSharder()
    plan = ShardingPlan(
        {
            name: construct_module_sharding_plan(
                getattr(model, name).embedding,
                {t: table_wise(rank=owner) for t, *_ in tables},
                world_size=world,
            )
            for name, owner, tables in (("query", 0, QUERY_TABLES), ("item", 1, ITEM_TABLES))
        }
    )
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    sharded = {
        name: isinstance(getattr(dmp.module, name), ShardedEmbeddingTower) for name in ("query", "item")
    }
    optimizer = torch.optim.SGD(dmp.parameters(), lr=LR)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    forward_diffs, losses = [], []
    for step in range(STEPS):
        features, labels = batch(step, rank)
        out = dmp(features)
        loss = nn.functional.binary_cross_entropy_with_logits(out, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        g_features, g_labels = global_batch(step, world)
        ref_out = reference(g_features)
        forward_diffs.append((out - ref_out[rank * BATCH : (rank + 1) * BATCH]).abs().max().item())
        ref_optimizer.zero_grad()
        ref_loss = nn.functional.binary_cross_entropy_with_logits(ref_out, g_labels)
        ref_loss.backward()
        ref_optimizer.step()
        losses.append(loss.item())
    # weights: the towers on their owners, the over-arch on every rank
    mine = dmp.module
    owned = "query" if rank == 0 else "item"
    tower, ref_tower = getattr(mine, owned)._lookup.tower, getattr(reference, owned)
    weight_diffs = {
        f"{owned}.table.{t.name}": (
            tower.embedding.table_weight(t.name) - ref_tower.embedding.table_weight(t.name)
        )
        .abs()
        .max()
        .item()
        for t in ref_tower.embedding.embedding_bag_configs()
    }
    for name, p in tower.interaction.named_parameters():
        weight_diffs[f"{owned}.interaction.{name}"] = (
            (p - dict(ref_tower.interaction.named_parameters())[name]).abs().max().item()
        )
    for name, p in mine.over.named_parameters():
        weight_diffs[f"over.{name}"] = (p - dict(reference.over.named_parameters())[name]).abs().max().item()
    # the other tower has no parameter on this rank
    other = "item" if rank == 0 else "query"
    other_params = sum(p.numel() for p in getattr(mine, other).parameters())
    moved = max(
        (ref_tower.embedding.table_weight(t.name) - getattr(initial, owned).embedding.table_weight(t.name))
        .abs()
        .max()
        .item()
        for t in ref_tower.embedding.embedding_bag_configs()
    )
    return dict(
        sharded=sharded,
        forward=forward_diffs,
        weights=weight_diffs,
        other_params=other_params,
        moved=moved,
        losses=losses,
    )


def test_two_tower_custom_sharder_trains_like_unsharded_twin():
    results = run_world(_tower_worker, 2)
    for rank, r in enumerate(results):
        assert r["sharded"] == {"query": True, "item": True}, r["sharded"]
        assert max(r["forward"]) < 1e-5, (rank, r["forward"])
        assert all(d < 1e-5 for d in r["weights"].values()), (rank, r["weights"])
        assert r["other_params"] == 0, rank
        # training moved the tables (the comparison is not between untouched weights)
        assert r["moved"] > 1e-3, (rank, r["moved"])


# ---- shardkit's built-in shardings through the same interface ------------------------------------

EBC_TABLES = [("t0", 12, 4, ["f0"]), ("t1", 10, 6, ["f1", "f2"]), ("t2", 14, 4, ["f0"])]
EBC_FEATURES = ["f0", "f1", "f2"]


class UserShardedEBC(nn.Module):
    """A user's pooled module: one built-in sharding per sharding type, chained as torchrec does."""

    def __init__(self, module: EmbeddingBagCollection, params, env: ShardingEnv) -> None:
        super().__init__()
        infos = create_sharding_infos_by_sharding(module, params, "embedding_bags.", None)
        self.shardings = [
            create_embedding_bag_sharding(kind, i, env, permute_embeddings=True) for kind, i in infos.items()
        ]
        self.input_dists = nn.ModuleList(s.create_input_dist() for s in self.shardings)
        self.lookups = nn.ModuleList(s.create_lookup() for s in self.shardings)
        self.output_dists = nn.ModuleList(s.create_output_dist() for s in self.shardings)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        ctx = EmbeddingBagCollectionContext(
            sharding_contexts=[EmbeddingShardingContext() for _ in self.shardings]
        )
        parts = [
            dist(select(features, s.feature_names())) for s, dist in zip(self.shardings, self.input_dists)
        ]
        dist_input = KJTListSplitsAwaitable(parts, ctx).wait().wait()
        embs = [lookup(kjt) for lookup, kjt in zip(self.lookups, dist_input)]
        out = [dist(e, c) for dist, e, c in zip(self.output_dists, embs, ctx.sharding_contexts)]
        names = [n for s in self.shardings for n in s.embedding_names()]
        dims = [d for s in self.shardings for d in s.embedding_dims()]
        return EmbeddingBagCollectionAwaitable(out, dims, names).wait()


def _builtin_worker(kind: str) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(1)
    configs = [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=fs)
        for t, n, d, fs in EBC_TABLES
    ]
    ebc = EmbeddingBagCollection(tables=configs)
    generators = {
        "table_wise": lambda i: table_wise(rank=i % world),
        "row_wise": lambda i: row_wise(),
        "column_wise": lambda i: column_wise(ranks=[0, 1]),
        "data_parallel": lambda i: data_parallel(),
        "mixed": lambda i: [table_wise(rank=1), row_wise(), column_wise(ranks=[1, 0])][i],
    }[kind]
    params = construct_module_sharding_plan(
        ebc, {t: generators(i) for i, (t, *_) in enumerate(EBC_TABLES)}, world_size=world
    )
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    user = UserShardedEBC(ebc, params, env)
    g = torch.Generator().manual_seed(7)
    diffs, grads = [], []
    for _ in range(2):
        per_rank = []
        for _ in range(world):
            lengths = torch.randint(0, 3, (len(EBC_FEATURES), BATCH), generator=g)
            values = torch.cat([torch.randint(0, 10, (int(n),), generator=g) for n in lengths.sum(1)])
            per_rank.append(KeyedJaggedTensor(EBC_FEATURES, values, lengths=lengths.flatten()))
        out = user(per_rank[rank])
        expected = ebc(per_rank[rank])
        diffs.append(max((out[k] - expected[k]).abs().max().item() for k in expected.keys()))
        diffs.append(float(sorted(out.keys()) != sorted(expected.keys())))
        out.values().sum().backward()
    for lookup in user.lookups:
        grads.append(sum(0 if p.grad is None else int(p.grad.abs().sum() > 0) for p in lookup.parameters()))
    return dict(diffs=diffs, grads=grads, names=[s.embedding_names() for s in user.shardings])


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"])
def test_builtin_shardings_through_the_extension_interface(kind):
    results = run_world(_builtin_worker, 2, kind)
    for rank, r in enumerate(results):
        assert max(r["diffs"]) < 1e-6, (rank, r)
        assert sum(r["grads"]) > 0, (rank, r)


def _missing_context_worker() -> str:
    world = torch.distributed.get_world_size()
    configs = [EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="t", feature_names=["f"])]
    ebc = EmbeddingBagCollection(tables=configs)
    params = construct_module_sharding_plan(ebc, {"t": table_wise(rank=0)}, world_size=world)
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    infos = create_sharding_infos_by_sharding(ebc, params, "embedding_bags.", None)
    sharding = create_embedding_bag_sharding("table_wise", infos["table_wise"], env)
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    received = sharding.create_input_dist()(kjt).wait().wait()
    local = sharding.create_lookup()(received)
    try:
        sharding.create_output_dist()(local, EmbeddingShardingContext())
    except ValueError as err:
        return str(err)
    return "no error"


def test_builtin_output_dist_without_its_input_context_is_a_clear_error():
    for message in run_world(_missing_context_worker, 2):
        assert "KJTListSplitsAwaitable" in message, message


# ---- sequence shardings through the interface ----------------------------------------------------

EC_TABLES = [("e0", 12, 4, ["f0"]), ("e1", 10, 4, ["f1", "f2"])]


class UserShardedEC(nn.Module):
    """A user's sequence module: built-in sequence shardings, chained as torchrec's EC does."""

    def __init__(self, module: EmbeddingCollection, params, env: ShardingEnv) -> None:
        super().__init__()
        infos = create_ec_sharding_infos_by_sharding(module, params, None)
        self.shardings = [create_embedding_sharding(kind, i, env) for kind, i in infos.items()]
        self.input_dists = nn.ModuleList(s.create_input_dist() for s in self.shardings)
        self.lookups = nn.ModuleList(s.create_lookup() for s in self.shardings)
        self.output_dists = nn.ModuleList(s.create_output_dist() for s in self.shardings)

    def forward(self, features: KeyedJaggedTensor):
        ctx = EmbeddingCollectionContext(
            sharding_contexts=[SequenceShardingContext() for _ in self.shardings]
        )
        inputs = [select(features, s.feature_names()) for s in self.shardings]
        parts = [dist(x) for dist, x in zip(self.input_dists, inputs)]
        dist_input = KJTListSplitsAwaitable(parts, ctx).wait().wait()
        embs = [lookup(kjt) for lookup, kjt in zip(self.lookups, dist_input)]
        out = [dist(e, c) for dist, e, c in zip(self.output_dists, embs, ctx.sharding_contexts)]
        names = [s.embedding_names() for s in self.shardings]
        return EmbeddingCollectionAwaitable(out, inputs, names, ctx).wait()


def _sequence_worker(kind: str) -> list:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(2)
    configs = [
        EmbeddingConfig(num_embeddings=n, embedding_dim=d, name=t, feature_names=fs)
        for t, n, d, fs in EC_TABLES
    ]
    ec = EmbeddingCollection(tables=configs)
    generators = {
        "table_wise": lambda i: table_wise(rank=i % world),
        "row_wise": lambda i: row_wise(),
        "data_parallel": lambda i: data_parallel(),
        "mixed": lambda i: [row_wise(), table_wise(rank=1)][i],
    }[kind]
    params = construct_module_sharding_plan(
        ec, {t: generators(i) for i, (t, *_) in enumerate(EC_TABLES)}, world_size=world
    )
    user = UserShardedEC(ec, params, ShardingEnv.from_process_group(torch.distributed.group.WORLD))
    g = torch.Generator().manual_seed(3)
    diffs = []
    for _ in range(2):
        per_rank = []
        for _ in range(world):
            lengths = torch.randint(0, 3, (3, BATCH), generator=g)
            values = torch.cat([torch.randint(0, 10, (int(n),), generator=g) for n in lengths.sum(1)])
            per_rank.append(KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=lengths.flatten()))
        out, expected = user(per_rank[rank]), ec(per_rank[rank])
        diffs.append(float(sorted(out) != sorted(expected)))
        for key in expected:
            diffs.append(
                (out[key].values() - expected[key].values()).abs().max().item()
                if expected[key].values().numel()
                else 0.0
            )
            diffs.append(float(not torch.equal(out[key].lengths(), expected[key].lengths())))
    return diffs


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "data_parallel", "mixed"])
def test_builtin_sequence_shardings_through_the_extension_interface(kind):
    for rank, diffs in enumerate(run_world(_sequence_worker, 2, kind)):
        assert max(diffs) < 1e-6, (rank, diffs)


def _disagreement_worker(case: str) -> str:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    configs = [EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="t", feature_names=["f", "g"])]
    ebc = EmbeddingBagCollection(tables=configs)
    owner = rank if case == "plan" else 0  # "plan": each rank plans the table on itself
    params = construct_module_sharding_plan(ebc, {"t": table_wise(rank=owner)}, world_size=world)
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    infos = create_sharding_infos_by_sharding(ebc, params, "embedding_bags.", None)
    kind = "row_wise" if case == "type" and rank == 1 else "table_wise"  # "type": rank 1 asks for another
    try:
        sharding = create_embedding_bag_sharding(kind, infos["table_wise"], env)
        keys = ["g", "f"] if case == "keys" and rank == 1 else ["f", "g"]  # "keys": rank 1's are swapped
        kjt = KeyedJaggedTensor(keys, torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
        sharding.create_input_dist()(kjt).wait().wait()
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("case", ["plan", "type", "keys"])
def test_a_disagreement_between_ranks_is_an_error_on_every_rank(case):
    expected = {
        "plan": "ranks disagree on the tables or the sharding plan",
        "type": "rank 1: ValueError: every table needs this sharding type",
        "keys": "rank 1: ValueError: ",
    }[case]
    for message in run_world(_disagreement_worker, 2, case, timeout=300):
        assert expected in message, message

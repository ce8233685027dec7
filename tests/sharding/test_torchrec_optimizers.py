"""Optimizers the torchrec way: ``fused_params`` on the sharder and ``_apply_optimizer_in_backward`` on
the collection select the fused kernel and train the tables like the unsharded module's fused
optimizer; the fused tables carry torchrec's in-backward marker, so ``in_backward_optimizer_filter``
builds the dense optimizer without them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.optim import RowWiseAdagrad, apply_optimizer_in_backward, in_backward_optimizer_filter
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.fused_optimizer_config import fused_optimizer_config
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

LR = 0.1
FEATURES = [("f0", 11), ("f1", 7)]


def _ebc(fused=None) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(rows, 3, name=f"t_{f}", feature_names=[f]) for f, rows in FEATURES]
    return EmbeddingBagCollection(tables, fused_optimizer=fused)


def test_fused_params_spellings_map_onto_one_config():
    expected = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=LR)
    for optimizer in ("EXACT_ROWWISE_ADAGRAD", "rowwise_adagrad", OptimType.ROWWISE_ADAGRAD, RowWiseAdagrad):
        assert (
            fused_optimizer_config({"optimizer": optimizer, "learning_rate": LR, "weight_decay": 0.0})
            == expected
        )
    adam = fused_optimizer_config({"optimizer": torch.optim.Adam, "lr": LR, "beta1": 0.8})
    assert adam.optimizer is OptimType.ADAM and adam.betas == (0.8, 0.999)
    with pytest.raises(ValueError, match="weight_decay=0.01 is not supported by the fused kernels"):
        fused_optimizer_config({"optimizer": "ADAGRAD", "weight_decay": 0.01})
    with pytest.raises(ValueError, match="has no fused kernel"):
        EmbeddingBagCollectionSharder(fused_params={"optimizer": "LAMB"})


def test_dense_row_wise_adagrad_in_backward_trains_like_the_fused_one():
    fused, dense = _ebc(FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=LR)), _ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, dense.parameters(), {"lr": LR})
    assert [n for n, _ in in_backward_optimizer_filter(dense.named_parameters())] == []
    assert [n for n, _ in in_backward_optimizer_filter(fused.named_parameters())] == []  # marked too
    for step in range(3):
        kjt = case.to_kjt(case.batch_rows(step, 0, FEATURES))
        grad = torch.randn(kjt.stride(), 6, generator=torch.Generator().manual_seed(step))
        for module in (fused, dense):
            (module(kjt).values() * grad).sum().backward()
    for name, _ in FEATURES:
        torch.testing.assert_close(dense.table_weight(f"t_{name}"), fused.table_weight(f"t_{name}"))


def _check_torchrec_optimizer_requests_train_like_the_fused_module() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = ShardingEnv.from_process_group(None)
    reference = _ebc(FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=LR))
    in_backward = _ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, in_backward.parameters(), {"lr": LR})
    gens = {"t_f0": table_wise(rank=1, compute_kernel="fused"), "t_f1": row_wise(compute_kernel="fused")}
    plan = construct_module_sharding_plan(reference, gens, world, world)
    by_params = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": LR}
    )
    sharded = [
        by_params.shard(_ebc(), plan, env),
        EmbeddingBagCollectionSharder().shard(in_backward, plan, env),
    ]
    for module in sharded:
        assert list(in_backward_optimizer_filter(module.named_parameters())) == []
        assert len(list(in_backward_optimizer_filter(module.named_parameters(), include=True))) > 0
    for step in range(3):
        global_kjt, local_kjt, _ = case.global_and_local(step, rank, world, FEATURES, False)
        grad = torch.randn(global_kjt.stride(), 6, generator=torch.Generator().manual_seed(step))
        (reference(global_kjt).values() * grad).sum().div(world).backward()
        mine = grad[sum(2 + r for r in range(rank)) :][: 2 + rank]
        for module in sharded:
            (module(local_kjt).wait().values() * mine).sum().backward()
    for module in sharded:
        for (name, r0, r1, c0, c1), weight in module.local_shards().items():
            torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach())


def test_fused_params_and_in_backward_optimizers_train_sharded_tables():
    run_world(_check_torchrec_optimizer_requests_train_like_the_fused_module, 2)


def test_the_planner_gives_fused_kernels_only_where_an_optimizer_was_asked_for():
    from shardkit.planner import EmbeddingShardingPlanner, Topology

    def kernels(module, sharder):
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu")).plan(
            module, [sharder]
        )
        return {ps.compute_kernel for ps in plan.plan[""].values()}

    in_backward = _ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, in_backward.parameters(), {"lr": LR})
    assert kernels(in_backward, EmbeddingBagCollectionSharder()) == {"fused"}
    assert kernels(
        _ebc(), EmbeddingBagCollectionSharder(fused_params={"optimizer": "ADAGRAD", "lr": LR})
    ) == {"fused"}
    assert kernels(_ebc(), EmbeddingBagCollectionSharder()) == {"dense"}

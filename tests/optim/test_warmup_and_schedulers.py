"""Learning-rate schedules over shardkit's optimizers: torch's LR schedulers and torchrec's warm-up.

torch's schedulers take only a ``torch.optim.Optimizer`` and write ``group["lr"]``; the fused
optimizers and ``CombinedOptimizer`` are optimizers of that kind whose groups pass the learning rate
on, so the fused tables follow the schedule. The warm-up's learning rates are torchrec 1.8's for the
same stages (its output, recorded once with the peer, is the expected list below).
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.optim import (
    CombinedOptimizer,
    KeyedOptimizerWrapper,
    WarmupOptimizer,
    WarmupPolicy,
    WarmupStage,
)
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

STAGES = [
    WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.2),
    WarmupStage(WarmupPolicy.CONSTANT, max_iters=6, value=0.5),
    WarmupStage(WarmupPolicy.POLY, max_iters=10, value=2.0, decay_iters=20),
    WarmupStage(WarmupPolicy.STEP, max_iters=14, value=0.5, decay_iters=3),
    WarmupStage(
        WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, max_iters=18, value=0.1, sgdr_period=4, lr_scale=2.0
    ),
    WarmupStage(WarmupPolicy.INVSQRT, max_iters=20),
    WarmupStage(
        WarmupPolicy.INTERPOLATE, max_iters=26, value=1.0, start_interpolating_iters=22, end_value=0.0
    ),
]
# torchrec 1.8's WarmupOptimizer(KeyedOptimizerWrapper(SGD), STAGES, lr=0.5): lr at construction, then
# after each of 28 steps
TORCHREC_LRS = [
    0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.25, 0.21125, 0.18, 0.15125, 0.125, 0.0625, 0.03125, 0.03125,
    0.03125, 0.231801948466, 1.0, 0.868198051534, 0.55, 0.114707866935, 0.111803398875, 0.625, 0.5,
    0.375, 0.25, 0.125, 0.0, 0.5, 0.5,
]  # fmt: skip


def _ebc(lr: float = 0.5) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(10, 4, name="t", feature_names=["f"])],
        fused_optimizer=FusedOptimizerConfig("SGD", lr=lr),
    )


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))


def test_warmup_learning_rates_are_torchrecs():
    p = torch.nn.Parameter(torch.zeros(2))
    warm = WarmupOptimizer(
        KeyedOptimizerWrapper({"p": p}, lambda ps: torch.optim.SGD(ps, lr=1.0)), STAGES, lr=0.5
    )
    lrs = [warm.param_groups[0]["lr"]]
    for _ in range(28):
        p.grad = torch.zeros(2)
        warm.step()
        lrs.append(warm.param_groups[0]["lr"])
    assert lrs == pytest.approx(TORCHREC_LRS, abs=1e-12)
    assert warm.state_dict()["state"]["__warmup"]["warmup"].tolist() == [28, 7]


def test_warmup_drives_fused_tables_and_round_trips_its_step():
    ebc, dense = _ebc(), torch.nn.Linear(4, 1)
    combined = CombinedOptimizer(
        [("fused", ebc.fused_optimizer), ("dense", torch.optim.SGD(dense.parameters(), 1.0))]
    )
    warm = WarmupOptimizer(combined, [WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.0)], lr=0.8)
    assert ebc.fused_optimizer.lr == 0.0  # step 0: the first backward's update uses it
    before = ebc.table_weight("t").detach().clone()
    dense(ebc(_kjt()).values()).sum().backward()
    assert torch.equal(ebc.table_weight("t"), before)  # lr 0: the fused update changed nothing
    warm.step()
    assert ebc.fused_optimizer.lr == pytest.approx(0.2) and combined.param_groups[1]["lr"] == pytest.approx(
        0.2
    )
    saved = warm.state_dict()
    assert saved["__warmup"]["warmup"].tolist() == [1, 0] and set(saved) == {"fused", "dense", "__warmup"}
    fresh = _ebc()
    again = WarmupOptimizer(
        CombinedOptimizer(
            [("fused", fresh.fused_optimizer), ("dense", torch.optim.SGD(dense.parameters(), 1.0))]
        ),
        [WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.0)],
        lr=0.8,
    )
    again.load_state_dict(saved)
    assert again.warmup_state == (1, 0) and fresh.fused_optimizer.lr == pytest.approx(0.2)


@pytest.mark.parametrize(
    "stages, words",
    [
        ([WarmupStage(max_iters=3), WarmupStage(max_iters=3)], "max_iters 3 must be greater"),
        ([WarmupStage(WarmupPolicy.INTERPOLATE, max_iters=3)], "needs start_interpolating_iters"),
    ],
)
def test_warmup_rejects_stages_that_cannot_work(stages, words):
    with pytest.raises(ValueError, match=words):
        WarmupOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), stages)


def test_torch_lr_scheduler_sets_the_fused_learning_rate():
    ebc = _ebc()
    assert isinstance(ebc.fused_optimizer, torch.optim.Optimizer)
    combined = CombinedOptimizer([ebc.fused_optimizer])
    schedule = torch.optim.lr_scheduler.StepLR(combined, step_size=1, gamma=0.5)
    for expected in (0.25, 0.125):
        ebc(_kjt()).values().sum().backward()
        combined.step()
        schedule.step()
        assert ebc.fused_optimizer.lr == pytest.approx(expected)
    ebc.fused_optimizer.set_learning_rate(0.3)  # set directly, the group reads the same
    assert combined.param_groups[0]["lr"] == 0.3


def _sharded_schedule_worker() -> bool:
    """A scheduled sharded EBC updates its tables as the unsharded EBC with the same schedule."""
    reference = _ebc()
    plan = construct_module_sharding_plan(reference, {"t": row_wise()}, 2, 2)
    sharded = EmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(CombinedOptimizer([opt]), lambda step: 1.0 / (1 + step))
        for opt in (reference.fused_optimizer, sharded.fused_optimizer)
    ]
    rank = torch.distributed.get_rank()
    for step in range(3):
        full = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3, 7, 9]), lengths=torch.tensor([2, 1, 1, 1]))
        mine = KeyedJaggedTensor(
            ["f"],
            torch.tensor([1, 2, 3] if rank == 0 else [7, 9]),
            lengths=torch.tensor([2, 1] if rank == 0 else [1, 1]),
        )
        reference(full).values().sum().div(2).backward()
        sharded(mine).values().sum().backward()
        for schedule in schedules:
            schedule.optimizer.step()
            schedule.step()
        assert sharded.fused_optimizer.lr == pytest.approx(0.5 / (2 + step))
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach())
    return True


def test_a_scheduled_sharded_collection_matches_the_unsharded_one():
    assert all(run_world(_sharded_schedule_worker, 2))

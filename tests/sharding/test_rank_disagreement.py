"""One rank set or fed differently from the others: an error on every rank, never a hang or silent
divergence. One 2-rank launch checks every case (bounded by the harness timeout, so a regression that
hangs fails the test instead of the suite)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.comm_ops import set_gradient_division
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.validation import set_validation
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, PoolingType
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world


def _sharded(pooling=PoolingType.SUM, lr=0.1):
    tables = [
        EmbeddingBagConfig(10, 4, name="a", feature_names=["fa"], pooling=pooling),
        EmbeddingBagConfig(6, 4, name="b", feature_names=["fb"]),
    ]
    ebc = EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig("SGD", lr=lr))
    plan = construct_module_sharding_plan(ebc, {"a": row_wise(), "b": table_wise(rank=1)})
    return EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_process_group(None))


def _kjt(lengths, values, validate=True):
    return KeyedJaggedTensor(
        ["fa", "fb"], torch.tensor(values), lengths=torch.tensor(lengths), validate=validate
    )


def _raises_everywhere(fn, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        fn()


def _worker() -> bool:
    rank = dist.get_rank()
    good = _kjt([1, 1, 1, 0], [1, 2, 3])
    model = _sharded()
    model(good).values()

    # unvalidated input with a negative length / lengths not summing to the values, on rank 1 only
    bad = _kjt([2, -1, 1, 1], [1, 2, 3], validate=False) if rank == 1 else good
    _raises_everywhere(lambda: model(bad).values(), r"rank 1: ValueError: .*negative length \(-1\)")
    bad = _kjt([1, 1, 1, 1], [1, 2, 3], validate=False) if rank == 1 else good
    _raises_everywhere(
        lambda: model(bad).values(), r"rank 1: ValueError: .*lengths sum to 4 but it has 3 values"
    )

    # any exception type of a subclass's extra check reaches every rank
    def failing(_):
        if rank == 0:
            raise RuntimeError("kernel said no")

    model._extra_input_check = failing
    _raises_everywhere(lambda: model(good).values(), r"rank 0: RuntimeError: kernel said no")
    model._extra_input_check = None

    # a process-wide switch set on one rank only: in the next forward, and when sharding
    for switch, pattern in ((set_validation, "validation"), (set_gradient_division, "gradient division")):
        switch(rank == 0)
        _raises_everywhere(
            lambda: model(good).values(), f"disagree on process-wide settings: {pattern}.*rank 1: False"
        )
        _raises_everywhere(_sharded, f"disagree on process-wide settings: {pattern}")
        switch(True)
    set_validation(False)  # off on every rank: still the same collectives, the forward runs
    model(good).values()
    set_validation(True)

    # a table config field or the fused optimizer config different on one rank
    _raises_everywhere(
        lambda: _sharded(pooling=PoolingType.MEAN if rank == 1 else PoolingType.SUM), r"fields \['pooling'\]"
    )
    _raises_everywhere(lambda: _sharded(lr=0.2 if rank == 1 else 0.1), "fused optimizer config differs")
    model(good).values()  # and the model still works after all of that
    return True


def test_disagreeing_rank_is_an_error_on_every_rank():
    assert all(run_world(_worker, 2, timeout=90))

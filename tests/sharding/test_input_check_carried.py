"""The sharded modules' input check rides in the KJT all-to-all's header: a forward makes no all-gather
of its own (one collective and one host sync less per step), and bad input, or a sharding that
raises before starting its all-to-all, is still the same ValueError on every rank, after which the
module works again (every rank made the same collectives)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import profile

from shardkit.distributed import shm_exchange
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.validation import set_validation
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, PoolingType
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world


def _sharded():
    tables = [
        EmbeddingBagConfig(10, 4, name="a", feature_names=["fa"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(6, 4, name="b", feature_names=["fb"]),
    ]
    ebc = EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig("SGD", lr=0.1))
    plan = construct_module_sharding_plan(ebc, {"a": row_wise(), "b": table_wise(rank=1)})
    return EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_process_group(None))


def _collectives(fn) -> list:
    """Names of the c10d collectives ``fn()`` started (waits not counted)."""
    with profile() as prof:
        fn()
    names = [e.key for e in prof.key_averages()]
    return sorted(n for n in names if n.startswith("c10d::") and not n.startswith("c10d::wait"))


def _worker() -> bool:
    rank = dist.get_rank()
    good = KeyedJaggedTensor(["fa", "fb"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0]))
    model = _sharded()
    model(good).values()
    # validation off (with it on, the output dists check their sizes with an all-gather of their own);
    # counted on gloo's path: the profiler sees c10d ops only, and through the shared-memory exchange
    # (the default) the all-to-alls are not c10d ops
    default = shm_exchange.shm_exchange_enabled()
    set_validation(False)
    shm_exchange.set_shm_exchange(False)
    made = _collectives(lambda: model(good).values())
    assert made and not [name for name in made if "gather" in name], made
    set_validation(True)
    shm_exchange.set_shm_exchange(default)  # the error cases below on the default path

    # bad ids on rank 0 only: every rank raises, naming rank 0's feature
    bad = KeyedJaggedTensor(["fa", "fb"], torch.tensor([1, 2, 99]), lengths=torch.tensor([1, 1, 1, 0]))
    with pytest.raises(ValueError, match=r"invalid input: rank 0: IndexError: .*id 99 of feature 'fb'"):
        model(bad if rank == 0 else good).values()
    model(good).values()

    # a variable batch per feature: row-wise MEAN raises before its all-to-all starts (after the
    # table-wise one started), and the rank still makes the same all-to-alls as the others
    variable = KeyedJaggedTensor(
        ["fa", "fb"],
        torch.tensor([1, 2]),
        lengths=torch.tensor([1, 1]),
        stride_per_key_per_rank=[[1], [1]],
        inverse_indices=(["fa", "fb"], torch.zeros(2, 1, dtype=torch.int64)),
    )
    with pytest.raises(ValueError, match="rank 0: ValueError: row_wise MEAN features .*rank 1: ValueError"):
        model(variable).values()
    model(good).values()
    # on rank 1 only: the ranks disagree, as the check's own all-gather would have said
    with pytest.raises(ValueError, match=r"disagree on whether the input has a variable batch.*rank 1: True"):
        model(variable if rank == 1 else good).values()
    model(good).values()  # and the module still works
    return True


def test_input_check_rides_in_the_all_to_all_and_errors_reach_every_rank():
    assert all(run_world(_worker, 2, timeout=120))

"""A sharded module's input dist leaves no reference cycle holding the batch: the received KJT (the
ids) and the ShardingContext are freed when the caller drops the output, not when Python's garbage
collector next runs (a cycle through the all-to-all awaitable's callback kept them: ~2.3 MiB a
262,144-id batch for a few batches)."""

from __future__ import annotations

import gc

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    OptimType,
)
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, table_wise
from shardkit.sparse import KeyedJaggedTensor


def _sharded(pooled: bool):
    fused = FusedOptimizerConfig(OptimType.SGD, lr=0.1)
    if pooled:
        module = EmbeddingBagCollection(
            [EmbeddingBagConfig(50, 8, name="t", feature_names=["f"])], fused_optimizer=fused
        )
        sharder = EmbeddingBagCollectionSharder()
    else:
        module = EmbeddingCollection(
            [EmbeddingConfig(50, 8, name="t", feature_names=["f"])], fused_optimizer=fused
        )
        sharder = EmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(module, {"t": table_wise(rank=0)}, 1, 1)
    return sharder.shard(module, plan, ShardingEnv.from_local(1, 0))


@pytest.mark.parametrize("pooled", [True, False])
def test_forward_leaves_no_cycle_holding_the_batch(pooled):
    sharded = _sharded(pooled)
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3, 4, 49]), lengths=torch.tensor([2, 0, 3]))
    with torch.no_grad():
        sharded(kjt).wait()  # once: lazily built state is not garbage
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            out = sharded(kjt).wait()
        del out
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = sorted(
            {
                type(o).__name__
                for o in gc.garbage
                if type(o).__name__ in ("ShardingContext", "KeyedJaggedTensor", "KJTAllToAllTensorsAwaitable")
            }
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    assert left == [], f"a forward left {left} in a reference cycle"

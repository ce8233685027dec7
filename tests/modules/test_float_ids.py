"""Ids must be integer tensors: float ids are an error naming the feature and the dtype (issue 23).

Before, a KeyedJaggedTensor with float32 values ``[1.5, -0.5, 2.7, 0.0]`` was looked up as rows
``[1, 0, 2, 0]`` (torch's index cast truncates; -0.5 became the valid row 0) by the float and the
quantized collections; sharded, the ids were truncated or bucketized on their way to the shards.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
)
from shardkit.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.sharding.types import EmbeddingComputeKernel
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

FLOAT_IDS = [1.5, -0.5, 2.7, 0.0]
BAD_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bool]


def _ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="a", feature_names=["fa"]),
            EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="b", feature_names=["fb"]),
        ],
        fused_optimizer=FusedOptimizerConfig("SGD", lr=0.1),
    )


def _ec() -> EmbeddingCollection:
    torch.manual_seed(0)
    return EmbeddingCollection(
        [
            EmbeddingConfig(num_embeddings=5, embedding_dim=4, name="a", feature_names=["fa"]),
            EmbeddingConfig(num_embeddings=6, embedding_dim=4, name="b", feature_names=["fb"]),
        ],
        fused_optimizer=FusedOptimizerConfig("SGD", lr=0.1),
    )


def _kjt(dtype=torch.float32) -> KeyedJaggedTensor:
    values = torch.tensor(FLOAT_IDS).to(dtype)
    return KeyedJaggedTensor(["fa", "fb"], values, lengths=torch.tensor([2, 0, 1, 1]))


def _modules():
    return {
        "EmbeddingBagCollection": _ebc(),
        "EmbeddingCollection": _ec(),
        "QuantEmbeddingBagCollection": QuantEmbeddingBagCollection.from_float(_ebc()),
        "QuantEmbeddingCollection": QuantEmbeddingCollection.from_float(_ec()),
    }


@pytest.mark.parametrize("name", list(_modules()))
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_unsharded_collections_refuse_non_integer_ids(name, dtype):
    module = _modules()[name]
    with pytest.raises(TypeError, match=rf"feature\(s\) \['fa', 'fb'\] have dtype {dtype}.*integer"):
        module(_kjt(dtype))


@pytest.mark.parametrize("name", list(_modules()))
def test_integer_ids_still_look_up(name):
    module = _modules()[name]
    for dtype in (torch.int64, torch.int32):
        ids = torch.tensor([1, 4, 2, 0], dtype=dtype)
        module(KeyedJaggedTensor(["fa", "fb"], ids, lengths=torch.tensor([2, 0, 1, 1])))


def _sharded_worker():
    """Float ids on rank 0 only: every rank fails naming rank 0, the features and the dtype."""
    env = ShardingEnv.from_process_group(None)
    rank = env.rank
    good = KeyedJaggedTensor(["fa", "fb"], torch.tensor([1, 4, 2, 0]), lengths=torch.tensor([2, 0, 1, 1]))
    quant = EmbeddingComputeKernel.QUANT.value
    cases = [
        (_ebc(), EmbeddingBagCollectionSharder(), {"a": row_wise(), "b": table_wise(rank=1)}),
        (_ec(), EmbeddingCollectionSharder(), {"a": row_wise(), "b": table_wise(rank=1)}),
        (
            QuantEmbeddingBagCollection.from_float(_ebc()),
            QuantEmbeddingBagCollectionSharder(),
            {"a": row_wise(compute_kernel=quant), "b": table_wise(rank=1, compute_kernel=quant)},
        ),
    ]
    messages = []
    for module, sharder, generators in cases:
        plan = construct_module_sharding_plan(module, generators, world_size=env.world_size)
        sharded = sharder.shard(module, plan, env)
        with pytest.raises(ValueError) as info:
            out = sharded(_kjt() if rank == 0 else good)
            out = out.wait() if hasattr(out, "wait") else out
        messages.append(str(info.value))
        sharded(good)  # the ranks are still in step: a good batch runs
    return messages


def test_sharded_collections_refuse_float_ids_on_every_rank():
    for messages in run_world(_sharded_worker, 2, timeout=120):
        for message in messages:
            assert "rank 0: TypeError" in message, message
            assert "['fa', 'fb'] have dtype torch.float32" in message, message

"""EmbeddingCollection against one nn.Embedding per table: per-id rows, gradients, dtypes, indices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.modules import DataType, EmbeddingCollection, EmbeddingConfig, FusedOptimizerConfig
from tests.modules._inputs import random_kjt

TOLERANCE = {
    DataType.FP32: dict(rtol=1e-6, atol=1e-7),
    DataType.FP16: dict(rtol=1e-3, atol=1e-3),
    DataType.BF16: dict(rtol=1e-2, atol=1e-2),
}
ROWS = {"a": 9, "b": 9, "c": 6}


def _tables(data_type=DataType.FP32):
    return [
        EmbeddingConfig(
            num_embeddings=9, embedding_dim=4, name="shared", feature_names=["a", "b"], data_type=data_type
        ),
        EmbeddingConfig(
            num_embeddings=6, embedding_dim=2, name="small", feature_names=["c"], data_type=data_type
        ),
    ]


@pytest.mark.parametrize("data_type", list(TOLERANCE))
def test_forward_and_gradients_match_embedding(data_type):
    ec = EmbeddingCollection(_tables(data_type))
    features = random_kjt(ROWS, batch=4, seed=5, keys=["c", "a", "b"])
    out = ec(features)
    assert list(out) == ["a", "b", "c"]

    refs = {}
    for table in ec.embedding_configs():
        emb = nn.Embedding(table.num_embeddings, table.embedding_dim)
        emb.weight.data.copy_(ec.table_weight(table.name).detach().float())
        refs[table.name] = emb
    owner = {"a": "shared", "b": "shared", "c": "small"}
    loss = 0
    ref_loss = 0
    for key, jt in out.items():
        ids = features[key].values()
        expected = refs[owner[key]](ids)
        assert jt.values().dtype == ec.table_weight(owner[key]).dtype
        torch.testing.assert_close(jt.values().float(), expected, **TOLERANCE[data_type])
        assert torch.equal(jt.lengths(), features[key].lengths())
        scale = torch.arange(expected.numel(), dtype=torch.float32).view_as(expected) / 10
        loss = loss + (jt.values().float() * scale).sum()
        ref_loss = ref_loss + (expected * scale).sum()
    loss.backward()
    ref_loss.backward()
    for name, emb in refs.items():
        torch.testing.assert_close(ec.table_grad(name).float(), emb.weight.grad, **TOLERANCE[data_type])


def test_need_indices_returns_ids_as_weights():
    ec = EmbeddingCollection(_tables(), need_indices=True)
    features = random_kjt(ROWS, batch=3, seed=1)
    out = ec(features)
    for key in ROWS:
        assert torch.equal(out[key].weights(), features[key].values())


def test_fused_sgd_matches_dense_sgd():
    ec = EmbeddingCollection(_tables(), fused_optimizer=FusedOptimizerConfig("SGD", lr=0.5))
    dense = EmbeddingCollection(_tables())
    dense.load_state_dict(ec.state_dict())
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    for seed in range(3):
        features = random_kjt(ROWS, batch=3, seed=seed)
        sum(jt.values().pow(2).sum() for jt in ec(features).values()).backward()
        sum(jt.values().pow(2).sum() for jt in dense(features).values()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name in ["shared", "small"]:
        torch.testing.assert_close(ec.table_weight(name), dense.table_weight(name))
    assert list(ec.state_dict()) == ["embeddings.shared.weight", "embeddings.small.weight"]

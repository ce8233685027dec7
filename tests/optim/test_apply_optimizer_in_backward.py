"""``apply_optimizer_in_backward``: the optimizer steps in backward; no parameters is an error."""

import pytest
import torch

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.optim import apply_optimizer_in_backward
from shardkit.sparse import KeyedJaggedTensor


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=3, feature_names=[f])
        for t, f in (("t1", "f1"), ("t2", "f2"))
    ]
    return EmbeddingBagCollection(tables=tables)


def test_sgd_in_backward_updates_the_tables_and_leaves_no_grad():
    ebc = _ebc()
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"], values=torch.tensor([0, 2, 1]), lengths=torch.tensor([2, 1])
    )
    ebc(kjt).values().sum().backward()
    after = ebc.state_dict()
    t1_before, t1_after = before["embedding_bags.t1.weight"], after["embedding_bags.t1.weight"]
    t2_before, t2_after = before["embedding_bags.t2.weight"], after["embedding_bags.t2.weight"]
    # sum pooling with d(sum)/d(row) = 1: each looked-up row drops by lr * 1 once per lookup
    assert torch.equal(t1_after[[0, 2]], t1_before[[0, 2]] - 1)
    assert torch.equal(t1_after[1], t1_before[1])
    assert torch.equal(t2_after[1], t2_before[1] - 1)
    assert all(p.grad is None for p in ebc.parameters())


def test_a_table_view_owns_no_parameter_so_the_per_table_idiom_is_an_error():
    ebc = _ebc()
    with pytest.raises(ValueError, match=r"ebc.parameters\(\)"):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.embedding_bags["t1"].parameters(), {"lr": 1.0})

"""torchrec's DLRM / DLRMTrain: shapes, the interaction's dot products, the loss, and bad configs."""

import pytest
import torch

from shardkit.datasets import Batch
from shardkit.models import DLRM, DLRMTrain, InteractionArch, OverArch
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor


def _ebc(dims=(4, 4)):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=10, feature_names=[f"f{i}"])
        for i, d in enumerate(dims)
    ]
    return EmbeddingBagCollection(tables)


def _kjt():
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 0, 1, 3])
    )


def test_interaction_is_dense_then_pairwise_dots_upper_triangle():
    dense, sparse = torch.randn(3, 2), torch.randn(3, 2, 2)
    out = InteractionArch(num_sparse_features=2)(dense, sparse)
    vectors = [dense, sparse[:, 0], sparse[:, 1]]
    dots = [(vectors[i] * vectors[j]).sum(1) for i in range(3) for j in range(i + 1, 3)]
    torch.testing.assert_close(out, torch.cat([dense, torch.stack(dots, 1)], 1))


def test_interaction_is_bitwise_the_two_index_pick_with_its_gradients():
    # the arch picks the pairs from the flattened dots; torchrec indexes with the two triu rows
    torch.manual_seed(0)
    features = 26
    arch = InteractionArch(num_sparse_features=features)
    dense = torch.randn(32, 16, requires_grad=True)
    sparse = torch.randn(32, features, 16, requires_grad=True)
    out = arch(dense, sparse)
    rows, cols = torch.triu_indices(features + 1, features + 1, offset=1)
    combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
    dots = torch.bmm(combined, combined.transpose(1, 2))
    reference = torch.cat((dense, dots[:, rows, cols]), dim=1)
    assert torch.equal(out, reference)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (dense, sparse), grad)
    expected = torch.autograd.grad(reference, (dense, sparse), grad)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


class _FixedPooled(torch.nn.Module):
    """An EBC stand-in returning fixed pooled values under the given keys (order and dims)."""

    def __init__(self, keys, dims, values):
        super().__init__()
        self.keys, self.dims, self.values = keys, dims, values

    def forward(self, features):
        return KeyedTensor(self.keys, self.dims, self.values)


@pytest.mark.parametrize("order", [["f0", "f1", "f2"], ["f2", "f0", "f1"]])
def test_sparse_arch_output_and_gradient_per_feature_in_feature_order(order):
    # in the collection's order the values are returned reshaped (no split and cat); in another
    # order each feature's columns are gathered: same [B, F, D] and same gradient either way
    from shardkit.models.dlrm import SparseArch

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=2, num_embeddings=10, feature_names=[f"f{i}"])
        for i in range(3)
    ]
    arch = SparseArch(EmbeddingBagCollection(tables, device=torch.device("meta")))
    per_key = {key: torch.randn(4, 2) for key in order}
    values = torch.cat([per_key[key] for key in order], dim=1).requires_grad_()
    arch.embedding_bag_collection = _FixedPooled(order, [2, 2, 2], values)
    out = arch(_kjt())
    expected = torch.stack([per_key[f"f{i}"] for i in range(3)], dim=1)
    assert torch.equal(out, expected)
    weights = torch.randn(4, 3, 2)
    (out * weights).sum().backward()
    expected_grad = torch.cat([weights[:, int(key[1])] for key in order], dim=1)
    assert torch.equal(values.grad, expected_grad)


def test_dlrm_train_traces_with_the_collection_as_a_leaf():
    # the pipelines trace the model (torch.fx) with the sharded collections as leaves: the sparse
    # arch's choice between its two paths must not be traced control flow
    class _Leaves(torch.fx.Tracer):
        def is_leaf_module(self, module, name):
            return isinstance(module, EmbeddingBagCollection) or super().is_leaf_module(module, name)

    dlrm = DLRM(_ebc(), dense_in_features=3, dense_arch_layer_sizes=[5, 4], over_arch_layer_sizes=[6, 1])
    graph = _Leaves().trace(DLRMTrain(dlrm))
    assert any(node.op == "call_function" and "_features_by_name" in str(node.target) for node in graph.nodes)


def test_dlrm_logits_and_dlrm_train_outputs():
    torch.manual_seed(0)
    dlrm = DLRM(_ebc(), dense_in_features=3, dense_arch_layer_sizes=[5, 4], over_arch_layer_sizes=[6, 1])
    logits = dlrm(torch.rand(2, 3), _kjt())
    assert logits.shape == (2, 1)
    labels = torch.tensor([1, 0])
    loss, (detached, out_logits, out_labels) = DLRMTrain(dlrm)(Batch(torch.rand(2, 3), _kjt(), labels))
    assert out_logits.shape == (2,) and torch.equal(out_labels, labels)
    torch.testing.assert_close(
        loss, torch.nn.functional.binary_cross_entropy_with_logits(out_logits, labels.float())
    )
    assert loss.requires_grad and not detached.requires_grad and not out_logits.requires_grad


def test_bad_configs_say_what_is_wrong():
    with pytest.raises(ValueError, match="one embedding_dim"):
        DLRM(_ebc((4, 8)), 3, [5, 4], [6, 1])
    with pytest.raises(ValueError, match=r"last dense arch layer \(5\)"):
        DLRM(_ebc(), 3, [5], [6, 1])
    with pytest.raises(ValueError, match="at least two layer sizes"):
        OverArch(3, [1])


def test_state_dict_keys_are_torchrec_s():
    """The keys torchrec's DLRMTrain has for the same model, so its checkpoints load by name."""
    keys = list(DLRMTrain(DLRM(_ebc(), 3, [5, 4], [6, 1])).state_dict())
    assert keys == [
        "model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight",
        "model.sparse_arch.embedding_bag_collection.embedding_bags.t1.weight",
        "model.dense_arch.model._mlp.0._linear.weight",
        "model.dense_arch.model._mlp.0._linear.bias",
        "model.dense_arch.model._mlp.1._linear.weight",
        "model.dense_arch.model._mlp.1._linear.bias",
        "model.over_arch.model.0._mlp.0._linear.weight",
        "model.over_arch.model.0._mlp.0._linear.bias",
        "model.over_arch.model.1.weight",
        "model.over_arch.model.1.bias",
    ]

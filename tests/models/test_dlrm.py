"""torchrec's DLRM / DLRMTrain: shapes, the interaction's dot products, the loss, and bad configs."""

import pytest
import torch

from shardkit.datasets import Batch
from shardkit.models import DLRM, DLRMTrain, InteractionArch, OverArch
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.sparse import KeyedJaggedTensor


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
